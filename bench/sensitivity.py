"""How small a one-off error the verdicts catch: one rank's gradients scaled by 1 + r after a single
backward of the cell, for every non-canary cell of the catalogue.

Run: python bench/sensitivity.py [--world-sizes 2,4] [--relative 1e-6,1e-5] [--backward 1,3]
     [--kinds 'ddp fp32,fsdp2 fp32'] [--variants PATTERNS] [--cases NAMES]
Prints, per relative error, row (wrapper and precision) and world size, how many cells fail (catch
it) out of those run, and names every cell that let it through, one a line, with its status and
summary. The error lands where the wrapper holds the gradient after that backward (p.grad, FSDP2's
unsharded gradient or fp32 accumulation between syncs); under DeepSpeed, which reduces (ZeRO-2/3) and
at a boundary steps inside ``backward``, through that backward's loss, so before any reduction.
Goals, at world sizes 2 and 4: 1e-6 caught by at least 95% of the cells of every wrapper whose gradient
is fp32 state (DDP in fp32 and bf16 autocast, FSDP2, FSDP1 and DeepSpeed ZeRO-1/2/3 in fp32, FSDP2's
reduce=fp32), where the oracle reproduces the reduction's summation order (gloo); 1e-2 (more than a bf16
ulp) by at least 95% of the cells whose wrapper holds it in bf16 (FSDP2 and FSDP1 under accelerate's
policy, DeepSpeed, ZeRO-1's BF16 optimizer too: it sums in fp32 but reduces in bf16), where a smaller
error rounds away inside the wrapper before anything can see it (bench/README.md). Targets live here,
not in timed tests (machines are shared and noisy). """

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import catalogue  # noqa: E402
from harness.records import Status  # noqa: E402
from harness.selfcheck import run as selfcheck


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _kind(target: selfcheck.Target) -> str:
    """The table's row label: wrapper and precision, and the dtype policy where the variant names one
    (FSDP2's reduce dtype, ZeRO-1's grad_accum dtype)."""
    policy = "".join(f" {key}={target.variant.params[key]}" for key in ("reduce", "grad_accum")
                     if target.variant.params.get(key))
    return f"{target.wrapper} {target.precision}{policy}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=_ints, default=[2, 4])
    parser.add_argument("--relative", type=_floats, default=[1e-6, 1e-5], help="relative errors to plant")
    parser.add_argument("--backward", type=_ints, default=[1, 3],
                        help="which backward of the cell (from 1) gets the error, one run each")
    parser.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    parser.add_argument("--variants", default=None,
                        help="comma list of variant patterns, e.g. bf16-wrapper=fsdp2 (default: every variant)")
    parser.add_argument("--kinds", default=None,
                        help="comma list of table rows to run, e.g. 'ddp fp32,fsdp2 fp32' (default: every row)")
    parser.add_argument("--seed", type=int, default=selfcheck.DEFAULT_SEED)
    args = parser.parse_args()
    cases = catalogue.discover(ROOT / "cases")
    targets = [t for t in selfcheck.select_targets(cases, all_variants=not args.variants,
                                                    variants=args.variants.split(",") if args.variants else None,
                                                    cases=args.cases.split(",") if args.cases else None)
               if not t.case.info.canary]
    if args.kinds:
        kinds = {k.strip() for k in args.kinds.split(",")}
        targets = [t for t in targets if _kind(t) in kinds]
    caught: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    missed: dict[tuple, list[str]] = defaultdict(list)
    started = time.perf_counter()
    for world_size in args.world_sizes:
        with selfcheck.Runner(world_size=world_size, seed=args.seed) as runner:
            clean = {t.label: runner.run(t).status for t in targets}
            for relative in args.relative:
                for backward in args.backward:
                    fault = f"perturb_once:{relative!r}@{backward}"
                    for target in targets:
                        if clean[target.label] != "pass":
                            continue
                        key = (relative, _kind(target), world_size)
                        cell = runner.run(target, fault=fault)
                        caught[key][1] += 1
                        if cell.status == Status.FAIL:
                            caught[key][0] += 1
                        else:
                            missed[key].append(f"{target.label} after backward {backward}: {cell.status}, "
                                               f"{cell.summary.split(';')[0]}")
                    print(f"  world size {world_size}, {fault}: done ({time.perf_counter() - started:.0f} s)",
                          file=sys.stderr, flush=True)
            not_clean = sorted(label for label, status in clean.items() if status != "pass")
            if not_clean:
                print(f"  world size {world_size}: not run, not pass when clean: {', '.join(not_clean)}",
                      file=sys.stderr)
    rows = [("relative error", "wrapper, precision", "world size", "caught", "of cells x backwards")]
    for (relative, precision, world_size), (n, total) in sorted(caught.items()):
        rows.append((f"{relative:g}", precision, str(world_size), str(n), str(total)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in [rows[0], tuple("-" * w for w in widths), *rows[1:]]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for key, cells in sorted(missed.items()):  # every cell that let an error through, by name
        print(f"missed at {key[0]:g}, {key[1]}, world size {key[2]} ({len(cells)}):")
        for line in cells:
            print(f"  {line}")
    print(f"({len(targets)} cells, backwards {args.backward}, seed {args.seed}, {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
