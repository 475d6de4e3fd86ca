"""The faults that perturb one rank's gradients by a relative amount (the self-check's sensitivity,
bench/sensitivity.py, and the two registered ``perturb_rank1``, ``rank_grad_perturbed``): a scale of
the rank's own gradient where its wrapper holds it, not a regression of accelerate's logic (those are
harness/selfcheck/faults.py's)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

from harness.selfcheck.planted import Fault, _patched
from harness.wrappers.registry import WRAPPERS

PERTURBATION_FORMS = "perturb:<relative> or perturb_once:<relative>[@<backward>]"


def _perturb_rank(target_rank: int, relative: float, *,
                  only: int | None = None) -> Callable[[int], ContextManager[None]]:
    """After every backward on ``target_rank`` (only the ``only``-th of the cell, counted from 1,
    when given), scale that rank's gradients by ``1 + relative``. Under DeepSpeed, which reduces
    (ZeRO-2/3) and at a boundary steps inside ``backward``, there is no gradient of the rank's own
    left after it: that backward's loss is scaled instead, so its gradient is, before any reduction."""

    @contextlib.contextmanager
    def patch(rank: int) -> Iterator[None]:
        from accelerate import Accelerator

        original = Accelerator.backward
        calls = 0

        def backward(self, loss, **kwargs):
            nonlocal calls
            hit = rank == target_rank and (only is None or calls + 1 == only)
            deepspeed = getattr(self, "deepspeed_engine_wrapped", None) is not None
            result = original(self, loss * (1.0 + relative) if hit and deepspeed else loss, **kwargs)
            calls += 1
            if hit and not deepspeed:
                for model in self._models:
                    for p in model.parameters():
                        if p.grad is not None:
                            _scale(p.grad, relative)
                    for held in _fsdp2_held_grads(model):
                        _scale(held, relative)
            return result

        with _patched(Accelerator, "backward", backward):
            yield

    return patch


def _scale(grad: Any, relative: float) -> None:
    """``grad`` scaled by ``1 + relative`` in place. A bf16 or fp16 gradient is scaled in fp32 and
    rounded back: multiplied by the Python number directly, the factor itself would be rounded to
    the gradient's dtype first, and 1 + 1e-3 is 1 in bf16 (nothing would change at all)."""
    if grad.is_floating_point() and grad.element_size() < 4:
        grad.copy_(grad.float() * (1.0 + relative))
    else:
        grad.mul_(1.0 + relative)


def _fsdp2_held_grads(model: Any) -> list[Any]:
    """The gradients FSDP2 holds inside itself between sync points (none in ``p.grad``): each
    parameter's unsharded gradient, or its fp32 accumulation where the reduce dtype is wider than the
    parameter dtype. Empty for a model that is not FSDP2's, or a torch whose FSDP2 keeps them elsewhere."""
    held = []
    for module in getattr(model, "modules", lambda: ())():
        try:
            group = module._get_fsdp_state()._fsdp_param_group
        except AttributeError:
            continue
        for fsdp_param in getattr(group, "fsdp_params", ()) if group is not None else ():
            accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if accumulated is not None:
                held.append(accumulated)
            elif hasattr(fsdp_param, "_unsharded_param") and fsdp_param._unsharded_param.grad is not None:
                held.append(fsdp_param._unsharded_param.grad)
    return held


def perturbation(relative: float, *, target_rank: int = 1, only: int | None = None) -> Fault:
    """A fault that scales one rank's gradients by ``1 + relative`` (sensitivity measurements): after
    every backward, or after the ``only``-th backward of the cell alone (a single event). It lands where
    each wrapper holds the gradient, so it runs on every wrapper's cells, each of which should catch it."""
    if only is None:
        return Fault(f"perturb:{relative:g}", f"rank {target_rank}'s gradients scaled by {1 + relative:g}",
                     _perturb_rank(target_rank, relative), wrappers=WRAPPERS, diagnoses=("wrong_scale", "misweighted"),
                     every_cell=True)
    return Fault(f"perturb_once:{relative:g}@{only}",
                 f"rank {target_rank}'s gradients scaled by {1 + relative:g} after its backward {only} only",
                 _perturb_rank(target_rank, relative, only=only), wrappers=WRAPPERS,
                 diagnoses=("wrong_scale", "misweighted"), every_cell=True)


def parse_perturbation(name: str) -> Fault | None:
    """The perturbation a ``perturb:`` or ``perturb_once:`` name asks for, or None for another name;
    a malformed one is refused in one line."""
    for prefix in ("perturb:", "perturb_once:"):
        if not name.startswith(prefix):
            continue
        text, _, at = name[len(prefix):].partition("@")
        try:
            relative = float(text)
            only = (int(at) if at else 1) if prefix == "perturb_once:" else None
        except ValueError:
            raise ValueError(f"fault {name!r}: give {PERTURBATION_FORMS}, e.g. perturb:1e-3 or "
                             "perturb_once:1e-5@2") from None
        if at and prefix == "perturb:":
            raise ValueError(f"fault {name!r}: perturb: has no @<backward>; use perturb_once:")
        if only is not None and only < 1:
            raise ValueError(f"fault {name!r}: the backward is counted from 1")
        return perturbation(relative, only=only)
    return None
