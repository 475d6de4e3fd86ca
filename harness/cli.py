"""The `python -m harness` command line: one function per subcommand, registered in build_parser."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from harness.crossversion import build_comparison, render_comparison_html, render_comparison_markdown
from harness.diff import diff_matrices, label_matrices, render_diff_markdown, render_diff_text
from harness.matrix import MatrixError, load_matrix, write_atomically

PROG = "harness"

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_UNUSABLE = 2


class UsageError(Exception):
    """A problem with the command line or its files; main prints it as one line and exits 2."""


def _write_report(path: Path, text: str) -> None:
    try:
        write_atomically(path, text)
    except OSError as exc:
        raise UsageError(f"{path}: cannot write ({exc.strerror or exc})") from None


def run_diff(args: argparse.Namespace) -> int:
    base = load_matrix(args.base)
    candidate = load_matrix(args.candidate)
    base_label, cand_label = label_matrices([(args.base, base), (args.candidate, candidate)])
    diff = diff_matrices(base, candidate)
    render = render_diff_markdown if args.format == "markdown" else render_diff_text
    report = render(diff, base_label, cand_label)
    if args.output is not None:
        _write_report(args.output, report)
    sys.stdout.write(report)
    return EXIT_REGRESSION if diff.has_regressions else EXIT_OK


def add_diff_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="compare two matrices cell by cell; exit 1 on a regression",
        description=(
            "Compare two matrix.json files cell by cell, a cell being (case, variant, world_size).\n"
            "Prints the regressions first (a cell that was pass or detected in BASE and is anything\n"
            "else in CANDIDATE), then the improvements, then other status changes, then the cells\n"
            "present in only one file, then a count line. Runs are labelled by the accelerate\n"
            "version they recorded, else by file name."
        ),
        epilog=(
            "exit status:\n"
            "  0  no regression\n"
            "  1  at least one regression\n"
            "  2  unusable input (missing file, not JSON, other schema) or bad arguments;\n"
            "     the reason is one line on stderr\n"
            "\n"
            "example:\n"
            "  python -m harness diff reports/accelerate-0.28.0/matrix.json \\\n"
            "                         reports/accelerate-1.15.0/matrix.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", type=Path, metavar="BASE.json", help="the matrix known to be good")
    parser.add_argument("candidate", type=Path, metavar="CANDIDATE.json", help="the matrix to check")
    parser.add_argument(
        "--format",
        choices=("text", "markdown"),
        default="text",
        help="report format on stdout and in --output (default: text)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        default=None,
        help="also write the report to FILE (e.g. a CI step summary)",
    )
    parser.set_defaults(run=run_diff)


def run_compare(args: argparse.Namespace) -> int:
    matrices = [(path, load_matrix(path)) for path in args.matrices]
    comparison = build_comparison(matrices)
    markdown = render_comparison_markdown(comparison)
    if args.markdown is not None:
        _write_report(args.markdown, markdown)
    if args.html is not None:
        _write_report(args.html, render_comparison_html(comparison))
    sys.stdout.write(markdown)
    return EXIT_OK


def add_compare_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="tabulate cell statuses across several matrices (e.g. accelerate versions)",
        description=(
            "Show one row per cell of any input and one column per input, headed by the\n"
            "accelerate version it recorded (else its file name). Rows whose statuses differ\n"
            "are marked. Markdown goes to stdout; --markdown and --html also write files.\n"
            "This command judges nothing: use `diff` to gate on regressions."
        ),
        epilog=(
            "exit status:\n"
            "  0  the table was produced\n"
            "  2  unusable input (missing file, not JSON, other schema) or bad arguments;\n"
            "     the reason is one line on stderr\n"
            "\n"
            "example:\n"
            "  python -m harness compare reports/accelerate-*/matrix.json --html compare.html"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("matrices", type=Path, nargs="+", metavar="MATRIX.json", help="one or more matrices")
    parser.add_argument("--markdown", type=Path, metavar="FILE", default=None, help="also write the markdown to FILE")
    parser.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        default=None,
        help="write a self-contained HTML page (no scripts, no network) to FILE",
    )
    parser.set_defaults(run=run_compare)


# Each subcommand is an add_*_parser function that registers its parser and sets `run`;
# a new subcommand is one more function here and one more entry in this tuple.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_diff_parser,
    add_compare_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Work with gradient-sync matrices written by `pytest cases/` (reports/matrix.json).",
        epilog="Run `python -m harness COMMAND --help` for a command's options and exit status.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (MatrixError, UsageError) as exc:
        reason = " ".join(str(exc).split())
        print(f"{PROG} {args.command}: error: {reason}", file=sys.stderr)
        return EXIT_UNUSABLE
