"""docs/unreported.md: each reproduction, run as a maintainer would paste it (a fresh interpreter, the
installed releases), prints what the page says it prints; while the defect is there. A release that
fixes one fails its test: the page (and the harness's declaration of it) are then out of date."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import fenced_blocks

PAGE = Path(__file__).resolve().parent.parent / "docs" / "unreported.md"


def sections() -> dict[str, list[str]]:
    """The page's code blocks by the title of their section (``## ...``)."""
    text = PAGE.read_text(encoding="utf-8")
    return {part.split("\n", 1)[0].strip(): fenced_blocks(part) for part in text.split("\n## ")[1:]}


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_context_parallel_reproduction_prints_what_the_page_says():
    pytest.importorskip("transformers")
    code, printed = sections()["accelerate's context-parallel hooks make eager attention attend to the future"]
    result = run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == printed.splitlines()
    # the defect itself, not only the page's copy of it: eager attention under the hooks, and only it
    assert printed.splitlines()[-1].endswith("True") and all(line.endswith("False")
                                                             for line in printed.splitlines()[:-1])


def test_the_tensor_parallel_reproduction_prints_what_the_page_says_and_accelerate_still_imports_it():
    transformers = pytest.importorskip("transformers")
    from accelerate import Accelerator

    code, printed = sections()["accelerate's tensor-parallel prepare under FSDP2 imports what transformers 5 no longer has"]
    # the import the page names is on accelerate's own path
    assert code in inspect.getsource(Accelerator._prepare_tp)
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__} still has ReplicateParallel (the page's is 5.0 and later)")
    result = run(code)
    assert result.returncode == 1 and result.stderr.splitlines()[-1].startswith(printed), result.stderr[-3000:]
