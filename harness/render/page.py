"""The HTML pages' shared parts: one look (CSS), one script, a cell's permalink, the verdict
banner, and data handed to the script; every report page (matrix, compare) is built from them.

A page stays one self-contained file: the CSS and the script are inlined, nothing is fetched, and
the data the script draws from travels in a ``<script type="application/json">`` element.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Mapping, Sequence
from urllib.parse import quote

from harness.records import CHECK_TITLES, STATUSES, FailureKind
from harness.render.style import PAGE_STYLE, status_style, verdict
from harness.text import html_text

# Every diagnosis has its own colour in a timeline; a kind this harness does not know is grey.
KIND_COLOURS = {
    FailureKind.NOT_SYNCED: "#cf222e",
    FailureKind.SYNCED_EARLY: "#fb8f44",
    FailureKind.WRONG_SCALE: "#8250df",
    FailureKind.STALE: "#9a6700",
    FailureKind.PARAMS_DIVERGED: "#bf3989",
    FailureKind.STEPPED_EARLY: "#0969da",
    FailureKind.STEP_SKIPPED: "#54aeff",
    FailureKind.SYNC_FLAG: "#e16f24",
    FailureKind.SCHEDULE: "#6e7781",
    FailureKind.MISMATCH: "#a40e26",
    FailureKind.COMM_UNEXPECTED: "#d4a72c",
    FailureKind.COMM_MISSING: "#633c01",
    FailureKind.MISWEIGHTED: "#1b7c83",
}
# What each status means, in the legend of every page.
STATUS_MEANINGS = {
    "pass": "every rank matched the oracle",
    "fail": "some rank did not match the oracle",
    "error": "the cell could not be judged (crash, hang, exception)",
    "skip": "not applicable on this machine",
    "unsupported": "the installed accelerate lacks the API",
    "detected": "canary: the harness caught the known-wrong usage",
    "missed": "canary: the harness did not catch the known-wrong usage",
}

AGREED_COLOUR = "#aceebb"
UNKNOWN_KIND_COLOUR = "#8c959f"

SHARED_CSS = (
    PAGE_STYLE
    + status_style(".s-{status}")
    + """
body { margin: 1.2em 2em; }
h1 { margin: 0 0 .3em 0; }
h2 { font-size: 1.15em; margin: 1.2em 0 .4em 0; }
.env { color: #57606a; font-size: .9em; margin: .2em 0 .8em 0; }
.verdict { padding: 10px 14px; border-radius: 6px; font-weight: 600; font-size: 1.1em; }
.verdict.good { background: #dafbe1; border: 1px solid #1a7f37; }
.verdict.bad { background: #ffebe9; border: 1px solid #cf222e; }
.verdict .counts { font-weight: 400; font-size: .85em; margin-left: .6em; }
.incomplete { background: #fff8c5; border: 2px solid #d4a72c; padding: 8px 14px; border-radius: 6px;
              font-weight: 700; margin-top: 6px; }
.badge { display: inline-block; padding: 1px 7px; border-radius: 10px; font-size: .85em; font-weight: 600;
         margin-right: 3px; white-space: nowrap; }
.kind { display: inline-block; padding: 0 6px; border-radius: 4px; font-size: .8em; color: #fff;
        margin-right: 3px; font-family: ui-monospace, monospace; }
button.badge { border: 0; cursor: pointer; font: inherit; font-size: .85em; font-weight: 600; }
a.permalink { color: #57606a; text-decoration: none; margin-left: .4em; }
a.permalink:hover { color: #0969da; }
:focus-visible { outline: 2px solid #0969da; outline-offset: 2px; }
pre { white-space: pre-wrap; max-width: 70em; font-size: .82em; background: #f6f8fa; padding: 6px;
      margin: 4px 0; }
.muted { color: #57606a; }
"""
    + "".join(f".k-{kind} {{ background: {colour}; fill: {colour}; }}\n" for kind, colour in KIND_COLOURS.items())
    + f".k-agreed {{ background: {AGREED_COLOUR}; fill: {AGREED_COLOUR}; }}\n"
    + f".k-other {{ background: {UNKNOWN_KIND_COLOUR}; fill: {UNKNOWN_KIND_COLOUR}; }}\n"
)


def page_script(name: str = "report.js") -> str:
    """A script of harness/render, inlined: report.js (the matrix page: filters, keyboard,
    permalinks, timelines) or compare.js."""
    return resources.files("harness.render").joinpath(name).read_text(encoding="utf-8")


def cell_anchor(case: str, variant: str, world_size: int) -> str:
    """The id of a cell on every page, the ``#cell-...`` of its permalink: readable and one-to-one
    (each part percent-encoded but for letters, digits and ``=,._-``; the parts joined by ``/``)."""
    parts = (quote(str(case), safe="=,._-"), quote(str(variant), safe="=,._-"), f"ws{int(world_size)}")
    return "cell-" + "/".join(parts)


def data_json(data: Any) -> str:
    """``data`` as the JSON text of a data_script: no ``<``, ``>`` or ``&`` survives (each is a JSON
    escape). The text of a list or object is its items' texts joined, so it can be put together
    from parts made apart (matrix.html's is, from each cell's own)."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def data_script(element_id: str, data: Any, *, text: str | None = None) -> str:
    """Data for the page's script, inert and safe in HTML: no ``<``, ``>`` or ``&`` survives into
    the element (each is a JSON escape), so nothing in it can end the script or start a tag.
    ``text``: data_json's text of the data, made already (``data`` is then not read)."""
    text = data_json(data) if text is None else text
    return f'<script type="application/json" id="{html_text(element_id)}">{text}</script>'


def status_badge(status: str, text: str | None = None) -> str:
    css = f"s-{status}" if status in STATUSES else "s-unknown"
    return f'<span class="badge {css}">{html_text(status if text is None else text)}</span>'


def kind_chip(kind: str, count: int = 0) -> str:
    css = f"k-{kind}" if kind in KIND_COLOURS else "k-other"
    text = f"{kind} ×{count}" if count > 1 else kind
    return f'<span class="kind {css}">{html_text(text)}</span>'


def verdict_banner(counts: Mapping[str, int], *, complete: bool, noun: str = "cells",
                   unchecked: Mapping[str, str] | None = None) -> list[str]:
    """The banner a page opens with: red when any cell is fail, error or missed, else green; the
    counts per status; and, loudly, a run that did not finish and each check that could not run
    (``unchecked``: the matrix's ``unavailable_checks``)."""
    good, words = verdict(counts, noun)
    css = "good" if good else "bad"
    shown = [s for s in STATUSES if counts.get(s)]
    badges = "".join(
        f'<button type="button" class="badge s-{s}" data-only-status="{s}" '
        f'title="show only {s} cells">{counts[s]} {s}</button>'
        for s in shown
    )
    lines = [f'<div id="verdict" class="verdict {css}" role="status">{html_text(words)}'
             f'<span class="counts">{badges}</span></div>']
    if not complete:
        lines.append('<div id="incomplete" class="incomplete" role="alert">INCOMPLETE RUN: the run did not '
                     "finish (interrupted, or cells were lost). Only the cells that finished are shown; "
                     "a cell that is not here was never judged.</div>")
    for check, reason in (unchecked or {}).items():
        lines.append(f'<div class="unchecked incomplete" role="alert" data-check="{html_text(check)}">NOT CHECKED '
                     f"in this run: {html_text(CHECK_TITLES.get(check, check))}: {html_text(reason)}</div>")
    return lines


def page_head(title: str, extra_css: str = "") -> list[str]:
    return [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html_text(title)}</title>",
        f"<style>{SHARED_CSS}{extra_css}</style>",
        "</head>",
    ]


def page_tail(data: Mapping[str, Any] | None, script: str = "report.js", *, text: str | None = None) -> list[str]:
    """The data (or ``text``, data_json's text of it) and the script, last, so that the page reads before they run."""
    return [data_script("harness-data", data, text=text), f"<script>{page_script(script)}</script>", "</body>", "</html>"]


def legend(meanings: Mapping[str, str], statuses: Sequence[str] = STATUSES) -> str:
    rows = "".join(f"<tr><td>{status_badge(s)}</td><td>{html_text(meanings[s])}</td></tr>" for s in statuses)
    return f'<table class="legend">{rows}</table>'

