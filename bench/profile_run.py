"""Where a whole run's CPU goes, in every process it starts: the command run under py-spy (sampling each
process and each one it starts, the ranks forked from the fork servers among them), then three tables.

1. By kind of process (the session's controller, its xdist workers, a fork server, a rank, torchrun, a
   launched script...): its share of the samples, how much of it was importing modules, and how much
   importing torch, with the count of such processes.
2. Within the ranks (processes forked from a fork server): by section of a cell (the harness's checks,
   the oracle's replica, the collective accounting, the case's own training, a Trainer, dynamo, a
   sharded wrapper's set-up, imports a rank makes itself).
3. The ranks' samples by case function.

py-spy leaves idle threads out; it is not one of the harness's dependencies (`pip install py-spy`).
A sample is a thread seen running or waiting for a core (py-spy reads the thread's state), so on a
machine with more runnable processes than cores the shares are of what the run asked of the CPU:
a rank woken from a collective and waiting for a core counts where it waits. `--busy-only` runs the
command without py-spy and says how busy the machine's cores were over it (/proc/stat): whether the
run is bound by the CPU or by waiting.

Run: python bench/profile_run.py [--rate 25] [--out reports/profile-run] -- pytest tests/
     python bench/profile_run.py --raw reports/profile-run/samples.txt   (the tables of an earlier run)
     python bench/profile_run.py --busy-only -- pytest tests/
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from session_costs import busy_s  # (bench/, this script's own folder, is on its path)

FORK_SERVER = "multiprocessing.forkserver"
# an xdist worker's command line, whose ';' is also py-spy's frame separator
XDIST_WORKER = "import sys;exec(eval(sys.stdin.readline()))"
# A rank's sections: the first whose pattern one of a sample's frames holds (the harness's own work
# first, so that what it runs inside, a replica's autograd, is its; then the case's steps, outermost last)
SECTIONS = [
    ("checks: compare, diagnose", ("(harness/rank/judging/",)),
    ("oracle: the replica's backward", ("backward (harness/rank/oracle/core.py",)),
    ("oracle: set-up, step, the synced hypothesis", ("(harness/rank/oracle/",)),
    ("collective accounting (reading the flight recorder)", ("_records (harness/rank/numerics/accounting.py",
                                                            "_issued_since (harness/rank/numerics/accounting.py")),
    ("torch.compile (dynamo)", ("(torch/_dynamo/convert_frame.py",)),
    ("DeepSpeed (its engine, backward and step)", ("deepspeed/",)),
    ("FSDP2 fully_shard", ("fully_shard",)),
    ("accelerator.prepare", ("prepare (accelerate/accelerator.py",)),
    ("the case's backward (the wrapper's reductions in it)", ("backward (accelerate/accelerator.py",)),
    ("the case's optimizer step", ("step (accelerate/optimizer.py",)),
    ("the rest of Trainer.train (forwards, its loop)", ("train (transformers/trainer.py",)),
    ("Accelerator()", ("__init__ (accelerate/accelerator.py",)),
    ("the rest of a script's own run", ("(harness/rank/script/",)),
    ("imports made by the rank", ("_find_and_load",)),
    ("the rest of the case's body (forwards, data, its loop)", ("(harness/rank/process/cell.py",)),
]


def process_kind(chain: list[str]) -> str:
    """A process's kind from its chain of ancestors' command lines (py-spy's ``process PID:"CMD"`` frames)."""
    servers = [i for i, p in enumerate(chain) if FORK_SERVER in p]
    if servers:
        starter = _command(chain[servers[0] - 1]) if servers[0] > 0 else ""
        return ("fork server" if len(servers) == 1 else "rank") + " of " + _short(starter)
    kind = _short(_command(chain[-1]))
    if kind == "an xdist worker" and sum("exec(eval(" in p for p in chain) > 1:
        return "an xdist worker of a session under test"
    return kind


def _command(frame: str) -> str:
    return frame.split(":", 1)[1].strip('"') if ":" in frame else frame


def _short(command: str) -> str:
    if "exec(eval(sys.stdin.readline()))" in command.replace(",", ";"):
        return "an xdist worker"
    program = " ".join(command.split()[:3])  # the interpreter, and -m/-c and its argument
    for pattern, name in [(r"torch\.distributed\.run|/torchrun\b", "torchrun"), (r"/accelerate\b", "accelerate launch"),
                          (r"-m harness (\w+)", "harness {}"), (r"-m pytest\b|/pytest\b", "a pytest session"),
                          (r"resource_tracker", "multiprocessing's resource tracker"), (r"chrom", "chromium"),
                          (r"\S+\.py\b", "python {}")]:
        found = re.search(pattern, command if name in ("harness {}", "python {}") or "'s" in name else program)
        if found:
            return name.format(*(found.groups() or [Path(found.group(0)).name]))
    return command[:60]


def read(raw: Path) -> tuple[collections.Counter, dict, collections.Counter, collections.Counter, int]:
    kinds: collections.Counter = collections.Counter()
    detail: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])  # imports, torch, processes
    sections: collections.Counter = collections.Counter()
    cases: collections.Counter = collections.Counter()
    total = 0
    with raw.open(errors="replace") as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            frames = stack.replace(XDIST_WORKER, XDIST_WORKER.replace(";", ",")).split(";")
            chain = [f for f in frames if f.startswith("process ")]
            if not chain:
                continue
            total += n
            kind = process_kind(chain)
            kinds[kind] += n
            entry = detail[kind]
            entry[2].add(chain[-1].split(":", 1)[0])
            if any("_find_and_load" in f for f in frames):
                entry[0] += n
            if any(f.startswith("<module> (") and "torch/__init__.py" in f for f in frames):
                entry[1] += n
            if kind.startswith("rank "):
                body = ";".join(frames)
                sections[next((name for name, patterns in SECTIONS if any(p in body for p in patterns)), "other")] += n
                case = next((f.split(" ", 1)[0] for f in frames if f.startswith("test_") and "(cases/" in f), None)
                cases[case or "(not a catalogue case)"] += n
    return kinds, detail, sections, cases, total


def report(raw: Path, rate: int) -> None:
    kinds, detail, sections, cases, total = read(raw)
    print(f"{total} samples ({total / rate:.0f} CPU-seconds at {rate} a second) in {raw}\n")
    print("| process | share | of which importing | importing torch | processes |")
    print("| --- | --- | --- | --- | --- |")
    for kind, n in kinds.most_common():
        if n < total / 500:
            continue
        imports, torch_imports, processes = detail[kind]
        print(f"| {kind} | {100 * n / total:.1f}% | {100 * imports / total:.1f}% | {100 * torch_imports / total:.1f}% "
              f"| {len(processes)} |")
    ranks = sum(sections.values())
    print(f"\nThe ranks: {100 * ranks / total:.1f}% of the run\n")
    print("| section | share of the ranks |")
    print("| --- | --- |")
    for name, n in sections.most_common():
        print(f"| {name} | {100 * n / ranks:.1f}% |")
    print("\n| case function | share of the ranks |")
    print("| --- | --- |")
    for name, n in cases.most_common(15):
        print(f"| {name} | {100 * n / ranks:.1f}% |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=25, help="samples a second of each process (default 25)")
    parser.add_argument("--out", type=Path, default=Path("reports/profile-run"))
    parser.add_argument("--raw", type=Path, help="print the tables of this earlier run's samples, running nothing")
    parser.add_argument("--busy-only", action="store_true",
                        help="no py-spy: run the command and say how busy the machine's cores were over it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to profile")
    args = parser.parse_args(argv)
    if args.raw is not None:
        report(args.raw, args.rate)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --, e.g. -- pytest tests/")
    spy = shutil.which("py-spy")
    if spy is None and not args.busy_only:
        parser.error("py-spy not found: pip install py-spy")
    if args.busy_only:
        busy, started = busy_s(), time.monotonic()
        run = subprocess.run(command)
        wall, used = time.monotonic() - started, busy_s() - busy
        cores = os.cpu_count() or 1
        print(f"the command ended with {run.returncode} after {wall:.0f} s wall; the machine was busy {used:.0f} "
              f"CPU-seconds of the {cores * wall:.0f} its {cores} cores had ({100 * used / (cores * wall):.0f}%)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "samples.txt"
    started = time.monotonic()
    run = subprocess.run([spy, "record", "--subprocesses", "--nonblocking", "--rate", str(args.rate), "--format", "raw",
                          "-o", str(raw), "--", *command])
    print(f"the command ended with {run.returncode} after {time.monotonic() - started:.0f} s wall (under py-spy)\n")
    report(raw, args.rate)
    return 0



if __name__ == "__main__":
    sys.exit(main())
