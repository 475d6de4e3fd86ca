"""Sync faults of accelerate's DeepSpeed path, registered with the others (harness/selfcheck/faults.py).

A fault here breaks only what accelerate does under DeepSpeed, so only a DeepSpeed cell can catch
it (``Fault.wrappers``): the self-check runs it on the DeepSpeed cells (which skip where deepspeed
is not installed), and tests/test_deepspeed.py runs it on a DeepSpeed cell.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.selfcheck.planted import Fault, _on_instance, _patched, register
from harness.wrappers.registry import of_family

ZERO = tuple(s.name for s in of_family("deepspeed"))  # every ZeRO stage's wrapper


@contextlib.contextmanager
def _boundary_ignored(rank: int) -> Iterator[None]:
    # accelerate's DeepSpeedEngineWrapper.backward tells the engine that every micro-batch is a
    # gradient-accumulation boundary (is_boundary=True whatever sync_gradients is); it still steps
    # the engine only where sync_gradients is True. ZeRO-2 then moves each micro-batch's reduced
    # gradient into its partition as if the window ended there (the window's sum is lost). Under
    # ZeRO-1 accumulate() also enters the engine's no_sync between sync points, which stops any
    # reduction whatever the boundary says, so ZeRO-1 cells do not see this fault; ZeRO-3 cells
    # neither (measured, deepspeed 0.19.8).
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    original = DeepSpeedEngineWrapper.backward

    def backward(self: Any, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
        engine = self.engine
        setter = engine.set_gradient_accumulation_boundary

        def always_a_boundary(is_boundary: bool) -> Any:
            return setter(True)

        with _on_instance(engine, "set_gradient_accumulation_boundary", always_a_boundary):
            return original(self, loss, sync_gradients=sync_gradients, **kwargs)

    with _patched(DeepSpeedEngineWrapper, "backward", backward):
        yield


@contextlib.contextmanager
def _engine_boundary_forced(rank: int) -> Iterator[None]:
    # DeepSpeedEngine.set_gradient_accumulation_boundary takes every call as is_boundary=True: a loop
    # that drives the engine itself, under DeepSpeed's gradient_accumulation_steps=1, and marks its
    # non-final micro-batches (allenai/open-instruct PR #1498's remedy) is back where it started:
    # ZeRO-1/2 keep only each window's last micro-batch. accelerate's own backward calls the setter
    # too, so accelerate's cells see it as they see deepspeed_boundary_ignored.
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.set_gradient_accumulation_boundary

    def set_gradient_accumulation_boundary(self: Any, is_boundary: bool) -> Any:
        return original(self, True)

    with _patched(DeepSpeedEngine, "set_gradient_accumulation_boundary", set_gradient_accumulation_boundary):
        yield


register(Fault("deepspeed_boundary_ignored",
               "accelerate's DeepSpeed backward marks every micro-batch a gradient-accumulation boundary",
               _boundary_ignored, wrappers=ZERO,
               diagnoses=("stepped_early", "synced_early", "comm_unexpected", "misweighted", "wrong_scale")))

register(Fault("deepspeed_engine_boundary_forced",
               "DeepSpeedEngine.set_gradient_accumulation_boundary takes every micro-batch as a boundary",
               _engine_boundary_forced, wrappers=ZERO,
               diagnoses=("misweighted", "stepped_early", "synced_early", "comm_unexpected", "wrong_scale")))


def _losses_zeroed(which: str) -> Any:
    """A patch of accelerate's DeepSpeed backward that hands the engine ``loss * 0`` at the
    micro-batches ``which`` names: "last" (the one that ends a window, sync_gradients True) or
    "earlier" (every other one). The gradient those micro-batches add is then zero, through the
    engine's own arithmetic, at every ZeRO stage: the effect of a wrapper that leaves them out."""

    @contextlib.contextmanager
    def patch(rank: int) -> Iterator[None]:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

        original = DeepSpeedEngineWrapper.backward

        def backward(self: Any, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
            if (which == "last") == bool(sync_gradients):
                loss = loss * 0
            return original(self, loss, sync_gradients=sync_gradients, **kwargs)

        with _patched(DeepSpeedEngineWrapper, "backward", backward):
            yield

    return patch


# DeepSpeed PR #7985 (0.18.5 to 0.18.9 with this configuration): under ZeRO-1 the BF16 optimizer
# all-reduced its fp32 accumulator before adding the window's last micro-batch to it, so that
# micro-batch stayed each rank's own. The installed release is fixed (0.19.0); the same order is
# planted on the ``grad_accum=fp32`` cells, which build that optimizer: at a boundary its epilogue
# (``update_hp_grads``) waits until the engine's all-reduce is done.
@contextlib.contextmanager
def _bf16_optimizer_reduces_early(rank: int) -> Iterator[None]:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

    epilogue, allreduce, engine_epilogue = (BF16_Optimizer.backward_epilogue, DeepSpeedEngine.allreduce_gradients,
                                            DeepSpeedEngine._backward_epilogue)
    waiting: dict[str, Any] = {}

    def backward_epilogue(self: Any) -> Any:
        if waiting.get("boundary"):
            waiting["optimizer"] = self  # after the all-reduce
            return None
        return epilogue(self)

    def allreduce_gradients(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = allreduce(self, *args, **kwargs)
        if "optimizer" in waiting:
            epilogue(waiting.pop("optimizer"))
        return result

    def _backward_epilogue(self: Any) -> Any:
        waiting["boundary"] = isinstance(self.optimizer, BF16_Optimizer) and self.is_gradient_accumulation_boundary()
        try:
            return engine_epilogue(self)
        finally:
            waiting.pop("boundary", None)
            if "optimizer" in waiting:  # no all-reduce came: added all the same
                epilogue(waiting.pop("optimizer"))

    with (_patched(BF16_Optimizer, "backward_epilogue", backward_epilogue),
          _patched(DeepSpeedEngine, "allreduce_gradients", allreduce_gradients),
          _patched(DeepSpeedEngine, "_backward_epilogue", _backward_epilogue)):
        yield


register(Fault("deepspeed_bf16_optimizer_reduces_early",
               "DeepSpeed's BF16 optimizer all-reduces its fp32 gradient sum before adding the window's last "
               "micro-batch to it (DeepSpeed PR #7985's order)",
               _bf16_optimizer_reduces_early, wrappers=("deepspeed-z1",), needs="grad_accum=fp32",
               diagnoses=("not_synced", "misweighted")))
# The same effect at every stage and on the default bf16 path, planted through the loss: the last
# micro-batch's gradient left out of every rank's window.
register(Fault("deepspeed_last_micro_batch_dropped",
               "the window's last micro-batch is left out of DeepSpeed's averaged gradient (the shape of "
               "DeepSpeed PR #7985)",
               _losses_zeroed("last"), wrappers=ZERO, needs="bf16",
               diagnoses=("misweighted", "wrong_scale")))
# DeepSpeed PR #6550 (before 0.15.2): ZeRO-2 with CPU offload copied each micro-batch's gradient
# into its buffer instead of adding it, so a window's gradient was its last micro-batch's alone.
register(Fault("deepspeed_copy_not_accumulate",
               "each micro-batch's gradient replaces the window's instead of adding to it, so only the last "
               "counts (the shape of DeepSpeed PR #6550)",
               _losses_zeroed("earlier"), wrappers=ZERO, needs="bf16",
               diagnoses=("misweighted", "wrong_scale")))


# transformers' Trainer before PR #35808 (4.49.0): under DeepSpeed it normalised the loss for the
# window (by num_items_in_batch, or the window's micro-batches) and the engine divided it by its
# gradient_accumulation_steps again, so each window's gradient was 1/steps of the right one and
# grad_norm depended on the steps. Trainer now passes scale_wrt_gas=False to accelerator.backward;
# this drops it on its way to the engine. Cells whose loop passes no scale_wrt_gas are quiet.
@contextlib.contextmanager
def _scale_wrt_gas_dropped(rank: int) -> Iterator[None]:
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    original = DeepSpeedEngineWrapper.backward

    def backward(self: Any, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
        kwargs.pop("scale_wrt_gas", None)
        return original(self, loss, sync_gradients=sync_gradients, **kwargs)

    with _patched(DeepSpeedEngineWrapper, "backward", backward):
        yield


register(Fault("deepspeed_scale_wrt_gas_dropped",
               "accelerate's DeepSpeed backward drops Trainer's scale_wrt_gas=False: the engine divides the loss "
               "by its accumulation steps again (transformers before PR #35808)",
               _scale_wrt_gas_dropped, wrappers=ZERO, diagnoses=("misweighted", "wrong_scale")))
