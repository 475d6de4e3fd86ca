"""Tests for harness.matrix.merge and the `merge` subcommand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.matrix.file import load_matrix
from harness.matrix.merge import MergeError, merge_matrices
from harness.matrix.schema import Cell, Matrix
from harness.records import Failure
from harness.render.reports import REPORT_NAMES, write_reports

REPO_ROOT = Path(__file__).resolve().parents[1]


def environment(world_sizes, *, backend="gloo", device="cpu", **extra) -> dict:
    env = {"python": "3.11.7", "torch": "2.13.0", "accelerate": "1.15.0", "backend": backend,
           "device": device, "world_sizes": list(world_sizes), "seed": 1234}
    env.update(extra)
    return env


def not_synced(world_size: int) -> Cell:
    failure = Failure(rank=1, step=3, model="model", param="weight", kind="not_synced",
                      max_abs_diff=0.12, message="gradient differs from the synced oracle")
    return Cell("no_sync", "steps=2-fp32", world_size, "fail", "'model.weight' on rank 1 at step 3: not synced",
                max_abs_diff=0.12, duration_s=0.8, failures=[failure], checks=24, grad_checks=12,
                nodeid=f"cases/test_no_sync.py::test_no_sync[steps=2-fp32-ws{world_size}]",
                rerun=f"pytest cases/test_no_sync.py -k 'steps=2-fp32 and ws{world_size}'")


def run_matrix(world_sizes, *, complete=True, **env) -> Matrix:
    """What one launch writes: every case at every world size it ran."""
    cells = []
    for ws in world_sizes:
        cells.append(Cell("accumulate", "steps=2-fp32", ws, "pass", "", duration_s=0.4, checks=30, grad_checks=10))
        cells.append(Cell("accumulate_nested", "steps=2", ws, "detected", "canary caught", duration_s=0.3))
        cells.append(not_synced(ws) if ws > 1 else Cell("no_sync", "steps=2-fp32", ws, "pass"))
    return Matrix(environment=environment(world_sizes, **env), cells=cells,
                  created="2025-01-01T00:00:00+00:00", complete=complete)


def write_run(directory: Path, matrix: Matrix) -> str:
    write_reports(matrix, directory)
    return str(directory / "matrix.json")


def harness(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("harness merge: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    return lines[0]


# merge_matrices


def test_merge_is_the_union_with_each_world_size_keeping_its_environment():
    cpu = run_matrix((1, 2), hostname="laptop")
    gpu = run_matrix((4, 8), backend="nccl", device="cuda", hostname="dgx", complete=False)
    merged = merge_matrices([("cpu/matrix.json", cpu), ("gpu/matrix.json", gpu)])
    assert sorted(c.key for c in merged.cells) == sorted(c.key for c in cpu.cells + gpu.cells)
    assert len(merged.cells) == 12
    assert merged.complete is False
    assert merge_matrices([("a", cpu), ("b", run_matrix((4,)))]).complete is True
    env = merged.environment
    assert env["world_sizes"] == [1, 2, 4, 8]
    assert env["merged_from"] == ["cpu/matrix.json", "gpu/matrix.json"]
    # the common environment: the keys equal everywhere, no backend, device or hostname
    common = {k: v for k, v in env.items() if k not in ("world_sizes", "merged_from", "environments")}
    assert common == {"python": "3.11.7", "torch": "2.13.0", "accelerate": "1.15.0", "seed": 1234}
    assert list(env["environments"]) == ["1", "2", "4", "8"]
    assert env["environments"]["2"] == cpu.environment
    assert env["environments"]["8"] == gpu.environment
    assert env["environments"]["4"]["backend"] == "nccl"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", merged.created)


def test_the_reports_show_what_differs_per_world_size_readably():
    from harness.render.matrix import render_html, render_markdown

    merged = merge_matrices([("cpu", run_matrix((1, 2))), ("gpu", run_matrix((4,), backend="nccl", device="cuda"))])
    line = render_markdown(merged).splitlines()[2]
    assert "backend `(per world size)`" in line and "?" not in line
    html = render_html(merged)
    assert "ws=4: {python=3.11.7, torch=2.13.0, accelerate=1.15.0, backend=nccl, device=cuda" in html
    assert "{&#x27;" not in html and "{'" not in html  # no Python dict repr


def test_a_world_size_split_across_runs_keeps_the_first_runs_environment():
    cells = run_matrix((2,)).cells
    first = Matrix(environment=environment((2,), hostname="node-a"), cells=cells[:1])
    second = Matrix(environment=environment((2,), hostname="node-b"), cells=cells[1:])
    merged = merge_matrices([("a.json", first), ("b.json", second)])
    assert len(merged.cells) == 3
    assert merged.environment["environments"] == {"2": first.environment}
    assert "hostname" not in merged.environment


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"torch": "2.12.0"}, "torch 2.13.0 in a.json but 2.12.0 in b.json"),
        ({"seed": 7}, "seed 1234 in a.json but 7 in b.json"),
        ({"fault": "grads_summed"}, "fault absent in a.json but grads_summed in b.json"),
    ],
)
def test_runs_of_one_world_size_must_agree(change, fragment):
    first = Matrix(environment=environment((1, 2)), cells=[Cell("a", "v", 2, "pass")])
    second = Matrix(environment=environment((2,), **change), cells=[Cell("b", "v", 2, "pass")])
    with pytest.raises(MergeError, match="^world size 2 ran with ") as excinfo:
        merge_matrices([("a.json", first), ("b.json", second)])
    assert fragment in str(excinfo.value)


def test_the_same_cell_twice_is_refused():
    run = run_matrix((2,))
    with pytest.raises(MergeError) as excinfo:
        merge_matrices([("a.json", run_matrix((1,))), ("b.json", run), ("c.json", run)])
    assert str(excinfo.value) == "cell accumulate[steps=2-fp32] at world size 2 is in both b.json and c.json"
    with pytest.raises(MergeError, match="at least one"):
        merge_matrices([])


def test_a_merged_matrix_merges_again_keeping_its_environments():
    once = merge_matrices([("cpu.json", run_matrix((1, 2))), ("gpu.json", run_matrix((4,), backend="nccl"))])
    again = merge_matrices([("merged.json", once), ("big.json", run_matrix((8,), backend="nccl"))])
    assert again.environment["environments"]["1"]["backend"] == "gloo"
    assert again.environment["environments"]["4"]["backend"] == "nccl"
    assert again.environment["world_sizes"] == [1, 2, 4, 8]
    with pytest.raises(MergeError, match="world size 4 ran with backend nccl in merged.json but gloo in x.json"):
        other = Matrix(environment=environment((4,)), cells=[Cell("fused_loss", "fp32", 4, "pass")])
        merge_matrices([("merged.json", once), ("x.json", other)])


# the command line


def test_merge_command_writes_the_three_reports(tmp_path):
    cpu = write_run(tmp_path / "cpu", run_matrix((1, 2)))
    gpu = write_run(tmp_path / "gpu", run_matrix((4, 8), backend="nccl", device="cuda"))
    result = harness("merge", "cpu/matrix.json", "gpu/matrix.json", "--out", "merged", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == (
        "merged 2 matrices (12 cells, world sizes 1, 2, 4, 8) into merged: "
        "merged/matrix.json, merged/matrix.md, merged/matrix.html\n"
    )
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == sorted(REPORT_NAMES)
    merged = load_matrix(tmp_path / "merged" / "matrix.json")
    assert len(merged.cells) == 12
    assert merged.environment["merged_from"] == ["cpu/matrix.json", "gpu/matrix.json"]
    assert merged.environment["environments"]["8"] == load_matrix(gpu).environment
    assert merged.environment["environments"]["1"] == load_matrix(cpu).environment
    assert "ws=8" in (tmp_path / "merged" / "matrix.md").read_text(encoding="utf-8")
    assert '<option value="8">ws=8</option>' in (tmp_path / "merged" / "matrix.html").read_text(encoding="utf-8")


def test_the_merged_matrix_is_read_by_diff_and_compare(tmp_path):
    write_run(tmp_path / "cpu", run_matrix((1, 2)))
    write_run(tmp_path / "gpu", run_matrix((4,), backend="nccl", device="cuda"))
    assert harness("merge", "cpu/matrix.json", "gpu/matrix.json", "--out", "m", cwd=tmp_path).returncode == 0
    result = harness("diff", "m/matrix.json", "m/matrix.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("0 regressions, 0 improvements")
    # a merged matrix diffs against one of its parts: the other parts are only in base, nothing vanished
    assert harness("diff", "m/matrix.json", "cpu/matrix.json", cwd=tmp_path).returncode == 0
    assert harness("compare", "m/matrix.json", "cpu/matrix.json", cwd=tmp_path).returncode == 0


def test_a_duplicate_cell_exits_two_and_writes_nothing(tmp_path):
    write_run(tmp_path / "a", run_matrix((1, 2)))
    write_run(tmp_path / "b", run_matrix((2, 4)))
    result = harness("merge", "a/matrix.json", "b/matrix.json", "--out", "out", cwd=tmp_path)
    line = assert_one_line_error(result)
    assert line == ("harness merge: error: cell accumulate[steps=2-fp32] at world size 2 "
                    "is in both a/matrix.json and b/matrix.json")
    assert not (tmp_path / "out").exists()


def test_conflicting_environments_at_one_world_size_exit_two(tmp_path):
    a = Matrix(environment=environment((2,)), cells=[Cell("a", "v", 2, "pass")])
    b = Matrix(environment=environment((2,), accelerate="0.28.0"), cells=[Cell("b", "v", 2, "pass")])
    write_run(tmp_path / "a", a)
    write_run(tmp_path / "b", b)
    result = harness("merge", "a/matrix.json", "b/matrix.json", "--out", "out", cwd=tmp_path)
    assert_one_line_error(result, "world size 2", "accelerate 1.15.0 in a/matrix.json but 0.28.0 in b/matrix.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no such file"),
        ("this is { not json", "not JSON"),
        (json.dumps({"schema_version": 2, "cells": []}), "schema_version is 2"),
    ],
)
def test_an_unusable_input_exits_two_with_one_line(tmp_path, content, fragment):
    write_run(tmp_path / "a", run_matrix((1,)))
    if content is not None:
        (tmp_path / "broken.json").write_text(content, encoding="utf-8")
    result = harness("merge", "a/matrix.json", "broken.json", "--out", "out", cwd=tmp_path)
    assert_one_line_error(result, "broken.json", fragment)
    assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_written_exits_two(tmp_path):
    write_run(tmp_path / "a", run_matrix((1,)))
    (tmp_path / "taken").write_text("a file, not a folder", encoding="utf-8")
    result = harness("merge", "a/matrix.json", "--out", "taken", cwd=tmp_path)
    assert_one_line_error(result, "--out", "taken")
    result = harness("merge", "a/matrix.json", "--out", "taken/below", cwd=tmp_path)
    assert_one_line_error(result, "--out", "taken")


def test_one_input_and_out_are_required(tmp_path):
    write_run(tmp_path / "a", run_matrix((1,)))
    for args in (["merge", "--out", "out"], ["merge", "a/matrix.json"]):
        result = harness(*args, cwd=tmp_path)
        assert result.returncode == 2
        assert "required" in result.stderr
        assert "Traceback" not in result.stderr
    result = harness("merge", "a/matrix.json", "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("merged 1 matrix (3 cells, world size 1) into out: ")


def test_help_describes_exit_status(tmp_path):
    result = harness("merge", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "exit status" in result.stdout
    assert "python -m harness merge " in result.stdout
    assert "merge" in harness("--help", cwd=tmp_path).stdout
