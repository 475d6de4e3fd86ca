"""Faults of the paths the live upstream bugs' cases check (cases/test_short_window.py and the cases
that name an upstream issue), planted as harness/selfcheck/faults.py plants the others: each the bug
its case exists for, put into a release that does not have it, so that a case that passes here is
shown to catch it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.selfcheck.planted import Fault, _on_instance, _patched, register


@contextlib.contextmanager
def _short_window_rescaled(rank: int) -> Iterator[None]:
    # Accelerator.backward makes up for the short last window of an epoch itself: the window's last
    # loss (the one the dataloader flags as its end) is divided by the window's micro-batches instead
    # of the steps. A loop that rescales that window's losses already (short_last_window_rescaled)
    # now weighs its last micro-batch steps/k times too much.
    from accelerate import Accelerator

    original = Accelerator.backward

    def backward(self: Any, loss: Any, **kwargs: Any) -> Any:
        state = self.gradient_state
        steps = self.gradient_accumulation_steps
        loader = state.active_dataloader
        short = len(loader) % steps if loader is not None and state.sync_with_dataloader else 0
        if short and state.end_of_dataloader:
            loss = loss * (steps / short)
        return original(self, loss, **kwargs)

    with _patched(Accelerator, "backward", backward):
        yield


@contextlib.contextmanager
def _clip_returns_local_norm(rank: int) -> Iterator[None]:
    # clip_grad_norm_ clips by the right total norm but returns the norm of this rank's own shards
    # (pytorch #170862): the value a user logs is wrong while the update is right.
    import torch
    from accelerate import Accelerator

    original = Accelerator.clip_grad_norm_

    def clip_grad_norm_(self: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = list(parameters)
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in parameters if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in local]))
        original(self, parameters, *args, **kwargs)
        return norm

    with _patched(Accelerator, "clip_grad_norm_", clip_grad_norm_):
        yield



def _ddp_hooked(condition: Any, make_hook: Any) -> Any:
    """A patch of ``Accelerator.prepare_model`` that gives every DDP model it returns for which
    ``condition(ddp)`` holds the comm hook ``make_hook(ddp)`` makes (instead of DDP's average)."""

    @contextlib.contextmanager
    def patch(rank: int) -> Iterator[None]:
        import torch
        from accelerate import Accelerator

        original = Accelerator.prepare_model

        def prepare_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            prepared = original(self, model, *args, **kwargs)
            if isinstance(prepared, torch.nn.parallel.DistributedDataParallel) and condition(prepared):
                with contextlib.suppress(RuntimeError):  # a hook is registered already (a DDP kwargs handler)
                    prepared.register_comm_hook(None, make_hook(prepared))
            return prepared

        with _patched(Accelerator, "prepare_model", prepare_model):
            yield

    return patch


def _averaged(bucket: Any) -> Any:
    """DDP's own reduction of a bucket: the all-rank average, as a future of the bucket's buffer (a
    hook's future must hold a Python object: all_reduce's holds a list of tensors)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda future: future.value()[0])


def _syncs_first_iteration_only(ddp: Any) -> Any:
    # static graph's first iteration all-reduces (its delayed reduction); from the second forward on
    # each bucket comes back as this rank's own, with no collective: gradients silently stop being
    # averaged, as reported of static_graph with no_sync (huggingface/accelerate#3679)
    import torch

    forwards = [0]

    def count(module: Any, args: Any) -> None:
        forwards[0] += 1

    ddp.register_forward_pre_hook(count)

    def hook(state, bucket):  # unannotated: DDP rejects a bucket annotation that is not GradBucket
        if forwards[0] <= 1:
            return _averaged(bucket)
        future: Any = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def _unused_at_sync_kept_local(ddp: Any) -> Any:
    # with find_unused_parameters, a parameter that this backward did not use keeps this rank's own
    # gradient after the sync, though an earlier micro-batch of the window used it: the reducer knows
    # only the synced backward's use (pytorch #69031, before PR #124193 in torch 2.4)
    import torch

    before: dict[int, Any] = {}

    def remember(module: Any, args: Any) -> None:
        before.clear()
        before.update({id(p): None if p.grad is None else p.grad.detach().clone() for p in module.parameters()})

    ddp.register_forward_pre_hook(remember)

    def hook(state, bucket):  # unannotated: DDP rejects a bucket annotation that is not GradBucket
        buffer = bucket.buffer()
        kept = []
        offset = 0
        for p in bucket.parameters():
            size = p.numel()
            earlier = before.get(id(p))
            now = p.grad
            if now is None or (earlier is not None and torch.equal(now, earlier)):  # not used since the forward
                kept.append((offset, size, buffer[offset:offset + size].clone()))
            offset += size

        def restore(future: Any) -> Any:
            reduced = future.value()
            for start, size, local in kept:
                reduced[start:start + size] = local
            return reduced

        return _averaged(bucket).then(restore)

    return hook


# The Trainer subclass cases (cases/test_trainer.py): each fault is the bug of a transformers release
# put back into the installed one, where the case passes.

def _with_transformers(patch: Any) -> Any:
    """A fault's patch of a rank made of ``patch(transformers)``; where transformers is not installed it
    changes nothing (the cells it runs on have no Trainer to catch it with, and say NOT CAUGHT)."""

    @contextlib.contextmanager
    def patched(rank: int) -> Iterator[None]:
        try:
            import transformers
        except ImportError:
            yield
            return
        with patch(transformers):
            yield

    return patched


@contextlib.contextmanager
def _trainer_loss_flag_ignored(transformers: Any) -> Iterator[None]:
    # transformers #35856: Trainer takes the loss compute_loss returns to be scaled for the window
    # already, whatever the subclass set (loss_is_scaled_for_ga = False, or model_accepts_loss_kwargs =
    # False): a micro-batch's mean reaches backward undivided by the window's micro-batches. Put in
    # through the flag 5.x decides by (loss_is_scaled_for_ga, on the instance for each training_step);
    # a release without it is left as it is, and the self-check reports the fault not caught there.
    Trainer = transformers.Trainer
    original = Trainer.training_step

    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(Trainer, "loss_is_scaled_for_ga"):
            return original(self, *args, **kwargs)
        with _on_instance(self, "loss_is_scaled_for_ga", True):
            return original(self, *args, **kwargs)

    with _patched(Trainer, "training_step", training_step):
        yield


@contextlib.contextmanager
def _trainer_short_window_full_steps(transformers: Any) -> Iterator[None]:
    # transformers #38837 (fixed by PR #39659 in 4.55): the short last window of an epoch divided by the
    # configured steps: Trainer's current_gradient_accumulation_steps, which its loop sets to the
    # window's micro-batches, reads the configured steps whatever the loop set
    Trainer = transformers.Trainer

    def configured(self: Any) -> int:
        return self.args.gradient_accumulation_steps

    def ignored(self: Any, value: int) -> None:
        pass

    with _on_instance(Trainer, "current_gradient_accumulation_steps", property(configured, ignored)):
        yield


@contextlib.contextmanager
def _trainer_tokens_per_device(transformers: Any) -> Iterator[None]:
    # transformers #39392 (PR #39395 turned the default on in 4.54): TrainingArguments'
    # average_tokens_across_devices off, each rank's loss divided by its own window's tokens
    TrainingArguments = transformers.TrainingArguments
    original = TrainingArguments.__post_init__

    def post_init(self: Any) -> None:
        original(self)
        self.average_tokens_across_devices = False

    with _patched(TrainingArguments, "__post_init__", post_init):
        yield


register(Fault("short_window_rescaled", "Accelerator.backward divides the last loss of an epoch's short window "
               "by that window's micro-batches, not the steps", _short_window_rescaled,
               diagnoses=("wrong_scale", "misweighted")))
register(Fault("clip_returns_local_norm", "Accelerator.clip_grad_norm_ clips by the total norm but returns the norm "
               "of this rank's shards (pytorch #170862)", _clip_returns_local_norm, wrappers=("fsdp2",),
               diagnoses=("wrong_scale:grad_norm",)))
register(Fault("static_graph_syncs_once", "a static-graph DDP model all-reduces its first iteration only, then keeps "
               "each rank's own gradients (as reported of static_graph with no_sync, accelerate #3679)",
               _ddp_hooked(lambda ddp: ddp.static_graph, _syncs_first_iteration_only),
               diagnoses=("not_synced", "comm_missing")))
register(Fault("unused_at_sync_kept_local", "with find_unused_parameters, a parameter unused by the synced backward "
               "keeps this rank's own gradient from the window's earlier micro-batches (pytorch #69031)",
               _ddp_hooked(lambda ddp: ddp.find_unused_parameters, _unused_at_sync_kept_local),
               diagnoses=("not_synced",)))
register(Fault("trainer_loss_flag_ignored", "Trainer takes a compute_loss override's mean loss as scaled for the "
               "window already, whatever the subclass set (transformers #35856)",
               _with_transformers(_trainer_loss_flag_ignored), diagnoses=("wrong_scale", "misweighted")))
register(Fault("trainer_short_window_full_steps", "Trainer divides the short last window of an epoch by the "
               "configured steps (transformers #38837)", _with_transformers(_trainer_short_window_full_steps),
               diagnoses=("wrong_scale", "misweighted")))
register(Fault("trainer_tokens_per_device", "Trainer divides each rank's loss by its own window's tokens "
               "(average_tokens_across_devices off, the default before transformers 4.54)",
               _with_transformers(_trainer_tokens_per_device), diagnoses=("misweighted",)))
