"""A gradient-sync correctness harness for PyTorch and accelerate."""

from harness.decorator import PRECISIONS, Diagnosis, SkipCell, Unsupported, Variant, case, grid

__version__ = "0.1.0"

__all__ = ["PRECISIONS", "Diagnosis", "SkipCell", "Unsupported", "Variant", "case", "grid", "__version__"]
