"""matrix.html: the verdict at the top, the failures first, the whole matrix as a heatmap, and a
failing cell's timeline, in one self-contained page (its script: harness/render/report.js)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.matrix import Cell, Matrix
from harness.records import BAD_STATUSES, STATUSES, Failure
from harness.render.page import (
    KIND_COLOURS,
    STATUS_MEANINGS,
    cell_anchor,
    kind_chip,
    legend,
    page_head,
    page_tail,
    status_badge,
    verdict_banner,
)
from harness.render.text import html_block, html_text, printable_block, printable_line
from harness.timeline import CHECK_WORDS, CHECKS, Timeline

# What the page carries of a cell's failures (matrix.json has them all): the first failure of each
# kind, for the first few kinds, each message cut (the timeline shows where the rest are).
FAILURES_SHOWN = 3
MESSAGE_CHARS = 1500
DETAIL_CHARS = 4000

MATRIX_CSS = """
#filters { display: flex; flex-wrap: wrap; gap: .4em 1.2em; align-items: center; margin: .8em 0;
           padding: 6px 10px; background: #f6f8fa; border-radius: 6px; font-size: .9em; }
#filters fieldset { border: 0; padding: 0; margin: 0; display: inline-flex; gap: .5em; align-items: center; }
#filters legend { float: left; font-weight: 600; margin-right: .4em; }
#shown { color: #57606a; }
#failure-list { max-height: 46vh; overflow-y: auto; padding-right: 4px; }
.group h3 { font-size: 1em; margin: .8em 0 .2em 0; font-family: ui-monospace, monospace; }
details.failure { border: 1px solid #d0d7de; border-radius: 6px; margin: 4px 0; padding: 4px 8px; }
details.failure > summary { cursor: pointer; }
details.failure[open] { background: #fcfcfd; }
.heatmap { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: flex-start; }
.card { border: 1px solid #d0d7de; border-radius: 6px; padding: 3px 6px 5px 6px; }
.card h3 { font-size: .78em; margin: 0 0 2px 0; font-family: ui-monospace, monospace; font-weight: 600; }
.grid { display: grid; gap: 2px; grid-auto-flow: row; }
.grid .ws { font-size: .65em; color: #57606a; line-height: 12px; padding-right: 3px; text-align: right; }
.m { display: block; width: 12px; height: 12px; border-radius: 2px; }
.m.gap { background: repeating-linear-gradient(45deg, #fff, #fff 2px, #eaeef2 2px, #eaeef2 4px); }
a.m[hidden] { display: block; visibility: hidden; }
a.m.sel { outline: 2px solid #1f2328; outline-offset: 1px; }
#panel { border: 2px solid #1f2328; border-radius: 8px; padding: 8px 12px; margin: .8em 0; }
#panel h2 { margin-top: 0; }
.timeline svg { display: block; margin: 6px 0; max-width: 100%; height: auto; }
.timeline text { font-size: 11px; fill: #57606a; font-family: system-ui, sans-serif; }
.legend td { border: 0; padding: 1px 6px; }
.kinds-legend { font-size: .85em; }
.kind.k-agreed { color: #1f2328; }
"""



def render_matrix_page(matrix: Matrix, *, world_sizes: list[int], environment_line: str, notes: list[str]) -> str:
    """The page; ``world_sizes``: those run or asked for (a requested one with no cell still shows)."""
    cells = matrix.sorted_cells()
    cases = sorted({c.case for c in cells})
    counts = matrix.counts()
    out = page_head("Gradient-sync matrix", MATRIX_CSS) + ["<body>", "<h1>Gradient-sync matrix</h1>"]
    out += verdict_banner(counts, complete=matrix.complete)
    out.append(f'<p class="env">{html_text(environment_line)}</p>')
    out += _filters(cases, world_sizes, counts)
    out += _failures(cells)
    out.append('<section id="panel" hidden tabindex="-1" aria-live="polite"></section>')
    out += _heatmap(cells, cases, world_sizes)
    out.append("<h2>Legend</h2>")
    out.append(legend(STATUS_MEANINGS))
    out.append(_kinds_legend())
    out += [f'<p class="ws1 muted">{html_text(note)}</p>' for note in notes]
    out += page_tail(_page_data(cells, cases))
    return "\n".join(out) + "\n"


def _filters(cases: list[str], world_sizes: list[int], counts: dict[str, int]) -> list[str]:
    statuses = "".join(
        f'<label><input type="checkbox" name="status" value="{s}" checked> {status_badge(s, f"{s} {counts[s]}")}</label>'
        for s in STATUSES if counts.get(s)
    )
    case_options = "".join(f'<option value="{html_text(c)}">{html_text(c)}</option>' for c in cases)
    ws_options = "".join(f'<option value="{ws}">ws={ws}</option>' for ws in world_sizes)
    return [
        '<form id="filters" aria-label="filters" onsubmit="return false">',
        f"<fieldset><legend>status</legend>{statuses}</fieldset>",
        '<label>case <select id="filter-case"><option value="">all cases</option>' + case_options + "</select></label>",
        '<label>world size <select id="filter-ws"><option value="">all</option>' + ws_options + "</select></label>",
        '<button type="button" id="filter-reset">show all</button>',
        '<span id="shown"></span>',
        "</form>",
    ]


def _failures(cells: list[Cell]) -> list[str]:
    bad = [c for c in cells if c.status in BAD_STATUSES]
    out = [f'<section id="failures"><h2>Failures ({len(bad)})</h2>', '<div id="failure-list">']
    if not bad:
        out.append('<p class="muted">No cell failed, errored or missed its canary.</p>')
    by_case: dict[str, list[Cell]] = {}
    for cell in bad:
        by_case.setdefault(cell.case, []).append(cell)
    for case, group in by_case.items():
        out.append(f'<div class="group" data-case="{html_text(case)}"><h3>{html_text(case)} '
                   f'<span class="muted">({len(group)})</span></h3>')
        out += [_failure_entry(cell) for cell in group]
        out.append("</div>")
    out.append("</div></section>")
    return out


def _failure_entry(cell: Cell) -> str:
    anchor = cell_anchor(cell.case, cell.variant, cell.world_size)
    kinds = Counter(str(f.kind) for f in cell.failures)
    ranks = sorted({f.rank for f in cell.failures})
    steps = [f.step for f in cell.failures]
    facts = []
    if ranks:
        facts.append(("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks))
    if steps:
        first = min(steps)
        facts.append("before the first step" if first == 0 else f"first at step {first}")
    if not cell.failures and cell.summary:  # an error or a missed canary: its one line says why
        facts.append(cell.summary if len(cell.summary) <= 160 else cell.summary[:160] + "…")
    summary = (
        f"{status_badge(cell.status)} <strong>{html_text(cell.variant)}</strong> · ws={cell.world_size} "
        + "".join(kind_chip(k, n) for k, n in kinds.most_common())
        + (f' <span class="muted">{html_text(", ".join(facts))}</span>' if facts else "")
    )
    body = [f"<p>{html_text(cell.summary)}</p>" if cell.summary else ""]
    if cell.timeline is not None:
        body.append('<div class="timeline"></div>')
    if cell.status == "error" and cell.detail:
        body.append(f"<pre>{_pre_text(cell.detail, DETAIL_CHARS)}</pre>")
    shown = _shown_failures(cell)
    body += [f"<pre>{_pre_text(f.message, MESSAGE_CHARS)}</pre>" for f in shown]
    if len(cell.failures) > len(shown):
        body.append(f'<p class="muted">… and {len(cell.failures) - len(shown)} more failures in matrix.json</p>')
    if cell.rerun:
        body.append(f"<p>rerun: <code>{html_text(cell.rerun)}</code></p>")
    return (
        f'<details class="failure" data-cell="{html_text(anchor)}" data-status="{html_text(cell.status)}" '
        f'data-case="{html_text(cell.case)}" data-ws="{cell.world_size}"><summary>{summary}'
        f'<a class="permalink" href="#{html_text(anchor)}" title="permalink to this cell">¶</a></summary>'
        f'<div class="body">{"".join(body)}</div></details>'
    )


def _shown_failures(cell: Cell) -> list[Failure]:
    """The first failure of each kind, in step order, for the first FAILURES_SHOWN kinds."""
    firsts: dict[str, Failure] = {}
    for failure in cell.failures:
        if failure.message and str(failure.kind) not in firsts:
            firsts[str(failure.kind)] = failure
    return list(firsts.values())[:FAILURES_SHOWN]


def _pre_text(text: str, limit: int) -> str:
    """``text`` for a ``<pre>``, cut after ``limit`` characters (matrix.json has it all)."""
    shown = printable_block(text)
    if len(shown) > limit:
        shown = shown[:limit] + f"\n… ({len(shown) - limit} more characters in matrix.json)"
    return html_block(shown)


def _heatmap(cells: list[Cell], cases: list[str], world_sizes: list[int]) -> list[str]:
    out = ['<section id="matrix"><h2>Matrix</h2>',
           '<p class="muted">One square per cell: a card per case, a row per world size, a column per variant. '
           "Hover for its name, click (or Enter) for its summary; the arrow keys move between cells.</p>",
           '<div class="heatmap" id="heatmap">']
    for case in cases:
        mine = [c for c in cells if c.case == case]
        variants = list(dict.fromkeys(c.variant for c in mine))
        at = {(c.variant, c.world_size): c for c in mine}
        sizes = [ws for ws in world_sizes if any(c.world_size == ws for c in mine)] or world_sizes
        grid = [f'<div class="card" data-case="{html_text(case)}"><h3>{html_text(case)}</h3>'
                f'<div class="grid" style="grid-template-columns: auto repeat({len(variants)}, 12px)">']
        for ws in sizes:
            grid.append(f'<span class="ws">{ws}</span>')
            for variant in variants:
                cell = at.get((variant, ws))
                if cell is None:
                    grid.append(f'<span class="m gap" title="{html_text(variant)} · ws={ws}: no cell"></span>')
                    continue
                anchor = cell_anchor(case, variant, ws)
                # the script gives each square its status, case and world size from the page's data
                grid.append(
                    f'<a class="m s-{html_text(cell.status)}" id="{html_text(anchor)}" href="#{html_text(anchor)}" '
                    f'title="{html_text(variant)} · ws={ws}: {html_text(cell.status)}"></a>'
                )
        grid.append("</div></div>")
        out.append("".join(grid))
    out += ["</div>", "</section>"]
    return out


def _kinds_legend() -> str:
    chips = "".join(kind_chip(kind) for kind in KIND_COLOURS)
    return ('<p class="kinds-legend">Timeline marks: <span class="kind k-agreed">agreed</span> the check agreed '
            f"with the oracle; otherwise the diagnosis: {chips}</p>")


def _page_data(cells: list[Cell], cases: list[str]) -> dict[str, Any]:
    """What the script draws from, in short (the matrix.json cells hold it all). A cell with an
    entry under Failures has its messages there only: its panel shows that entry's."""
    checks = list(CHECKS) + sorted({m.check for c in cells if c.timeline for m in c.timeline.marks} - set(CHECKS))
    kinds = list(KIND_COLOURS) + sorted({m.kind for c in cells if c.timeline for m in c.timeline.marks
                                         if m.kind and m.kind not in KIND_COLOURS})
    case_index = {case: n for n, case in enumerate(cases)}
    return {
        "cases": cases, "checks": checks, "check_words": CHECK_WORDS, "kinds": kinds, "coloured": len(KIND_COLOURS),
        "cells": [_cell_data(c, case_index, checks, kinds) for c in cells],
    }


def _cell_data(cell: Cell, case_index: dict[str, int], checks: list[str], kinds: list[str]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "i": cell_anchor(cell.case, cell.variant, cell.world_size), "c": case_index[cell.case],
        "v": cell.variant, "w": cell.world_size, "s": str(cell.status), "m": printable_line(cell.summary),
        "e": [cell.checks, cell.grad_checks, cell.vacuous_checks, cell.comm_checks, round(cell.duration_s, 3)],
    }
    if cell.status not in BAD_STATUSES:  # a bad cell's messages and rerun line are in its Failures entry
        if cell.failures:
            shown = _shown_failures(cell)
            data["f"] = [printable_block(f.message)[:MESSAGE_CHARS] for f in shown]
            data["n"] = len(cell.failures) - len(shown)
        if cell.rerun and cell.status != "pass":  # a passing cell's is in matrix.json: the page keeps its size
            data["r"] = printable_line(cell.rerun)
    if cell.timeline is not None:
        data["t"] = _timeline_data(cell.timeline, checks, kinds)
    return data


def _timeline_data(timeline: Timeline, checks: list[str], kinds: list[str]) -> dict[str, Any]:
    """Steps as [step, epoch, batch, sync, optimizer_step]; marks as [rank, step, check, kind], the
    check and kind as indices into the page's lists, kind -1 where the check agreed."""
    return {
        "s": [[s.step, s.epoch, s.batch, s.sync, s.optimizer_step] for s in timeline.steps],
        "m": [[m.rank, m.step, checks.index(m.check), kinds.index(m.kind) if m.kind else -1] for m in timeline.marks],
    }
