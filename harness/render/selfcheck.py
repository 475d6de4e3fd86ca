"""The self-check as a person reads it: the fault x cell table, the kill rate, the sensitivity, and
one progress line per step."""

from __future__ import annotations

import math
from typing import Any, Iterable

from harness.decorator import PRECISIONS
from harness.records import BAD_STATUSES, Status
from harness.selfcheck.planted import Fault
from harness.selfcheck.run import CleanRun, FaultDone, PoolUp, SelfcheckResult, Sensitivity, first_kinds

SYMBOLS = {Status.FAIL: "X", Status.PASS: ".", Status.ERROR: "E", Status.SKIP: "-", Status.UNSUPPORTED: "-",
           Status.DETECTED: "d", Status.MISSED: "m"}


def fault_list(faults: Iterable[Fault]) -> str:
    """One line a fault: its name, what it breaks, and the diagnoses that name it."""
    faults = list(faults)
    width = max(len(f.name) for f in faults)
    return "".join(f"{f.name.ljust(width)}  {f.description} (named by: {', '.join(f.diagnoses)})\n" for f in faults)


def sensitivity_text(s: Sensitivity) -> str:
    if s.caught is None:
        return f"not caught up to {s.missed:.3g}"
    if s.missed is None:
        return f"caught down to {s.caught:.3g} (the smallest tried)"
    return f"{s.caught:.3g} caught, {s.missed:.3g} not"


def progress_line(event: Any) -> str:
    """One line for stderr as the self-check goes."""
    if isinstance(event, PoolUp):
        return (f"pool of {event.world_size} ranks up in {event.seconds:.1f} s; "
                f"{event.cells} cells clean, then {event.faults} faults")
    if isinstance(event, CleanRun):
        bad = [c for c in event.cells if c.status in BAD_STATUSES]
        return (f"[clean] {len(event.cells) - len(bad)}/{len(event.cells)} cells as expected"
                + (f"; NOT: {', '.join(f'{c.case}[{c.variant}] {c.status}' for c in bad)}" if bad else ""))
    if isinstance(event, FaultDone):
        result, cells = event.result, event.result.cells
        verdict = (f"caught by {len(result.caught_by)}/{len(result.ran)}" if result.caught
                   else "NOT CAUGHT" if result.ran else "not run here")
        errors = sum(c.status == Status.ERROR for c in cells)
        extra = f", {errors} error" if errors else ""
        how = f" ({', '.join(result.kinds()[:3])}; named by {len(result.named_by)})" if result.caught else ""
        return f"[{event.n:>2}/{event.total}] {result.fault.name:<30} {verdict}{how}{extra}  {result.duration_s:.1f} s"
    if isinstance(event, Sensitivity):
        return f"sensitivity {event.precision}: {sensitivity_text(event)} ({', '.join(event.cases)})"
    raise TypeError(f"no progress line for {type(event).__name__}")


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
    header = "fault".ljust(name_width) + "".join(c.rjust(width) for c in columns) + "   caught by  named by  diagnoses"
    lines.append(header)
    clean_by_label = {f"{c.case}[{c.variant}]": c for c in result.clean}
    clean_row = "(clean)".ljust(name_width) + "".join(
        SYMBOLS.get(clean_by_label[t.label].status, "?").rjust(width) for t in counted)
    lines.append(clean_row + f"   {sum(clean_by_label[t.label].status == Status.FAIL for t in counted)} fail")
    for r in result.faults:
        row = r.fault.name.ljust(name_width) + "".join(SYMBOLS.get(c.status, "?").rjust(width) for c in r.cells)
        caught = f"{len(r.caught_by)}/{len(r.ran)}".rjust(9)
        named = (f"{len(r.named_by)}/{len(r.caught_by)}" if r.caught else "").rjust(8)
        verdict = ", ".join(r.kinds()) if r.caught else ("NOT CAUGHT" if r.ran else "not run here")
        lines.append(f"{row}   {caught}  {named}  {verdict}")
    lines += ["", "X caught (fail)   . passed (not caught)   E error (not caught)   - skip, unsupported, or not pass when clean",
              "named by: the cells that caught it whose diagnoses at their first failing step name it "
              "(selfcheck --list-faults shows the kinds that do)", ""]
    for column, target in zip(columns, counted):
        lines.append(f"{column.rjust(width)}  {target.label}")
    canaries = [c for c in result.clean if c.status in (Status.DETECTED, Status.MISSED)]
    if canaries:
        lines.append("canaries (clean run only, not counted): "
                     + ", ".join(f"{c.case}[{c.variant}] {c.status}" for c in canaries))
    lines.append("")
    if result.clean_bad:
        lines.append("CLEAN RUN NOT CLEAN:")
        lines += [f"  {c.case}[{c.variant}] {c.status}: {c.summary}" for c in result.clean_bad]
    counted_faults = result.counted_faults
    caught = sum(r.caught for r in counted_faults)
    rate = caught / len(counted_faults) if counted_faults else math.nan
    lines.append(f"kill rate: {caught}/{len(counted_faults)} faults caught by at least one case ({rate:.0%})")
    accuracy = result.diagnosis_accuracy()
    if accuracy["cells"]:
        lines.append(f"diagnosis accuracy: {accuracy['named']}/{accuracy['cells']} catching cells name their fault "
                     f"({accuracy['rate']:.0%}); {accuracy['faults_always_named']}/{accuracy['faults']} faults named "
                     "by every cell that caught them")
        for r in counted_faults:
            if r.caught and r.accuracy != 1.0:
                lines.append(f"  NOT ALWAYS NAMED: {r.fault.name}: {len(r.named_by)}/{len(r.caught_by)} cells say "
                             f"{' or '.join(r.fault.diagnoses)}; the others: "
                             + ", ".join(f"{c.case}[{c.variant}] {', '.join(map(str, first_kinds(c)))}"
                                         for c in r.caught_by if c not in r.named_by)[:400])
    for r in counted_faults:
        if r.fault.every_cell and r.missed_by:  # each by name: every cell it ran on can catch it
            lines.append(f"  MISSED BY {len(r.missed_by)}/{len(r.ran)}: {r.fault.name}: "
                         + ", ".join(f"{c.case}[{c.variant}] {c.status}" for c in r.missed_by))
    for r in result.not_run:
        needs = f"{r.fault.needs} " if r.fault.needs else ""
        lines.append(f"  not run here: {r.fault.name} (no {needs}cell of {', '.join(r.fault.wrappers)} passed clean)")
    for r in result.uncaught:
        errors = [c for c in r.cells if c.status == Status.ERROR]
        note = f"; {len(errors)} cells errored, e.g. {errors[0].case}: {errors[0].summary}" if errors else ""
        lines.append(f"  NOT CAUGHT: {r.fault.name}: {r.fault.description}{note}")
    if result.sensitivity:
        lines += ["", "sensitivity: the smallest relative perturbation of rank 1's gradients (after every "
                  "backward) that fails the cell, on a grid of 4 a decade"]
        label_width = max(len(", ".join(s.cases)) for s in result.sensitivity)
        for s in result.sensitivity:
            lines.append(f"  {s.precision}  {', '.join(s.cases).ljust(label_width)}  {sensitivity_text(s)}")
        for precision in PRECISIONS:
            caught = [s.caught for s in result.sensitivity if s.precision == precision and s.caught is not None]
            if caught:
                lines.append(f"  {precision}: caught from {min(caught):.3g}")
    lines += ["", f"{'OK' if result.ok else 'FAILED'} in {result.duration_s:.0f} s"]
    return "\n".join(lines) + "\n"
