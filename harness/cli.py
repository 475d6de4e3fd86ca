"""The `python -m harness` command line: one function per subcommand, registered in build_parser;
the words of its reports come from harness/render/."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from harness.controller.options import (DEFAULT_CASE_TIMEOUT_S, DEFAULT_SEED, argparse_type, parse_case_timeout,
                                        parse_seed)
from harness.matrix.comparison import build_comparison
from harness.matrix.diff import diff_matrices, label_matrices
from harness.matrix.file import load_matrix
from harness.matrix.merge import merge_matrices, summary_line
from harness.matrix.schema import MatrixError
from harness.render.comparison import render_comparison_html, render_comparison_markdown
from harness.render.diff import render_diff_markdown, render_diff_text
from harness.render.reports import check_report_dir, write_atomically, write_reports
from harness.launch.watch_command import WatchUsage, add_watch_parser

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
            "else in CANDIDATE, or has vanished: is missing from CANDIDATE at a world size CANDIDATE\n"
            "ran, inside the selection it ran), then the improvements, then other status changes,\n"
            "then the cells present in only one file, then a count line. The world sizes CANDIDATE\n"
            "ran are those it records and those of its cells. A CANDIDATE that ran a narrower\n"
            "selection (-k, -m, paths, --world-sizes, --wrappers, --meshes; its environment's 'selection')\n"
            "has the BASE cells it did not select counted as 'not selected', not as regressions.\n"
            "Runs are labelled by the accelerate version they recorded, else by file name."
        ),
        epilog=(
            "exit status:\n"
            "  0  no regression\n"
            "  1  at least one regression (a changed or vanished cell, as above), never anything else\n"
            "  2  unusable input or bad arguments, with one line on stderr naming the file and\n"
            "     the reason: a file that is missing, not a regular file or larger than 256 MiB;\n"
            "     not strict JSON (not UTF-8, NaN, duplicate keys, too deep); another schema;\n"
            "     a malformed cell (wrong field type, unknown status) or the same cell twice\n"
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
    markdown = render_comparison_markdown(comparison, changed_only=args.changed_only)
    if args.markdown is not None:
        _write_report(args.markdown, markdown)
    if args.html is not None:
        _write_report(args.html, render_comparison_html(comparison, html_path=args.html))
    sys.stdout.write(markdown)
    return EXIT_OK


def add_compare_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="tabulate cell statuses across several matrices (e.g. accelerate versions)",
        description=(
            "Show one row per cell of any input and one column per input, headed by the\n"
            "accelerate version it recorded (else its file name). Rows whose statuses differ\n"
            "are marked, and so are those that regressed as `diff` counts it (pass or detected in\n"
            "one input, anything else in the next that has the cell). Markdown goes to stdout; --markdown\n"
            "and --html also write files. This command judges nothing: use `diff` to gate on\n"
            "regressions."
        ),
        epilog=(
            "exit status:\n"
            "  0  the table was produced\n"
            "  2  unusable input or bad arguments, with one line on stderr naming the file and\n"
            "     the reason (the same checks as `diff`)\n"
            "\n"
            "example:\n"
            "  python -m harness compare reports/accelerate-*/matrix.json --html compare.html"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("matrices", type=Path, nargs="+", metavar="MATRIX.json", help="one or more matrices")
    parser.add_argument("--markdown", type=Path, metavar="FILE", default=None, help="also write the markdown to FILE")
    parser.add_argument("--changed-only", action="store_true",
                        help="in the markdown, list only the cells whose status differs between inputs")
    parser.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        default=None,
        help="write one self-contained HTML page to FILE (inline CSS and script, nothing fetched); "
             "a status links to its cell on an input's matrix.html when that page sits beside the "
             "input's matrix.json, by a path relative to FILE",
    )
    parser.set_defaults(run=run_compare)


def run_merge(args: argparse.Namespace) -> int:
    inputs = [(path, load_matrix(path)) for path in args.matrices]
    merged = merge_matrices(inputs)  # before anything is written: a refused merge leaves no trace
    reason = check_report_dir(args.out)
    if reason:
        raise UsageError(f"--out: {reason}")
    try:
        paths = write_reports(merged, args.out)
    except OSError as exc:
        raise UsageError(f"--out: cannot write to {exc.filename or args.out}: {exc.strerror or exc}") from None
    print(summary_line(merged, len(inputs), args.out, paths))
    return EXIT_OK


def add_merge_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="make one matrix from several runs (e.g. one per GPU count or node count)",
        description=(
            "Merge matrix.json files from several runs (one launch per GPU count, per node count, or\n"
            "a catalogue split with -k) into one matrix: matrix.json, matrix.md and matrix.html in DIR.\n"
            "It holds every cell of every input, and is complete when every input is. Its environment\n"
            "keeps the keys equal in every input, world_sizes (the union of those the inputs ran),\n"
            "merged_from (the input files) and environments: for each world size, the whole\n"
            "environment of the run that ran it. Two inputs that ran one world size must agree on\n"
            "python, torch, accelerate, backend, device, seed and fault. The result is a schema-1\n"
            "matrix that `diff` and `compare` read like any other."
        ),
        epilog=(
            "exit status:\n"
            "  0  the merged matrix was written; one line on stdout names its files\n"
            "  2  one line on stderr saying why: an unusable input (the same checks as `diff`), a\n"
            "     cell (case, variant, world size) in two inputs, or two inputs that ran one world\n"
            "     size under different environments (then nothing is written); an --out that cannot\n"
            "     be written; bad arguments\n"
            "\n"
            "example:\n"
            "  python -m harness merge gpus-1-2/matrix.json gpus-4-8/matrix.json --out reports/merged"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("matrices", nargs="+", metavar="MATRIX.json", help="the matrices to merge, one or more")
    parser.add_argument("--out", type=Path, metavar="DIR", required=True,
                        help="the folder for the merged matrix.json, matrix.md and matrix.html")
    parser.set_defaults(run=run_merge)


def _comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list")
    return items


def _world_size(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give 2 or more ranks (1 cannot tell synced from local)")
    return int(text)


def run_selfcheck(args: argparse.Namespace) -> int:
    # the rank pool and fault injection: imported only for this command
    from harness import catalogue, heap
    from harness.render.selfcheck import fault_list, progress_line, render
    from harness.selfcheck import run as selfcheck
    from harness.selfcheck.faults import FAULTS

    if args.list_faults:
        sys.stdout.write(fault_list(FAULTS.values()))
        return EXIT_OK
    try:
        with heap.imports_frozen():  # the case files import torch (harness/heap.py)
            cases = catalogue.discover(args.cases_dir or catalogue.default_cases_dir())
        unknown = sorted(set(args.sensitivity_cases or ()) - {case.name for case in cases})
        if unknown:
            raise UsageError(f"--sensitivity-cases: unknown case {', '.join(map(repr, unknown))}")
        result = selfcheck.run_selfcheck(
            cases,
            cases=args.cases,
            faults=args.faults,
            variants=args.variants,
            all_variants=args.all_variants,
            world_size=args.world_size,
            seed=args.seed,
            case_timeout_s=args.case_timeout,
            sensitivity_cases=None if args.no_sensitivity else (args.sensitivity_cases or selfcheck.SENSITIVITY_CASES),
            progress=lambda event: print(progress_line(event), file=sys.stderr, flush=True),
        )
    except (catalogue.CatalogueError, selfcheck.SelfcheckError) as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        print(f"{PROG} selfcheck: interrupted; the ranks were stopped", file=sys.stderr)
        return 130
    report = render(result)
    if args.json is not None:
        _write_report(args.json, json.dumps(result.to_dict(), indent=2) + "\n")
    sys.stdout.write(report)
    return EXIT_OK if result.ok else EXIT_REGRESSION


def add_selfcheck_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selfcheck",
        help="run the catalogue under planted sync faults and count the ones it catches",
        description=(
            "Run the case catalogue (cases/test_*.py) on one live pool of ranks, once clean and once\n"
            "under each injected sync fault (harness/selfcheck/faults.py: accelerate or DDP patched at run time\n"
            "inside the ranks, never the cases). A fault is caught when some cell ends fail. Prints a\n"
            "fault x cell table, the kill rate (faults caught by at least one case / faults), the\n"
            "diagnosis accuracy (of the cells that caught a fault, those whose diagnoses at their first\n"
            "failing step name it: each fault declares the kinds that do, --list-faults), and the\n"
            "smallest relative perturbation of one rank's gradients that the harness catches, for fp32\n"
            "and bf16. A fault every cell can catch (one rank's gradients scaled) is followed by each\n"
            "cell that let it through, by name. Canary cases run in the clean pass only. Progress goes\n"
            "to stderr, one line a fault."
        ),
        epilog=(
            "exit status:\n"
            "  0  every fault caught by some case, and the clean run has no fail, error or missed\n"
            "  1  a fault went uncaught, or the clean run is not clean\n"
            "  2  bad arguments, no cases, or the ranks could not start; the reason is one line on stderr\n"
            "\n"
            "examples:\n"
            "  python -m harness selfcheck\n"
            "  python -m harness selfcheck --cases no_sync,accumulate --faults no_sync_still_syncs,grads_summed\n"
            "  python -m harness selfcheck --all-variants --json selfcheck.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cases", type=_comma_list, metavar="LIST", default=None,
                        help="only these cases (comma list of case names; default: the whole catalogue)")
    parser.add_argument("--faults", type=_comma_list, metavar="LIST", default=None,
                        help="only these faults (names from --list-faults, or perturb:<relative> and "
                             "perturb_once:<relative>[@<backward>], which run on every wrapper's cells; "
                             "default: all)")
    variants = parser.add_mutually_exclusive_group()
    variants.add_argument("--variants", type=_comma_list, metavar="LIST", default=None,
                          help="the variants whose name has all the parts of any pattern in LIST "
                               "(e.g. fp32, or steps=2-bf16; default: the first fp32 variant of each case and "
                               "wrapper that is no declared defect, and the first that each of the wrapper's "
                               "faults needs, docs/judging.md)")
    variants.add_argument("--all-variants", action="store_true", help="every variant of every case")
    parser.add_argument("--world-size", type=_world_size, default=2, metavar="N",
                        help="ranks in the pool (default: 2)")
    parser.add_argument("--case-timeout", type=argparse_type(parse_case_timeout), default=DEFAULT_CASE_TIMEOUT_S,
                        metavar="SECONDS", help="seconds one cell may take before its ranks are declared hung "
                                                f"(default: {DEFAULT_CASE_TIMEOUT_S:g})")
    parser.add_argument("--seed", type=argparse_type(parse_seed), default=DEFAULT_SEED, metavar="N",
                        help=f"base seed for models and data (default: {DEFAULT_SEED})")
    parser.add_argument("--sensitivity-cases", type=_comma_list, metavar="LIST", default=None,
                        help="cases for the perturbation search (default: fused_loss,accumulate where present)")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the perturbation search")
    parser.add_argument("--cases-dir", type=Path, metavar="DIR", default=None,
                        help="where the case files (test_*.py) are: your own cases, or the catalogue "
                             "(default: ./cases, else the installed catalogue)")
    parser.add_argument("--json", type=Path, metavar="FILE", default=None, help="also write every result to FILE")
    parser.add_argument("--list-faults", action="store_true", help="list the registered faults and exit")
    parser.set_defaults(run=run_selfcheck)


def run_catalogue(args: argparse.Namespace) -> int:
    from harness.catalogue import CatalogueError, installed_cases_dir

    try:
        cases_dir = installed_cases_dir()
    except CatalogueError as exc:
        raise UsageError(str(exc)) from None
    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    # the pytest cache goes to the working directory, never into the installed package
    rootdir = [] if any(a == "--rootdir" or a.startswith("--rootdir=") for a in pytest_args) else ["--rootdir", "."]
    # pytest replaces this process (its exit status and signals are pytest's own), and starts clean:
    # in this one the harness is imported already, too early for pytest to load it as its plugin
    command = [sys.executable, "-m", "pytest", str(cases_dir), *rootdir, *pytest_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return EXIT_UNUSABLE  # not reached


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the built-in case catalogue with pytest (from an installed harness)",
        description=(
            "Run the case catalogue that ships with the installed harness (the package harness.cases),\n"
            "as `pytest -n auto cases/` runs it in a checkout. Every argument after `run` goes to pytest:\n"
            "the harness's options (--world-sizes, --backend, --report-dir, --case-timeout, --seed),\n"
            "-n auto, -k, -x and the rest. Reports go to ./reports unless --report-dir says otherwise."
        ),
        epilog=(
            "exit status: pytest's own; non-zero whenever any cell is fail, error or missed\n"
            "\n"
            "examples:\n"
            "  python -m harness run -n auto\n"
            "  python -m harness run --world-sizes 1,2 -k 'fused_loss or accumulate'"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS",
                        help="options and node ids for pytest")
    parser.set_defaults(run=run_catalogue)


def run_launch(args: argparse.Namespace) -> int:
    from harness.launch.main import main as launch_main  # torch is imported only for this command

    return launch_main(args.pytest_args)


def add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run the catalogue with a launcher's processes as the ranks (torchrun, srun, accelerate launch)",
        description=(
            "Run under a launcher, on every process it starts: each process is one rank (the world size\n"
            "is the launcher's, the device LOCAL_RANK's GPU with nccl, the rendezvous the launcher's\n"
            "env:// store). Global rank 0 runs pytest: it collects the cells, runs each on every rank and\n"
            "writes the one matrix into --report-dir on its host, recording the launcher, nodes, processes\n"
            "per node, hosts and devices. Every argument after `launch` goes to pytest, as for `pytest\n"
            "cases/` (--backend, --report-dir, --case-timeout, --seed, -k, paths; not -n). Without paths:\n"
            "./cases, else the installed catalogue. A rank that raises makes its cell an error and the\n"
            "launch goes on; one that dies or hangs makes its cell an error and every later cell `not run`."
        ),
        epilog=(
            "exit status: pytest's own, on every rank; non-zero whenever any cell is fail, error or missed\n"
            "  2  not under a launcher, or a bad --backend / --case-timeout (one line on stderr)\n"
            "  3  a rank could not join the launch\n"
            "\n"
            "examples:\n"
            "  torchrun --nproc-per-node 4 -m harness launch cases/\n"
            "  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\\n"
            "           -m harness launch --report-dir reports/2x8\n"
            "  srun --ntasks-per-node 8 python -m harness launch   (MASTER_ADDR/MASTER_PORT exported)\n"
            "  accelerate launch --multi_gpu --num_processes 4 -m harness launch"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS",
                        help="options and paths for pytest")
    parser.set_defaults(run=run_launch)


# Each subcommand is an add_*_parser function that registers its parser and sets `run`;
# a new subcommand is one more function here and one more entry in this tuple.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_run_parser,
    add_launch_parser,
    add_diff_parser,
    add_compare_parser,
    add_merge_parser,
    add_selfcheck_parser,
    add_watch_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=("The harness's commands beside `pytest cases/`: run the installed catalogue with `run`, or\n"
                     "under torchrun, srun or accelerate launch with `launch`,\n"
                     "compare the matrices it writes (reports/matrix.json) with `diff` and `compare`, join\n"
                     "several runs' matrices into one with `merge`, check the harness (or your own cases)\n"
                     "with `selfcheck`, and check a training script as it is with `watch`."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `python -m harness COMMAND --help` for a command's options and exit status.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["run"], ["launch"]) and argv[1:] not in (["-h"], ["--help"]):
        # everything after `run` or `launch` is pytest's, in its order, its options too
        args = argparse.Namespace(command=argv[0], run=run_catalogue if argv[0] == "run" else run_launch,
                                  pytest_args=argv[1:])
    else:  # `watch SCRIPT [options] -- ARGS`: what follows `--` is the script's
        cut = argv.index("--") if argv[:1] == ["watch"] and "--" in argv else len(argv)
        args = parser.parse_args(argv[:cut])
        if cut < len(argv):
            args.script_args = argv[cut + 1:]
    try:
        return args.run(args)
    except (MatrixError, UsageError, WatchUsage) as exc:
        reason = " ".join(str(exc).split())
        print(f"{PROG} {args.command}: error: {reason}", file=sys.stderr)
        return EXIT_UNUSABLE
