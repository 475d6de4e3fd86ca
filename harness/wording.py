"""The text of a failure, a rank fault and a judged cell: the lines a person reads first.

A mismatch reads like torch's ``assert_close`` with where and what added; a cell's summary counts
what was checked or names what went wrong; a bad cell's pytest message ends with the command that
reruns it. The rank side imports this module (a failure's message is written where it happens).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Mapping, Sequence

from harness.records import CAUSES, CHECK_TITLES, Failure, FaultKind, RankFault, RankOutcome, Status

if TYPE_CHECKING:
    from harness.matrix.schema import Cell
    from harness.messages import RankResult
    from harness.rank.numerics.closeness import Difference

KIND_TEXT = {
    "not_synced": "not synced (the rank's local gradient where the average of all ranks was due)",
    "synced_early": "synced when it should be local (the average of all ranks where this rank's own gradient was due)",
    "stale": "stale from the last window (the gradient was not cleared after the optimizer step)",
    "wrong_scale": "scaled by {factor:.6g}",
    "misweighted": ("misweighted: its {unit} since the last check weigh {factor:.6g} times their share of the "
                    "{mean} over the window on every rank"),
    "params_diverged": "parameters diverged across ranks (no longer equal to rank 0's)",
    "stepped_early": "the optimizer stepped where the schedule has no step",
    "step_skipped": "the optimizer did not step where the schedule has one",
    "mismatch": "does not match the oracle",
}
# Failures shown in a bad cell's pytest message; the rest are in matrix.json.
MESSAGE_FAILURES = 6


# one failure, on the rank


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


# What a misweighted gradient's contributions are, and the mean they are shares of: a token window's
# (``token_window``), or a window held to the full-batch mean (``contract="full_batch"``)
WEIGHED_UNITS = {"tokens": "token mean", "micro-batches": "mean of the micro-batches' losses"}


def mismatch_text(*, what: str, where: str, kind: str, factor: float | None, diff: Difference,
                  weights: Sequence[float] | None = None, earlier: float | Sequence[float] | None = None,
                  backwards: int = 1, unit: str = "tokens", shards: Sequence[Sequence[int]] | None = None) -> str:
    """The assert_close-style block for one mismatch, headed by where and what; a misweighted one
    after a sync names every rank's weight (under a mesh every data shard's, with the ranks that draw
    it: ``shards``), and what its weights weigh (``unit``: WEIGHED_UNITS); ``earlier``: the weight fitted
    to the gradient it held before them (the window's earlier micro-batches as the last check found
    them: scaled by a clip inside the window, or dropped by a zero_grad), where that was fitted too;
    after a sync, one weight a rank (or data shard): each rank's clip scales by its own norm."""
    text = KIND_TEXT[kind].format(factor=factor or 0.0, unit=unit, mean=WEIGHED_UNITS[unit])
    if weights is not None and backwards > 1:  # several micro-batches since the last check: each one's
        per = len(weights) // backwards
        groups = [weights[b * per:(b + 1) * per] for b in range(backwards)]
        by = (", each by data shard (" + "; ".join(f"ranks {', '.join(map(str, r))}" for r in shards) + ")"
              if shards is not None and len(shards) == per else ", each by rank" if per > 1 else "")
        text += (f" (its last micro-batch's; the weights of the {backwards} since the last check{by}: "
                 + "; ".join(", ".join(f"{w:.6g}" for w in group) for group in groups) + ")")
    elif weights is not None and len(weights) > 1 and shards is not None and len(shards) == len(weights):
        text += " (weights by data shard: " + ", ".join(
            f"{w:.6g} (ranks {', '.join(map(str, ranks))})" for w, ranks in zip(weights, shards)) + ")"
    elif weights is not None and len(weights) > 1:
        text += " (weights by rank: " + ", ".join(f"{w:.6g}" for w in weights) + ")"
    if isinstance(earlier, (int, float)):
        text += f", and the gradient held before them weighs {earlier:.6g} times itself"
    elif earlier is not None and shards is not None and len(shards) == len(earlier):
        text += (", and the gradient each data shard held before them weighs " + ", ".join(
            f"{e:.6g} (ranks {', '.join(map(str, ranks))})" for e, ranks in zip(earlier, shards)) + " times itself")
    elif earlier is not None:
        text += (", and the gradient each rank held before them weighs "
                 + ", ".join(f"{e:.6g} (rank {r})" for r, e in enumerate(earlier)) + " times itself")
    share = 100.0 * diff.mismatched / max(diff.numel, 1)
    return (
        f"{what} {where}: {text}\n"
        f"Mismatched elements: {diff.mismatched} / {diff.numel} ({share:.1f}%)\n"
        f"Greatest absolute difference: {diff.max_abs:.6g} at index {_fmt_index(diff.max_abs_index)} "
        f"(up to {diff.allowed_abs:.2g} allowed there)\n"
        f"Greatest relative difference: {diff.max_rel:.6g} at index {_fmt_index(diff.max_rel_index)} "
        f"(up to {diff.allowed_rel:.2g} allowed there)"
    )


def sync_flag_text(*, rank: int, where: str, flag: bool, due: bool) -> str:
    return f"accelerator.sync_gradients on rank {rank} at {where}: is {flag}, the schedule says {due}"


def comm_text(*, rank: int, where: str, issued: str, syncs: bool, needed: int, why: str = "") -> str:
    """A backward that issued gradient reductions the contract has none of, or too few (under a mesh,
    ``why``: over the wrong group, or not reaching every data-parallel peer)."""
    if why:
        return f"collectives of the backward on rank {rank} at {where}: {issued}; {why}"
    if syncs:
        return (f"collectives of the backward on rank {rank} at {where}: {issued}, where the contract syncs "
                f"the gradients of {needed} elements (each reduced at least once)")
    return (f"collectives of the backward on rank {rank} at {where}: {issued}, where the contract has no "
            "gradient reduction (no_sync, or a micro-batch that does not sync)")


def hidden_grad_text(*, rank: int, where: str, what: str, shown: int) -> str:
    return (f"gradient of '{what}' on rank {rank} at {where}: synced when it should be local (a sharded "
            f"gradient is shown on {shown} parameter(s) between sync points, where no_sync keeps it unsharded "
            "inside the wrapper (FSDP2: p.grad None; FSDP1: the full local gradient): it was reduce-scattered)")


def lr_text(*, rank: int, where: str, optimizer: str, group: int, actual: float, expected: float) -> str:
    return (f"learning rate of optimizer '{optimizer}' (param group {group}) on rank {rank} at "
            f"{where}: is {actual:.6g}, the contract says {expected:.6g}")


def unsuppressed_text(count: int) -> str:
    """A loop's backwards that synced where their window has none, the loop never asking not to."""
    return (f"{count} backward{'s' if count != 1 else ''} all-reduced inside {'their windows' if count != 1 else 'its window'} "
            f"(the loop never asked for no_sync or accumulate there): correct, and no_sync would save "
            f"{count} all-reduce{'s' if count != 1 else ''} a rank")


def optimizer_stepped_text(*, rank: int, model: str, where: str) -> str:
    """An optimizer step the schedule has not, as the optimizer itself says it (whether or not a parameter
    moved for it: not one does at a learning rate of 0)."""
    return f"optimizer of {model!r} on rank {rank} at {where}: {KIND_TEXT['stepped_early']} (its step() ran)"


def batch_count_text(*, rank: int, what: str, epoch: int, seen: int, expected: int) -> str:
    return f"{what} on rank {rank} yielded {seen} batches in epoch {epoch}, the contract says {expected}"


def trainer_count_text(*, rank: int, what: str, seen: int, expected: int) -> str:
    return f"Trainer.train() on rank {rank} ran {seen} {what}, the schedule of its arguments says {expected}"


def trainer_window_text(*, rank: int, first: str, last: str, due: str, steps: int) -> str:
    """Trainer stepped the optimizer where the schedule of its arguments does not (said once a cell)."""
    return (f"Trainer.train() on rank {rank} stepped the optimizer after the micro-batches from {first} to "
            f"{last}; the schedule of its arguments (windows of gradient_accumulation_steps={steps} in each "
            f"epoch, the last one shorter) ends that window at {due}. Each step is judged on the window "
            "Trainer took")


def grad_norm_text(*, who: str = "grad_norm logged by Trainer", rank: int, where: str, logged: float, expected: float,
                   allowed: float) -> str:
    """A reported gradient norm (Trainer's logged grad_norm, or what ``clip_grad_norm_`` returned: the
    norm its clip measured, before clipping) against the oracle's."""
    ratio = f" ({logged / expected:.6g} times it)" if expected > 0 else ""
    return (f"{who} on rank {rank} at {where}: is {logged:.6g}, the gradient of the "
            f"step's mean loss has norm {expected:.6g}{ratio} (up to {allowed:.2g} apart allowed)")


# rank faults


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _name(fault: RankFault) -> str:
    """``1``, or under a launcher ``1 on node-b``."""
    return f"{fault.rank} on {fault.host}" if fault.host else str(fault.rank)


def _who(fault: RankFault) -> str:
    return f"rank {_name(fault)}"


def fault_text(fault: RankFault, *, timeout_s: float) -> str:
    who = _who(fault)
    if fault.what == FaultKind.RAISED:
        return f"{who} raised {last_line(fault.detail)}"
    if fault.what in (FaultKind.EXITED, FaultKind.KILLED):
        return f"{who} {fault.detail.splitlines()[0] if fault.detail else fault.what}"
    if fault.what == FaultKind.HUNG:
        return f"{who} hung (no result within {timeout_s:g} s)"
    if fault.what == FaultKind.LOST:
        return f"{who} died ({fault.detail.split(':', 1)[0]})"
    return f"{who} was blocked waiting for the others"


def _ranks(faults: Sequence[RankFault]) -> str:
    """``rank 1``, ``ranks 0, 2``, or with hosts ``ranks 0 on a, 2 on b``."""
    ordered = sorted(faults, key=lambda f: f.rank)
    names = ", ".join(_name(f) for f in ordered)
    return f"rank{'s' if len(ordered) > 1 else ''} {names}"


def faults_summary(faults: Sequence[RankFault], *, timeout_s: float) -> str:
    """The causes, then the ranks that only waited for them."""
    causes = [f for f in faults if f.what in CAUSES] or list(faults)
    blocked = [f for f in faults if f.what == FaultKind.BLOCKED and f not in causes]
    # ranks that raised the same error are said once: "ranks 0, 1 raised ValueError: ..."
    raised: dict[str, list[RankFault]] = {}  # an error's last line: the ranks that raised it
    order: list[tuple[bool, str]] = []  # (raised?, the error's last line or the fault's text), in order
    for fault in causes:
        if fault.what != FaultKind.RAISED:
            order.append((False, fault_text(fault, timeout_s=timeout_s)))
            continue
        error = last_line(fault.detail)
        if error not in raised:
            order.append((True, error))
        raised.setdefault(error, []).append(fault)
    summary = "; ".join(f"{_ranks(raised[text])} raised {text}" if is_raised else text for is_raised, text in order)
    if blocked:
        summary += f" ({_ranks(blocked)} blocked waiting for it)"
    return summary


def faults_detail(faults: Sequence[RankFault], *, timeout_s: float) -> str:
    """Each rank's traceback, output or stack dump under a heading, causes first."""
    parts = []
    for fault in sorted(faults, key=lambda f: (f.what not in CAUSES, f.rank)):
        heading = fault_text(fault, timeout_s=timeout_s)
        kind = "stack" if fault.what in (FaultKind.HUNG, FaultKind.BLOCKED) else "output"
        parts.append(f"--- {heading} ---\n{fault.detail.strip() or f'(no {kind} captured)'}")
    return "\n\n".join(parts)


# a judged cell's summary


def failures_summary(failures: Sequence[Failure], omitted: int) -> str:
    total = len(failures) + omitted
    ranks = sorted({f.rank for f in failures})
    by_kind: dict[str, set[str]] = defaultdict(set)
    for failure in failures:
        by_kind[failure.kind].add(failure.model)
    kinds = "; ".join(kind + (f" in {', '.join(sorted(m for m in models if m))}" if any(models) else "")
                      for kind, models in sorted(by_kind.items()))
    first = min(failures, key=lambda f: (f.step, f.rank))
    where = f"{first.model}.{first.param}" if first.checked in ("grad", "param") else first.model
    if first.checked == "raise":  # a declared raise (harness/rank/process/raises.py): what the library said
        where = first.message
    raised = all(f.checked == "raise" for f in failures)
    noun = ("raise" if raised else "mismatch") if total == 1 else ("raises" if raised else "mismatches")
    return (
        f"{total} {noun} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {kinds}; "
        f"first: {where} on rank {first.rank} at step {first.step}"
    )


def evidence_summary(cell: Cell) -> str:
    """What a cell compared: its checks, how many tested sync, and the largest difference."""
    world_size = cell.world_size
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    text = f"{cell.checks} checks on {ranks}, {cell.grad_checks} of them gradients"
    if cell.grad_checks and cell.vacuous_checks == cell.grad_checks:
        why = "world size 1 cannot tell synced from local" if world_size == 1 else "synced and local gradients were too alike"
        text += f", all vacuous for sync ({why})"
    elif cell.vacuous_checks:
        text += f", {cell.vacuous_checks} vacuous for sync"
    if cell.comm_checks:
        text += f"; collectives of {cell.comm_checks} backwards checked"
    return f"{text}; max |diff| {cell.max_abs_diff:.3g}" + unchecked_suffix(cell.unchecked)


def said_suffix(said: Mapping[str, str]) -> str:
    """What the harness chose or noticed in a cell that changes no verdict, by topic, or nothing."""
    return "".join(f"; {topic}: {text}" for topic, text in said.items())


def wrapper_suffix(wrapper: str) -> str:
    """The wrapper a script's own plugin asked for, which the cell ran under, or nothing."""
    return f"; under {wrapper}, as the script's Accelerator asks" if wrapper else ""


def forced_suffix(forced: Mapping[str, str]) -> str:
    """What the harness changed of the user's own settings to run a cell, or nothing."""
    return "; FORCED: " + ", ".join(f"{key} {change}" for key, change in forced.items()) if forced else ""


def unchecked_suffix(unchecked: Mapping[str, str]) -> str:
    """What a cell did not check and why (docs/upgrade-checks.md), or nothing."""
    return "".join(f"; NOT CHECKED: {CHECK_TITLES.get(check, check)}: {reason}" for check, reason in unchecked.items())


def canary_unchecked_summary(required: Sequence[object], unchecked: Mapping[str, str]) -> str:
    checks = "; ".join(f"{CHECK_TITLES.get(check, check)}: {reason}" for check, reason in unchecked.items())
    return (f"this canary must show {', '.join(map(str, required))}, and a check it needs cannot run "
            f"here: {checks}")


def all_vacuous_summary(cell: Cell) -> str:
    return (f"every gradient check was vacuous for sync: the ranks' data were too alike to tell "
            f"a synced gradient from a local one (a harness defect); {evidence_summary(cell)}")


NO_GRADIENT_CHECK = "the case compared no gradient with the oracle (a check that cannot fail)"


def disagreement_summary(results: Sequence[RankResult]) -> str:
    parts = []
    for r in results:
        what = {RankOutcome.OK: "ran it", RankOutcome.SKIPPED: "skipped it",
                RankOutcome.UNSUPPORTED: "found it unsupported"}.get(r.outcome, str(r.outcome))
        detail = f" ({last_line(r.detail)})" if r.detail else ""
        found = f" with {len(r.failures) + r.omitted_failures} failures" if r.failures else ""
        parts.append(f"rank {r.rank} {what}{detail}{found}")
    return "the ranks disagree on whether the cell applies: " + "; ".join(parts)


def start_error_summary(world_size: int, start_error: str) -> str:
    return f"the pool of {world_size} ranks did not start: {last_line(start_error)}"


def not_run_summary(reason: str) -> str:
    return f"not run: {reason}"


def controller_error_summary(controller_error: str) -> str:
    return f"the harness failed while waiting for the cell: {last_line(controller_error)}"


def nccl_skip_summary(world_size: int, gpu_count: int) -> str:
    return f"nccl needs one GPU per rank: world size {world_size}, {gpu_count} GPU(s) here"


def canary_unobservable_summary(detects: Sequence[object], world_size: int) -> str:
    fewest = max(d.fewest_ranks for d in detects)  # type: ignore[attr-defined]
    why = "sync needs two ranks" if all(d.ranks <= 1 for d in detects) else f"it needs {fewest} ranks"  # type: ignore[attr-defined]
    return (f"this canary shows only as {', '.join(map(str, detects))}, which world size "
            f"{world_size} cannot show ({why})")


def canary_detected_summary(required: Sequence[object], failures: Sequence[Failure], omitted: int) -> str:
    return f"diagnosed as declared ({', '.join(map(_described, required))}): " + failures_summary(failures, omitted)


def _described(diagnosis: object) -> str:
    described = getattr(diagnosis, "described", None)
    return described() if callable(described) else str(diagnosis)


def canary_missed_summary(missing: Sequence[object], failures: Sequence[Failure], omitted: int) -> str:
    seen = failures_summary(failures, omitted) if failures else "no failure at all"
    return (f"the known-wrong pattern was not diagnosed as declared: no {', '.join(map(_described, missing))}; "
            f"found {seen}")


# a bad cell, as pytest shows it


def cell_message(cell: Cell) -> str:
    """The text pytest shows for a cell that is not pass/detected/skip/unsupported."""
    head = f"{cell.case}[{cell.variant}] at world size {cell.world_size}"
    if cell.status == Status.ERROR:
        lines = [f"The cell could not be judged: {head}", "", cell.summary]
        if cell.detail:
            lines += ["", cell.detail]
    elif cell.status == Status.MISSED:
        lines = [f"The harness missed a known-wrong pattern: {head}", "", cell.summary]
    else:
        counts = Counter(f.kind for f in cell.failures)
        lines = [f"Gradients are not right on every rank: {head}", "",
                 "Diagnoses: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())), ""]
        for failure in cell.failures[:MESSAGE_FAILURES]:
            lines += [failure.message, ""]
        hidden = len(cell.failures) - MESSAGE_FAILURES
        if hidden > 0:
            lines += [f"... and {hidden} more (all in the cell's entry in matrix.json)", ""]
        lines.append(cell.summary)
    if cell.rerun:
        lines += ["", f"Rerun this cell: {cell.rerun}"]
    return "\n".join(lines)


def skip_reason(cell: Cell) -> str:
    """Why pytest shows a skip, unsupported (or any other status that is neither good nor bad) cell as skipped."""
    return f"{cell.status}: {cell.summary}"
