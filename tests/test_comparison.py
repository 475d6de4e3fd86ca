"""Tests for harness.crossversion and the `compare` subcommand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.cli import main
from harness.comparison import build_comparison
from harness.render.comparison import render_comparison_html, render_comparison_markdown
from harness.matrix import Cell, Matrix


def make_matrix(cells, *, accelerate="1.15.0", world_sizes=(1, 2)) -> Matrix:
    environment = {"python": "3.11.7", "torch": "2.13.0", "backend": "gloo", "device": "cpu",
                   "world_sizes": list(world_sizes), "seed": 1234}
    if accelerate is not None:
        environment["accelerate"] = accelerate
    return Matrix(environment=environment, cells=[Cell(*c) for c in cells], created="2025-01-01T00:00:00")


def write_matrix(path: Path, matrix: Matrix) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(matrix.to_dict()), encoding="utf-8")
    return path


OLD = make_matrix(
    [
        ("accumulate", "steps=2", 1, "pass", "ok"),
        ("accumulate", "steps=2", 2, "pass", "ok"),
        ("no_sync", "plain", 2, "fail", "old failure"),
    ],
    accelerate="0.28.0",
)
NEW = make_matrix(
    [
        ("accumulate", "steps=2", 1, "pass", "ok"),
        ("accumulate", "steps=2", 2, "fail", "'m.weight' on rank 1 at step 3: <not synced> & \"stale\""),
        ("unused_parameters", "plain", 2, "unsupported", "needs Accelerator.foo"),
    ],
    accelerate="1.15.0",
)


def test_rows_are_the_union_of_keys_sorted():
    comparison = build_comparison([("old/matrix.json", OLD), ("new/matrix.json", NEW)])
    assert [c.heading for c in comparison.columns] == ["accelerate 0.28.0", "accelerate 1.15.0"]
    assert [row.key for row in comparison.rows] == [
        ("accumulate", "steps=2", 1),
        ("accumulate", "steps=2", 2),
        ("no_sync", "plain", 2),
        ("unused_parameters", "plain", 2),
    ]
    by_key = {row.key: row for row in comparison.rows}
    assert by_key[("accumulate", "steps=2", 2)].statuses == ["pass", "fail"]
    assert by_key[("no_sync", "plain", 2)].statuses == ["fail", None]
    assert by_key[("accumulate", "steps=2", 2)].differs
    assert not by_key[("accumulate", "steps=2", 1)].differs
    # A cell one input lacks is shown as absent, not as a difference.
    assert not by_key[("no_sync", "plain", 2)].differs


def test_headings_fall_back_to_file_name_and_are_disambiguated():
    unversioned = make_matrix([("a", "v", 1, "pass")], accelerate=None)
    comparison = build_comparison(
        [("runs/a.json", OLD), ("runs/b.json", OLD), ("runs/nightly.json", unversioned)]
    )
    assert [c.heading for c in comparison.columns] == [
        "accelerate 0.28.0 (a.json)",
        "accelerate 0.28.0 (b.json)",
        "nightly.json",
    ]
    same_name = build_comparison([("x/matrix.json", unversioned), ("y/matrix.json", unversioned)])
    headings = [c.heading for c in same_name.columns]
    assert len(set(headings)) == 2


def test_markdown_marks_differing_rows_in_bold():
    md = render_comparison_markdown(build_comparison([("old.json", OLD), ("new.json", NEW)]))
    assert "| | case | variant | world size | accelerate 0.28.0 | accelerate 1.15.0 |" in md
    rows = {line.split("|")[2].strip() + "/" + line.split("|")[4].strip(): line
            for line in md.splitlines() if line.startswith("| ") and "steps=2" in line}
    assert rows["accumulate/2"].startswith("| **≠** |")
    assert "**" not in rows["accumulate/1"]
    assert "1 of 4 cells differ across 2 inputs" in md


def test_html_is_self_contained_and_escaped():
    page = render_comparison_html(build_comparison([("old.json", OLD), ("new.json", NEW)]))
    lowered = page.lower()
    for forbidden in ("<script", "<link", "src=", "href=", "http://", "https://", "@import", "url("):
        assert forbidden not in lowered, forbidden
    assert "<style>" in page
    assert "accelerate 0.28.0" in page and "accelerate 1.15.0" in page
    assert "&lt;not synced&gt; &amp; &quot;stale&quot;" in page
    assert "<not synced>" not in page
    assert 'class="differs"' in page
    fail_cell = re.search(r'<td class="status s-fail" title="([^"]*)">fail</td>', page)
    assert fail_cell is not None
    assert fail_cell.group(1).startswith("accelerate 1.15.0: fail — ")


def test_compare_command_writes_files(tmp_path, capsys):
    old = write_matrix(tmp_path / "reports" / "accelerate-0.28.0" / "matrix.json", OLD)
    new = write_matrix(tmp_path / "reports" / "accelerate-1.15.0" / "matrix.json", NEW)
    html_path, md_path = tmp_path / "compare.html", tmp_path / "compare.md"
    assert main(["compare", str(old), str(new), "--html", str(html_path), "--markdown", str(md_path)]) == 0
    stdout = capsys.readouterr().out
    assert "accelerate 0.28.0" in stdout and "accelerate 1.15.0" in stdout
    assert md_path.read_text(encoding="utf-8") == stdout
    page = html_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert "accelerate 0.28.0" in page and "accelerate 1.15.0" in page


def test_compare_accepts_a_single_input(tmp_path, capsys):
    only = write_matrix(tmp_path / "m.json", OLD)
    assert main(["compare", str(only)]) == 0
    assert "accelerate 0.28.0" in capsys.readouterr().out


def test_compare_default_writes_no_html(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    only = write_matrix(tmp_path / "m.json", OLD)
    assert main(["compare", str(only)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "no such file"), ("{oops", "not JSON"), (json.dumps({"schema_version": 2}), "schema_version is 2")],
)
def test_compare_unusable_input_exits_two(tmp_path, capsys, content, fragment):
    good = write_matrix(tmp_path / "good.json", OLD)
    broken = tmp_path / "broken.json"
    if content is not None:
        broken.write_text(content, encoding="utf-8")
    html_path = tmp_path / "out.html"
    assert main(["compare", str(good), str(broken), "--html", str(html_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("harness compare: error: ")
    assert fragment in captured.err
    assert "Traceback" not in captured.err
    assert not html_path.exists()


def test_compare_needs_an_input(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["compare"])
    assert excinfo.value.code == 2


def test_changed_only_lists_just_the_rows_that_differ(tmp_path):
    old = write_matrix(tmp_path / "old.json", make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "fail")], accelerate="0.28.0"))
    new = write_matrix(tmp_path / "new.json", make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "pass")]))
    full = render_comparison_markdown(build_comparison([(old, load(old)), (new, load(new))]))
    short = render_comparison_markdown(build_comparison([(old, load(old)), (new, load(new))]), changed_only=True)
    assert "| a | v |" in full and "| a | v |" not in short
    assert "| b | v |" in short


def load(path):
    from harness.matrixfile import load_matrix

    return load_matrix(path)


def test_compare_markdown_and_html_never_carry_markup_from_the_data(tmp_path, capsys):
    comment = "<!-- hide the rest -->"
    hostile = make_matrix([(comment, comment, 2, "pass", comment)], accelerate=comment)
    hostile.environment["torch"] = comment
    hostile.environment["backend"] = "gloo\x1b[2J\u202e"
    old = write_matrix(tmp_path / "old.json", hostile)
    new = write_matrix(tmp_path / "new.json", OLD)
    page_path = tmp_path / "page.html"
    assert main(["compare", str(old), str(new), "--html", str(page_path)]) == 0
    md = capsys.readouterr().out
    assert "<" not in md and "\x1b" not in md and "\u202e" not in md
    assert "| &lt;!-- hide the rest --&gt; | &lt;!-- hide the rest --&gt; | 2 |" in md
    assert "torch &lt;!-- hide the rest --&gt;" in md
    assert "backend gloo\\\\x1b[2J\\\\u202e" in md
    page = page_path.read_text(encoding="utf-8")
    assert "<!--" not in page and "&lt;!-- hide the rest --&gt;" in page
    assert "\x1b" not in page and "gloo\\x1b[2J\\u202e" in page
