"""Tests for harness.crossversion and the `compare` subcommand."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

from harness.cli import main
from harness.matrix.comparison import build_comparison
from harness.matrix.schema import Cell, Matrix
from harness.render.comparison import render_comparison_html, render_comparison_markdown
from harness.render.matrix import render_html
from harness.render.page import cell_anchor


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
    assert "| ✅ pass | ❌ fail |" in rows["accumulate/2"].replace("**", "")


def assert_self_contained(page: str) -> None:
    """One file: inline CSS and script only, nothing fetched, no link but to a cell of this page or
    (relative) to a matrix page on disk."""
    lowered = page.lower()
    for forbidden in ("<link", "src=", "http://", "https://", "@import", "url(", "//cdn", "fetch("):
        assert forbidden not in lowered, forbidden
    assert page.count("<script") == 2  # the data (type="application/json") and the inline script
    assert '<script type="application/json" id="harness-data">' in page
    for href in re.findall(r'href="([^"]*)"', page):
        assert not re.match(r"[a-z][a-z0-9+.-]*:", href), href  # no scheme: relative, or a #fragment


def test_html_is_self_contained_and_escaped():
    page = render_comparison_html(build_comparison([("old.json", OLD), ("new.json", NEW)]))
    assert_self_contained(page)
    assert "<style>" in page
    assert "accelerate 0.28.0" in page and "accelerate 1.15.0" in page
    assert "&lt;not synced&gt; &amp; &quot;stale&quot;" in page
    assert "<not synced>" not in page
    assert 'class="differs regressed"' in page
    fail_cell = re.search(r'<span title="([^"]*)"><span class="badge s-fail">fail</span></span>', page)
    assert fail_cell is not None
    assert fail_cell.group(1).startswith("accelerate 1.15.0: fail — ")
    # Without knowing where the page goes, no status links out.
    assert 'class="cell-link"' not in page


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
    from harness.matrix.file import load_matrix

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


# The verdict, the regressed cells, and the page's links to each run's own matrix page.


def test_a_cell_regressed_as_diff_counts_it_from_holding_to_anything_else_between_consecutive_inputs():
    def row(*statuses):
        matrices = [make_matrix([("a", "v", 1, s)] if s else [], accelerate=f"0.{n}.0")
                    for n, s in enumerate(statuses)]
        return build_comparison([(f"m{n}.json", m) for n, m in enumerate(matrices)]).rows[0]

    assert row("pass", "fail").regressed and row("detected", "missed").regressed
    assert row("pass", "error").turned_bad == [False, True]
    # An input without the cell is skipped: the next input that has it is the one compared.
    assert row("pass", None, "fail").turned_bad == [False, False, True]
    assert row("fail", "pass", "error").turned_bad == [False, False, True]
    assert row("pass", "skip").regressed and row("detected", "unsupported").regressed
    for statuses in [("fail", "pass"), ("fail", "error"), ("skip", "fail"), ("pass", "pass"), ("pass", "detected"),
                     ("pass", None)]:
        assert not row(*statuses).regressed, statuses
    assert row("pass", "skip").differs


def verdict_class(page: str) -> tuple[str, str]:
    found = re.search(r'<div id="verdict" class="verdict (\w+)" role="status">([^<]*)<', page)
    assert found is not None
    return found.group(1), found.group(2)


def test_banner_is_red_on_a_regression_amber_on_a_difference_green_otherwise():
    same = make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "fail")], accelerate="0.28.0")
    better = make_matrix([("a", "v", 1, "pass"), ("b", "v", 1, "pass")], accelerate="1.15.0")
    worse = make_matrix([("a", "v", 1, "fail"), ("b", "v", 1, "pass")], accelerate="1.16.0")
    cases = [
        ([same, same], "good", "0 of 2 cells differ across 2 inputs", "✅"),
        ([same, better], "differs", "1 of 2 cells differ across 2 inputs", "≠"),
        ([same, better, worse], "bad", "2 of 2 cells differ across 3 inputs, 1 regressed", "❌"),
        # the other order: a fails, then passes; b fails, then passes: no regression
        ([worse, better], "differs", "1 of 2 cells differ across 2 inputs", "≠"),
    ]
    for matrices, css, words, symbol in cases:
        comparison = build_comparison([(f"m{n}.json", m) for n, m in enumerate(matrices)])
        assert verdict_class(render_comparison_html(comparison)) == (css, words)
        md = render_comparison_markdown(comparison).splitlines()
        assert md[0] == "### Cross-version comparison"
        assert md[2] == f"{symbol} **{words}.**"


def test_each_input_shows_its_counts_as_badges_and_an_incomplete_run_says_so():
    unfinished = make_matrix([("a", "v", 1, "pass"), ("a", "v", 2, "fail")], accelerate="1.15.0")
    unfinished.complete = False
    page = render_comparison_html(build_comparison([("old.json", OLD), ("new.json", unfinished)]))
    inputs = re.search(r'<ol class="inputs" id="inputs">(.*?)</ol>', page, re.S).group(1)
    old_item, new_item = re.findall(r"<li>(.*?)</li>", inputs)
    assert '<span class="badge s-pass">2 pass</span><span class="badge s-fail">1 fail</span>' in old_item
    assert "INCOMPLETE" not in old_item and "INCOMPLETE" in new_item
    assert "torch 2.13.0, python 3.11.7, backend gloo, device cpu, world sizes [1,2]" in new_item


class _Rows(HTMLParser):
    """The rows of compare.html's whole table: id, data attributes, and each status cell's link."""

    def __init__(self):
        super().__init__()
        self.rows, self._in_table, self._td = [], False, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._in_table = attrs.get("id") == "all-cells"
        elif self._in_table and tag == "tr" and "data-case" in attrs:
            self.rows.append({"attrs": attrs, "cells": []})
        elif self._in_table and tag == "td" and self.rows:
            self.rows[-1]["cells"].append(None)
        elif self._in_table and tag == "a" and "cell-link" in attrs.get("class", "") and self.rows:
            self.rows[-1]["cells"][-1] = attrs["href"]

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = False


def table_rows(page: str) -> list[dict]:
    parser = _Rows()
    parser.feed(page)
    return parser.rows


def write_run(directory: Path, matrix: Matrix, *, with_page: bool) -> Path:
    """A run's report directory as `pytest cases/` leaves it: matrix.json, and matrix.html beside it."""
    path = write_matrix(directory / "matrix.json", matrix)
    if with_page:
        (directory / "matrix.html").write_text(render_html(matrix), encoding="utf-8")
    return path


def test_a_status_links_to_its_cell_on_the_matrix_page_beside_its_matrix_json(tmp_path, capsys):
    old = write_run(tmp_path / "reports" / "accelerate-0.28.0", OLD, with_page=True)
    new = write_run(tmp_path / "reports" / "accelerate 1.15.0 #nightly", NEW, with_page=False)
    html_path = tmp_path / "out" / "compare.html"
    html_path.parent.mkdir()
    assert main(["compare", str(old), str(new), "--html", str(html_path)]) == 0
    page = html_path.read_text(encoding="utf-8")
    assert_self_contained(page)
    rows = table_rows(page)
    comparison = build_comparison([(old, OLD), (new, NEW)])
    assert len(rows) == len(comparison.rows)
    matrix_page = (tmp_path / "reports" / "accelerate-0.28.0" / "matrix.html").read_text(encoding="utf-8")
    linked = 0
    for row, expected in zip(rows, comparison.rows):
        anchor = cell_anchor(*expected.key)
        assert row["attrs"]["id"] == anchor  # compare.html#cell-... is a permalink too
        old_href, new_href = row["cells"][4:]
        assert new_href is None  # no matrix.html beside that matrix.json
        if expected.cells[0] is None:
            assert old_href is None  # no such cell, nothing to link to
            continue
        path, _, fragment = old_href.partition("#")
        assert not path.startswith("/")
        target = (html_path.parent / unquote(path)).resolve()
        assert target == (tmp_path / "reports" / "accelerate-0.28.0" / "matrix.html").resolve()
        assert target.is_file()
        assert fragment == anchor
        assert f'id="{anchor}"' in matrix_page  # the fragment names a cell on that page
        linked += 1
    assert linked == len(OLD.cells)
    # The run's heading links to its page too; the other run has none.
    assert page.count('title="this run&#x27;s matrix page"') + page.count("title=\"this run's matrix page\"") == 1


def test_links_are_relative_to_where_the_page_is_written(tmp_path, monkeypatch):
    old = write_run(tmp_path / "runs" / "old", OLD, with_page=True)
    new = write_run(tmp_path / "runs" / "new", NEW, with_page=True)
    monkeypatch.chdir(tmp_path)
    for html_path, prefix in [(Path("compare.html"), "runs/old/matrix.html#"),
                              (Path("runs/old/compare.html"), "matrix.html#"),
                              (Path("deep/er/compare.html"), "../../runs/old/matrix.html#")]:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        relative = [(Path("runs/old/matrix.json"), OLD), (new, NEW)]
        assert main(["compare", *(str(p) for p, _ in relative), "--html", str(html_path)]) == 0
        hrefs = [href for row in table_rows(html_path.read_text(encoding="utf-8")) for href in row["cells"] if href]
        old_hrefs = [href for href in hrefs if "old" in href or href.startswith("matrix.html")]
        assert old_hrefs and all(href.startswith(prefix) for href in old_hrefs), (html_path, old_hrefs[:2])
        assert all((html_path.parent / unquote(href.partition("#")[0])).is_file() for href in hrefs)
    # A matrix page that is the compare page itself (written over it) is no link.
    assert main(["compare", str(old), "--html", str(old.with_suffix(".html"))]) == 0
    assert 'class="cell-link"' not in old.with_suffix(".html").read_text(encoding="utf-8")


def test_compare_page_in_a_browser(browser, tmp_path):
    old = write_run(tmp_path / "reports" / "accelerate-0.28.0", OLD, with_page=True)
    new = write_run(tmp_path / "reports" / "accelerate-1.15.0", NEW, with_page=True)
    html_path = tmp_path / "compare.html"
    assert main(["compare", str(old), str(new), "--html", str(html_path)]) == 0
    comparison = build_comparison([(old, OLD), (new, NEW)])
    equal = sorted(cell_anchor(*row.key) for row in comparison.rows if not row.differs)
    differing = [cell_anchor(*row.key) for row in comparison.differing_rows]
    assert equal and differing
    visible = "[...document.querySelectorAll('#all-cells tbody tr')].filter(r => !r.hidden).map(r => r.id).sort()"
    page = browser.open(html_path.as_uri())
    try:
        assert page.evaluate("document.getElementById('compare-filters').hidden") is False
        assert page.evaluate("document.getElementById('compare-shown').textContent") == "showing 4 of 4 cells"
        # The filter, by keyboard: Tab to the native checkbox, Space ticks it.
        for _ in range(30):
            if page.evaluate("document.activeElement.id") == "only-differing":
                break
            page.press("Tab")
        assert page.evaluate("document.activeElement.id") == "only-differing"
        page.press(" ")
        page.wait_for(f"JSON.stringify({visible}) === JSON.stringify({differing!r})".replace("'", '"'))
        hidden = page.evaluate("[...document.querySelectorAll('#all-cells tbody tr[hidden]')].map(r => r.id).sort()")
        assert hidden == equal
        assert page.evaluate("document.getElementById('compare-shown').textContent") == "showing 1 of 4 cells"
        page.click("#compare-reset")
        page.wait_for(f"{visible}.length === 4")
        # A world size, chosen as a person would (the select's value, then its change event).
        page.evaluate("s => { const el = document.getElementById(s); el.value = '1'; "
                      "el.dispatchEvent(new Event('change', {bubbles: true})); }", "compare-ws")
        assert page.evaluate(visible) == [cell_anchor("accumulate", "steps=2", 1)]
        page.click("#compare-reset")
        # A permalink to a row the filter hides shows it again.
        page.click("#only-differing")
        page.wait_for(f"{visible}.length === 1")
        page.goto(html_path.as_uri() + "#" + equal[0])
        page.wait_for(f"{visible}.length === 4")
        # A status links to that cell on the run's own matrix page.
        anchor = cell_anchor("accumulate", "steps=2", 2)
        link = f"#all-cells tr[id='{anchor}'] td:nth-child(5) a.cell-link"
        href = page.evaluate("s => document.querySelector(s).href", link)
        matrix_page = tmp_path / "reports" / "accelerate-0.28.0" / "matrix.html"
        assert href == matrix_page.as_uri() + "#" + anchor
        assert not page.console_errors, page.console_errors
        page.click(link)
        page.wait_for("location.pathname.endsWith('/accelerate-0.28.0/matrix.html')")
        assert page.evaluate("location.hash") == "#" + anchor
        assert page.wait_for("s => document.getElementById(s) !== null", anchor)
    finally:
        page.close()
