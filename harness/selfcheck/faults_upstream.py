"""Faults of the paths the live upstream bugs' cases check (cases/test_short_window.py and the cases
that name an upstream issue), planted as harness/selfcheck/faults.py plants the others: each the bug
its case exists for, put into a release that does not have it, so that a case that passes here is
shown to catch it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.selfcheck.planted import Fault, _patched, register


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


register(Fault("short_window_rescaled", "Accelerator.backward divides the last loss of an epoch's short window "
               "by that window's micro-batches, not the steps", _short_window_rescaled))
register(Fault("clip_returns_local_norm", "Accelerator.clip_grad_norm_ clips by the total norm but returns the norm "
               "of this rank's shards (pytorch #170862)", _clip_returns_local_norm, wrappers=("fsdp2",)))
