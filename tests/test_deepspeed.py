"""DeepSpeed ZeRO cells on real pools (CPU, gloo): each stage passes, the planted boundary fault is
caught, and a model prepared as another stage than the cell names is an error, never a pass."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.catalogue import load_case_file
from harness.records import Status
from harness.selfcheck.run import Runner, Target
from harness.wrappers.prepare import cell_variants

ROOT = Path(__file__).resolve().parent.parent
MISSING = [p for p in ("deepspeed", "transformers") if importlib.util.find_spec(p) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"DeepSpeed cells need {' and '.join(MISSING)} "
                                                      "(pip install 'gradsync-harness[deepspeed]')")


def target(case_file: str, variant: str, wrapper: str, name: str | None = None) -> Target:
    """The cell of ``variant`` under ``wrapper`` of the file's case ``name`` (default: its first)."""
    cases = load_case_file(ROOT / "cases" / case_file)
    case = next(c for c in cases if c.name == name) if name else cases[0]
    wanted = f"{variant}-wrapper={wrapper}"
    chosen = [v for v in cell_variants(case.info.variants, case.info.wrappers, (wrapper,)) if v.name == wanted]
    assert chosen, f"{case.name} has no variant {wanted}"
    return Target(case, chosen[0])


# A case that asks for ZeRO-1 and has accelerate build a ZeRO-2 engine (its plugin's config edited
# before prepare): a misconfiguration that must end the cell as an error, never a pass.
WRONG_STAGE_CASE = """
import torch

from harness import case
from harness.rank.models import regression_loss


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


@case("deepspeed_prepared_as_zero2", wrappers=["deepspeed-z1"])
def test_prepared_as_zero2(ctx):
    accelerator = ctx.accelerator()
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] = 2
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    batch = ctx.batch(1)
    accelerator.backward(regression_loss(model, batch))
    oracle.backward(lambda m: regression_loss(m["model"], batch), sync=True)
    oracle.check_grads(1, {"model": model})
"""


@pytest.fixture(scope="module")
def runner():
    with Runner(world_size=2) as live:
        yield live


@pytest.mark.parametrize("wrapper", ["deepspeed-z1", "deepspeed-z2", "deepspeed-z3"])
def test_each_zero_stage_passes_accumulate_at_world_size_2(runner, wrapper):
    cell = runner.run(target("test_accumulate.py", "steps=2-fp32", wrapper))
    assert cell.status == Status.PASS, cell.summary
    assert cell.max_abs_diff < 1e-6
    assert cell.grad_checks > 0 and cell.comm_checks > 0


def test_bf16_at_every_zero_stage_is_deepspeeds_arithmetic_exactly_and_a_1e_2_error_fails_it(run_pytest):
    """DeepSpeed's bf16 (bf16 module, fp32 masters made from it, gradients accumulated and reduced in
    bf16: divided by the world size, summed in gloo's ring order over ZeRO-1's bucket in parameter
    order, ZeRO-2's in backward order every micro-batch, ZeRO-3's chunks by rank) reproduced at three
    ranks, where the order shows: nothing differs; likewise ZeRO-1's BF16_Optimizer (``grad_accum=fp32``:
    an fp32 sum of the micro-batches, cast to bf16 and summed in bf16 over its padded flat buffer,
    then scaled by 1/world size). An error of 1e-2 in one rank's gradient once (two bf16 ulps; the
    gradient DeepSpeed reduces is bf16, where less rounds away) fails every cell."""
    stages = "deepspeed-z1,deepspeed-z2,deepspeed-z3"
    session = run_pytest("cases/test_fused_loss.py", "cases/test_accumulate_optim.py", "-k", "bf16 and (fused or adamw)",
                         "--wrappers", stages, "--world-sizes", "3", "-q", timeout=900)
    cells = session.cells()
    runs = (("fused_loss", ""), ("accumulate_adamw", "steps=2-"), ("accumulate_adamw", "steps=3-"))
    assert {(k[0], k[1]) for k in cells} == {
        (case, f"{steps}bf16-wrapper=deepspeed-z{stage}") for stage in (1, 2, 3) for case, steps in runs} | {
        (case, f"{steps}bf16-grad_accum=fp32-wrapper=deepspeed-z1") for case, steps in runs}
    for key, cell in cells.items():
        assert (cell["status"], cell["max_abs_diff"]) == ("pass", 0.0), (key, cell["summary"])
        assert "NOT CHECKED" not in cell["summary"], (key, cell["summary"])
    perturbed = run_pytest("cases/test_fused_loss.py", "-k", "bf16", "--wrappers", stages, "--world-sizes", "2",
                           "--harness-fault", "perturb_once:1e-2", "-q", timeout=600)
    assert {c["status"] for c in perturbed.cells().values()} == {"fail"}
    assert len(perturbed.cells()) == 4


def test_the_boundary_fault_is_caught_by_a_zero2_cell_that_passes_clean(runner):
    """accelerate telling the engine that every micro-batch is a boundary: ZeRO-2 moves each
    micro-batch's reduced gradient into its partition as if the window ended there."""
    chosen = target("test_accumulate.py", "steps=2-fp32", "deepspeed-z2")
    clean = runner.run(chosen)
    faulty = runner.run(chosen, fault="deepspeed_boundary_ignored")
    assert clean.status == Status.PASS, clean.summary
    assert faulty.status == Status.FAIL, faulty.summary
    assert {f.checked for f in faulty.failures} & {"grad", "param"}


@pytest.mark.parametrize("wrapper, unmarked", [("deepspeed-z1", Status.DETECTED), ("deepspeed-z2", Status.DETECTED),
                                                ("deepspeed-z3", Status.PASS)])
def test_a_loop_accumulating_by_hand_on_the_engine_needs_the_boundary_marked_under_zero_1_and_2(runner, wrapper,
                                                                                              unmarked):
    """open-instruct PR #1498: under DeepSpeed's gradient_accumulation_steps=1 the loop that marks its
    windows' last micro-batches passes at every stage; unmarked, ZeRO-1/2 keep each window's last
    micro-batch alone (declared, misweighted), ZeRO-3 accumulates. A fault that takes every mark as a
    boundary fails the marking loop where the unmarked one is wrong: the pass is not vacuous."""
    marked = target("test_deepspeed_by_hand.py", "steps=2-fp32", wrapper, name="deepspeed_by_hand")
    clean = runner.run(marked)
    assert clean.status == Status.PASS and clean.grad_checks > 0 and clean.vacuous_checks == 0, clean.summary
    cell = runner.run(target("test_deepspeed_by_hand.py", "steps=2-fp32", wrapper, name="deepspeed_by_hand_unmarked"))
    assert cell.status == unmarked, cell.summary
    faulty = runner.run(marked, fault="deepspeed_engine_boundary_forced")
    if unmarked == Status.DETECTED:
        assert "allenai/open-instruct#1498" in cell.summary
        assert faulty.status == Status.FAIL and "misweighted" in {f.kind for f in faulty.failures}, faulty.summary
    else:
        assert faulty.status == Status.PASS, faulty.summary


@pytest.mark.parametrize("fault", ["deepspeed_last_micro_batch_dropped", "deepspeed_copy_not_accumulate"])
@pytest.mark.parametrize("wrapper", ["deepspeed-z1", "deepspeed-z2"])
def test_the_shapes_of_deepspeeds_bf16_accumulation_bugs_are_caught_by_bf16_cells_that_pass_clean(runner, wrapper, fault):
    """DeepSpeed PR #7985's shape (the window's last micro-batch out of the average) and PR #6550's (a
    micro-batch's gradient replacing the window's instead of adding to it), planted on a bf16 cell of
    two micro-batches a window: the cell passes clean and fails under each."""
    chosen = target("test_accumulate.py", "steps=2-bf16", wrapper)
    clean = runner.run(chosen)
    faulty = runner.run(chosen, fault=fault)
    assert clean.status == Status.PASS, clean.summary
    assert faulty.status == Status.FAIL, faulty.summary
    assert {f.checked for f in faulty.failures} & {"grad", "param"}


@pytest.mark.parametrize("fault", ["deepspeed_bf16_optimizer_reduces_early", "deepspeed_last_micro_batch_dropped"])
def test_pr_7985_is_caught_by_the_bf16_optimizer_cells_that_pass_clean(runner, fault):
    """DeepSpeed PR #7985's order itself (BF16_Optimizer all-reduces its fp32 sum, then adds the
    boundary micro-batch to it on each rank alone), planted in the optimizer that had it, and its
    effect through the loss, on a ``grad_accum=fp32`` cell: it passes clean and fails under each."""
    chosen = target("test_accumulate.py", "steps=2-bf16-grad_accum=fp32", "deepspeed-z1")
    clean = runner.run(chosen)
    faulty = runner.run(chosen, fault=fault)
    assert (clean.status, clean.max_abs_diff) == (Status.PASS, 0.0), clean.summary
    assert faulty.status == Status.FAIL, faulty.summary
    assert {f.checked for f in faulty.failures} & {"grad", "param"}


def test_a_model_prepared_as_another_stage_is_an_error_not_a_pass(runner, tmp_path):
    path = tmp_path / "test_wrong_stage.py"
    path.write_text(WRONG_STAGE_CASE)
    case = load_case_file(path)[0]
    variant = cell_variants(case.info.variants, case.info.wrappers, ("deepspeed-z1",))[0]
    cell = runner.run(Target(case, variant))
    assert cell.status == Status.ERROR, cell.summary
    assert "prepared as deepspeed-z2" in cell.summary and "wrapper=deepspeed-z1" in cell.summary


# What a cell sees as torch.nn.functional.linear, said in its skip reason.
LINEAR_CASE = """
import torch

from harness import case


@case("linear_seen", wrappers=["ddp"])
def test_linear_seen(ctx):
    linear = torch.nn.functional.linear
    ctx.skip(f"linear is {getattr(linear, '__module__', None)}.{linear.__name__}")
"""


def test_a_zero3_cell_leaves_torch_linear_as_it_found_it(runner, tmp_path):
    # ZeRO-3's engine replaces torch.nn.functional.linear process-wide; the next cell on the pool
    # must run torch's own
    assert runner.run(target("test_accumulate.py", "steps=2-fp32", "deepspeed-z3")).status == Status.PASS
    path = tmp_path / "test_linear_seen.py"
    path.write_text(LINEAR_CASE)
    case = load_case_file(path)[0]
    cell = runner.run(Target(case, cell_variants(case.info.variants, case.info.wrappers, ("ddp",))[0]))
    assert cell.status == Status.SKIP
    assert "deepspeed" not in cell.summary and "zero3_linear_wrap" not in cell.summary, cell.summary


def test_zero3_module_boundaries_reorder_the_llamas_gradient_sums_and_nothing_else():
    """The replica's ZeRO-3 boundaries (harness/rank/oracle/replica.py:module_boundaries) on the
    transformers Llama: the same loss; gradients within an fp32 rounding of the plain backward's but not
    all the same bits (the residual stream's gradients are summed in another order); the parameters
    downstream of the last residual add (the head) unchanged; every hook gone after."""
    import torch

    from harness.rank.hf_models import causal_lm
    from harness.rank.oracle.replica import module_boundaries

    torch.manual_seed(0)
    model = causal_lm()
    ids = torch.randint(0, 16, (2, 8))

    def backward() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, plain = backward()
    with module_boundaries(model):
        bounded_loss, bounded = backward()
    assert torch.equal(loss, bounded_loss)
    assert all(torch.allclose(plain[n], bounded[n], rtol=1e-5, atol=1e-8) for n in plain)
    assert not torch.equal(plain["model.embed_tokens.weight"], bounded["model.embed_tokens.weight"])
    assert torch.equal(plain["lm_head.weight"], bounded["lm_head.weight"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(backward()[1]["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])


def test_the_transformers_llama_passes_zero3_bit_for_bit(runner):
    """accumulate_token_loss_transformers under ZeRO-3: the oracle's replica runs ZeRO-3's module
    boundaries, so every gradient is DeepSpeed's to the bit (without them a few fp32 ulps apart)."""
    cell = runner.run(target("test_token_loss.py", "sync_each_batch=false-fp32", "deepspeed-z3",
                             name="accumulate_token_loss_transformers"))
    assert cell.status == Status.PASS, cell.summary
    assert cell.max_abs_diff == 0 and cell.grad_checks > 0, cell.summary
