"""What checking a script costs: accelerate's ``multi_process_metrics.py`` example (its training loop is
``nlp_example.py``'s, plus ``gather_for_metrics``) on a BERT of about 2e7 parameters, under
``torchrun --nproc-per-node N`` and under ``python -m harness watch --world-sizes N``, in turns, in the
same run (issue 76: the checked run within 1.2x of the plain one). Both run the script with its own
``--cpu``: without it, on a machine without a GPU, accelerate under torchrun leaves each process
alone (``DistributedType.NO``: two single-process trainings on the whole data each, no gradient ever
synced), which is not the run the harness checks.

    git clone https://github.com/huggingface/accelerate
    python bench/watch_overhead.py --examples accelerate/examples/by_feature [--repeats 3] [--world-size 2]

The stand-ins are bench/accelerate_examples.py's (offline: the scripts' own ``TESTING_MOCKED_DATALOADERS``
path, a local metric), but for the model: a BERT of 6 layers of width 512 (``--hidden``, ``--layers``),
1.9e7 parameters. The mocked loaders take batches of 2 for 2 epochs: 36 training rows make 9 optimizer
steps an epoch on each of 2 ranks, 18 in all, and an evaluation after each epoch. Each row of the table
is one run of each, wall time from the command's start to its end (the interpreter's start and its
imports included: what a user waits for); the ratio is the watch's over torchrun's, and the last line
their medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accelerate_examples import offline_workdir, tiny_bert

SCRIPT = "multi_process_metrics.py"


def timed(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.monotonic() - started, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, required=True, help="accelerate's examples/by_feature directory")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=36, help="training rows (batches of 2 a rank, 2 epochs)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    script = args.examples / SCRIPT
    if not script.exists():
        print(f"watch_overhead: no {SCRIPT} in {args.examples}", file=sys.stderr)
        return 2
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        print("watch_overhead: no torchrun beside this interpreter or on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="watch-overhead-") as tmp:
        workdir = Path(tmp)
        env = {**os.environ, **offline_workdir(workdir, args.rows)}
        tiny_bert(workdir / "bert-base-cased", hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                  intermediate=4 * args.hidden)
        from transformers import AutoConfig, BertForSequenceClassification

        params = sum(p.numel() for p in BertForSequenceClassification(
            AutoConfig.from_pretrained(workdir / "bert-base-cased")).parameters())
        plain = [torchrun, "--nproc-per-node", str(args.world_size), str(script), "--cpu"]
        checked = [sys.executable, "-m", "harness", "watch", str(script), "--world-sizes", str(args.world_size),
                   "--report-dir", str(workdir / "reports"), "--", "--cpu"]
        print(f"{SCRIPT}, BERT of {params / 1e6:.1f}M parameters, world size {args.world_size}, "
              f"{args.rows} training rows\n")
        print("| run | torchrun s | harness watch s | ratio |")
        print("| --- | --- | --- | --- |")
        plains, checks = [], []
        for n in range(1, args.repeats + 1):
            plain_s, done = timed(plain, workdir, env, args.timeout)
            if done.returncode != 0:
                print(f"watch_overhead: torchrun exited {done.returncode}:\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            checked_s, done = timed(checked, workdir, env, args.timeout)
            if done.returncode != 0:
                print(f"watch_overhead: harness watch exited {done.returncode}:\n{done.stdout[-3000:]}",
                      file=sys.stderr)
                return 1
            plains.append(plain_s)
            checks.append(checked_s)
            print(f"| {n} | {plain_s:.1f} | {checked_s:.1f} | {checked_s / plain_s:.2f} |")
            sys.stdout.flush()
        p, c = statistics.median(plains), statistics.median(checks)
        print(f"| median | {p:.1f} | {c:.1f} | {c / p:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
