"""matrix.html: the verdict at the top, the failures first, the whole matrix as a heatmap, and a
failing cell's timeline, in one self-contained page (its script: harness/render/report.js)."""

from __future__ import annotations

from collections import Counter
from operator import is_
from typing import Any, Callable, TypeVar

from harness.matrix.schema import Cell, Matrix, unavailable_checks
from harness.records import BAD_STATUSES, STATUSES, Failure
from harness.render.page import (
    KIND_COLOURS,
    STATUS_MEANINGS,
    cell_anchor,
    data_json,
    kind_chip,
    legend,
    page_head,
    page_tail,
    status_badge,
    verdict_banner,
)
from harness.text import html_block, html_text, printable_block, printable_line
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



T = TypeVar("T")


class CellFragments:
    """The pieces of the reports that are one cell's own (its heatmap square, its Failures entry, its
    JSON texts, its Markdown lines), each made once. A run rewrites its reports after every cell, and
    remaking every cell's pieces each time would be quadratic in the cells.

    A piece is reused only for the very cell object it was made from (held here, so its id cannot
    pass to another object) whose fields are still the very objects they were then (a field set
    anew, ``cell.status = ...``, drops the cell's pieces); and, for a piece that depends on the rest
    of the matrix too (its case's index), only in the same ``context``. What is not seen is a change
    inside a field's object (a failure appended to ``cell.failures``): a cell is not to be changed
    after it is rendered, and the plugin never does (its cells are read back from each test's report)."""

    def __init__(self) -> None:
        self._cells: dict[int, tuple[Cell, tuple[Any, ...], dict[str, tuple[Any, Any]]]] = {}

    def get(self, cell: Cell, name: str, make: Callable[[Cell], T], context: Any = None) -> T:
        """``make(cell)``, the piece called ``name``, made anew only where it cannot be reused."""
        entry = self._cells.get(id(cell))
        fields = vars(cell)
        if entry is None or entry[0] is not cell or len(entry[1]) != len(fields) or not all(
                map(is_, entry[1], fields.values())):
            entry = (cell, tuple(fields.values()), {})
            self._cells[id(cell)] = entry
        known = entry[2].get(name)
        if known is None or known[0] != context:
            known = entry[2][name] = (context, make(cell))
        return known[1]


def render_matrix_page(matrix: Matrix, *, world_sizes: list[int], environment_line: str, notes: list[str],
                       fragments: CellFragments | None = None) -> str:
    """The page; ``world_sizes``: those run or asked for (a requested one with no cell still shows);
    ``fragments``: the cells' pieces kept from an earlier page of the same run."""
    fragments = fragments if fragments is not None else CellFragments()
    cells = matrix.sorted_cells()
    cases = sorted({c.case for c in cells})
    counts = matrix.counts()
    # each cell's square and page data; the data is made again where what it indexes into changed
    # (its case's place among the cases, the checks and kinds its timeline's marks are numbered by)
    case_index = {case: n for n, case in enumerate(cases)}
    checks, kinds = _checks_and_kinds(cells, fragments)
    indexed = (tuple(checks), tuple(kinds))
    made = [fragments.get(c, "html", lambda cell: _cell_pieces(cell, case_index, checks, kinds),
                          (case_index[c.case], indexed if c.timeline is not None else None)) for c in cells]
    out = page_head("Gradient-sync matrix", MATRIX_CSS) + ["<body>", "<h1>Gradient-sync matrix</h1>"]
    out += verdict_banner(counts, complete=matrix.complete, unchecked=unavailable_checks(matrix.environment))
    out.append(f'<p class="env">{html_text(environment_line)}</p>')
    out += _filters(cases, world_sizes, counts)
    out += _failures(cells, fragments)
    out.append('<section id="panel" hidden tabindex="-1" aria-live="polite"></section>')
    out += _heatmap(cells, cases, world_sizes, {id(c): square for c, (square, _) in zip(cells, made)})
    out.append("<h2>Legend</h2>")
    out.append(legend(STATUS_MEANINGS))
    out.append(_kinds_legend())
    out += [f'<p class="ws1 muted">{html_text(note)}</p>' for note in notes]
    out += page_tail(None, text=_page_data_text(cases, checks, kinds, [text for _, text in made]))
    return "\n".join(out) + "\n"


def _cell_pieces(cell: Cell, case_index: dict[str, int], checks: list[str], kinds: list[str]) -> tuple[str, str]:
    """A cell's square in the heatmap, and its entry in the page's data as data_json's text."""
    return _square(cell), data_json(_cell_data(cell, case_index, checks, kinds))


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


def _failures(cells: list[Cell], fragments: CellFragments) -> list[str]:
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
        out += [fragments.get(cell, "html-failure", _failure_entry) for cell in group]
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


def _heatmap(cells: list[Cell], cases: list[str], world_sizes: list[int], squares: dict[int, str]) -> list[str]:
    """The cards of squares; ``squares``: each cell's, by the cell's id."""
    out = ['<section id="matrix"><h2>Matrix</h2>',
           '<p class="muted">One square per cell: a card per case, a row per world size, a column per variant. '
           "Hover for its name, click (or Enter) for its summary; the arrow keys move between cells.</p>",
           '<div class="heatmap" id="heatmap">']
    by_case: dict[str, list[Cell]] = {}
    for cell in cells:
        by_case.setdefault(cell.case, []).append(cell)
    for case in cases:
        mine = by_case.get(case, [])
        variants = list(dict.fromkeys(c.variant for c in mine))
        at = {(c.variant, c.world_size): c for c in mine}
        present = {c.world_size for c in mine}
        sizes = [ws for ws in world_sizes if ws in present] or world_sizes
        grid = [f'<div class="card" data-case="{html_text(case)}"><h3>{html_text(case)}</h3>'
                f'<div class="grid" style="grid-template-columns: auto repeat({len(variants)}, 12px)">']
        for ws in sizes:
            grid.append(f'<span class="ws">{ws}</span>')
            for variant in variants:
                cell = at.get((variant, ws))
                if cell is None:
                    grid.append(f'<span class="m gap" title="{html_text(variant)} · ws={ws}: no cell"></span>')
                else:
                    grid.append(squares[id(cell)])
        grid.append("</div></div>")
        out.append("".join(grid))
    out += ["</div>", "</section>"]
    return out


def _square(cell: Cell) -> str:
    """A cell's square in the heatmap; the script gives it its status, case and world size from the page's data."""
    anchor = cell_anchor(cell.case, cell.variant, cell.world_size)
    return (f'<a class="m s-{html_text(cell.status)}" id="{html_text(anchor)}" href="#{html_text(anchor)}" '
            f'title="{html_text(cell.variant)} · ws={cell.world_size}: {html_text(cell.status)}"></a>')


def _kinds_legend() -> str:
    chips = "".join(kind_chip(kind) for kind in KIND_COLOURS)
    return ('<p class="kinds-legend">Timeline marks: <span class="kind k-agreed">agreed</span> the check agreed '
            f"with the oracle; otherwise the diagnosis: {chips}</p>")


def _checks_and_kinds(cells: list[Cell], fragments: CellFragments) -> tuple[list[str], list[str]]:
    """The checks and the kinds the page's timelines number their marks by: the known ones, then any other."""
    named = [fragments.get(c, "marks", _marks_named) for c in cells if c.timeline]
    checks = list(CHECKS) + sorted(set().union(*(n[0] for n in named)) - set(CHECKS))
    kinds = list(KIND_COLOURS) + sorted(set().union(*(n[1] for n in named)))
    return checks, kinds


def _page_data_text(cases: list[str], checks: list[str], kinds: list[str], cell_texts: list[str]) -> str:
    """What the script draws from, in short (the matrix.json cells hold it all), as data_json's text
    of the whole, put together from each cell's own (_cell_data's). A cell with an entry under
    Failures has its messages there only: its panel shows that entry's."""
    head = data_json({"cases": cases, "checks": checks, "check_words": CHECK_WORDS, "kinds": kinds,
                      "coloured": len(KIND_COLOURS), "cells": []})
    assert head.endswith('"cells":[]}')
    return head[: -len("[]}")] + "[" + ",".join(cell_texts) + "]}"


def _marks_named(cell: Cell) -> tuple[frozenset[str], frozenset[str]]:
    """The checks a cell's timeline names, and the kinds it names that have no colour of their own."""
    marks = cell.timeline.marks if cell.timeline else []
    return (frozenset(m.check for m in marks),
            frozenset(m.kind for m in marks if m.kind and m.kind not in KIND_COLOURS))


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
