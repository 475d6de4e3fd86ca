"""A fault of the token-weighted path, planted as harness/selfcheck/faults.py plants the others: the window's
token count that a loop gathers from every rank (``accelerator.gather(count).sum()``, as accelerate's
usage guide and transformers' Trainer do) comes back as this rank's alone, so each rank divides by
its own count: the token losses of a rank with fewer tokens weigh more (``misweighted``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.selfcheck.planted import Fault, _patched, register


@contextlib.contextmanager
def _gather_drops_ranks(rank: int) -> Iterator[None]:
    # Accelerator.gather returns this rank's tensors only, shaped as if one rank had been gathered
    import torch
    from accelerate import Accelerator

    def gather(self: Any, tensor: Any) -> Any:
        return torch.utils._pytree.tree_map(lambda t: t.reshape(1) if t.dim() == 0 else t, tensor)

    with _patched(Accelerator, "gather", gather):
        yield


register(Fault("gather_drops_ranks", "Accelerator.gather returns this rank's tensor alone (a gathered token "
               "count is the rank's own)", _gather_drops_ranks,
               diagnoses=("misweighted",)))
