"""How a status looks wherever a person sees it: its symbol in Markdown, its colours in HTML, and the
page style every HTML report shares (one page layout and one set of colours to learn)."""

from __future__ import annotations

from typing import Mapping

from harness.records import BAD_STATUSES, Status
from harness.text import md_text

# What a table shows where an input has no such cell.
ABSENT = "—"

# A Markdown cell shows its status with a symbol so the table reads at a glance.
STATUS_SYMBOLS = {
    Status.PASS: "✅",
    Status.FAIL: "❌",
    Status.ERROR: "💥",
    Status.SKIP: "⏭",
    Status.UNSUPPORTED: "🚫",
    Status.DETECTED: "🎯",
    Status.MISSED: "⚠️",
}

# The page every HTML report is laid out on.
PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1f2328; }
h1 { font-size: 1.5em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
"""
# status -> (background, text colour)
STATUS_COLOURS = {
    Status.PASS: ("#1a7f37", "#fff"),
    Status.FAIL: ("#cf222e", "#fff"),
    Status.ERROR: ("#8250df", "#fff"),
    Status.SKIP: ("#6e7781", "#fff"),
    Status.UNSUPPORTED: ("#d0d7de", "#1f2328"),
    Status.DETECTED: ("#0a7b83", "#fff"),
    Status.MISSED: ("#d4a72c", "#1f2328"),
}


def status_style(selector: str) -> str:
    """One CSS rule per status; ``selector`` has ``{status}`` where the status name goes."""
    return "".join(
        f"{selector.format(status=status)} {{ background: {background}; color: {text}; }}\n"
        for status, (background, text) in STATUS_COLOURS.items()
    )


def md_status(status: str) -> str:
    """A status for Markdown, after its symbol."""
    symbol = STATUS_SYMBOLS.get(status)
    return f"{symbol} {md_text(status)}" if symbol else md_text(status)


def verdict(counts: Mapping[str, int], noun: str = "cells") -> tuple[bool, str]:
    """Whether a run holds (no cell fail, error or missed; and some cell ran), and the words for it
    that every report opens with."""
    total = sum(counts.values())
    bad = sum(counts.get(s, 0) for s in BAD_STATUSES)
    if total == 0:
        return False, f"No {noun} ran"
    if bad:
        return False, f"{bad} of {total} {noun} need attention"
    return True, f"All {total} {noun} hold"
