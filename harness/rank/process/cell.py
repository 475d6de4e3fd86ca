"""One cell on one rank: the case's body run with its context, what it leaves in the process put back after
it, and its ``RankResult``."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
from typing import Any, ContextManager

from harness.messages import CellSpec, RankResult
from harness.records import RankOutcome


def _declared_raise(info: Any, spec: CellSpec, ctx: Any, exc: Exception) -> Any:
    """The ``raised`` failure when the cell declares this exception (harness/rank/raises.py), else None."""
    from harness.decorator import Variant
    from harness.rank.process.raises import declared_raise

    declared = info.detects_for(Variant(spec.variant, dict(spec.variant_params)))
    return declared_raise(declared, exc, rank=ctx.rank, step=ctx.at_step)


def _forget_deepspeed_config() -> None:
    """transformers' process-wide DeepSpeed config (a weak reference that accelerate's DeepSpeed
    plugin and ``TrainingArguments(deepspeed=...)`` set, alive while anything holds the config) goes
    with the cell: under ZeRO-3 it makes every later ``from_config`` build its model inside
    ``deepspeed.zero.Init``, a sequence-classification head's base model included."""
    deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "unset_hf_deepspeed_config"):
        deepspeed.unset_hf_deepspeed_config()


def run_rank_cell(spec: CellSpec, rank: int, device: Any) -> RankResult:
    """Run the cell ``spec`` on this rank (``rank`` on ``device``): its outcome, its failures and its counts."""
    import torch

    from harness.catalogue import find_case, locate
    from harness.decorator import SkipCell, Unsupported
    from harness.rank.context import RankContext
    from harness.rank.numerics.rng import seed_rng
    from harness.wrappers.prepare import refusal
    from harness.wrappers.probe import reset_accelerate

    started = time.perf_counter()
    ctx = None
    environment = dict(os.environ)
    # DeepSpeed's ZeRO-3 engine replaces torch.nn.functional.linear for the whole process ("This will
    # persist unless manually reset"): put torch's own back after the cell, as the environment
    linear = torch.nn.functional.linear
    try:
        reset_accelerate()
        info = find_case(locate(spec.case_anchor, spec.case_relpath, spec.case_file), spec.case_attr)
        body = info.body
        ctx = RankContext(
            case=spec.case, variant=spec.variant, params=spec.variant_params, rank=rank,
            world_size=spec.world_size, seed=spec.seed, device=device,
        )
        seed_rng(ctx.seed + rank, device)
        graphs = _compiled_graphs()
        with _planted_fault(spec.fault, rank):
            body(ctx)
            ctx.finish()
        if ctx.compile is not None and _compiled_graphs() == graphs:
            raise AssertionError(f"the cell's variant compiles with {ctx.compile}, but torch.compile compiled no graph "
                                 "on this rank (dynamo compiles no frame of torch.nn's own modules, a bare "
                                 "nn.Sequential, say): the cell would check eager code under a compiled name")
        outcome, detail = RankOutcome.OK, ""
    except Unsupported as exc:
        outcome, detail = RankOutcome.UNSUPPORTED, str(exc)
    except SkipCell as exc:
        outcome, detail = RankOutcome.SKIPPED, str(exc)
    except Exception as exc:
        refused = refusal(ctx.wrapper, exc) if ctx is not None else None
        declared = _declared_raise(info, spec, ctx, exc) if ctx is not None and refused is None else None
        if refused is not None:
            outcome, detail = RankOutcome.UNSUPPORTED, str(refused)
        elif declared is not None:  # the library raised as the case declares: a failure, judged as declared
            ctx.recorder.add(declared)
            outcome, detail = RankOutcome.OK, ""
        else:
            outcome, detail = RankOutcome.RAISED, traceback.format_exc()
    finally:
        _restore_environment(environment)
        torch.nn.functional.linear = linear
        _forget_deepspeed_config()
        try:
            reset_accelerate()
            if ctx is not None and ctx.compile is not None:
                torch._dynamo.reset()  # the next cell compiles its own models afresh
        except Exception:
            pass
        freeze_imports()
    duration = time.perf_counter() - started
    if ctx is None:
        return RankResult(rank=rank, outcome=outcome, cell_id=spec.cell_id, detail=detail, duration_s=duration)
    return ctx.recorder.result(outcome=outcome, cell_id=spec.cell_id, detail=detail, duration_s=duration)


def _compiled_graphs() -> int:
    """The graphs torch.compile has handed to AOT autograd in this process so far (aot_eager and
    inductor both go through it)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["total"]


def _restore_environment(saved: dict[str, str]) -> None:
    """Put the process environment back as it was before the cell: what a cell's libraries set
    for the process (accelerate's ACCELERATE_USE_DEEPSPEED/_FSDP when given a plugin, LOCAL_RANK for
    a DeepSpeed cell of one process) must not reach the next cell of the pool."""
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _planted_fault(name: str | None, rank: int) -> ContextManager[None]:
    """The self-check's planted fault, patched in for the cell; fault injection is imported only
    for a cell that has one, never on the path of a real run."""
    if name is None:
        return contextlib.nullcontext()
    from harness.selfcheck.faults import apply_fault

    return apply_fault(name, rank=rank)

# The modules imported when the garbage collector last froze what was alive (``_freeze_imports``).
_frozen_at_modules = 0


def freeze_imports() -> None:
    """Keep the garbage collector off what torch, accelerate (and later DeepSpeed, transformers)
    leave alive for the life of the process: about 300,000 objects, which every full collection
    walks (0.2 to 0.5 s here; DeepSpeed's ZeRO-3 asks for one each time it builds an engine, and
    Python's own come every so often). ``gc.freeze`` moves them out of its reach; everything made
    later is collected as before. At start-up there is little garbage to freeze with them; after a
    cell that imported more, the cell's garbage is collected first, so that nothing of it is kept."""
    global _frozen_at_modules
    if _frozen_at_modules and len(sys.modules) < _frozen_at_modules + 50:
        return
    if _frozen_at_modules:
        gc.collect()
    gc.freeze()
    _frozen_at_modules = len(sys.modules)
