"""Malformed matrix files given to `diff` and `compare`: exit 2 with one line, never a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import stat
from pathlib import Path

import pytest

import harness.matrix
from harness.cli import main
from harness.matrix import Matrix, MatrixError, load_matrix

GOOD = {
    "schema_version": 1,
    "created": "2025-01-01T00:00:00",
    "complete": True,
    "environment": {"accelerate": "1.15.0", "backend": "gloo", "world_sizes": [1, 2]},
    "cells": [
        {"case": "accumulate", "variant": "steps=2", "world_size": 1, "status": "pass"},
        {"case": "accumulate", "variant": "steps=2", "world_size": 2, "status": "pass"},
    ],
}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in this process, with its stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], path: Path | str, fragment: str) -> str:
    code, out, err = run_cli(argv)
    command = argv[0]
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"harness {command}: error: {path}: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert out == ""
    return lines[0]


def assert_refused_everywhere(path: Path | str, good: Path, fragment: str) -> str:
    """The file is refused as BASE and as CANDIDATE of diff, and as any input of compare."""
    line = assert_refused(["diff", str(path), str(good)], path, fragment)
    assert_refused(["diff", str(good), str(path)], path, fragment)
    assert_refused(["compare", str(good), str(path)], path, fragment)
    return line


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.json"
    path.write_text(json.dumps(GOOD), encoding="utf-8")
    return path


def with_cell(**fields) -> dict:
    data = json.loads(json.dumps(GOOD))
    data["cells"][1].update(fields)
    return data


@contextlib.contextmanager
def no_longer_than(seconds: int):
    """Fail instead of hanging should a read block (a FIFO with no writer)."""

    def expire(signum, frame):
        raise AssertionError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# Files that are not regular files, or too large.


def test_fifo_is_refused_without_blocking(tmp_path, good):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with no_longer_than(20):
        assert_refused_everywhere(fifo, good, "is a FIFO")


def test_directory_is_refused(tmp_path, good):
    folder = tmp_path / "folder.json"
    folder.mkdir()
    assert_refused_everywhere(folder, good, "is a directory")


def test_dev_zero_is_refused(good):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    with no_longer_than(20):
        assert_refused_everywhere("/dev/zero", good, "is a character device")


def test_socket_is_refused(tmp_path, good):
    path = tmp_path / "s.sock"
    if len(os.fsencode(path)) > 100:
        pytest.skip("temporary path too long for a unix socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert_refused_everywhere(path, good, "is a socket")
    finally:
        server.close()


def test_oversize_file_is_refused_with_its_size(tmp_path, good, monkeypatch):
    monkeypatch.setattr(harness.matrix, "MAX_MATRIX_BYTES", 1000)
    small = tmp_path / "small.json"
    small.write_text(json.dumps(GOOD), encoding="utf-8")
    assert small.stat().st_size < 1000
    assert run_cli(["diff", str(small), str(small)])[0] == 0
    big = tmp_path / "big.json"
    data = dict(GOOD, padding="x" * 5000)
    big.write_text(json.dumps(data), encoding="utf-8")
    size = big.stat().st_size
    line = assert_refused_everywhere(big, good, f"is {size} bytes")
    assert "1000 bytes" in line


def test_missing_file_and_a_file_on_the_path(tmp_path, good):
    assert_refused_everywhere(tmp_path / "missing.json", good, "no such file")
    assert_refused_everywhere(good / "inside.json", good, "no such file")


# Text that is not strict JSON.

NOT_STRICT_JSON = [
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="not-utf8"),
    pytest.param(b"", "empty", id="empty"),
    pytest.param(b"{oops", "not JSON", id="not-json"),
    pytest.param(b'{"schema_version": 1, "cells": [], "x": NaN}', "NaN is not a JSON number", id="nan"),
    pytest.param(b'{"schema_version": 1, "cells": [], "x": -Infinity}', "-Infinity is not a JSON number", id="inf"),
    pytest.param(b'{"schema_version": 1, "cells": [], "x": 1e999}', "too large", id="float-overflow"),
    pytest.param(b'{"schema_version": 1, "cells": [], "x": ' + b"9" * 5000 + b"}", "5000 digits", id="5000-digits"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "nested too deeply", id="deep-nesting"),
    pytest.param(b'{"schema_version": 1, "cells": [], "cells": []}', "duplicate key 'cells'", id="duplicate-key"),
    pytest.param(b'{"schema_version": 1, "cells": [], "x": "\\udc80"}', "lone surrogate", id="lone-surrogate"),
]


@pytest.mark.parametrize(("content", "fragment"), NOT_STRICT_JSON)
def test_not_strict_json_is_refused(tmp_path, good, content, fragment):
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    assert_refused_everywhere(path, good, fragment)


def test_nesting_below_the_parser_limit_is_refused_too(tmp_path, good):
    data = dict(GOOD, extra=json.loads("[" * 500 + "]" * 500))
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert_refused_everywhere(path, good, "nested too deeply")


# JSON that is not a schema-1 matrix.

CELL = "cells[1] (accumulate / steps=2 / ws=2): "
NOT_A_MATRIX = [
    pytest.param([GOOD], "not a matrix", id="top-level-list"),
    pytest.param(dict(GOOD, schema_version=True), "schema_version is true, expected 1", id="schema-version-true"),
    pytest.param(dict(GOOD, schema_version="1"), "schema_version is the string '1', expected 1", id="schema-version-str"),
    pytest.param(dict(GOOD, schema_version=1.0), "schema_version is 1.0, expected 1", id="schema-version-float"),
    pytest.param({"cells": []}, "schema_version is missing", id="schema-version-missing"),
    pytest.param(dict(GOOD, complete="false"), "complete is the string 'false', expected true or false",
                 id="complete-string"),
    pytest.param(dict(GOOD, created=20250101), "created is 20250101, expected a string", id="created-int"),
    pytest.param(dict(GOOD, environment="gloo"), "environment is the string 'gloo', expected an object",
                 id="environment-string"),
    pytest.param(dict(GOOD, environment={"world_sizes": [1, True]}),
                 "environment.world_sizes[1] is true, expected a positive integer", id="world-sizes-bool"),
    pytest.param(dict(GOOD, environment={"world_sizes": "1,2"}),
                 "environment.world_sizes is the string '1,2', expected a list of positive integers",
                 id="world-sizes-string"),
    pytest.param({k: v for k, v in GOOD.items() if k != "cells"}, "cells is missing", id="cells-missing"),
    pytest.param(dict(GOOD, cells={}), "cells is an empty object, expected a list of cells", id="cells-object"),
    pytest.param(dict(GOOD, cells=[GOOD["cells"][0], "pass"]), "cells[1] is the string 'pass', expected an object",
                 id="cell-string"),
    pytest.param(with_cell(case=["accumulate"]), "cells[1] (steps=2 / ws=2): case is a list, expected a non-empty string",
                 id="case-list"),
    pytest.param(with_cell(case=""), "cells[1] (steps=2 / ws=2): case is an empty string", id="case-empty"),
    pytest.param(with_cell(variant=None), "cells[1] (accumulate / ws=2): variant is null, expected a string",
                 id="variant-null"),
    pytest.param(with_cell(world_size={"n": 2}),
                 "cells[1] (accumulate / steps=2): world_size is an object, expected a positive integer",
                 id="world-size-dict"),
    pytest.param(with_cell(world_size=[2]), "world_size is a list, expected a positive integer", id="world-size-list"),
    pytest.param(with_cell(world_size=True), "world_size is true, expected a positive integer", id="world-size-bool"),
    pytest.param(with_cell(world_size=0), "world_size is 0, expected a positive integer", id="world-size-zero"),
    pytest.param(with_cell(world_size=2.0), "world_size is 2.0, expected a positive integer", id="world-size-float"),
    pytest.param(with_cell(status="passed"), CELL + "status is the string 'passed', expected one of pass, fail",
                 id="unknown-status"),
    pytest.param(with_cell(status=None), CELL + "status is null", id="status-null"),
    pytest.param({**GOOD, "cells": [{"case": "a", "variant": "v", "world_size": 1}]},
                 "cells[0] (a / v / ws=1): status is missing", id="status-missing"),
    pytest.param(with_cell(summary=["a"]), CELL + "summary is a list, expected a string", id="summary-list"),
    pytest.param(with_cell(rerun=False), CELL + "rerun is false, expected a string", id="rerun-bool"),
    pytest.param(with_cell(max_abs_diff="0.5"), CELL + "max_abs_diff is the string '0.5', expected a finite number",
                 id="max-abs-diff-string"),
    pytest.param(with_cell(duration_s=True), CELL + "duration_s is true, expected a finite number", id="duration-bool"),
    pytest.param(with_cell(max_abs_diff=10**400), CELL + "max_abs_diff is", id="number-too-large-for-a-float"),
    pytest.param(with_cell(checks=-1), CELL + "checks is -1, expected a non-negative integer", id="checks-negative"),
    pytest.param(with_cell(grad_checks=1.5), CELL + "grad_checks is 1.5, expected a non-negative integer",
                 id="grad-checks-float"),
    pytest.param(with_cell(failures={}), CELL + "failures is an empty object, expected a list of failures",
                 id="failures-object"),
    pytest.param(with_cell(failures=[3]), CELL + "failures[0] is 3, expected an object", id="failure-int"),
    pytest.param(with_cell(failures=[{"rank": 1}]), CELL + "failures[0].step is missing", id="failure-incomplete"),
    pytest.param(
        with_cell(failures=[{"rank": "1", "step": 0, "model": "m", "param": "p", "kind": "stale",
                             "max_abs_diff": 0.5, "message": "m"}]),
        CELL + "failures[0].rank is the string '1', expected an integer",
        id="failure-rank-string",
    ),
    pytest.param(
        with_cell(failures=[{"rank": 1, "step": 0, "model": "m", "param": "p", "kind": "stale",
                             "max_abs_diff": 0.5, "message": "m", "index": [0, "1"]}]),
        CELL + "failures[0].index[1] is the string '1', expected an integer",
        id="failure-index-string",
    ),
    pytest.param(
        with_cell(failures=[{"rank": 1, "step": 0, "model": "m", "param": "p", "kind": "stale",
                             "max_abs_diff": 0.5, "message": "m", "factor": "2"}]),
        CELL + "failures[0].factor is the string '2', expected a finite number or null",
        id="failure-factor-string",
    ),
    pytest.param(dict(GOOD, cells=GOOD["cells"] + [dict(GOOD["cells"][1], status="fail")]),
                 "cells[2] (accumulate / steps=2 / ws=2): the same cell as cells[1]", id="duplicate-cell"),
]


@pytest.mark.parametrize(("data", "fragment"), NOT_A_MATRIX)
def test_not_a_matrix_is_refused(tmp_path, good, data, fragment):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert_refused_everywhere(path, good, fragment)


def test_long_and_unprintable_values_stay_on_one_short_line(tmp_path, good):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(with_cell(case="a\nb\x1b[31m\u202e", status="x\n" * 10_000)), encoding="utf-8")
    line = assert_refused_everywhere(path, good, "status is the string 'x\\nx\\n")
    assert "(20000 characters)" in line
    assert "a b\\x1b[31m\\u202e / steps=2 / ws=2" in line
    assert len(line) < 400
    assert all(c.isprintable() for c in line)


def test_unprintable_file_name_is_escaped(tmp_path, good):
    path = tmp_path / "bad\nname\x1b.json"
    code, out, err = run_cli(["diff", str(path), str(good)])
    assert code == 2
    assert err.count("\n") == 1
    assert "bad\\nname\\x1b.json: no such file" in err


# What is accepted.


def test_unknown_keys_are_accepted(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["written_by"] = {"harness": "9.9", "nested": [1, {"a": None}]}
    data["environment"]["wrappers"] = ["fsdp2"]
    data["cells"][1]["wrapper"] = "fsdp2"
    data["cells"][1]["failures"] = [{"rank": 1, "step": 0, "model": "m", "param": "p", "kind": "misweighted",
                                     "max_abs_diff": 0.5, "message": "m", "ratio": 1.5, "index": None}]
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    matrix = load_matrix(path)
    assert [c.key for c in matrix.cells] == [("accumulate", "steps=2", 1), ("accumulate", "steps=2", 2)]
    assert matrix.cells[1].failures[0].kind == "misweighted"
    assert run_cli(["diff", str(path), str(path)])[0] == 0


def test_a_matrix_the_harness_wrote_round_trips(tmp_path):
    from harness.matrix import Cell, Failure
    from harness.report import render_json

    failure = Failure(rank=1, step=3, model="gen", param="weight", kind="wrong_scale", max_abs_diff=0.25,
                      message="scaled", index=[0, 1], factor=2.0)
    matrix = Matrix(environment={"world_sizes": [2], "accelerate": "1.15.0"},
                    cells=[Cell("a", "", 2, "fail", "one \u2728 line", failures=[failure], checks=4)],
                    created="2025-01-01T00:00:00", complete=False)
    path = tmp_path / "m.json"
    path.write_text(render_json(matrix), encoding="utf-8")
    assert load_matrix(path).to_dict() == matrix.to_dict()


def test_a_field_added_to_cell_later_is_checked_by_its_annotation(tmp_path, good, monkeypatch):
    import dataclasses

    @dataclasses.dataclass
    class NewerCell(harness.matrix.Cell):
        wrapper: str = ""
        ranks_per_node: "int | None" = None

    monkeypatch.setattr(harness.matrix, "Cell", NewerCell)
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(with_cell(wrapper="fsdp2", ranks_per_node=None)), encoding="utf-8")
    assert load_matrix(path).cells[1].wrapper == "fsdp2"
    path.write_text(json.dumps(with_cell(wrapper=["fsdp2"])), encoding="utf-8")
    assert_refused_everywhere(path, good, CELL + "wrapper is a list, expected a string")
    path.write_text(json.dumps(with_cell(ranks_per_node="2")), encoding="utf-8")
    assert_refused_everywhere(path, good, CELL + "ranks_per_node is the string '2', expected an integer or null")


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    assert len(load_matrix(path).cells) == 2


def test_from_dict_names_the_source():
    with pytest.raises(MatrixError, match=r"^run\.json: schema_version is true, expected 1$"):
        Matrix.from_dict({"schema_version": True, "cells": []}, source="run.json")
