"""compile_ddp's cpp_reducer form on a real pool: compiled autograd around the backward of DDP's C++
Reducer. torch refuses it from 2.8.0 (PR #152735) and the cell is unsupported, naming the refusal;
on an earlier torch the Reducer issued no collective under compiled autograd, and the cell is the
declared defect, detected as not_synced (docs/catalogue.md; measured on 2.4.1 to 2.7.1)."""

from __future__ import annotations

from conftest import ROOT

from harness.catalogue import load_case_file
from harness.records import Status
from harness.selfcheck.run import Runner, Target
from harness.versions import below
from harness.wrappers.registry import WRAPPERS
from harness.wrappers.prepare import cell_variants


def test_compiled_autograd_with_the_cpp_reducer_is_refused_or_caught_never_passed():
    case = next(c for c in load_case_file(ROOT / "cases" / "test_compile_ddp.py") if c.name == "compile_ddp")
    variant = next(v for v in cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
                   if v.name == "form=cpp_reducer-compile=aot_eager")
    with Runner(world_size=2) as runner:
        cell = runner.run(Target(case, variant))
    if below("torch", "2.8"):
        assert cell.status == Status.DETECTED, cell.summary
        assert "not_synced" in {f.kind for f in cell.failures}
    else:
        assert cell.status == Status.UNSUPPORTED, cell.summary
        assert "installed torch lacks compiled autograd with DDP's C++ Reducer" in cell.summary
        assert "PR #152735" in cell.summary and "not compatible with C++ DDP Reducer" in cell.summary
