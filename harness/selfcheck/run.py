"""The self-check: run the catalogue clean and under planted sync faults, and count what it catches."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from harness.catalogue import CaseRef
from harness.controller.cells import run_cell, settings_for
from harness.controller.options import DEFAULT_CASE_TIMEOUT_S, DEFAULT_SEED, Settings
from harness.controller.pool import PoolSet, PoolStartError
from harness.controller.rank_server import preload_all
from harness.decorator import PRECISIONS, Variant
from harness.matrix.schema import Cell
from harness.records import BAD_STATUSES, Failure, Status
from harness.selfcheck.faults import FAULTS, resolve
from harness.selfcheck.planted import Fault
from harness.wrappers.registry import DDP, WRAPPERS
from harness.wrappers.prepare import cell_variants

# A fault's cell that was not run starts its summary with this.
NOT_RUN = "not run: "
# Relative perturbations tried by the sensitivity search: four a decade, 1e-9 to 1.
SENSITIVITY_GRID = tuple(10.0 ** (e / 4) for e in range(-36, 1))
SENSITIVITY_CASES = ("fused_loss", "accumulate")


class SelfcheckError(Exception):
    """A bad argument or an unusable catalogue; the message is one line."""


@dataclass(frozen=True)
class Target:
    """One (case, variant): a cell once a world size, seed and fault are chosen."""

    case: CaseRef
    variant: Variant

    @property
    def label(self) -> str:
        return f"{self.case.name}[{self.variant.name}]"

    @property
    def precision(self) -> str:
        return str(self.variant.params.get("precision", "fp32"))

    @property
    def wrapper(self) -> str:
        return str(self.variant.params.get("wrapper", DDP))

    @property
    def known_wrong(self) -> bool:
        """A canary, or a known defect under this wrapper: broken on purpose, it proves nothing here."""
        return bool(self.case.info.detects_for(self.variant))


def _matches(variant: Variant, pattern: str) -> bool:
    """A pattern is a ``-``-joined set of name parts (``fp32``, ``steps=2-bf16``), all present."""
    parts = set(variant.name.split("-"))
    return variant.name == pattern or set(pattern.split("-")) <= parts


def select_targets(
    catalogue: Sequence[CaseRef],
    *,
    cases: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    all_variants: bool = False,
) -> list[Target]:
    """The (case, variant) pairs to run. By default one variant a case and wrapper: its first fp32 one
    (not compiled) that is no declared defect, and the first that each fault of the wrapper needs
    (``Fault.needs``). ``variants`` keeps those matching any pattern; ``all_variants`` keeps every
    variant (every wrapper's: ``wrapper=<name>`` is a part of the variant's name)."""
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
        options = cell_variants(case.info.variants, case.info.wrappers, WRAPPERS, case.info.meshes)
        if all_variants:
            picked = list(options)
        elif variants:
            picked = [v for v in options if any(_matches(v, p) for p in variants)]
        else:
            picked = []
            for wrapper in WRAPPERS:
                mine = [v for v in options if v.params.get("wrapper", DDP) == wrapper]
                fp32 = [v for v in mine if v.params.get("precision", "fp32") == "fp32" and "compile" not in v.params]
                # a declared defect's variant proves nothing (Target.known_wrong): the first that is none
                fp32 = [v for v in fp32 if not case.info.detects_for(v)] or fp32
                picked += [(fp32 or mine)[0]] if mine else []
                # and the first that each fault planted on the wrapper's cells needs: reduce=fp32 under
                # FSDP2 (a reduction in a dtype other than the one asked for, pytorch #190626), bf16
                # under DeepSpeed (its bf16 path's faults) and under DDP (autocast_dropped)
                for need in sorted({f.needs for f in FAULTS.values() if f.needs and wrapper in f.wrappers}):
                    picked += [v for v in mine if _matches(v, need) and v not in picked][:1]
        targets.extend(Target(case, v) for v in picked)
    if not targets:
        raise SelfcheckError(f"no variant matches {','.join(variants or [])} in the chosen cases")
    return targets


class Runner:
    """One live pool of ranks that runs cells for the whole self-check."""

    def __init__(self, *, world_size: int, backend: str = "gloo", seed: int = DEFAULT_SEED,
                 case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S) -> None:
        if world_size < 2:
            raise SelfcheckError(f"world size {world_size}: a self-check needs at least 2 ranks "
                                 "(1 cannot tell synced from local)")
        self.world_size = world_size
        self.settings = Settings(world_sizes=(world_size,), backend=backend, device="cpu", report_dir="reports",
                                 case_timeout_s=case_timeout_s, seed=seed, gpu_count=0)
        preload_all()  # the whole catalogue, clean and with each fault, on this pool and the next
        self.pools = PoolSet(backend=backend)

    def __enter__(self) -> "Runner":
        try:
            self.pools.get(self.world_size)
        except PoolStartError as exc:
            self.close()
            first_line = str(exc).splitlines()[0]
            raise SelfcheckError(f"the pool of {self.world_size} ranks did not start: {first_line}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.pools.close()

    def run(self, target: Target, *, fault: str | None = None, seed: int | None = None) -> Cell:
        settings = settings_for(self.settings, seed=seed, fault=fault)
        return run_cell(self.pools, target.case, target.variant, self.world_size, settings)


def _first_failures(cell: Cell) -> list[Failure]:
    """The failures of the cell's first failing step, in the order they were found."""
    if not cell.failures:
        return []
    first = min(f.step for f in cell.failures)
    return [f for f in cell.failures if f.step == first]


def first_kinds(cell: Cell) -> list[str]:
    """The diagnoses at the cell's first failing step, in the order they were found: the cause,
    before the mismatches it drags along in later steps."""
    return list(dict.fromkeys(f.kind for f in _first_failures(cell)))


def names(cell: Cell, fault: Fault) -> bool:
    """Whether the cell's diagnoses at its first failing step include one that names the fault
    (``Fault.diagnoses``: a kind, or ``kind:checked``, a kind found by that check)."""
    found = {k for f in _first_failures(cell) for k in (str(f.kind), f"{f.kind}:{f.checked}")}
    return bool(found & set(fault.diagnoses))


@dataclass
class FaultResult:
    fault: Fault
    cells: list[Cell]
    duration_s: float = 0.0

    @property
    def caught_by(self) -> list[Cell]:
        return [c for c in self.cells if c.status == Status.FAIL]

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    @property
    def ran(self) -> list[Cell]:
        """The cells it ran on: those of its wrappers that passed clean."""
        return [c for c in self.cells if not c.summary.startswith(NOT_RUN)]

    @property
    def missed_by(self) -> list[Cell]:
        """The cells it ran on that let it through (any status but fail)."""
        return [c for c in self.ran if c.status != Status.FAIL]

    @property
    def named_by(self) -> list[Cell]:
        """The cells that caught it and named it (``names``)."""
        return [c for c in self.caught_by if names(c, self.fault)]

    @property
    def accuracy(self) -> float | None:
        """The share of the cells that caught it whose diagnoses name it; None when none caught it."""
        return len(self.named_by) / len(self.caught_by) if self.caught_by else None

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
        return [t for t in self.targets if not t.known_wrong]

    @property
    def clean_bad(self) -> list[Cell]:
        return [c for c in self.clean if c.status in BAD_STATUSES]

    @property
    def uncaught(self) -> list[FaultResult]:
        return [r for r in self.faults if r.ran and not r.caught]

    @property
    def not_run(self) -> list[FaultResult]:
        """Faults with no cell to run on here (no cell of their wrappers passed clean, e.g. DeepSpeed
        not installed): neither caught nor missed, and left out of the kill rate."""
        return [r for r in self.faults if not r.ran]

    @property
    def counted_faults(self) -> list[FaultResult]:
        return [r for r in self.faults if r.ran]

    def diagnosis_accuracy(self) -> dict[str, Any]:
        """Of every cell that caught a fault, those whose diagnoses name it; and the faults every one
        of whose catching cells name it."""
        caught = [r for r in self.counted_faults if r.caught]
        cells = sum(len(r.caught_by) for r in caught)
        named = sum(len(r.named_by) for r in caught)
        return {"named": named, "cells": cells, "rate": named / cells if cells else None,
                "faults_always_named": sum(r.accuracy == 1.0 for r in caught), "faults": len(caught)}

    @property
    def ok(self) -> bool:
        return not self.clean_bad and not self.uncaught

    def to_dict(self) -> dict[str, Any]:
        caught = sum(r.caught for r in self.counted_faults)
        return {
            "world_size": self.world_size,
            "seed": self.seed,
            "cells": [t.label for t in self.targets],
            "clean": [c.to_dict() for c in self.clean],
            "faults": [
                {"name": r.fault.name, "description": r.fault.description, "caught": r.caught,
                 "caught_by": {f"{c.case}[{c.variant}]": first_kinds(c) for c in r.caught_by}, "kinds": r.kinds(),
                 "missed_by": {f"{c.case}[{c.variant}]": c.status for c in r.missed_by},
                 "diagnoses": list(r.fault.diagnoses), "named_by": [f"{c.case}[{c.variant}]" for c in r.named_by],
                 "accuracy": r.accuracy,
                 "cells": [c.to_dict() for c in r.cells]}
                for r in self.faults
            ],
            "kill_rate": {"caught": caught, "faults": len(self.counted_faults),
                          "rate": caught / len(self.counted_faults) if self.counted_faults else None},
            "diagnosis_accuracy": self.diagnosis_accuracy(),
            "not_run": [r.fault.name for r in self.not_run],
            "sensitivity": [{"precision": s.precision, "cases": s.cases, "caught": s.caught, "missed": s.missed}
                            for s in self.sensitivity],
            "ok": self.ok,
            "duration_s": round(self.duration_s, 2),
        }


@dataclass(frozen=True)
class PoolUp:
    """Progress: the pool started; the clean run and the faults come next."""

    world_size: int
    seconds: float
    cells: int
    faults: int


@dataclass(frozen=True)
class CleanRun:
    """Progress: the clean run is done."""

    cells: list[Cell]


@dataclass(frozen=True)
class FaultDone:
    """Progress: fault ``n`` of ``total`` ran on every counted cell."""

    n: int
    total: int
    result: FaultResult


# Called with each PoolUp, CleanRun, FaultDone and Sensitivity as it happens (harness/render/selfcheck.py
# has their words).
Progress = Callable[[Any], None]


def _quiet(event: Any) -> None:
    pass


def run_faults(runner: Runner, targets: Sequence[Target], faults: Iterable[Fault], *,
               clean: Sequence[Cell] | None = None, progress: Progress = _quiet) -> list[FaultResult]:
    """Each fault on every non-canary target of the wrappers it is planted in (a canary is broken on
    purpose: it proves nothing here). A target whose clean cell did not pass is not run: its failing
    under a fault would prove nothing."""
    counted = [t for t in targets if not t.known_wrong]
    baseline = {(c.case, c.variant): c.status for c in clean or ()}
    faults = list(faults)
    results = []

    def run(target: Target, fault: Fault) -> Cell:
        status = baseline.get((target.case.name, target.variant.name), Status.PASS)
        if target.wrapper not in fault.wrappers:
            return Cell(case=target.case.name, variant=target.variant.name, world_size=runner.world_size,
                        status=Status.SKIP, summary=f"{NOT_RUN}planted in the path of {', '.join(fault.wrappers)}")
        if fault.needs and not _matches(target.variant, fault.needs):
            return Cell(case=target.case.name, variant=target.variant.name, world_size=runner.world_size,
                        status=Status.SKIP, summary=f"{NOT_RUN}planted in the path of {fault.needs} cells")
        if status != Status.PASS:
            return Cell(case=target.case.name, variant=target.variant.name, world_size=runner.world_size,
                        status=Status.SKIP, summary=f"{NOT_RUN}{status} in the clean run")
        return runner.run(target, fault=fault.name)

    for n, fault in enumerate(faults, 1):
        started = time.perf_counter()
        cells = [run(t, fault) for t in counted]
        result = FaultResult(fault, cells, time.perf_counter() - started)
        results.append(result)
        progress(FaultDone(n, len(faults), result))
    return results


def _perturbation_name(relative: float) -> str:
    return f"perturb:{relative!r}"


def measure_sensitivity(runner: Runner, targets: Sequence[Target], *, grid: Sequence[float] = SENSITIVITY_GRID,
                        progress: Progress = _quiet) -> Sensitivity:
    """Bisect the log-spaced grid for the smallest relative perturbation of rank 1's gradients
    that fails some target (assumes a larger perturbation is no harder to catch)."""
    precision = targets[0].precision

    def caught(index: int) -> bool:
        return any(runner.run(t, fault=_perturbation_name(grid[index])).status == Status.FAIL for t in targets)

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
    progress(result)
    return result


def sensitivity_targets(catalogue: Sequence[CaseRef], names: Sequence[str], precision: str) -> list[Target]:
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
    catalogue: Sequence[CaseRef],
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
        # each fault runs on the cells of the wrappers it is planted in (Fault.wrappers)
        chosen_faults = [resolve(name) for name in (faults if faults is not None else list(FAULTS))]
    except ValueError as exc:
        raise SelfcheckError(str(exc)) from None
    if not [t for t in targets if not t.known_wrong]:
        raise SelfcheckError("every chosen case is a canary: nothing to count faults with")
    started = time.perf_counter()
    with Runner(world_size=world_size, seed=seed, case_timeout_s=case_timeout_s) as runner:
        progress(PoolUp(world_size, time.perf_counter() - started, len(targets), len(chosen_faults)))
        clean = [runner.run(t) for t in targets]
        progress(CleanRun(clean))
        result = SelfcheckResult(world_size=world_size, seed=seed, targets=list(targets), clean=clean)
        result.faults = run_faults(runner, targets, chosen_faults, clean=clean, progress=progress)
        if sensitivity_cases is not None:
            chosen = [t.case for t in targets]
            for precision in PRECISIONS:
                for target in sensitivity_targets(chosen, sensitivity_cases, precision):
                    result.sensitivity.append(measure_sensitivity(runner, [target], progress=progress))
    result.duration_s = time.perf_counter() - started
    return result
