"""Tests for matrix.html as markup (harness/render/matrix_page.py): one heatmap square and one
permalink per cell, failures first and grouped, the timeline's data, and the page's size. What the
page does in a browser is tests/test_report_pages.py's."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

from harness.matrix import Cell, Matrix
from harness.records import Failure
from harness.render.matrix import render_html
from harness.render.page import cell_anchor
from harness.timeline import Timeline, TimelineMark, TimelineStep


class Elements(HTMLParser):
    """Every start tag with its attributes, and the page's JSON data."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._in_data = False
        self.data: dict = {}
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        self.tags.append((tag, attributes))
        self._in_data = tag == "script" and attributes.get("id") == "harness-data"

    def handle_data(self, data):
        if self._in_data:
            self.data = json.loads(data)
            self._in_data = False

    def having(self, tag: str, css: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and css in a.get("class", "").split()]


def timeline(ranks: int = 2, steps: int = 4, failing_rank: int = 1) -> Timeline:
    return Timeline(
        steps=[TimelineStep(step=s, epoch=0, batch=s - 1, sync=s % 2 == 0, optimizer_step=s % 2 == 0)
               for s in range(1, steps + 1)],
        marks=[TimelineMark(rank=r, step=s, check=c, kind="not_synced" if r == failing_rank and c == "grad" else None)
               for s in range(1, steps + 1) for r in range(ranks) for c in ("flag", "grad", "param")],
    )


def failing(case: str, variant: str, ws: int, kinds=("not_synced",)) -> Cell:
    failures = [Failure(rank=1, step=s, model="model", param="w", kind=k, max_abs_diff=0.5,
                        message=f"gradient of 'model.w' on rank 1 at step {s}: {k}\nMismatched elements: 3 / 4 (75.0%)")
                for s in (2, 4) for k in kinds]
    return Cell(case, variant, ws, "fail", summary="2 mismatches on rank 1", failures=failures,
                rerun=f"pytest 'cases/x.py::{case}[{variant}-ws{ws}]'", timeline=timeline(ranks=ws))


def matrix() -> Matrix:
    cells = [Cell("accumulate", f"steps={s}", ws, "pass", summary="every rank matched") for s in (1, 2) for ws in (1, 2)]
    cells += [failing("no_sync", "fp32", 2, kinds=("not_synced", "stale")), failing("no_sync", "bf16", 2),
              Cell("no_sync", "fp32", 1, "pass"),
              Cell("fused_loss", "fp32", 2, "error", summary="rank 1 hung after 120 s", detail="Thread 0x1 (most recent call first)"),
              Cell("canary", "fp32", 2, "detected", summary="caught", failures=failing("canary", "fp32", 2).failures,
                   timeline=timeline()),
              Cell("odd", "a/b c#d", 2, "skip", summary="not here")]
    return Matrix(environment={"world_sizes": [1, 2]}, cells=cells)


def test_the_heatmap_has_one_linked_square_per_cell_whose_id_is_its_permalink():
    page = Elements(render_html(matrix()))
    marks = page.having("a", "m")
    cells = matrix().sorted_cells()
    assert len(marks) == len(cells)
    assert sorted(m["id"] for m in marks) == sorted(cell_anchor(c.case, c.variant, c.world_size) for c in cells)
    assert all(m["href"] == "#" + m["id"] for m in marks)
    assert {m["class"] for m in marks} == {f"m s-{s}" for s in ("pass", "fail", "error", "detected", "skip")}
    ids = [a["id"] for _, a in page.tags if "id" in a]
    assert len(ids) == len(set(ids))
    # a variant with no cell at a world size is drawn as a gap, not a square
    assert len(page.having("span", "gap")) == 1  # no_sync bf16 at ws=1


def test_failures_come_first_grouped_by_case_with_kinds_ranks_and_first_step():
    text = render_html(matrix())
    page = Elements(text)
    entries = page.having("details", "failure")
    assert [(e["data-case"], e["data-status"]) for e in entries] == [
        ("fused_loss", "error"), ("no_sync", "fail"), ("no_sync", "fail")]  # not the detected canary
    assert text.index('id="failures"') < text.index('id="heatmap"')
    no_sync = text[text.index('<div class="group" data-case="no_sync">'):]
    assert "not_synced ×2" in no_sync and "stale ×2" in no_sync and "rank 1, first at step 2" in no_sync
    assert "rank 1 hung after 120 s" in text and "Thread 0x1" in text


def test_the_data_carries_each_timeline_and_the_messages_only_once():
    text = render_html(matrix())
    page = Elements(text)
    by_id = {c["i"]: c for c in page.data["cells"]}
    failing_cell = by_id[cell_anchor("no_sync", "fp32", 2)]
    assert "f" not in failing_cell  # its messages are in its Failures entry
    assert text.count("on rank 1 at step 2: stale") == 1
    kinds, checks = page.data["kinds"], page.data["checks"]
    marks = failing_cell["t"]["m"]
    assert len(marks) == 2 * 4 * 3
    assert {(checks[c], kinds[k] if k >= 0 else None) for r, s, c, k in marks if r == 1} == {
        ("flag", None), ("grad", "not_synced"), ("param", None)}
    assert failing_cell["t"]["s"][1] == [2, 0, 1, True, True]
    canary = by_id[cell_anchor("canary", "fp32", 2)]
    assert canary["t"] and canary["f"]  # a detected cell is not under Failures: its panel has them


def test_a_permalink_is_one_to_one_and_readable():
    assert cell_anchor("accumulate", "steps=2-fp32", 2) == "cell-accumulate/steps=2-fp32/ws2"
    names = [("a", "b/c", 1), ("a/b", "c", 1), ("a", "b c", 1), ("a", "b%20c", 1), ("a", "b", 11)]
    anchors = [cell_anchor(*n) for n in names]
    assert len(set(anchors)) == len(anchors)
    assert all(re.fullmatch(r"cell-[A-Za-z0-9=,._%-]+/[A-Za-z0-9=,._%-]*/ws\d+", a) for a in anchors)


def test_a_thousand_cells_fit_in_about_a_megabyte():
    # 1,000 cells as the default run has them, scaled: most pass, one in eight a canary's detected
    # cell with its timeline, a few failing with 64 failures each.
    cells = []
    for n in range(1000):
        case, variant, ws = f"case_{n % 40}", f"variant_{n // 120}-fp32-wrapper=fsdp2", 1 + n % 3
        if n % 100 == 7:
            cell = failing(case, variant, 4, kinds=("not_synced", "stale", "mismatch", "sync_flag"))
            cell.world_size = ws
            cell.failures = cell.failures * 8
            cell.timeline = timeline(ranks=4, steps=10)
        elif n % 8 == 3:
            cell = Cell(case, variant, ws, "detected", summary="diagnosed as declared (not_synced in model): " * 2,
                        failures=failing(case, variant, ws).failures, timeline=timeline(ranks=4, steps=10))
        else:
            cell = Cell(case, variant, ws, "pass", duration_s=0.1234,
                        summary="every rank matched the oracle: 60 checks, 20 of gradients (0 vacuous), 20 backwards' collectives")
        cells.append(cell)
    page = render_html(Matrix(environment={"world_sizes": [1, 2, 3]}, cells=cells))
    assert len(Elements(page).having("a", "m")) == 1000
    assert len(page.encode("utf-8")) < 1_000_000
