"""``python -m harness watch SCRIPT [options] [-- SCRIPT ARGUMENTS]``: a training script run unedited on
N ranks with every step checked (harness/rank/script/run.py), its cells judged and reported as any case's
(docs/script.md). Locally the harness's rank pools run it (pytest on harness/rank/script/cells.py); under
torchrun, srun or ``accelerate launch`` the launcher's processes are the ranks (``harness launch``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from harness.controller.options import DEFAULT_CASE_TIMEOUT_S, argparse_type, parse_case_timeout
from harness.controller.script import SCRIPT_CELLS
from harness.decorator import ALL_PRECISIONS as PRECISIONS
from harness.launch.environment import LaunchError, detect
from harness.messages import WATCH_ENVIRONMENT
from harness.rank.oracle.schedule import SCRIPT_CONTRACTS


class WatchUsage(Exception):
    """A bad command line or script: one line, exit 2."""


def _count(what: str, least: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of {least} or more {what}")
        return int(text)

    return convert


def _world_sizes(text: str) -> list[int]:
    sizes = [part.strip() for part in text.split(",")]
    if not sizes or not all(s.isdigit() and int(s) >= 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of world sizes of 1 or more, e.g. 1,2")
    return sorted({int(s) for s in sizes})


def _precisions(text: str) -> list[str]:
    asked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in asked if p not in PRECISIONS]
    if unknown or not asked:
        raise argparse.ArgumentTypeError(f"{text!r}: give precisions among {', '.join(PRECISIONS)}")
    return list(dict.fromkeys(asked))


def _loss(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: give module:function, e.g. my_losses:token_loss")
    return text


def under_launcher() -> bool:
    """Whether a launcher started this process (harness/launch/environment.py's ``detect``)."""
    try:
        detect()
    except LaunchError:
        return False
    return True


def case_name(script: Path) -> str:
    """The cells' case name: the script's file name without ``.py``."""
    return re.sub(r"\W", "_", script.stem) or "script"


def run_watch(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise WatchUsage(f"no script at {script}")
    if args.nproc is not None and args.world_sizes is not None:
        raise WatchUsage("give --nproc or --world-sizes, not both")
    sizes = args.world_sizes or [args.nproc or 2]
    from harness.rank.process.environment import launcher_settings

    # the ACCELERATE_* settings of `accelerate launch` (or the shell) are the script's configuration: the
    # ranks drop them for the harness's own cells, and give them back to the script while it runs
    settings = {name: os.environ[name] for name in launcher_settings()}
    os.environ[WATCH_ENVIRONMENT] = json.dumps({
        "path": str(script.resolve()), "argv": list(args.script_args), "name": case_name(script),
        "precisions": args.precision or [], "loss": args.loss, "num_steps": args.num_steps,
        "contract": args.contract, "accelerate_settings": settings, "tiny_model": args.tiny_model,
    })
    import harness.rank

    cells = str(Path(harness.rank.__file__).parent.joinpath(*SCRIPT_CELLS))
    # no ini file of the working directory's project (its addopts, its plugins) changes the run
    options = ["--report-dir", str(args.report_dir), "--case-timeout", f"{args.case_timeout:g}",
               "-p", "no:cacheprovider", "-c", os.devnull]
    if under_launcher():
        from harness.launch.main import main as launch_main

        # the world size is the launcher's: one asked here that differs stops every rank with one line
        asked = ["--world-sizes", ",".join(map(str, sizes))] if args.nproc or args.world_sizes else []
        return launch_main([cells, *options, *asked])
    command = [sys.executable, "-m", "pytest", cells, "--rootdir", ".", "--world-sizes",
               ",".join(map(str, sizes)), *options]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return 2  # not reached


def add_watch_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "watch",
        help="run a training script unedited on N ranks, every step checked against the oracle",
        description=(
            "Run SCRIPT as it is (its `if __name__ == \"__main__\":` with the arguments after `--`) on\n"
            "every rank of one cell per world size and precision. The first Accelerator the script\n"
            "constructs is the cell's: its own arguments kept (gradient_accumulation_steps,\n"
            "mixed_precision), only what the cell needs forced (cpu=True on a CPU host; a --precision)\n"
            "and said in the cell's summary. The models it prepares, their optimizers and schedulers,\n"
            "its training dataloader's batches, its backwards, accumulate and clip are followed; each\n"
            "micro-batch is checked against the oracle: the model's own .loss on the batch, called as the\n"
            "script called its model (or --loss), accelerate's accumulation contract with the\n"
            "Accelerator's steps (or --num-steps for a loop that accumulates by hand with no_sync), or\n"
            "the token contract for a loop that passes num_items_in_batch. Each backward belongs to the\n"
            "batch its forward was given, so a loop that draws a window first is followed too. A second\n"
            "Accelerator, evaluation, gather and printing are left alone. A script the harness cannot\n"
            "follow is an error cell saying why.\n"
            "Reports as for `pytest cases/`: --report-dir/matrix.{json,md,html}."
        ),
        epilog=(
            "exit status: pytest's own; non-zero whenever a cell is fail or error (2: a bad command line)\n"
            "\n"
            "examples:\n"
            "  python -m harness watch train.py --nproc 2 -- --gradient_accumulation_steps 2\n"
            "  python -m harness watch train.py --world-sizes 1,2 --precision fp32,bf16\n"
            "  python -m harness watch by_hand.py --num-steps 4 -- --accumulation 4\n"
            "  torchrun --nproc-per-node 2 -m harness watch train.py -- --epochs 1"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script, run as __main__")
    parser.add_argument("--nproc", type=_count("ranks", 1), default=None, metavar="N",
                        help="ranks of the one cell (default: 2)")
    parser.add_argument("--world-sizes", type=_world_sizes, default=None, metavar="LIST",
                        help="one cell per world size (comma list, e.g. 1,2)")
    parser.add_argument("--precision", type=_precisions, default=None, metavar="LIST",
                        help="one cell per precision, forced on the script's Accelerator (fp32, bf16, fp16; "
                             "default: one cell, as-written, in the script's own)")
    parser.add_argument("--loss", type=_loss, default=None, metavar="MODULE:FUNCTION",
                        help="the loss of one micro-batch, function(model, batch), before any division by the "
                             "accumulation steps (default: the model's own .loss on the batch)")
    parser.add_argument("--num-steps", type=_count("micro-batches", 1), default=None, metavar="K",
                        help="the micro-batches of a window, for a loop that accumulates by hand under an "
                             "Accelerator of one step (default: the Accelerator's gradient_accumulation_steps)")
    parser.add_argument("--contract", choices=SCRIPT_CONTRACTS, default=None,
                        help="accelerate: each micro-batch's loss divided by the steps; full_batch: each window "
                             "the mean over the micro-batches it really had; tokens: each window the mean over "
                             "every valid label token of the global window (default: tokens where the script "
                             "passes num_items_in_batch to its model, else accelerate; the cell's summary says "
                             "which was chosen)")
    parser.add_argument("--tiny-model", action="store_true",
                        help="build every pretrained transformers model the script loads (from_pretrained) of its "
                             "own config shrunk to 2 layers of width 32, with random weights: the checkpoint's "
                             "config is read, its weights are not (said in each cell's summary)")
    parser.add_argument("--report-dir", type=Path, default=Path("reports"), metavar="DIR",
                        help="where matrix.json, matrix.md and matrix.html go (default: reports)")
    parser.add_argument("--case-timeout", type=argparse_type(parse_case_timeout),
                        default=max(DEFAULT_CASE_TIMEOUT_S, 600.0),
                        metavar="SECONDS", help="seconds one cell may take before its ranks are declared hung "
                                                "(default: 600)")
    parser.set_defaults(run=run_watch, script_args=[])
