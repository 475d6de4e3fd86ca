"""Tests for harness.matrix.diff and the `diff` subcommand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.matrix.diff import diff_matrices, label_matrices
from harness.matrix.schema import Cell, Matrix
from harness.records import STATUSES
from harness.render.diff import notes, render_diff_markdown, render_diff_text

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_matrix(cells, *, accelerate="1.15.0", world_sizes=(1, 2), complete=True) -> Matrix:
    environment = {"python": "3.11.7", "torch": "2.13.0", "backend": "gloo", "device": "cpu",
                   "world_sizes": list(world_sizes), "seed": 1234}
    if accelerate is not None:
        environment["accelerate"] = accelerate
    parsed = [Cell(*c) if isinstance(c, tuple) else c for c in cells]
    return Matrix(environment=environment, cells=parsed, created="2025-01-01T00:00:00", complete=complete)


def write_matrix(path: Path, matrix: Matrix) -> Path:
    path.write_text(json.dumps(matrix.to_dict()), encoding="utf-8")
    return path


def single_cell_diff(before: str, after: str):
    base = make_matrix([("accumulate", "steps=2", 2, before, f"was {before}")])
    candidate = make_matrix([("accumulate", "steps=2", 2, after, f"now {after}")])
    return diff_matrices(base, candidate)


CLASSES = ("regressions", "improvements", "changed_other")


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("pass", "fail", "regressions"),
        ("detected", "missed", "regressions"),
        ("pass", "error", "regressions"),
        ("pass", "skip", "regressions"),
        ("pass", "unsupported", "regressions"),
        ("detected", "error", "regressions"),
        ("fail", "pass", "improvements"),
        ("missed", "detected", "improvements"),
        ("skip", "pass", "improvements"),
        ("fail", "error", "changed_other"),
        ("error", "skip", "changed_other"),
        ("pass", "detected", "changed_other"),
        ("pass", "pass", None),
        ("fail", "fail", None),
    ],
)
def test_status_transition_is_classified_once(before, after, expected):
    diff = single_cell_diff(before, after)
    for name in CLASSES:
        assert len(getattr(diff, name)) == (1 if name == expected else 0), name
    assert diff.unchanged == (1 if expected is None else 0)
    assert diff.has_regressions == (expected == "regressions")
    assert not diff.only_in_base and not diff.only_in_candidate


def test_every_pair_of_statuses_lands_in_exactly_one_place():
    for before in STATUSES:
        for after in STATUSES:
            diff = single_cell_diff(before, after)
            placed = sum(len(getattr(diff, name)) for name in CLASSES) + diff.unchanged
            assert placed == 1, (before, after)


def test_cells_only_in_one_matrix():
    base = make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "pass"), ("b", "v", 2, "fail")])
    candidate = make_matrix([("a", "v", 1, "pass"), ("c", "v", 1, "error")])
    diff = diff_matrices(base, candidate)
    # A cell that held in base and is gone from a candidate that ran its world size vanished:
    # that is a regression. One that did not hold (fail) is only reported.
    assert [c.key for c in diff.vanished] == [("b", "v", 1)]
    assert [c.key for c in diff.only_in_base] == [("b", "v", 2)]
    assert [c.key for c in diff.only_in_candidate] == [("c", "v", 1)]
    assert diff.unchanged == 1
    assert diff.has_regressions and diff.regression_count == 1 and not diff.regressions


@pytest.mark.parametrize(("status", "vanishes"), [(s, s in ("pass", "detected")) for s in STATUSES])
def test_only_a_cell_that_held_can_vanish(status, vanishes):
    diff = diff_matrices(make_matrix([("a", "v", 2, status)]), make_matrix([("b", "v", 2, "pass")]))
    assert [c.key for c in diff.vanished] == ([("a", "v", 2)] if vanishes else [])
    assert [c.key for c in diff.only_in_base] == ([] if vanishes else [("a", "v", 2)])
    assert diff.has_regressions == vanishes


def test_a_world_size_the_candidate_did_not_run_is_no_regression():
    base = make_matrix([("a", "v", 1, "pass"), ("a", "v", 4, "pass")], world_sizes=(1, 4))
    candidate = make_matrix([("a", "v", 1, "pass")], world_sizes=(1,))
    diff = diff_matrices(base, candidate)
    assert not diff.has_regressions
    assert [c.key for c in diff.only_in_base] == [("a", "v", 4)]
    assert "compared only where cells meet: base world sizes [1,4], candidate [1]" in notes(diff)


def test_candidate_world_sizes_come_from_its_cells_when_not_recorded():
    base = make_matrix([("a", "v", 1, "pass"), ("a", "v", 2, "pass"), ("b", "v", 2, "pass")], world_sizes=(1, 2))
    candidate = make_matrix([("a", "v", 2, "pass")], world_sizes=())
    diff = diff_matrices(base, candidate)
    assert [c.key for c in diff.vanished] == [("b", "v", 2)]
    assert [c.key for c in diff.only_in_base] == [("a", "v", 1)]


def test_a_cell_at_a_world_size_the_record_omits_shows_it_ran():
    base = make_matrix([("a", "v", 4, "pass"), ("b", "v", 4, "pass")], world_sizes=(4,))
    candidate = make_matrix([("a", "v", 4, "pass")], world_sizes=(1, 2))
    assert [c.key for c in diff_matrices(base, candidate).vanished] == [("b", "v", 4)]


def test_an_empty_candidate_that_records_nothing_ran_the_bases_world_sizes():
    base = make_matrix([("a", "v", 1, "pass"), ("a", "v", 2, "detected"), ("b", "v", 2, "skip")])
    diff = diff_matrices(base, make_matrix([], world_sizes=()))
    assert [c.key for c in diff.vanished] == [("a", "v", 1), ("a", "v", 2)]
    assert [c.key for c in diff.only_in_base] == [("b", "v", 2)]
    assert any("taken to have run the base's world sizes [1,2]" in note for note in notes(diff))
    # An empty candidate that says it ran other world sizes loses nothing.
    assert not diff_matrices(base, make_matrix([], world_sizes=(4,))).has_regressions


def test_an_unfinished_candidate_loses_the_cells_it_did_not_reach():
    base = make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "pass")])
    diff = diff_matrices(base, make_matrix([("a", "v", 1, "pass")], complete=False))
    assert [c.key for c in diff.vanished] == [("b", "v", 1)]
    assert any("the candidate run did not finish" in note for note in notes(diff))


def test_world_size_note_only_when_sets_differ():
    cells = [("a", "v", 1, "pass"), ("a", "v", 2, "pass")]
    base = make_matrix(cells + [("a", "v", 4, "pass")], world_sizes=(1, 2, 4))
    candidate = make_matrix(cells, world_sizes=(1, 2))
    diff = diff_matrices(base, candidate)
    assert "compared only where cells meet: base world sizes [1,2,4], candidate [1,2]" in notes(diff)
    assert notes(diff_matrices(candidate, candidate)) == []


def test_text_report_orders_sections_and_counts():
    base = make_matrix(
        [
            ("accumulate", "steps=2", 2, "pass"),
            ("no_sync", "plain", 2, "detected"),
            ("fused_loss", "plain", 2, "fail"),
            Cell("gone", "a", 1, "pass", rerun="pytest cases/test_gone.py -k 'a and ws1'"),
            ("gone", "b", 1, "detected"),
            ("gone", "c", 1, "pass"),
            ("old", "x", 2, "fail"),
        ]
    )
    candidate = make_matrix(
        [
            Cell("accumulate", "steps=2", 2, "fail", "'model.weight' on rank 1 at step 3: not synced",
                 rerun="pytest cases/test_accumulate.py -k 'steps=2 and ws2'"),
            ("no_sync", "plain", 2, "missed", "canary went unnoticed"),
            ("fused_loss", "plain", 2, "pass"),
        ]
    )
    text = render_diff_text(diff_matrices(base, candidate), "accelerate 0.28.0", "accelerate 1.15.0")
    lines = text.splitlines()
    assert lines[0] == "base: accelerate 0.28.0"
    assert lines[1] == "candidate: accelerate 1.15.0"
    regression = "REGRESSION accumulate / steps=2 / ws=2: pass -> fail — 'model.weight' on rank 1 at step 3: not synced"
    assert regression in lines
    assert "    rerun: pytest cases/test_accumulate.py -k 'steps=2 and ws2'" in lines
    assert "REGRESSION no_sync / plain / ws=2: detected -> missed — canary went unnoticed" in lines
    vanished = "VANISHED gone / a / ws=1: pass -> missing"
    assert vanished in lines
    assert lines[lines.index(vanished) + 1] == "    rerun: pytest cases/test_gone.py -k 'a and ws1'"
    assert "VANISHED gone / b / ws=1: detected -> missing" in lines
    assert "VANISHED gone / c / ws=1: pass -> missing" in lines
    improvement = "IMPROVEMENT fused_loss / plain / ws=2: fail -> pass"
    assert improvement in lines
    only = "ONLY IN BASE old / x / ws=2: fail"
    assert only in lines
    assert lines.index(regression) < lines.index(vanished) < lines.index(improvement) < lines.index(only)
    assert lines[-1] == (
        "5 regressions (3 vanished), 1 improvement, 0 other changes, 1 cell only in base, 0 only in candidate"
    )


UNPRINTABLE = "red \x1b[31mALERT\x1b[0m\x00 \u202eevil\u202c\r\nsecond line\x07"


def test_text_report_prints_control_characters_escaped_one_line_per_entry():
    base = make_matrix([("a", "v", 2, "pass"), ("gone", "v", 2, "pass"), ("b", "v", 2, "fail")])
    candidate = make_matrix(
        [
            Cell("a", UNPRINTABLE, 2, "pass"),
            Cell("a", "v", 2, "fail", summary=UNPRINTABLE, rerun=UNPRINTABLE),
            Cell("b", "v", 2, "pass", summary=UNPRINTABLE),
            Cell(UNPRINTABLE, "v", 1, "skip", summary=UNPRINTABLE),
        ],
        accelerate=UNPRINTABLE,
    )
    candidate.environment["backend"] = UNPRINTABLE
    diff = diff_matrices(base, candidate)
    text = render_diff_text(diff, UNPRINTABLE, UNPRINTABLE)
    lines = text.splitlines()
    shown = "red \\x1b[31mALERT\\x1b[0m\\x00 \\u202eevil\\u202c second line\\x07"
    assert all(line.isprintable() for line in lines), [line for line in lines if not line.isprintable()]
    assert lines[0] == f"base: {shown}"
    assert lines[1] == f"candidate: {shown}"
    assert f"note: the runs used different backends: base gloo, candidate {shown}" in lines
    assert f"REGRESSION a / v / ws=2: pass -> fail — {shown}" in lines
    assert f"    rerun: {shown}" in lines
    assert f"IMPROVEMENT b / v / ws=2: fail -> pass — {shown}" in lines
    assert f"ONLY IN CANDIDATE a / {shown} / ws=2: pass" in lines
    assert f"ONLY IN CANDIDATE {shown} / v / ws=1: skip — {shown}" in lines
    assert "VANISHED gone / v / ws=2: pass -> missing" in lines
    entries = [line for line in lines if line.startswith(("REGRESSION", "VANISHED", "IMPROVEMENT", "ONLY", "    rerun"))]
    assert len(entries) == 6


def test_markdown_diff_of_files_with_markup_in_them(tmp_path, capsys):
    comment = "<!-- the rest of the summary -->"
    base = write_matrix(tmp_path / "base.json", make_matrix([("a", comment, 2, "pass", comment)], accelerate=comment))
    cand = write_matrix(tmp_path / "cand.json", make_matrix([("a", comment, 2, "fail", comment)]))
    assert main(["diff", str(base), str(cand), "--format", "markdown"]) == 1
    md = capsys.readouterr().out
    assert "<" not in md
    assert "| a | &lt;!-- the rest of the summary --&gt; | 2 | ✅ pass | ❌ fail | &lt;!-- the rest" in md
    assert md.startswith("### Matrix diff: accelerate &lt;!-- the rest of the summary --&gt; → accelerate 1.15.0")


def test_labels_prefer_accelerate_version_then_file_name():
    with_version = make_matrix([], accelerate="0.28.0")
    without = make_matrix([], accelerate=None)
    assert label_matrices([("a/matrix.json", with_version), ("b/other.json", without)]) == [
        "accelerate 0.28.0",
        "other.json",
    ]
    same = label_matrices([("x/one.json", with_version), ("y/two.json", with_version)])
    assert same == ["accelerate 0.28.0 (one.json)", "accelerate 0.28.0 (two.json)"]


def test_markdown_lists_vanished_cells_among_the_regressions():
    base = make_matrix([("accumulate", "steps=2", 2, "pass"), ("gone", "v", 2, "detected")])
    candidate = make_matrix([("accumulate", "steps=2", 2, "fail", "not synced")])
    md = render_diff_markdown(diff_matrices(base, candidate), "a", "b")
    assert "#### Regressions (2)" in md
    assert "| accumulate | steps=2 | 2 | ✅ pass | ❌ fail | not synced |" in md
    assert "| gone | v | 2 | 🎯 detected | missing | vanished: no such cell in the candidate" in md
    assert "**2 regressions (1 vanished), 0 improvements, 0 other changes, 0 cells only in base" in md
    assert "Only in base" not in md


def test_markdown_report():
    base = make_matrix([("accumulate", "steps=2", 2, "pass"), ("only", "here", 1, "skip")])
    candidate = make_matrix([("accumulate", "steps=2", 2, "fail", "grad | not synced")], world_sizes=(1,))
    md = render_diff_markdown(diff_matrices(base, candidate), "accelerate 0.28.0", "accelerate 1.15.0")
    assert md.startswith("### Matrix diff: accelerate 0.28.0 → accelerate 1.15.0")
    assert "#### Regressions (1)" in md
    assert "| accumulate | steps=2 | 2 | ✅ pass | ❌ fail | grad \\| not synced |" in md
    assert "#### Only in base (1)" in md
    assert "> note: compared only where cells meet: base world sizes [1,2], candidate [1]" in md
    assert "**1 regression, 0 improvements, 0 other changes, 1 cell only in base, 0 only in candidate**" in md
    assert "| only | here | 1 | ⏭ skip |" in md


def test_markdown_opens_with_a_one_line_verdict():
    base = make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "fail")])
    regressed = render_diff_markdown(diff_matrices(base, make_matrix([("a", "v", 1, "error"), ("b", "v", 1, "fail")])),
                                     "old", "new").splitlines()
    assert regressed[:3] == [
        "### Matrix diff: old → new",
        "",
        "❌ **1 regression, 0 improvements, 0 other changes, 0 cells only in base, 0 only in candidate**",
    ]
    assert "| a | v | 1 | ✅ pass | 💥 error |" in "\n".join(regressed)
    improved = render_diff_markdown(diff_matrices(base, make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "pass")])),
                                    "old", "new").splitlines()
    assert improved[2] == "✅ **0 regressions, 1 improvement, 0 other changes, 0 cells only in base, 0 only in candidate**"
    # A vanished cell is a regression: the verdict says so.
    vanished = render_diff_markdown(diff_matrices(base, make_matrix([("b", "v", 1, "fail")])), "old", "new")
    assert vanished.splitlines()[2].startswith("❌ **1 regression (1 vanished), ")


# The command line.


def test_matrix_against_itself_exits_zero(tmp_path, capsys):
    path = write_matrix(tmp_path / "m.json", make_matrix([("a", "v", 1, "pass"), ("b", "v", 2, "fail")]))
    assert main(["diff", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "0 regressions, 0 improvements, 0 other changes, 0 cells only in base, 0 only in candidate"


def test_regression_exits_one_and_improvement_zero(tmp_path, capsys):
    good = write_matrix(tmp_path / "good.json", make_matrix([("a", "v", 1, "pass")], accelerate="0.28.0"))
    bad = write_matrix(tmp_path / "bad.json", make_matrix([("a", "v", 1, "fail")], accelerate="1.15.0"))
    assert main(["diff", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION a / v / ws=1: pass -> fail" in out
    assert "base: accelerate 0.28.0" in out
    assert main(["diff", str(bad), str(good)]) == 0


def test_vanished_cell_at_a_world_size_the_candidate_ran_exits_one(tmp_path, capsys):
    base = write_matrix(tmp_path / "base.json", make_matrix([("a", "v", 1, "pass"), ("a", "v", 2, "pass")]))
    cand = write_matrix(tmp_path / "cand.json", make_matrix([("a", "v", 1, "pass")]))
    assert main(["diff", str(base), str(cand)]) == 1
    out = capsys.readouterr().out
    assert "VANISHED a / v / ws=2: pass -> missing" in out
    assert out.splitlines()[-1].startswith("1 regression (1 vanished), ")
    # The other way round the cell is new in the candidate: no regression.
    assert main(["diff", str(cand), str(base)]) == 0


def test_vanished_cell_at_a_world_size_the_candidate_did_not_run_exits_zero(tmp_path, capsys):
    base = write_matrix(tmp_path / "base.json",
                        make_matrix([("a", "v", 1, "pass"), ("a", "v", 2, "pass")], world_sizes=(1, 2)))
    cand = write_matrix(tmp_path / "cand.json", make_matrix([("a", "v", 1, "pass")], world_sizes=(1,)))
    assert main(["diff", str(base), str(cand)]) == 0
    out = capsys.readouterr().out
    assert "note: compared only where cells meet: base world sizes [1,2], candidate [1]" in out
    assert "ONLY IN BASE a / v / ws=2: pass" in out
    assert "VANISHED" not in out


@pytest.mark.parametrize("world_sizes", [(), (1, 2)])
def test_candidate_without_cells_exits_one(tmp_path, capsys, world_sizes):
    base = write_matrix(tmp_path / "base.json", make_matrix([("a", "v", 1, "pass"), ("b", "v", 2, "detected")]))
    empty = make_matrix([], world_sizes=world_sizes)
    if not world_sizes:
        del empty.environment["world_sizes"]
    cand = write_matrix(tmp_path / "cand.json", empty)
    assert main(["diff", str(base), str(cand)]) == 1
    out = capsys.readouterr().out
    assert "VANISHED a / v / ws=1: pass -> missing" in out
    assert "VANISHED b / v / ws=2: detected -> missing" in out
    assert out.splitlines()[-1].startswith("2 regressions (2 vanished), ")


def test_markdown_format_and_output_file(tmp_path, capsys):
    good = write_matrix(tmp_path / "good.json", make_matrix([("a", "v", 1, "pass")]))
    bad = write_matrix(tmp_path / "bad.json", make_matrix([("a", "v", 1, "error")]))
    out_file = tmp_path / "summary.md"
    assert main(["diff", str(good), str(bad), "--format", "markdown", "--output", str(out_file)]) == 1
    stdout = capsys.readouterr().out
    assert "#### Regressions (1)" in stdout
    assert out_file.read_text(encoding="utf-8") == stdout


def _assert_one_line_error(capsys, fragment: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("harness diff: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no such file"),
        ("this is { not json", "not JSON"),
        (json.dumps({"schema_version": 2, "cells": []}), "schema_version is 2"),
        (json.dumps([1, 2, 3]), "not a matrix"),
    ],
)
def test_unusable_input_exits_two_with_one_line(tmp_path, capsys, content, fragment):
    good = write_matrix(tmp_path / "good.json", make_matrix([("a", "v", 1, "pass")]))
    broken = tmp_path / "broken.json"
    if content is not None:
        broken.write_text(content, encoding="utf-8")
    assert main(["diff", str(broken), str(good)]) == 2
    _assert_one_line_error(capsys, fragment)
    assert main(["diff", str(good), str(broken)]) == 2
    _assert_one_line_error(capsys, fragment)


def test_unwritable_output_exits_two(tmp_path, capsys):
    good = write_matrix(tmp_path / "good.json", make_matrix([("a", "v", 1, "pass")]))
    target = tmp_path / "no" / "such" / "dir" / "out.txt"
    assert main(["diff", str(good), str(good), "--output", str(target)]) == 2
    _assert_one_line_error(capsys, "cannot write")


def test_usage_errors_exit_two(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["diff", "only-one.json"])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit) as excinfo:
        main(["diff", "a.json", "b.json", "--format", "html"])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit) as excinfo:
        main([])
    assert excinfo.value.code == 2


def test_help_describes_exit_status(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["diff", "--help"])
    assert excinfo.value.code == 0
    help_text = capsys.readouterr().out
    assert "exit status" in help_text
    assert "1  at least one regression" in help_text
    assert "vanished" in help_text
    assert "never anything else" in help_text


def test_python_dash_m_harness_missing_file(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "harness", "diff", str(tmp_path / "missing.json"), str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("harness diff: error: ")
    assert "missing.json" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_labels_name_the_torch_release_where_the_inputs_ran_different_ones():
    old, new = make_matrix([], accelerate="1.15.0"), make_matrix([], accelerate="1.15.0")
    old.environment["torch"], new.environment["torch"] = "2.9.1", "2.13.0+cpu"
    assert label_matrices([("a/matrix.json", old), ("b/matrix.json", new)]) == [
        "torch 2.9.1, accelerate 1.15.0", "torch 2.13.0+cpu, accelerate 1.15.0"]
    new.environment["torch"] = "2.9.1"
    assert label_matrices([("a/x.json", old), ("b/y.json", new)]) == [
        "accelerate 1.15.0 (x.json)", "accelerate 1.15.0 (y.json)"]


def test_labels_that_are_the_same_name_the_path_once_and_never_the_file_name_twice():
    run = make_matrix([], accelerate="1.15.0")
    assert label_matrices([("reports/matrix.json", run), ("old/matrix.json", run)]) == [
        "accelerate 1.15.0 (reports/matrix.json)", "accelerate 1.15.0 (old/matrix.json)"]
    unlabelled = make_matrix([], accelerate=None)
    assert label_matrices([("a/matrix.json", unlabelled), ("b/matrix.json", unlabelled)]) == [
        "a/matrix.json", "b/matrix.json"]
    assert label_matrices([("m.json", run), ("m.json", run)]) == ["accelerate 1.15.0 (m.json)",
                                                                  "accelerate 1.15.0 (m.json) #2"]


def _selected(matrix: Matrix, *nodeids: str, keyword: str = "", args=("cases/",)) -> Matrix:
    matrix.environment["selection"] = {"args": list(args), "keyword": keyword, "markers": "",
                                       "selected": sorted(nodeids)}
    return matrix


def _cell(case: str, ws: int, status: str = "pass") -> Cell:
    return Cell(case, "fp32", ws, status, nodeid=f"cases/test_{case}.py::test_{case}[fp32-ws{ws}]")


def test_a_candidate_that_ran_a_narrower_selection_has_its_other_cells_not_selected_not_vanished():
    base = _selected(make_matrix([_cell("a", 1), _cell("a", 2), _cell("b", 1), _cell("b", 2, "detected")]),
                     *(f"test_{c}.py::test_{c}[fp32-ws{ws}]" for c in "ab" for ws in (1, 2)))
    # -k a: b's cells were not selected; a's ws2 was selected and is missing (the run stopped)
    candidate = _selected(make_matrix([_cell("a", 1)]), "test_a.py::test_a[fp32-ws1]", "test_a.py::test_a[fp32-ws2]",
                          keyword="a")
    diff = diff_matrices(base, candidate)
    assert [c.key for c in diff.not_selected] == [("b", "fp32", 1), ("b", "fp32", 2)]
    assert [c.key for c in diff.vanished] == [("a", "fp32", 2)]
    assert diff.regression_count == 1
    text = render_diff_text(diff, "base", "candidate")
    assert "note: the candidate ran a narrower selection (-k 'a'): 2 cells of the base it did not select" in text
    assert text.rstrip().endswith("1 regression (1 vanished), 0 improvements, 0 other changes, 0 cells only in base, "
                                  "0 only in candidate, 2 not selected")
    assert "not selected" in render_diff_markdown(diff, "base", "candidate")
    # the ids are the case files' names: the installed catalogue's paths select the same cells
    installed = _selected(make_matrix([_cell("a", 1), _cell("a", 2)]), "test_a.py::test_a[fp32-ws1]",
                          "test_a.py::test_a[fp32-ws2]")
    for cell in installed.cells:
        cell.nodeid = "/site-packages/harness/cases/" + cell.nodeid.split("/", 1)[1]
    assert [c.key for c in diff_matrices(base, installed).not_selected] == [("b", "fp32", 1), ("b", "fp32", 2)]
    # a candidate that records no selection (an older harness): every missing held cell is vanished
    assert len(diff_matrices(base, make_matrix([_cell("a", 1)])).vanished) == 3


def test_diff_of_a_full_run_against_a_k_subset_of_it_has_no_regression(left_out_run, run_pytest):
    from conftest import PLANTED

    # two cells, then one of them: the subset's world sizes are the full run's, so before runs recorded
    # their selection its other cell (a pass at world size 1) read as vanished, a regression
    full = left_out_run
    subset = run_pytest(PLANTED, "-k", "left_out and ws2", "--world-sizes", "1,2")
    selection = subset.matrix["environment"]["selection"]
    assert selection["keyword"] == "left_out and ws2" and selection["args"] == [PLANTED]
    assert len(selection["selected"]) == len(subset.matrix["cells"]) < len(full.matrix["cells"])
    shown = subprocess.run([sys.executable, "-m", "harness", "diff", str(full.report_dir / "matrix.json"),
                            str(subset.report_dir / "matrix.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "narrower selection (-k 'left_out and ws2'" in shown.stdout
    assert "1 not selected" in shown.stdout
    assert "0 regressions" in shown.stdout and "not selected" in shown.stdout
    # the other way round the subset's cells are all in the full run: nothing is left out
    back = subprocess.run([sys.executable, "-m", "harness", "diff", str(subset.report_dir / "matrix.json"),
                           str(full.report_dir / "matrix.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert "not selected" not in back.stdout
