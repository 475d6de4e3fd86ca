"""The self-check: run the catalogue clean and under planted sync faults, and count what it catches."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from harness.catalogue import PRECISIONS, CaseInfo, Variant, case_info
from harness.faults import FAULTS, Fault, resolve
from harness.matrix import DETECTED, ERROR, FAIL, MISSED, PASS, SKIP, UNSUPPORTED, Cell
from harness.messages import CellSpec
from harness.options import DEFAULT_CASE_TIMEOUT_S, DEFAULT_SEED, rerun_command
from harness.pool import RankPool, PoolStartError
from harness.verdict import judge

# A clean run is red with any of these (a canary must end `detected`).
CLEAN_BAD = frozenset({FAIL, ERROR, MISSED})
SYMBOLS = {FAIL: "X", PASS: ".", ERROR: "E", SKIP: "-", UNSUPPORTED: "-", DETECTED: "d", MISSED: "m"}
# Relative perturbations tried by the sensitivity search: four a decade, 1e-9 to 1.
SENSITIVITY_GRID = tuple(10.0 ** (e / 4) for e in range(-36, 1))
SENSITIVITY_CASES = ("fused_loss", "accumulate")


class SelfcheckError(Exception):
    """A bad argument or an unusable catalogue; the message is one line."""


@dataclass(frozen=True)
class CatalogueCase:
    """A case found in a case file: what the plugin would collect, without pytest."""

    info: CaseInfo
    path: Path
    attr: str

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(frozen=True)
class Target:
    """One (case, variant): a cell once a world size, seed and fault are chosen."""

    case: CatalogueCase
    variant: Variant

    @property
    def label(self) -> str:
        return f"{self.case.name}[{self.variant.name}]"

    @property
    def precision(self) -> str:
        return str(self.variant.params.get("precision", "fp32"))


def default_cases_dir() -> Path:
    """``cases/`` in the working directory, else the one beside this package (an editable install)."""
    here = Path("cases")
    return here if here.is_dir() else Path(__file__).resolve().parent.parent / "cases"


def discover(cases_dir: str | os.PathLike[str]) -> list[CatalogueCase]:
    """Every case in ``cases_dir/test_*.py``, by file name, then in order of definition."""
    directory = Path(cases_dir)
    if not directory.is_dir():
        raise SelfcheckError(f"{directory}: no such case directory")
    found: list[CatalogueCase] = []
    names: dict[str, Path] = {}
    for path in sorted(directory.glob("test_*.py")):
        path = path.resolve()
        module_name = f"harness_selfcheck_case_{path.stem}_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise SelfcheckError(f"{path}: cannot import")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        for attr, value in vars(module).items():
            info = case_info(value)
            if info is None:
                continue
            if info.name in names:
                raise SelfcheckError(f"case {info.name!r} is defined in {names[info.name]} and in {path}")
            names[info.name] = path
            found.append(CatalogueCase(info=info, path=path, attr=attr))
    if not found:
        raise SelfcheckError(f"{directory}: no cases in test_*.py")
    return found


def _matches(variant: Variant, pattern: str) -> bool:
    """A pattern is a ``-``-joined set of name parts (``fp32``, ``steps=2-bf16``), all present."""
    parts = set(variant.name.split("-"))
    return variant.name == pattern or set(pattern.split("-")) <= parts


def select_targets(
    catalogue: Sequence[CatalogueCase],
    *,
    cases: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    all_variants: bool = False,
) -> list[Target]:
    """The (case, variant) pairs to run. By default one variant a case: its first fp32 one.
    ``variants`` keeps those matching any pattern; ``all_variants`` keeps every variant."""
    by_name = {c.name: c for c in catalogue}
    if cases:
        unknown = [name for name in cases if name not in by_name]
        if unknown:
            raise SelfcheckError(f"unknown case {', '.join(map(repr, unknown))}; known: {', '.join(by_name)}")
        chosen = [by_name[name] for name in cases]
    else:
        chosen = list(catalogue)
    targets = []
    for case in chosen:
        options = case.info.variants
        if all_variants:
            picked = list(options)
        elif variants:
            picked = [v for v in options if any(_matches(v, p) for p in variants)]
        else:
            fp32 = [v for v in options if v.params.get("precision", "fp32") == "fp32"]
            picked = [(fp32 or list(options))[0]]
        targets.extend(Target(case, v) for v in picked)
    if not targets:
        raise SelfcheckError(f"no variant matches {','.join(variants or [])} in the chosen cases")
    return targets


class Runner:
    """One live pool of ranks that runs cells for the whole self-check."""

    def __init__(self, *, world_size: int = 2, backend: str = "gloo", seed: int = DEFAULT_SEED,
                 case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S) -> None:
        if world_size < 2:
            raise SelfcheckError(f"world size {world_size}: a self-check needs at least 2 ranks "
                                 "(1 cannot tell synced from local)")
        self.world_size = world_size
        self.backend = backend
        self.seed = seed
        self.case_timeout_s = case_timeout_s
        self.pool = RankPool(world_size, backend=backend)

    def __enter__(self) -> "Runner":
        try:
            self.pool.start()
        except PoolStartError as exc:
            self.close()
            first_line = str(exc).splitlines()[0]
            raise SelfcheckError(f"the pool of {self.world_size} ranks did not start: {first_line}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()
        self.pool.remove_workdir()

    def run(self, target: Target, *, fault: str | None = None, seed: int | None = None) -> Cell:
        seed = self.seed if seed is None else seed
        spec = CellSpec(
            case=target.case.name, variant=target.variant.name, variant_params=dict(target.variant.params),
            world_size=self.world_size, seed=seed, backend=self.backend,
            case_file=str(target.case.path), case_attr=target.case.attr, fault=fault,
            cell_id=f"{target.label}-ws{self.world_size}-seed{seed}-{fault or 'clean'}",
        )
        cell = nodeid(target, self.world_size)
        common = dict(case=target.case.name, variant=target.variant.name, world_size=self.world_size,
                      detects=target.case.info.detects, timeout_s=self.case_timeout_s,
                      rerun=rerun_command(cell, world_size=self.world_size, backend=self.backend, seed=seed,
                                          case_timeout_s=self.case_timeout_s, fault=fault))
        started = time.perf_counter()
        try:
            outcome = self.pool.run(spec, timeout_s=self.case_timeout_s)
        except PoolStartError as exc:
            return judge(outcome=None, duration_s=0.0, start_error=str(exc), **common)
        return judge(outcome=outcome, duration_s=time.perf_counter() - started, **common)


def nodeid(target: Target, world_size: int) -> str:
    """The pytest node id of the target's cell, relative to the working directory where it can be."""
    try:
        path = os.path.relpath(target.case.path)
    except ValueError:
        path = str(target.case.path)
    return f"{path}::{target.case.attr}[{target.variant.name}-ws{world_size}]"


def first_kinds(cell: Cell) -> list[str]:
    """The diagnoses at the cell's first failing step, in the order they were found: the cause,
    before the mismatches it drags along in later steps."""
    if not cell.failures:
        return []
    first = min(f.step for f in cell.failures)
    return list(dict.fromkeys(f.kind for f in cell.failures if f.step == first))


@dataclass
class FaultResult:
    fault: Fault
    cells: list[Cell]
    duration_s: float = 0.0

    @property
    def caught_by(self) -> list[Cell]:
        return [c for c in self.cells if c.status == FAIL]

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    def kinds(self) -> list[str]:
        """The diagnoses at the first failing step of the cells that caught it, most common first."""
        counts = Counter(kind for c in self.caught_by for kind in first_kinds(c))
        return [kind for kind, _ in counts.most_common()]


@dataclass
class Sensitivity:
    """The smallest perturbation of the grid that was caught, and the largest that was not."""

    precision: str
    cases: list[str]
    caught: float | None  # None: not even the largest was caught
    missed: float | None  # None: even the smallest was caught

    def text(self) -> str:
        if self.caught is None:
            return f"not caught up to {self.missed:.3g}"
        if self.missed is None:
            return f"caught down to {self.caught:.3g} (the smallest tried)"
        return f"{self.caught:.3g} caught, {self.missed:.3g} not"


@dataclass
class SelfcheckResult:
    world_size: int
    seed: int
    targets: list[Target]
    clean: list[Cell]
    faults: list[FaultResult] = field(default_factory=list)
    sensitivity: list[Sensitivity] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def counted_targets(self) -> list[Target]:
        return [t for t in self.targets if not t.case.info.canary]

    @property
    def clean_bad(self) -> list[Cell]:
        return [c for c in self.clean if c.status in CLEAN_BAD]

    @property
    def uncaught(self) -> list[FaultResult]:
        return [r for r in self.faults if not r.caught]

    @property
    def ok(self) -> bool:
        return not self.clean_bad and not self.uncaught

    def to_dict(self) -> dict[str, Any]:
        caught = sum(r.caught for r in self.faults)
        return {
            "world_size": self.world_size,
            "seed": self.seed,
            "cells": [t.label for t in self.targets],
            "clean": [c.to_dict() for c in self.clean],
            "faults": [
                {"name": r.fault.name, "description": r.fault.description, "caught": r.caught,
                 "caught_by": {f"{c.case}[{c.variant}]": first_kinds(c) for c in r.caught_by}, "kinds": r.kinds(),
                 "cells": [c.to_dict() for c in r.cells]}
                for r in self.faults
            ],
            "kill_rate": {"caught": caught, "faults": len(self.faults),
                          "rate": caught / len(self.faults) if self.faults else None},
            "sensitivity": [{"precision": s.precision, "cases": s.cases, "caught": s.caught, "missed": s.missed}
                            for s in self.sensitivity],
            "ok": self.ok,
            "duration_s": round(self.duration_s, 2),
        }


Progress = Callable[[str], None]


def _quiet(line: str) -> None:
    pass


def run_faults(runner: Runner, targets: Sequence[Target], faults: Iterable[Fault], *,
               clean: Sequence[Cell] | None = None, progress: Progress = _quiet) -> list[FaultResult]:
    """Each fault on every non-canary target (a canary is broken on purpose: it proves nothing here).
    A target whose clean cell did not pass is not run: its failing under a fault would prove nothing."""
    counted = [t for t in targets if not t.case.info.canary]
    baseline = {(c.case, c.variant): c.status for c in clean or ()}
    faults = list(faults)
    results = []

    def run(target: Target, fault: Fault) -> Cell:
        status = baseline.get((target.case.name, target.variant.name), PASS)
        if status != PASS:
            return Cell(case=target.case.name, variant=target.variant.name, world_size=runner.world_size,
                        status=SKIP, summary=f"not run: {status} in the clean run")
        return runner.run(target, fault=fault.name)

    for n, fault in enumerate(faults, 1):
        started = time.perf_counter()
        cells = [run(t, fault) for t in counted]
        result = FaultResult(fault, cells, time.perf_counter() - started)
        results.append(result)
        verdict = f"caught by {len(result.caught_by)}/{len(cells)}" if result.caught else "NOT CAUGHT"
        errors = sum(c.status == ERROR for c in cells)
        extra = f", {errors} error" if errors else ""
        how = f" ({', '.join(result.kinds()[:3])})" if result.caught else ""
        progress(f"[{n:>2}/{len(faults)}] {fault.name:<30} {verdict}{how}{extra}  {result.duration_s:.1f} s")
    return results


def _perturbation_name(relative: float) -> str:
    return f"perturb:{relative!r}"


def measure_sensitivity(runner: Runner, targets: Sequence[Target], *, grid: Sequence[float] = SENSITIVITY_GRID,
                        progress: Progress = _quiet) -> Sensitivity:
    """Bisect the log-spaced grid for the smallest relative perturbation of rank 1's gradients
    that fails some target (assumes a larger perturbation is no harder to catch)."""
    precision = targets[0].precision

    def caught(index: int) -> bool:
        return any(runner.run(t, fault=_perturbation_name(grid[index])).status == FAIL for t in targets)

    names = [t.label for t in targets]
    lo, hi = 0, len(grid) - 1
    if not caught(hi):
        result = Sensitivity(precision, names, caught=None, missed=grid[hi])
    elif caught(lo):
        result = Sensitivity(precision, names, caught=grid[lo], missed=None)
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if caught(mid):
                hi = mid
            else:
                lo = mid
        result = Sensitivity(precision, names, caught=grid[hi], missed=grid[lo])
    progress(f"sensitivity {precision}: {result.text()} ({', '.join(names)})")
    return result


def sensitivity_targets(catalogue: Sequence[CatalogueCase], names: Sequence[str], precision: str) -> list[Target]:
    """The first variant of ``precision`` of each named case (of the first non-canary case if none is found)."""
    by_name = {c.name: c for c in catalogue}
    cases = [by_name[n] for n in names if n in by_name]
    if not cases:
        cases = [c for c in catalogue if not c.info.canary][:1]
    targets = []
    for case in cases:
        variants = [v for v in case.info.variants if v.params.get("precision", "fp32") == precision]
        if variants:
            targets.append(Target(case, variants[0]))
    return targets


def run_selfcheck(
    catalogue: Sequence[CatalogueCase],
    *,
    cases: Sequence[str] | None = None,
    faults: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    all_variants: bool = False,
    world_size: int = 2,
    seed: int = DEFAULT_SEED,
    case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S,
    sensitivity_cases: Sequence[str] | None = SENSITIVITY_CASES,
    progress: Progress = _quiet,
) -> SelfcheckResult:
    """Run the chosen targets clean, then under each fault, then the sensitivity search
    (skipped when ``sensitivity_cases`` is None)."""
    targets = select_targets(catalogue, cases=cases, variants=variants, all_variants=all_variants)
    try:
        chosen_faults = [resolve(name) for name in (faults if faults is not None else list(FAULTS))]
    except ValueError as exc:
        raise SelfcheckError(str(exc)) from None
    if not [t for t in targets if not t.case.info.canary]:
        raise SelfcheckError("every chosen case is a canary: nothing to count faults with")
    started = time.perf_counter()
    with Runner(world_size=world_size, seed=seed, case_timeout_s=case_timeout_s) as runner:
        progress(f"pool of {world_size} ranks up in {time.perf_counter() - started:.1f} s; "
                 f"{len(targets)} cells clean, then {len(chosen_faults)} faults")
        clean = [runner.run(t) for t in targets]
        bad = [c for c in clean if c.status in CLEAN_BAD]
        progress(f"[clean] {len(clean) - len(bad)}/{len(clean)} cells as expected"
                 + (f"; NOT: {', '.join(f'{c.case}[{c.variant}] {c.status}' for c in bad)}" if bad else ""))
        result = SelfcheckResult(world_size=world_size, seed=seed, targets=list(targets), clean=clean)
        result.faults = run_faults(runner, targets, chosen_faults, clean=clean, progress=progress)
        if sensitivity_cases is not None:
            chosen = [t.case for t in targets]
            for precision in PRECISIONS:
                for target in sensitivity_targets(chosen, sensitivity_cases, precision):
                    result.sensitivity.append(measure_sensitivity(runner, [target], progress=progress))
    result.duration_s = time.perf_counter() - started
    return result


def render(result: SelfcheckResult) -> str:
    """The fault x case table, the clean run, the kill rate and the sensitivity, as plain text."""
    counted = result.counted_targets
    columns = [str(n) for n in range(1, len(counted) + 1)]
    width = max(len(c) for c in columns) + 1
    name_width = max([len("fault")] + [len(r.fault.name) for r in result.faults]) + 2
    lines = [
        f"selfcheck at world size {result.world_size}, seed {result.seed}: {len(counted)} cells x "
        f"{len(result.faults)} faults (caught = the cell ended fail)",
        "",
    ]
    header = "fault".ljust(name_width) + "".join(c.rjust(width) for c in columns) + "   caught by  diagnoses"
    lines.append(header)
    clean_by_label = {f"{c.case}[{c.variant}]": c for c in result.clean}
    clean_row = "(clean)".ljust(name_width) + "".join(
        SYMBOLS.get(clean_by_label[t.label].status, "?").rjust(width) for t in counted)
    lines.append(clean_row + f"   {sum(clean_by_label[t.label].status == FAIL for t in counted)} fail")
    for r in result.faults:
        row = r.fault.name.ljust(name_width) + "".join(SYMBOLS.get(c.status, "?").rjust(width) for c in r.cells)
        caught = f"{len(r.caught_by)}/{len(r.cells)}".rjust(9)
        lines.append(f"{row}   {caught}  {', '.join(r.kinds()) if r.caught else 'NOT CAUGHT'}")
    lines += ["", "X caught (fail)   . passed (not caught)   E error (not caught)   - skip, unsupported, or not pass when clean", ""]
    for column, target in zip(columns, counted):
        lines.append(f"{column.rjust(width)}  {target.label}")
    canaries = [c for c in result.clean if c.status in (DETECTED, MISSED)]
    if canaries:
        lines.append("canaries (clean run only, not counted): "
                     + ", ".join(f"{c.case}[{c.variant}] {c.status}" for c in canaries))
    lines.append("")
    if result.clean_bad:
        lines.append("CLEAN RUN NOT CLEAN:")
        lines += [f"  {c.case}[{c.variant}] {c.status}: {c.summary}" for c in result.clean_bad]
    caught = sum(r.caught for r in result.faults)
    rate = caught / len(result.faults) if result.faults else math.nan
    lines.append(f"kill rate: {caught}/{len(result.faults)} faults caught by at least one case ({rate:.0%})")
    for r in result.uncaught:
        errors = [c for c in r.cells if c.status == ERROR]
        note = f"; {len(errors)} cells errored, e.g. {errors[0].case}: {errors[0].summary}" if errors else ""
        lines.append(f"  NOT CAUGHT: {r.fault.name}: {r.fault.description}{note}")
    if result.sensitivity:
        lines += ["", "sensitivity: the smallest relative perturbation of rank 1's gradients (after every "
                  "backward) that fails the cell, on a grid of 4 a decade"]
        label_width = max(len(", ".join(s.cases)) for s in result.sensitivity)
        for s in result.sensitivity:
            lines.append(f"  {s.precision}  {', '.join(s.cases).ljust(label_width)}  {s.text()}")
        for precision in PRECISIONS:
            caught = [s.caught for s in result.sensitivity if s.precision == precision and s.caught is not None]
            if caught:
                lines.append(f"  {precision}: caught from {min(caught):.3g}")
    lines += ["", f"{'OK' if result.ok else 'FAILED'} in {result.duration_s:.0f} s"]
    return "\n".join(lines) + "\n"
