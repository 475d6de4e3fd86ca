"""Malformed matrix files given to `diff` and `compare`: exit 2 with one line, never a traceback."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import signal
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harness.matrix.file
import harness.matrix.schema
import harness.matrix.strictjson
from harness.cli import main
from harness.matrix.file import load_matrix, parse_matrix
from harness.matrix.schema import Matrix, MatrixError
from harness.records import STATUSES

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
    monkeypatch.setattr(harness.matrix.strictjson, "MAX_FILE_BYTES", 1000)
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
    from harness.matrix.schema import Cell
    from harness.records import Failure
    from harness.render.reports import render_json

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
    class NewerCell(harness.matrix.schema.Cell):
        wrapper: str = ""
        ranks_per_node: "int | None" = None

    monkeypatch.setattr(harness.matrix.file, "Cell", NewerCell)
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
        parse_matrix({"schema_version": True, "cells": []}, source="run.json")


# Property tests: any JSON (or any bytes) as either file of diff, or as an input of compare, gives
# exit 0, 1 or 2 (compare: 0 or 2), never a traceback or another exception; exit 2 is one line.

PROPERTY = settings(
    max_examples=400,
    derandomize=True,  # the same inputs on every run, so that CI is reproducible
    database=None,  # and nothing replayed from an earlier run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# How many inputs the property tests tried, and what came of them (reported at the end of the module).
TRIED: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def report_inputs_tried(request):
    yield
    if TRIED:
        outcomes = ", ".join(f"{name} {count}" for name, count in sorted(TRIED.items()))
        line = f"hypothesis: {TRIED['inputs']} inputs tried by the matrix input properties ({outcomes})"
        # Shown without -s too: the count belongs in the test log.
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n{line}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("matrix-input")
    (folder / "good.json").write_text(json.dumps(GOOD), encoding="utf-8")
    return folder


@dataclass(frozen=True)
class RawNumber:
    """A number written as given (json.dumps cannot write an integer of 5,000 digits)."""

    text: str


@dataclass(frozen=True)
class Obj:
    """A JSON object as key/value pairs, so that a key can occur twice."""

    pairs: tuple


def to_json(value) -> str:
    if isinstance(value, RawNumber):
        return value.text
    if isinstance(value, Obj):
        return "{" + ", ".join(f"{json.dumps(k)}: {to_json(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return to_json(Obj(tuple(value.items())))
    if isinstance(value, list):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    return json.dumps(value)  # NaN and Infinity come out as such, lone surrogates as \\udXXX


# Valid text that is hostile to terminals and Markdown, and two lone surrogates (not valid text).
HOSTILE_TEXT = ["<!--", "\x1b[31m", "\x00", "\u202e", "`|`", "\n\r\t", "\ufeff", ""]
NOT_TEXT = ["\ud800", "a\udfff"]
KEYS = ["schema_version", "cells", "environment", "world_sizes", "complete", "created", "case", "variant",
        "world_size", "status", "summary", "failures", "rank", "index", "factor"]

texts = st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_TEXT))
any_texts = st.one_of(texts, st.sampled_from(NOT_TEXT))
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.integers(min_value=4290, max_value=4400).map(lambda n: RawNumber("9" * n)),
    st.sampled_from(["1e999", "-1e999", "1e-999", "-0", "0.0", "1E+2"]).map(RawNumber),
    st.floats(),  # NaN and infinities included
)
leaves = st.one_of(st.none(), st.booleans(), numbers, any_texts)
keys = st.one_of(st.sampled_from(KEYS), any_texts)
json_values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(st.tuples(keys, children), max_size=4).map(lambda pairs: Obj(tuple(pairs))),
    ),
    max_leaves=24,
)
deep_nesting = st.integers(min_value=95, max_value=3000).map(lambda n: "[" * n + "]" * n)
documents = st.one_of(
    json_values.map(lambda v: to_json(v).encode("utf-8", "surrogatepass")),
    deep_nesting.map(str.encode),
    st.binary(max_size=64),
)


# How often a field is replaced by any JSON value: never in a clean matrix, 1 in 40 or 1 in 8 in a
# noisy one. Clean matrices can still fail, by a duplicated cell or an unlucky name.
NOISE = {"clean": 0, "noisy": 40, "very noisy": 8}


def sometimes(draw, valid, noise: int, *, required: bool):
    """Mostly a valid value; now and then missing (None here) or, when noisy, any JSON value."""
    if noise and draw(st.integers(min_value=1, max_value=noise)) == 1:
        return ("value", draw(json_values))
    if draw(st.integers(min_value=0, max_value=9)) == 0 and (noise or not required):
        return None
    return ("value", draw(valid))


def build(draw, fields: dict, noise: int, required: tuple = ()) -> Obj:
    pairs = []
    for name, valid in fields.items():
        drawn = sometimes(draw, valid, noise, required=name in required)
        if drawn is not None:
            pairs.append((name, drawn[1]))
    if noise and pairs and draw(st.integers(min_value=1, max_value=2 * noise)) == 1:
        pairs.append(draw(st.sampled_from(pairs)))  # a key twice
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        pairs.append(("x-" + draw(texts), draw(json_values)))  # a key this harness does not know
    return Obj(tuple(draw(st.permutations(pairs))))


finite = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=0, max_value=10))
counts = st.integers(min_value=0, max_value=100)


@st.composite
def near_failures(draw, noise: int):
    return build(draw, {
        "rank": st.integers(min_value=0, max_value=3),
        "step": st.integers(min_value=0, max_value=9),
        "model": texts,
        "param": texts,
        "kind": st.sampled_from(["not_synced", "wrong_scale", "misweighted"]),
        "max_abs_diff": finite,
        "message": texts,
        "max_rel_diff": finite,
        "index": st.one_of(st.none(), st.lists(st.integers(min_value=0, max_value=9), max_size=3)),
        "checked": st.sampled_from(["grad", "param", "flag"]),
        "factor": st.one_of(st.none(), finite),
        "mismatched": counts,
        "numel": counts,
    }, noise, required=("rank", "step", "model", "param", "kind", "max_abs_diff", "message"))


@st.composite
def near_cells(draw, noise: int):
    return build(draw, {
        # Few names, so that cells meet across the two files and now and then repeat within one.
        "case": st.sampled_from(["accumulate", "no_sync", "fused_loss", "<!--x"]),
        "variant": st.sampled_from(["steps=2", "fp32", ""]),
        "world_size": st.sampled_from([1, 2, 4]),
        "status": st.sampled_from(STATUSES),
        "summary": texts,
        "max_abs_diff": finite,
        "duration_s": finite,
        "failures": st.lists(near_failures(noise), max_size=2),
        "checks": counts,
        "grad_checks": counts,
        "vacuous_checks": counts,
        "nodeid": texts,
        "rerun": texts,
        "detail": texts,
    }, noise, required=("case", "variant", "world_size", "status"))


@st.composite
def near_matrices(draw):
    noise = NOISE[draw(st.sampled_from(["clean", "clean", "clean", "noisy", "very noisy"]))]
    environment = build(draw, {
        "accelerate": texts,
        "backend": st.sampled_from(["gloo", "nccl"]),
        "world_sizes": st.lists(st.sampled_from([1, 2, 4]), max_size=3, unique=True),
    }, noise)
    cell = near_cells(noise)
    entries = st.one_of(cell, json_values) if noise else cell
    cells = draw(st.lists(entries, max_size=6))
    matrix = build(draw, {
        "schema_version": st.just(1),
        "created": texts,
        "complete": st.booleans(),
        "environment": st.just(environment),
        "cells": st.just(cells),
    }, noise, required=("schema_version", "cells"))
    return to_json(matrix).encode("utf-8", "surrogatepass")


def check_run(argv: list[str]) -> int:
    """Run the command and check what every outcome must look like; return the exit status."""
    code, out, err = run_cli(argv)
    command = argv[0]
    TRIED[f"{command} exit {code}"] += 1
    assert code in ((0, 1, 2) if command == "diff" else (0, 2)), (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert err.endswith("\n") and err.count("\n") == 1, err
        assert err.startswith(f"harness {command}: error: "), err
        assert err[:-1].isprintable(), err
        assert out == ""
    else:
        assert err == ""
        assert all(line.isprintable() for line in out.splitlines())
        if command == "diff":
            regression = any(line.startswith(("REGRESSION ", "VANISHED ")) for line in out.splitlines())
            assert regression == (code == 1), out
    return code


@PROPERTY
@given(document=documents)
def test_any_json_as_either_file_is_exit_0_1_or_2(workdir, document):
    TRIED["inputs"] += 1
    path = workdir / "any.json"
    path.write_bytes(document)
    good = str(workdir / "good.json")
    check_run(["diff", str(path), good])
    check_run(["diff", good, str(path)])
    check_run(["compare", good, str(path)])


@PROPERTY
@given(base=near_matrices(), candidate=near_matrices())
def test_near_valid_matrices_are_exit_0_1_or_2(workdir, base, candidate):
    TRIED["inputs"] += 1
    base_path, cand_path = workdir / "base.json", workdir / "candidate.json"
    base_path.write_bytes(base)
    cand_path.write_bytes(candidate)
    TRIED["near-valid base usable" if check_run(["diff", str(base_path), str(base_path)]) != 2 else "near-valid base refused"] += 1
    check_run(["diff", str(base_path), str(cand_path)])
    check_run(["diff", str(cand_path), str(base_path)])
    check_run(["compare", str(base_path), str(cand_path), str(workdir / "good.json")])
