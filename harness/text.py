"""The one escaper: any text from a matrix, a case or a rank made safe for a terminal, Markdown or HTML.

Text that reaches a person may come from a hand-edited or hostile file: every renderer shows it
through one of these functions and nothing else.
"""

from __future__ import annotations

import html
import re


def escape_unprintable(text: str) -> str:
    """``text`` with every character that does not print shown as its Python escape (``\\n``, ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable_line(text: object) -> str:
    """``text`` as one line that is safe to print on a terminal, in a log or in a report.

    Runs of whitespace (newlines, tabs, ...) become one space; any other character that does not
    print (control characters such as ANSI escapes and NUL, format characters such as bidi
    overrides, lone surrogates) is shown as its Python escape, e.g. ``\\x1b`` or ``\\u202e``.
    """
    return escape_unprintable(" ".join(str(text).split()))


def printable_block(text: object) -> str:
    """``text`` as lines safe to print, laid out as written (a traceback or a failure block keeps
    its indentation): tabs become spaces, any other character that does not print is escaped."""
    return "\n".join(escape_unprintable(line.expandtabs()) for line in str(text).splitlines())


# Markdown: every text from a matrix goes through md_text (or md_code).
_MARKDOWN_ESCAPES = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\\": "\\\\", "|": "\\|", "`": "\\`"}
)
# Text holding any of these is never put in a code span, where Markdown would show it raw.
_NOT_IN_CODE_SPANS = frozenset("<>&|")


def md_text(text: object) -> str:
    """``text`` made safe anywhere in Markdown: a table cell, a heading, a list item, a step summary.

    One line (whitespace runs become a space, other control and format characters are shown as
    escapes like ``\\x1b``: see printable_line); ``&``, ``<`` and ``>`` become HTML entities, so
    that no tag or comment (``<!--``) from the data reaches the page; ``\\``, ``|`` and a backtick
    are backslash-escaped, so that the text cannot end a table cell or open a code span.
    """
    return printable_line(text).translate(_MARKDOWN_ESCAPES)


def md_code(text: object) -> str:
    """``text`` as a Markdown code span (shown literally, in monospace), also safe anywhere.

    The fence is one backtick longer than the longest run of backticks in the text, so none of
    them can close it. A code span shows its content raw (an entity or a backslash escape would be
    shown as typed), so text holding ``<``, ``>``, ``&`` or ``|`` is rendered by md_text instead.
    """
    line = printable_line(text)
    if not line or _NOT_IN_CODE_SPANS.intersection(line):
        return md_text(line)
    if "`" not in line:
        return f"`{line}`"
    longest = max(len(run) for run in re.findall("`+", line))
    fence = "`" * (longest + 1)
    return f"{fence} {line} {fence}"


def html_text(text: object) -> str:
    """``text`` as one printable line, HTML-escaped (quotes too): safe in an element or an attribute."""
    return html.escape(printable_line(text), quote=True)


def html_block(text: object) -> str:
    """``text`` as printable lines (printable_block), HTML-escaped: safe inside a ``<pre>``."""
    return html.escape(printable_block(text), quote=True)
