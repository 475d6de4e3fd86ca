"""Sync faults injected into accelerate or DDP at run time, inside the ranks: each a plausible regression.

A fault patches the installed library, never a case: ``patch(rank)`` is a context manager that
swaps one or more attributes of accelerate's (or torch's) classes for a broken version and puts
the originals back on exit. ``python -m harness selfcheck`` runs the catalogue under each one and
counts the faults that some case catches; a fault that no case catches is a blind spot.

Faults change what gradients are computed, never whether the code runs: a fault that makes a case
raise would only show as an ``error`` cell, which says nothing of the harness's power to detect.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.selfcheck.perturbations import PERTURBATION_FORMS, _perturb_rank, parse_perturbation
from harness.selfcheck.planted import _ABSENT, FAULTS, Fault, _patched, register

__all__ = ["FAULTS", "PERTURBATION_FORMS", "apply_fault", "resolve"]


@contextlib.contextmanager
def _forced_sync_gradients(gradient_state: Any) -> Iterator[None]:
    """Make ``gradient_state.sync_gradients`` read True for a moment: code that checks it behaves
    as if it ignored the check."""
    saved = gradient_state.sync_gradients
    gradient_state.sync_gradients = True
    try:
        yield
    finally:
        gradient_state.sync_gradients = saved


@contextlib.contextmanager
def _plugin_option(gradient_state: Any, key: str, value: Any) -> Iterator[None]:
    kwargs = gradient_state.plugin_kwargs
    saved = kwargs.get(key, _ABSENT)
    kwargs[key] = value
    try:
        yield
    finally:
        if saved is _ABSENT:
            kwargs.pop(key, None)
        else:
            kwargs[key] = saved


# ---------------------------------------------------------------------------------------------
# The faults. Each builder returns patch(rank); ``rank`` matters only to faults of one rank.


@contextlib.contextmanager
def _autocast_dropped(rank: int) -> Iterator[None]:
    # The prepared model's forward, and ``accelerator.autocast()``, run without the mixed-precision
    # context: a bf16 run computes in fp32 and nothing raises (every value is a little different
    # from the bf16 one, no scale of it). accelerate wraps the forward in prepare_model with the
    # context this function makes; Trainer relies on the same for its autocast.
    # (a decorator as well as a context, as autocast is: prepare_model decorates the forward with it)
    import accelerate.accelerator

    class NoAutocast(contextlib.ContextDecorator):
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            return None

    with _patched(accelerate.accelerator, "get_mixed_precision_context_manager", lambda *args, **kwargs: NoAutocast()):
        yield


@contextlib.contextmanager
def _no_sync_still_syncs(rank: int) -> Iterator[None]:
    # Accelerator.no_sync forgets to enter DDP's no_sync: every backward all-reduces. The sum of
    # averages equals the average of sums, so the window's last gradient is right; only the
    # gradients in between show it.
    from accelerate import Accelerator

    @contextlib.contextmanager
    def no_sync(self, model):
        yield

    with _patched(Accelerator, "no_sync", no_sync):
        yield


@contextlib.contextmanager
def _trigger_noop(rank: int) -> Iterator[None]:
    # trigger_sync_in_backward does nothing: the backward under no_sync stays local.
    from accelerate import Accelerator

    @contextlib.contextmanager
    def trigger_sync_in_backward(model):
        yield

    with _patched(Accelerator, "trigger_sync_in_backward", staticmethod(trigger_sync_in_backward)):
        yield


@contextlib.contextmanager
def _loss_not_scaled(rank: int) -> Iterator[None]:
    # backward forgets to divide the loss by gradient_accumulation_steps: the original divides,
    # so hand it the loss multiplied back.
    from accelerate import Accelerator

    original = Accelerator.backward

    def backward(self, loss, **kwargs):
        return original(self, loss * self.gradient_accumulation_steps, **kwargs)

    with _patched(Accelerator, "backward", backward):
        yield


@contextlib.contextmanager
def _optimizer_every_batch(rank: int) -> Iterator[None]:
    # The prepared optimizer steps on every call, ignoring gradient_state.sync_gradients.
    from accelerate.optimizer import AcceleratedOptimizer

    original = AcceleratedOptimizer.step

    def step(self, closure=None):
        with _forced_sync_gradients(self.gradient_state):
            return original(self, closure)

    with _patched(AcceleratedOptimizer, "step", step):
        yield


@contextlib.contextmanager
def _zero_grad_skipped(rank: int) -> Iterator[None]:
    # The prepared optimizer's zero_grad does nothing: the next window starts from stale gradients.
    from accelerate.optimizer import AcceleratedOptimizer

    def zero_grad(self, set_to_none=None):
        return None

    with _patched(AcceleratedOptimizer, "zero_grad", zero_grad):
        yield


@contextlib.contextmanager
def _zero_grad_every_batch(rank: int) -> Iterator[None]:
    # The prepared optimizer's zero_grad clears on every call, ignoring gradient_state.sync_gradients:
    # an accumulation window keeps only its last micro-batch.
    from accelerate.optimizer import AcceleratedOptimizer

    original = AcceleratedOptimizer.zero_grad

    def zero_grad(self, set_to_none=None):
        with _forced_sync_gradients(self.gradient_state):
            return original(self, set_to_none)

    with _patched(AcceleratedOptimizer, "zero_grad", zero_grad):
        yield


@contextlib.contextmanager
def _scheduler_every_batch(rank: int) -> Iterator[None]:
    # The prepared scheduler steps on every call, ignoring gradient_state.sync_gradients.
    from accelerate.scheduler import AcceleratedScheduler

    original = AcceleratedScheduler.step

    def step(self, *args, **kwargs):
        with _forced_sync_gradients(self.gradient_state):
            return original(self, *args, **kwargs)

    with _patched(AcceleratedScheduler, "step", step):
        yield


def _sum_hook(state, bucket):  # unannotated: DDP rejects a hook whose bucket annotation is not GradBucket
    """A DDP comm hook that all-reduces each bucket without dividing by the world size. DDP's
    Python reducer (``optimize_ddp="python_reducer"``) calls it a parameter at a time with
    ``(grad, param)`` inside the backward compiled autograd traces, and keeps no result: the sum is
    written into the gradient with a functional collective (one that graph can hold)."""
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    if isinstance(bucket, tuple):
        from torch.distributed import _functional_collectives as functional

        grad, _ = bucket
        grad.copy_(functional.all_reduce(grad, "sum", group))
        return None
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


@contextlib.contextmanager
def _grads_summed(rank: int) -> Iterator[None]:
    # DDP sums the gradients instead of averaging them: every model that prepare() wraps in DDP
    # gets a comm hook that all-reduces without the division (under a dynamo_backend the DDP model
    # is the compiled module's _orig_mod).
    import torch
    from accelerate import Accelerator

    original = Accelerator.prepare_model

    def prepare_model(self, model, *args, **kwargs):
        prepared = original(self, model, *args, **kwargs)
        ddp = getattr(prepared, "_orig_mod", prepared)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            with contextlib.suppress(RuntimeError):  # a hook is registered already (a DDP kwargs handler)
                ddp.register_comm_hook(None, _sum_hook)
        return prepared

    with _patched(Accelerator, "prepare_model", prepare_model):
        yield


@contextlib.contextmanager
def _no_dataloader_end_sync(rank: int) -> Iterator[None]:
    # GradientState never sees the end of the dataloader: no sync (and no counter reset) at the
    # last batch of an epoch.
    from accelerate.state import GradientState

    with _patched(GradientState, "end_of_dataloader", property(lambda self: False)):
        yield


@contextlib.contextmanager
def _counter_off_by_one(rank: int) -> Iterator[None]:
    # _do_sync tests the counter before counting this micro-batch: every window syncs (and steps)
    # one micro-batch early.
    from accelerate import Accelerator

    def _do_sync(self):
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(((self.step + 1) % state.num_steps) == 0)

    with _patched(Accelerator, "_do_sync", _do_sync):
        yield


@contextlib.contextmanager
def _accumulate_ignores_models(rank: int) -> Iterator[None]:
    # accumulate(*models) enters no_sync for the first model only; the others sync every batch.
    from accelerate import Accelerator

    original = Accelerator.accumulate

    @contextlib.contextmanager
    def accumulate(self, *models):
        with original(self, *models[:1]):
            yield

    with _patched(Accelerator, "accumulate", accumulate):
        yield


@contextlib.contextmanager
def _sync_each_batch_ignored(rank: int) -> Iterator[None]:
    # accumulate reads sync_each_batch as False: it enters no_sync between sync points anyway.
    from accelerate import Accelerator

    original = Accelerator.accumulate

    @contextlib.contextmanager
    def accumulate(self, *models):
        with contextlib.ExitStack() as stack:
            with _plugin_option(self.gradient_state, "sync_each_batch", False):
                stack.enter_context(original(self, *models))
            yield

    with _patched(Accelerator, "accumulate", accumulate):
        yield


@contextlib.contextmanager
def _sync_with_dataloader_ignored(rank: int) -> Iterator[None]:
    # GradientState reads sync_with_dataloader as True whatever the plugin says: windows are cut
    # at the end of every epoch even with sync_with_dataloader=False.
    from accelerate.state import GradientState

    with _patched(GradientState, "sync_with_dataloader", property(lambda self: True)):
        yield


@contextlib.contextmanager
def _eval_dataloader_not_removed(rank: int) -> Iterator[None]:
    # A finished dataloader is never removed from GradientState: after an evaluation loop inside
    # a training epoch, the finished eval loader stays the active one, at its end, so every later
    # training batch syncs.
    from accelerate.state import GradientState

    def _remove_dataloader(self, dataloader):
        return None

    with _patched(GradientState, "_remove_dataloader", _remove_dataloader):
        yield


@contextlib.contextmanager
def _dispatcher_end_missed(rank: int) -> Iterator[None]:
    # With dispatch_batches=True, the dispatching dataloader never flags its last batch.
    from accelerate.data_loader import DataLoaderDispatcher

    flag = property(lambda self: False, lambda self, value: None)
    with _patched(DataLoaderDispatcher, "end_of_dataloader", flag):
        yield


@contextlib.contextmanager
def _clip_grad_norm_noop(rank: int) -> Iterator[None]:
    # clip_grad_norm_ computes and returns the total norm but does not clip.
    import torch
    from accelerate import Accelerator

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        grads = [p.grad.detach() for p in parameters if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)

    with _patched(Accelerator, "clip_grad_norm_", clip_grad_norm_):
        yield


register(Fault("perturb_rank1", "rank 1's gradients scaled by 1.01 after every backward", _perturb_rank(1, 0.01),
               diagnoses=("wrong_scale", "misweighted"), every_cell=True))
register(Fault("no_sync_still_syncs", "Accelerator.no_sync yields without entering DDP's no_sync",
               _no_sync_still_syncs,
               diagnoses=("synced_early", "comm_unexpected")))
register(Fault("trigger_noop", "trigger_sync_in_backward does nothing", _trigger_noop,
               diagnoses=("not_synced", "comm_missing")))
register(Fault("loss_not_scaled", "backward does not divide the loss by the accumulation steps", _loss_not_scaled,
               diagnoses=("wrong_scale", "misweighted")))
register(Fault("optimizer_every_batch", "the prepared optimizer steps even when sync_gradients is False",
               _optimizer_every_batch,
               diagnoses=("stepped_early",)))
register(Fault("grads_summed", "DDP all-reduce sums the gradients instead of averaging them", _grads_summed,
               diagnoses=("wrong_scale", "misweighted")))
register(Fault("zero_grad_skipped", "the prepared optimizer's zero_grad does nothing (stale gradients)",
               _zero_grad_skipped,
               diagnoses=("stale",)))
register(Fault("zero_grad_every_batch", "the prepared optimizer's zero_grad clears even when sync_gradients is False",
               _zero_grad_every_batch,
               diagnoses=("misweighted",)))
register(Fault("no_dataloader_end_sync", "GradientState.end_of_dataloader is always False",
               _no_dataloader_end_sync,
               diagnoses=("sync_flag", "not_synced", "step_skipped", "comm_missing")))
register(Fault("counter_off_by_one", "accumulate's step counter syncs one micro-batch early", _counter_off_by_one,
               diagnoses=("sync_flag", "synced_early", "stepped_early", "comm_unexpected")))
register(Fault("accumulate_ignores_models", "accumulate(*models) enters no_sync for the first model only",
               _accumulate_ignores_models,
               diagnoses=("synced_early", "comm_unexpected")))
register(Fault("scheduler_every_batch", "the prepared scheduler steps even when sync_gradients is False",
               _scheduler_every_batch,
               diagnoses=("mismatch:lr",)))
register(Fault("rank_grad_perturbed", "rank 1's gradients scaled by 1+1e-3 after every backward",
               _perturb_rank(1, 1e-3),
               diagnoses=("wrong_scale", "misweighted"), every_cell=True))
register(Fault("sync_each_batch_ignored", "accumulate enters no_sync despite sync_each_batch=True",
               _sync_each_batch_ignored,
               diagnoses=("not_synced", "comm_missing")))
register(Fault("sync_with_dataloader_ignored", "GradientState.sync_with_dataloader is always True",
               _sync_with_dataloader_ignored,
               diagnoses=("sync_flag", "synced_early", "stepped_early", "comm_unexpected")))
register(Fault("eval_dataloader_not_removed", "a finished dataloader stays GradientState's active one",
               _eval_dataloader_not_removed,
               diagnoses=("sync_flag", "synced_early", "stepped_early", "comm_unexpected")))
register(Fault("dispatcher_end_missed", "with dispatch_batches, the last batch is never flagged as the end",
               _dispatcher_end_missed,
               diagnoses=("sync_flag", "not_synced", "step_skipped", "comm_missing")))
register(Fault("clip_grad_norm_noop", "Accelerator.clip_grad_norm_ returns the norm without clipping",
               _clip_grad_norm_noop,
               diagnoses=("wrong_scale", "misweighted")))

register(Fault("autocast_dropped", "accelerate's mixed-precision forward runs without autocast (bf16 asked, fp32 computed)",
               _autocast_dropped, needs="bf16",
               diagnoses=("mismatch",)))


def resolve(name: str) -> Fault:
    perturbed = parse_perturbation(name)
    if perturbed is not None:
        return perturbed
    try:
        return FAULTS[name]
    except KeyError:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}, {PERTURBATION_FORMS}") from None


@contextlib.contextmanager
def apply_fault(name: str | None, *, rank: int) -> Iterator[None]:
    """Run the enclosed code with the named fault patched in (nothing when ``name`` is None)."""
    if name is None:
        yield
        return
    with resolve(name).patch(rank):
        yield


# The faults of one wrapper's path, registered into FAULTS after these (the self-check's order).
from harness.selfcheck import faults_deepspeed, faults_fsdp, faults_tokens, faults_upstream  # noqa: E402,F401
