"""Wrappers (FSDP2, FSDP1; DeepSpeed where it runs): the variant axis and --wrappers, the sharded
reading of a model, the collective accounting on real collectives, and whole cells on real pools."""

from __future__ import annotations

import pytest
from distributed import run_on_ranks

from harness import Variant, compiled, grid
from harness.rank.judging.reductions import judge
from harness.rank.numerics.accounting import Backward
from harness.wrappers import registry
from harness.wrappers.registry import AUTO, SPECS, WRAPPERS, WrapperSpec, parse
from harness.wrappers.prepare import cell_variants

PLANTED = "tests/planted/wrapper_cases.py"


# the variant axis


def test_ddp_keeps_its_variant_ids_and_other_wrappers_add_a_part():
    variants = grid(steps=[2, 3], precision=["fp32", "bf16"]) + compiled(Variant("steps=2-fp32", {"steps": 2, "precision": "fp32"}))
    every = cell_variants(variants, WRAPPERS, ("ddp", "fsdp2"))
    names = [v.name for v in every]
    assert names[:5] == [v.name for v in variants]  # DDP: today's ids
    # FSDP2 at every fp32 and bf16 variant, each bf16 one also with reduce_dtype=fp32; compiled in fp32 only
    assert names[5:] == ["steps=2-fp32-wrapper=fsdp2", "steps=2-bf16-wrapper=fsdp2",
                         "steps=2-bf16-reduce=fp32-wrapper=fsdp2", "steps=3-fp32-wrapper=fsdp2",
                         "steps=3-bf16-wrapper=fsdp2", "steps=3-bf16-reduce=fp32-wrapper=fsdp2",
                         "steps=2-fp32-compile=aot_eager-wrapper=fsdp2"]
    assert every[7].params == {"steps": 2, "precision": "bf16", "reduce": "fp32", "wrapper": "fsdp2"}
    assert every[-1].params == {"steps": 2, "precision": "fp32", "compile": "aot_eager", "wrapper": "fsdp2"}


def test_auto_runs_every_other_wrapper_at_the_lead_variants_of_the_wrappers_a_case_applies_to():
    variants = grid(steps=[2, 3], precision=["fp32", "bf16"]) + compiled(Variant("steps=2-fp32", {"steps": 2, "precision": "fp32"}))
    auto = [v.name for v in cell_variants(variants, ("ddp", "fsdp2", "fsdp1"), AUTO)]
    # compiled variants run under DDP and FSDP2 only; FSDP2's lead bf16 variant too, with each reduce dtype;
    # FSDP1's lead fp32 and bf16 variants (accelerate's MixedPrecision: no reduce axis)
    assert auto[5:] == ["steps=2-fp32-wrapper=fsdp2", "steps=2-bf16-wrapper=fsdp2",
                        "steps=2-bf16-reduce=fp32-wrapper=fsdp2", "steps=2-fp32-compile=aot_eager-wrapper=fsdp2",
                        "steps=2-fp32-wrapper=fsdp1", "steps=2-bf16-wrapper=fsdp1"]
    assert [v.name for v in cell_variants(variants, ("ddp",), ("fsdp2",))] == []


@pytest.mark.parametrize("text, expected", [
    ("auto", AUTO), ("ddp", ("ddp",)), ("fsdp1, ddp", ("ddp", "fsdp1")), ("deepspeed-z3", ("deepspeed-z3",)),
])
def test_parse_takes_auto_or_known_names_in_report_order(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text, reason", [("fsdp3", "unknown wrapper 'fsdp3'"), (",", "expected 'auto'")])
def test_parse_names_what_is_wrong(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse(text)


def test_an_unknown_wrapper_is_a_one_line_usage_error(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "--wrappers", "ddp,fsdp3", "--collect-only", "-q", timeout=120)
    assert session.returncode == 4
    assert "--wrappers: unknown wrapper 'fsdp3'; known: ddp, fsdp2, fsdp1" in session.stderr
    assert "Traceback" not in session.stderr


# the registry: one spec a wrapper


def test_every_public_wrapper_name_has_its_spec_in_report_order():
    assert tuple(s.name for s in SPECS) == WRAPPERS
    assert all(registry.spec(name).name == name for name in WRAPPERS)
    with pytest.raises(ValueError, match="unknown wrapper 'fsdp3'; known: ddp, fsdp2"):
        registry.spec("fsdp3")


def test_a_spec_refuses_an_accumulation_dtype_it_does_not_know_and_a_family_without_its_level():
    with pytest.raises(ValueError, match="accumulates_in='output'"):
        WrapperSpec("x", "ddp", ("fp32",), accumulates_in="output")
    with pytest.raises(ValueError, match="an fsdp_version for FSDP"):
        WrapperSpec("x", "fsdp", ("fp32",))
    with pytest.raises(ValueError, match="family 'megatron'"):
        WrapperSpec("x", "megatron", ("fp32",))


def test_each_identity_names_one_spec_and_back():
    assert len({s.identity for s in SPECS}) == len(SPECS)
    for s in SPECS:
        assert registry.of_identity(*s.identity) is s
    assert registry.spec("fsdp1").identity == ("fsdp", 1) and registry.spec("deepspeed-z3").identity == ("deepspeed", 3)
    assert registry.of_identity("deepspeed", 0) is None and registry.of_identity("fsdp") is None


def test_of_family_and_the_mesh_wrappers_in_report_order():
    assert [s.name for s in registry.of_family("deepspeed")] == ["deepspeed-z1", "deepspeed-z2", "deepspeed-z3"]
    assert [s.name for s in registry.of_family("fsdp")] == ["fsdp2", "fsdp1"]
    assert [s.name for s in registry.of_family("ddp")] == ["ddp"]
    assert [s.name for s in registry.mesh_wrappers()] == ["fsdp2"]
    assert [s.name for s in SPECS if not s.sharded] == ["ddp"]
    assert [s.name for s in SPECS if s.flat_parameters] == ["fsdp1"]


def test_a_prepared_model_is_verified_by_its_identity_and_a_plain_one_passes_under_ddp_only():
    from torch import nn

    from harness.wrappers.prepare import prepared_as, verify

    class DeepSpeedEngine(nn.Module):  # told apart by its class name and stage, as deepspeed's is
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage

        def zero_optimization_stage(self) -> int:
            return self.stage

    plain = nn.Linear(2, 2)
    verify("ddp", plain, name="m", world_size=1)
    with pytest.raises(registry.WrongWrapper,
                       match=r"model 'm' was prepared as none \(Linear\), but the cell is wrapper=fsdp1"):
        verify("fsdp1", plain, name="m", world_size=2)
    verify("deepspeed-z2", DeepSpeedEngine(2), name="m", world_size=2)
    with pytest.raises(registry.WrongWrapper, match="prepared as deepspeed-z2 .*wrapper=deepspeed-z1"):
        verify("deepspeed-z1", DeepSpeedEngine(2), name="m", world_size=2)
    assert prepared_as(DeepSpeedEngine(0)) == "deepspeed-z0"  # no spec: named by its stage still


# the collective accounting's judgement


def test_judge_pairs_backwards_with_the_contract():
    quiet, reduced = Backward([]), Backward([("gloo:all_reduce", 10)])
    kinds = [v.kind for v in judge([quiet, reduced, quiet, reduced], [(False, 10), (True, 10), (True, 10), (False, 10)],
                                   reduces_every_micro_batch=False)]
    assert kinds == [None, None, "comm_missing", "comm_unexpected"]
    # a sync must reduce every element that got a gradient (one of two models left out is missing)
    assert judge([Backward([("gloo:all_reduce", 6)])], [(True, 10)], reduces_every_micro_batch=False)[0].kind == "comm_missing"
    # ZeRO >= 2 reduces every micro-batch by design
    assert judge([reduced], [(False, 10)], reduces_every_micro_batch=True)[0].kind is None
    # records the ring lost: no claim
    assert judge([Backward([], complete=False)], [(True, 10)], reduces_every_micro_batch=False) == []


def _ddp_backwards(rank, world_size):
    """A DDP model's backwards watched through the flight recorder: one under no_sync, one synced,
    and an all-reduce of the harness's own between them (not in a backward: never counted)."""
    import os

    import torch
    import torch.distributed as dist

    from harness.rank.numerics.accounting import Accounting

    assert os.environ.get("TORCH_FR_BUFFER_SIZE")  # set before the group was made (below)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))

    class Accelerator:  # only what Accounting.watch wraps: a backward
        def backward(self, loss):
            loss.backward()

    accelerator = Accelerator()
    accounting = Accounting()
    accounting.watch(accelerator)
    with model.no_sync():
        accelerator.backward(model(torch.randn(3, 4)).sum())
    dist.all_reduce(torch.ones(5))
    accelerator.backward(model(torch.randn(3, 4)).sum())
    return accounting.available, [b.reductions for b in accounting.take()]


def test_the_flight_recorder_sees_ddp_reduce_in_a_synced_backward_only(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    for available, reductions in run_on_ranks(_ddp_backwards, 2):
        assert available
        assert reductions == [[], [("gloo:all_reduce", 10)]]  # DDP's one bucket: 4x2 weight + 2 bias


# FSDP2's shards


def _shards(rank, world_size):
    import torch
    from torch.distributed.fsdp import fully_shard

    from harness.wrappers.sharding import observe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model)
    model(torch.randn(2, 5)).sum().backward()
    observed = observe(model, list(full), sync=True)
    whole = observed.full_params()
    return {n: (torch.equal(observed.piece(n, full[n]), observed.params[n]), torch.equal(whole[n], full[n]),
                tuple(observed.params[n].shape)) for n in full}, observed.sharded


def test_a_rank_is_compared_with_its_own_shard_of_the_full_tensor_even_when_the_split_is_uneven():
    results = run_on_ranks(_shards, 3)
    for rank, (pieces, sharded) in enumerate(results):
        assert sharded
        assert all(same_piece and same_whole for same_piece, same_whole, _ in pieces.values()), pieces
    # 7 rows over 3 ranks: 3, 3, 1; the 1-element bias: rank 0 only
    assert [r[0]["0.weight"][2] for r in results] == [(3, 5), (3, 5), (1, 5)]
    assert [r[0]["1.bias"][2] for r in results] == [(1,), (0,), (0,)]


# whole cells on real pools


def test_fsdp_cells_pass_shard_by_shard_with_their_collectives_checked(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "cases/test_no_sync.py", "cases/test_accumulate.py",
                         "-k", "test_fused_loss or test_no_sync or test_accumulate[", "--wrappers", "fsdp2,fsdp1",
                         "--world-sizes", "1,2", "--meshes", "none", "-q", timeout=900)
    assert session.returncode == 0, session.stdout[-3000:]
    cells = session.cells()
    run = {k: c for k, c in cells.items() if k[2] == 2}
    assert {k[1] for k in run} >= {"fp32-wrapper=fsdp2", "fp32-wrapper=fsdp1", "steps=2-fp32-wrapper=fsdp2",
                                   "fp32-compile=aot_eager-wrapper=fsdp2"}
    for key, cell in run.items():
        assert cell["status"] == "pass", (key, cell["summary"])
        assert cell["grad_checks"] > 0 and cell["comm_checks"] > 0, (key, cell)
        assert cell["max_abs_diff"] < 1e-5
    # one rank: accelerate wraps nothing, so neither does the harness (skip, never silently DDP)
    one = [c for k, c in cells.items() if k[2] == 1]
    assert one and all(c["status"] == "skip" and "world size 2 and more" in c["summary"] for c in one)
    assert session.matrix["environment"]["wrappers"] == "fsdp2,fsdp1"


def test_fsdp2_bf16_is_the_wrappers_arithmetic_exactly_and_a_1e_5_error_fails_it(run_pytest):
    """accelerate's bf16 under FSDP2 (param, reduce and output dtype bf16) and an explicit policy
    reducing in fp32: the oracle computes in bf16 from the fp32 masters, accumulates in the reduce
    dtype and sums the ranks in gloo's ring order (odd chunks at 3 ranks), so nothing differs."""
    session = run_pytest("cases/test_fused_loss.py", "cases/test_accumulate.py", "-k", "bf16",
                         "--wrappers", "fsdp2", "--world-sizes", "2,3", "--meshes", "none", "-q", timeout=900)
    bf16 = {k: c for k, c in session.cells().items() if k[0] in ("fused_loss", "accumulate")}
    assert {k[1] for k in bf16} >= {"bf16-wrapper=fsdp2", "bf16-reduce=fp32-wrapper=fsdp2",
                                    "steps=3-bf16-wrapper=fsdp2", "steps=3-bf16-reduce=fp32-wrapper=fsdp2"}
    for key, cell in bf16.items():
        assert (cell["status"], cell["max_abs_diff"]) == ("pass", 0.0), (key, cell["summary"])
    # rank 1's gradient scaled by 1 + 1e-5 once, after the cell's first backward: far below bf16's
    # rounding (3.9e-3), seen because nothing else is allowed. In no_sync's first backward FSDP2
    # holds the gradient inside itself (fp32 under reduce=fp32, where the error stays; bf16 under
    # accelerate's policy, where it rounds away): the fault reaches it there.
    perturbed = run_pytest("cases/test_fused_loss.py", "cases/test_no_sync.py", "-k", "bf16", "--wrappers", "fsdp2",
                           "--world-sizes", "2", "--harness-fault", "perturb_once:1e-5", "-q", timeout=600)
    statuses = {(k[0], k[1]): c["status"] for k, c in perturbed.cells().items()}
    assert statuses == {("fused_loss", "bf16-wrapper=fsdp2"): "fail", ("fused_loss", "bf16-reduce=fp32-wrapper=fsdp2"): "fail",
                        ("no_sync", "bf16-reduce=fp32-wrapper=fsdp2"): "fail", ("no_sync", "bf16-wrapper=fsdp2"): "pass"}


def test_fsdp1_bf16_is_the_wrappers_arithmetic_exactly_and_a_1e_5_error_fails_it(run_pytest):
    """accelerate's bf16 under FSDP1 (MixedPrecision with param, reduce and buffer dtype bf16, and
    accelerate's autocast inside the wrapper): the oracle views one bf16 flat parameter per forward,
    adds each forward's contribution into the unsharded gradient in bf16 (the last forward's
    first), and reduces as FSDP1 does (divide by 2, SUM in gloo's ring order, divide by the rest:
    1.5 at three ranks), so nothing differs; a discriminator called three times in one loss
    (accumulate_multi_model) included."""
    session = run_pytest("cases/test_fused_loss.py", "cases/test_accumulate.py", "-k",
                         "bf16 and (fused or multi_model)", "--wrappers", "fsdp1",
                         "--world-sizes", "2,3", "-q", timeout=900)
    cells = session.cells()
    assert {k[1] for k in cells} == {"bf16-wrapper=fsdp1"} | {f"steps={s}-models={m}-bf16-wrapper=fsdp1"
                                                               for s in (2, 3) for m in (2, 3)}
    assert {k[2] for k in cells} == {2, 3}
    for key, cell in cells.items():
        assert (cell["status"], cell["max_abs_diff"]) == ("pass", 0.0), (key, cell["summary"])
        assert "NOT CHECKED" not in cell["summary"], (key, cell["summary"])
    # rank 1's gradient scaled by 1 + 1e-5 once, after the first backward: fused_loss syncs there,
    # and FSDP1 holds the reduced gradient in fp32, where nothing else is allowed
    perturbed = run_pytest("cases/test_fused_loss.py", "-k", "bf16", "--wrappers", "fsdp1", "--world-sizes", "2",
                           "--harness-fault", "perturb_once:1e-5", "-q", timeout=600)
    assert {k[1]: c["status"] for k, c in perturbed.cells().items()} == {"bf16-wrapper=fsdp1": "fail"}


def test_fsdp2_bf16_where_the_reduction_order_is_not_known_is_judged_within_the_bound_and_says_so(run_pytest):
    """Where FSDP2 does not reduce-scatter with AVG (here the self-check fault that makes it SUM, as
    torch does at world size 1), the oracle cannot reproduce the order: it allows the bf16
    reduction's bound, the cell says that check did not run, and the wrong scale is still found."""
    session = run_pytest("cases/test_fused_loss.py", "-k", "bf16", "--wrappers", "fsdp2", "--world-sizes", "3",
                         "--harness-fault", "fsdp2_reduce_sums", "-q", timeout=600)
    cells = {k[1]: c for k, c in session.cells().items()}
    assert set(cells) == {"bf16-wrapper=fsdp2", "bf16-reduce=fp32-wrapper=fsdp2"}
    for variant, cell in cells.items():
        assert cell["status"] == "fail", (variant, cell["summary"])
        assert "wrong_scale" in {f["kind"] for f in cell["failures"]}, cell["summary"]
        assert "NOT CHECKED: exact reduction order" in cell["summary"], cell["summary"]


def test_a_cell_prepared_as_another_wrapper_is_an_error_and_a_logged_reduce_is_not_a_gradient_collective(
        run_pytest):
    session = run_pytest(PLANTED, "--world-sizes", "2", "--wrappers", "ddp,fsdp2", "-q", timeout=300)
    cells = session.cells()
    wrong = cells[("planted_silently_ddp", "fp32-wrapper=fsdp2", 2)]
    assert wrong["status"] == "error"
    assert "model 'model' was prepared as ddp (DistributedDataParallel), but the cell is wrapper=fsdp2" in wrong["summary"]
    for variant in ("fp32", "fp32-wrapper=fsdp2"):
        logged = cells[("planted_logged_loss", variant, 2)]
        assert logged["status"] == "pass", logged["summary"]
        assert logged["comm_checks"] == 8  # 4 backwards on each of 2 ranks


def test_trigger_sync_on_a_compiled_ddp_model_is_the_known_accelerate_defect(run_pytest):
    session = run_pytest("cases/test_no_sync.py", "-k", "compiled", "--world-sizes", "2", "-q", timeout=300)
    [cell] = session.matrix["cells"]
    assert (cell["case"], cell["variant"], cell["status"]) == (
        "no_sync_trigger_sync_compiled", "fp32-compile=aot_eager", "detected"), cell["summary"]
    kinds = {f["kind"] for f in cell["failures"]}
    assert {"not_synced", "comm_missing"} <= kinds
    missing = next(f for f in cell["failures"] if f["kind"] == "comm_missing")
    assert "no gradient reduction, where the contract syncs the gradients of 49 elements" in missing["message"]
