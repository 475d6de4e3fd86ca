"""A gradient-sync correctness harness for PyTorch and accelerate.

The public case API is what ``__all__`` names (docs/writing-a-case.md): ``case`` and ``grid`` declare
a case; ``RankContext`` is what its body receives on every rank; ``Oracle`` is what
``ctx.oracle(...)`` returns; ``MicroStep`` is one micro-batch of ``ctx.schedule(...)``.
``RankContext`` and ``Oracle`` are imported on first use (they need torch), so that importing the
decorator (and the pytest plugin, in the controller) does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.decorator import (
    ALL_PRECISIONS,
    PRECISIONS,
    Diagnosis,
    SkipCell,
    Unsupported,
    Variant,
    case,
    compiled,
    grid,
)
from harness.rank.oracle.schedule import MicroStep

if TYPE_CHECKING:
    from harness.rank.context import RankContext
    from harness.rank.oracle.core import Oracle

__version__ = "0.1.0"

__all__ = ["ALL_PRECISIONS", "PRECISIONS", "Diagnosis", "MicroStep", "Oracle", "RankContext", "SkipCell",
           "Unsupported", "Variant", "case", "compiled", "grid", "__version__"]

_LAZY = {"RankContext": "harness.rank.context", "Oracle": "harness.rank.oracle.core"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
