"""Tests for harness.render.reports: the JSON, Markdown, HTML and terminal renderings of a matrix."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from harness.matrix.file import parse_matrix
from harness.matrix.schema import Cell, Matrix
from harness.records import STATUSES, Failure
from harness.render.matrix import render_html, render_markdown, render_table
from harness.render.reports import check_report_dir, render_json, write_atomically, write_reports
from harness.text import md_code, md_text

PLANTED_MESSAGE = "'gen.weight' on rank 1 at step 3: not synced <b>& friends</b>"

CELL_KEYS = {"case", "variant", "world_size", "status", "summary", "max_abs_diff", "duration_s"}
FAILURE_KEYS = {"rank", "step", "model", "param", "kind", "max_abs_diff", "message"}


def make_failure(rank: int = 1, step: int = 3, message: str = PLANTED_MESSAGE) -> Failure:
    return Failure(
        rank=rank,
        step=step,
        model="gen",
        param="weight",
        kind="not_synced",
        max_abs_diff=0.125,
        message=message,
    )


def make_matrix(*, complete: bool = True) -> Matrix:
    cells = [
        Cell("accumulate", "steps=2", 1, "pass", duration_s=0.05),
        Cell("accumulate", "steps=2", 2, "pass", duration_s=0.07),
        Cell("accumulate", "steps=2", 4, "skip", summary="needs 4 GPUs, have 2"),
        Cell(
            "accumulate_multi_model",
            "steps=2-bf16",
            2,
            "fail",
            summary="gen.weight not synced on rank 1",
            max_abs_diff=0.125,
            failures=[make_failure(rank=r, step=s) for r in (0, 1) for s in (1, 2, 3, 4)],
            rerun="pytest 'cases/test_accumulate.py::test_multi[steps=2-bf16-ws2]'",
        ),
        Cell("accumulate_multi_model", "steps=2-bf16", 1, "pass"),
        Cell("accumulate_nested", "", 2, "detected", summary="caught nested accumulate"),
        Cell("accumulate_nested", "", 4, "missed", summary="nested accumulate went unnoticed"),
        Cell("no_sync", "a|b", 2, "error", summary="rank 1 hung after 120 s"),
        Cell("unused_parameters", "default", 1, "unsupported", summary="needs Accelerator.foo"),
    ]
    return Matrix(
        environment={
            "python": "3.11.7",
            "torch": "2.5.1",
            "accelerate": "1.2.0",
            "backend": "gloo",
            "device": "cpu",
            "world_sizes": [1, 2, 4],
            "seed": 1234,
        },
        cells=cells,
        created="2025-01-01T00:00:00+00:00",
        complete=complete,
    )


def table_rows(markdown: str) -> list[list[str]]:
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_json_round_trips() -> None:
    matrix = make_matrix()
    text = render_json(matrix)
    assert text.endswith("\n")
    data = json.loads(text)
    assert parse_matrix(data).to_dict() == matrix.to_dict()
    assert data == matrix.to_dict()


def test_json_of_an_infinite_difference_is_strict_and_reads_back(tmp_path: Path) -> None:
    from harness.matrix.file import load_matrix

    failure = make_failure()
    failure.max_abs_diff, failure.max_rel_diff, failure.factor = float("inf"), float("nan"), float("-inf")
    matrix = Matrix(environment={"world_sizes": [2]},
                    cells=[Cell("c", "v", 2, "fail", max_abs_diff=float("inf"), failures=[failure])])
    text = render_json(matrix)
    assert "Infinity" not in text and "NaN" not in text
    path = tmp_path / "matrix.json"
    path.write_text(text, encoding="utf-8")
    cell = load_matrix(path).cells[0]
    assert cell.max_abs_diff == 1e308
    assert (cell.failures[0].max_abs_diff, cell.failures[0].max_rel_diff) == (1e308, 1e308)
    assert cell.failures[0].factor == -1e308


def test_json_has_schema_1_keys_in_every_cell() -> None:
    data = json.loads(render_json(make_matrix()))
    assert data["schema_version"] == 1
    assert {"created", "environment", "cells"} <= data.keys()
    assert len(data["cells"]) == len(make_matrix().cells)
    for cell in data["cells"]:
        assert CELL_KEYS | {"failures"} <= cell.keys()
        for failure in cell["failures"]:
            assert FAILURE_KEYS <= failure.keys()
    assert any(cell["failures"] for cell in data["cells"])


def test_markdown_pivot_shows_every_cell_in_its_column() -> None:
    matrix = make_matrix()
    markdown = render_markdown(matrix)
    assert markdown.startswith("# Gradient-sync matrix\n")
    rows = table_rows(markdown)
    header, body = rows[0], rows[1:]
    assert header == ["case", "variant", "ws=1", "ws=2", "ws=4"]
    by_row = {(row[0], row[1].replace("\\|", "|")): row for row in body}
    assert len(by_row) == len({(c.case, c.variant) for c in matrix.cells})
    for cell in matrix.cells:
        row = by_row[(cell.case, cell.variant)]
        entry = row[header.index(f"ws={cell.world_size}")]
        assert entry.endswith(cell.status), (cell.key, entry)
    assert by_row[("accumulate_nested", "")][2] == "—"


def test_markdown_escapes_pipes_in_table_text() -> None:
    markdown = render_markdown(make_matrix())
    assert "| a\\|b |" in markdown
    assert "| a|b |" not in markdown


def test_markdown_header_names_environment_and_counts() -> None:
    markdown = render_markdown(make_matrix())
    for word in ("3.11.7", "2.5.1", "1.2.0", "gloo", "cpu", "1,2,4", "1234"):
        assert word in markdown
    assert "9 cells: 3 pass, 1 fail, 1 error, 1 skip, 1 unsupported, 1 detected, 1 missed" in markdown


def test_markdown_incomplete_banner_only_when_incomplete() -> None:
    banner = "**Incomplete run**: only the cells that finished are shown."
    assert banner not in render_markdown(make_matrix(complete=True))
    assert banner in render_markdown(make_matrix(complete=False))


def test_markdown_failures_section_lists_bad_cells_only() -> None:
    markdown = render_markdown(make_matrix())
    section = markdown.split("## Failures", 1)[1]
    assert "accumulate_multi_model / steps=2-bf16 / ws=2: ❌ fail — gen.weight not synced" in section
    # A pipe is escaped everywhere in Markdown (it renders as |), not only in tables.
    assert "no_sync / a\\|b / ws=2: 💥 error — rank 1 hung" in section
    assert "accumulate_nested /  / ws=4: ⚠️ missed" in section
    assert "unsupported — needs Accelerator.foo" in section
    assert "needs 4 GPUs" not in section
    assert "caught nested accumulate" not in section
    bullets = [line for line in section.splitlines() if line.startswith("  - rank ")]
    assert len(bullets) == 5
    assert "rank 0, step 1, `gen.weight`: not_synced, max abs diff 0.125" in bullets[0]
    assert "… and 3 more" in section
    assert "rerun: `pytest 'cases/test_accumulate.py::test_multi[steps=2-bf16-ws2]'`" in section


def test_markdown_of_all_passing_matrix_has_no_failures_section() -> None:
    matrix = Matrix(environment={}, cells=[Cell("accumulate", "x", 1, "pass")])
    assert "## Failures" not in render_markdown(matrix)


def test_html_is_self_contained() -> None:
    # One file: inline style and script, nothing that makes the browser fetch (the one URL in the
    # script is the SVG namespace, a name, not an address).
    page = render_html(make_matrix())
    assert page.startswith("<!DOCTYPE html>")
    assert "<style>" in page and "<script>" in page
    for forbidden in ("https://", "<link", "src=", "url(", "fetch(", "XMLHttpRequest", "import("):
        assert forbidden not in page
    assert set(re.findall(r"http://[^\s\"']*", page)) == {"http://www.w3.org/2000/svg"}


def test_html_has_a_badge_per_status_and_escaped_failure_text() -> None:
    page = render_html(make_matrix())
    for status in STATUSES:
        assert f'<span class="badge s-{status}">{status}</span>' in page  # the legend
        assert f".s-{status} {{" in page
    assert "&lt;b&gt;&amp; friends&lt;/b&gt;" in page
    assert "<b>&" not in page
    assert '<details class="failure"' in page and "<pre>" in page
    assert "a|b" in page


def test_html_incomplete_banner_only_when_incomplete() -> None:
    assert "INCOMPLETE RUN" not in render_html(make_matrix(complete=True))
    assert "INCOMPLETE RUN" in render_html(make_matrix(complete=False))


def test_html_escapes_environment_and_names() -> None:
    matrix = Matrix(
        environment={"torch": "<i>2.5</i>"},
        cells=[Cell("<case>", "v&1", 1, "pass", summary='say "hi" </script><b>')],
    )
    page = render_html(matrix)
    assert "<i>" not in page and "&lt;i&gt;2.5&lt;/i&gt;" in page
    assert "<case>" not in page and "&lt;case&gt;" in page
    assert "v&amp;1" in page
    # the summary travels in the page's data, where no <, > or & survives to end the script
    assert "</script><b>" not in page and "say \\\"hi\\\" \\u003c/script\\u003e\\u003cb\\u003e" in page


def test_table_is_aligned_and_counts_are_right() -> None:
    text = render_table(make_matrix())
    lines = text.splitlines()
    header, rows, counts = lines[0], lines[1:-1], lines[-1]
    assert header.split() == ["case", "variant", "ws=1", "ws=2", "ws=4"]
    assert len(rows) == 5
    for column in ("variant", "ws=1", "ws=2", "ws=4"):
        start = header.index(column)
        for row in rows:
            assert row[start - 2 : start] == "  ", (column, row)
            assert row[start] != " " or column == "variant"
    fail_row = next(row for row in rows if row.startswith("accumulate_multi_model"))
    assert fail_row[header.index("ws=1") :].split() == ["pass", "fail", "-"]
    assert counts == "9 cells: 3 pass, 1 fail, 1 error, 1 skip, 1 unsupported, 1 detected, 1 missed"


def _wide_matrix() -> Matrix:
    variants = ["steps=2-fp32", "steps=2-fp32-compile=aot_eager-wrapper=fsdp2",
                "steps=3-pattern=per_rank-fp32-wrapper=deepspeed-z3-reduce=fp32-extra=long-value"]
    statuses = iter(STATUSES * 10)
    cells = [Cell(case, variant, ws, next(statuses)) for case in ("accumulate_token_loss_transformers", "no_sync")
             for variant in variants for ws in (1, 2, 4, 8)]
    return Matrix(environment={"world_sizes": [1, 2, 4, 8]}, cells=cells)


def test_the_terminal_table_fits_the_terminal_and_keeps_every_cell() -> None:
    matrix = _wide_matrix()
    wide = render_table(matrix)
    assert max(len(line) for line in wide.splitlines()) > 80  # as a row per (case, variant) it would wrap
    assert render_table(matrix, 200) == wide  # where that fits, the table is unchanged
    text = render_table(matrix, 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert lines[0].split() == ["case", "/", "variant", "ws=1", "ws=2", "ws=4", "ws=8"]
    assert lines[-1] == render_table(matrix).splitlines()[-1]  # the counts
    # each case once, then its variants indented, statuses on a variant's first line and the rest of
    # a long variant below it, broken after a whole key=value (deepspeed-z3 stays whole)
    body = lines[1:-1]
    assert [line for line in body if not line.startswith(" ")] == ["accumulate_token_loss_transformers", "no_sync"]
    by_case: dict[str, list[tuple[str, list[str]]]] = {}
    case = ""
    for line in body:
        if not line.startswith(" "):
            case = line
        elif line.startswith("    "):
            variant, shown = by_case[case][-1]
            by_case[case][-1] = (variant + line.strip(), shown)
        else:
            words = line.split()
            by_case.setdefault(case, []).append((words[0], words[1:]))
    assert "wrapper=deepspeed-z3-" in "".join(v for v, _ in by_case["no_sync"])
    for cell in matrix.cells:
        variant, shown = next((v, s) for v, s in by_case[cell.case] if v == cell.variant)
        assert shown[[1, 2, 4, 8].index(cell.world_size)] == cell.status


def test_the_reports_line_breaks_into_one_line_per_report_where_it_would_not_fit() -> None:
    from harness.render.matrix import terminal_summary

    reports = ["reports/a-long-directory-name/matrix.json", "reports/a-long-directory-name/matrix.md",
               "reports/a-long-directory-name/matrix.html"]
    _, lines = terminal_summary(make_matrix(), reports, width=80)
    assert lines[-4:] == ["reports:"] + ["  " + r for r in reports]
    _, lines = terminal_summary(make_matrix(), reports, width=200)
    assert lines[-1] == "reports: " + ", ".join(reports)


def test_table_of_empty_matrix_says_so() -> None:
    assert render_table(Matrix(environment={}, cells=[])) == "no cells ran"


def test_table_counts_line_for_good_run() -> None:
    cells = [Cell("c", "v", ws, "pass") for ws in (1, 2, 4)] + [Cell("n", "", 2, "detected")]
    assert render_table(Matrix(environment={}, cells=cells)).splitlines()[-1] == (
        "4 cells: 3 pass, 1 detected"
    )


def test_write_reports_writes_three_files_and_no_temporaries(tmp_path: Path) -> None:
    matrix = make_matrix()
    report_dir = tmp_path / "nested" / "reports"
    paths = write_reports(matrix, report_dir)
    assert [p.name for p in paths] == ["matrix.json", "matrix.md", "matrix.html"]
    assert sorted(p.name for p in report_dir.iterdir()) == sorted(p.name for p in paths)
    assert paths[0].read_text(encoding="utf-8") == render_json(matrix)
    assert paths[1].read_text(encoding="utf-8") == render_markdown(matrix)
    assert paths[2].read_text(encoding="utf-8") == render_html(matrix)


def test_write_reports_replaces_old_reports(tmp_path: Path) -> None:
    write_reports(make_matrix(complete=False), tmp_path)
    paths = write_reports(make_matrix(complete=True), tmp_path)
    assert "Incomplete run" not in paths[1].read_text(encoding="utf-8")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_reports_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        paths = write_reports(make_matrix(), tmp_path)
        paths.append(tmp_path / "other.txt")
        write_atomically(paths[-1], "text\n")
    finally:
        os.umask(previous)
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path.name


def test_check_report_dir_accepts_a_fresh_nested_dir_and_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "x" / "y"
    assert check_report_dir(target) is None
    assert list(tmp_path.iterdir()) == []


def test_check_report_dir_rejects_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    reason = check_report_dir(blocker)
    assert reason is not None
    assert reason.startswith(f"cannot write to reports dir '{blocker}': ")
    assert "\n" not in reason


def test_check_report_dir_rejects_a_path_under_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    reason = check_report_dir(blocker / "sub")
    assert reason == f"cannot write to reports dir '{blocker / 'sub'}': Not a directory"


# Text from a matrix in Markdown: one helper (md_text / md_code) for matrix.md, diff and compare.

HOSTILE = "<!-- hide the rest --> <b>&amp; | \\| `tick` \x1b[31m\x00\u202e\nnext line"


def hostile_matrices() -> tuple[Matrix, Matrix]:
    environment = {name: HOSTILE for name in ("python", "torch", "accelerate", "backend", "device")}
    environment.update(world_sizes=[1, 2], seed=HOSTILE)
    failure = make_failure(message=HOSTILE)
    failure.model = failure.param = failure.kind = HOSTILE
    cells = [
        Cell(HOSTILE, HOSTILE, 1, "pass", summary=HOSTILE, rerun=HOSTILE),
        Cell(HOSTILE, "v", 2, "pass", summary=HOSTILE),
        Cell("c", HOSTILE, 2, "fail", summary=HOSTILE),
        Cell("gone", HOSTILE, 2, "pass", summary=HOSTILE),
        Cell("only", HOSTILE, 2, "skip", summary=HOSTILE),
    ]
    base = Matrix(environment=dict(environment), cells=cells, created=HOSTILE)
    after = [
        Cell(HOSTILE, HOSTILE, 1, "fail", summary=HOSTILE, failures=[failure], rerun=HOSTILE),
        Cell(HOSTILE, "v", 2, "error", summary=HOSTILE, detail=HOSTILE),
        Cell("c", HOSTILE, 2, "pass", summary=HOSTILE),
        Cell("new", HOSTILE, 2, "unsupported", summary=HOSTILE),
    ]
    candidate = Matrix(environment=dict(environment, accelerate=HOSTILE + " 2"), cells=after, complete=False)
    return base, candidate


def assert_no_raw_markup_from_data(markdown: str) -> None:
    # None of the renderers writes "<" or ">" of its own, so any here came from the data.
    assert "<" not in markdown and ">" not in markdown.replace("\n> note:", "")
    assert "&lt;!-- hide the rest --&gt;" in markdown
    assert "&lt;b&gt;&amp;amp;" in markdown
    for raw in ("\x1b", "\x00", "\u202e"):
        assert raw not in markdown
    # The escapes' backslashes are escaped in turn: the page shows \x1b[31m\x00\u202e.
    assert "\\\\x1b[31m\\\\x00\\\\u202e" in markdown
    assert "next line" in markdown and "\nnext line" not in markdown


def test_no_raw_html_from_the_data_reaches_any_markdown() -> None:
    from harness.matrix.comparison import build_comparison
    from harness.matrix.diff import diff_matrices
    from harness.render.comparison import render_comparison_markdown
    from harness.render.diff import render_diff_markdown

    base, candidate = hostile_matrices()
    matrix_md = render_markdown(candidate)
    assert_no_raw_markup_from_data(matrix_md)
    assert "Failures" in matrix_md and "rank 1, step 3" in matrix_md
    diff = diff_matrices(base, candidate)
    assert diff.regressions and diff.improvements and diff.vanished and diff.only_in_base and diff.only_in_candidate
    assert_no_raw_markup_from_data(render_diff_markdown(diff, HOSTILE, HOSTILE))
    comparison = build_comparison([("a.json", base), ("b.json", candidate)])
    for changed_only in (False, True):
        assert_no_raw_markup_from_data(render_comparison_markdown(comparison, changed_only=changed_only))


def test_md_text_escapes_markup_and_keeps_one_line() -> None:
    assert md_text("a | b") == "a \\| b"
    assert md_text("a\\|b") == "a\\\\\\|b"
    assert md_text("<!-- x -->") == "&lt;!-- x --&gt;"
    assert md_text("&lt;") == "&amp;lt;"
    assert md_text("`code`") == "\\`code\\`"
    assert md_text("one\n two\r\n\tthree") == "one two three"
    # Shown as the escape \x1b, whose backslash Markdown needs escaped in turn.
    assert md_text("\x1b[1m\x00\u202e\u200b") == "\\\\x1b[1m\\\\x00\\\\u202e\\\\u200b"
    assert md_text("\ud800") == "\\\\ud800"
    assert md_text(3) == "3"


def test_md_code_fences_backticks_and_never_shows_markup_raw() -> None:
    assert md_code("pytest cases/x.py") == "`pytest cases/x.py`"
    assert md_code("a`b") == "`` a`b ``"
    assert md_code("a``b`") == "``` a``b` ```"
    assert md_code("one\ntwo\x1b") == "`one two\\x1b`"
    # Inside a code span an entity or a backslash escape would be shown as typed: escaped text instead.
    assert md_code("a <!-- b") == md_text("a <!-- b") == "a &lt;!-- b"
    assert md_code("x | y") == "x \\| y"
    assert md_code("") == ""


def test_markdown_failure_bullets_escape_every_field() -> None:
    failure = make_failure(message="m")
    failure.model, failure.param, failure.kind = "<m>", "p|q", "k`<"
    matrix = Matrix(environment={}, cells=[Cell("c", "v", 2, "fail", summary="s", failures=[failure])])
    bullet = next(line for line in render_markdown(matrix).splitlines() if line.startswith("  - rank"))
    assert bullet == "  - rank 1, step 3, &lt;m&gt;.p\\|q: k\\`&lt;, max abs diff 0.125"


def test_reports_say_sync_is_not_tested_at_world_size_one_only_where_there_are_such_cells() -> None:
    from harness.render.matrix import WORLD_SIZE_ONE_NOTE

    with_one = make_matrix()
    assert "sync is not tested at world size 1" in WORLD_SIZE_ONE_NOTE
    assert WORLD_SIZE_ONE_NOTE in render_markdown(with_one)
    assert "sync is not tested at world size 1" in render_html(with_one)
    without = Matrix(environment={"world_sizes": [2]}, cells=[Cell("a", "v", 2, "pass")])
    assert "sync is not tested" not in render_markdown(without) + render_html(without)


def test_the_json_is_json_dumps_of_the_whole_matrix_made_of_each_cells_text_once() -> None:
    from harness.render.reports import CellTexts, _finite_json

    matrix = make_matrix()
    matrix.cells[0].max_abs_diff = float("inf")
    whole = json.dumps(_finite_json(matrix.to_dict()), indent=2, allow_nan=False) + "\n"
    texts = CellTexts()
    assert render_json(matrix, texts) == whole == render_json(matrix)
    empty = Matrix(environment={"seed": 1}, cells=[])
    assert render_json(empty) == json.dumps(empty.to_dict(), indent=2) + "\n"
    # a later write reuses a cell's text only for that very cell object: a new result of the same
    # cell (a rerun replacing it) is written anew
    replaced = Cell("accumulate", "steps=2", 1, "fail", summary="now failing")
    matrix.cells[0] = replaced
    assert json.loads(render_json(matrix, texts))["cells"][0]["status"] == "fail"
    assert render_json(matrix, texts) == json.dumps(_finite_json(matrix.to_dict()), indent=2) + "\n"
