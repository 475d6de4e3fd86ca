"""Token-weighted losses: the token data, the oracle's full-batch token mean on real ranks, the
misweighted diagnosis planted and quiet, and the token cases on a real pool (harness/rank/tokens.py,
Oracle.token_window, harness/rank/judging/diagnosis.py Reweighing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_on_ranks

from harness import catalogue as case_catalogue
from harness.decorator import Diagnosis, Variant
from harness.rank.judging.checks import checked
from harness.rank.judging.diagnosis import Hypotheses, diagnose, fitted_weights
from harness.rank.judging.recorder import Recorder
from harness.rank.models import TinyLM, derive_seed, seeded
from harness.rank.numerics.closeness import Expectation, rounding_allowance
from harness.rank.oracle.core import Oracle
from harness.rank.oracle.weighting import token_seeds
from harness.rank.tokens import IGNORE_INDEX, TokenDataset, pad_tokens, token_loss_sum, valid_tokens
from harness.records import FailureKind, Status
from harness.selfcheck.run import Runner, Target
from harness.wording import canary_unobservable_summary
from harness.wrappers.cell import CellConfig
from harness.wrappers.registry import WRAPPERS
from harness.wrappers.prepare import cell_variants

ROOT = Path(__file__).resolve().parent.parent


def test_token_batches_hold_different_numbers_of_valid_tokens_with_prompts_and_padding_ignored():
    data = TokenDataset(7, samples=40)
    batches = [pad_tokens([data[i] for i in range(start, start + 4)]) for start in range(0, 40, 4)]
    counts = [int(valid_tokens(b)) for b in batches]
    assert len(set(counts)) > 3  # micro-batches differ, which is the whole point
    for batch in batches:
        padding = batch["attention_mask"] == 0
        assert bool((batch["labels"][padding] == IGNORE_INDEX).all())
        assert bool((batch["labels"][:, 0] == IGNORE_INDEX).all())  # the prompt is at least one token
        assert bool(((batch["labels"] != IGNORE_INDEX).sum(dim=1) >= 1).all())
    causal = TokenDataset(7, samples=40, causal=True)
    assert [int(causal[i]["labels"].ne(IGNORE_INDEX).sum()) for i in range(40)] == \
        [int(data[i]["labels"].ne(IGNORE_INDEX).sum()) for i in range(40)]


def _rank_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    data = TokenDataset(100 + rank, samples=8 + 4 * rank)  # ranks hold different amounts too
    return [pad_tokens([data[i] for i in range(s, s + 4)]) for s in range(0, len(data), 4)]


def _oracle_token_grads(rank: int, world_size: int) -> dict[str, list]:
    with seeded(derive_seed(1, "tiny_lm")):
        model = TinyLM()
    oracle = checked(Oracle({"m": model}, CellConfig(num_steps=2, rank=rank, world_size=world_size),
                            recorder=Recorder(rank=rank)))
    batches = _rank_batches(rank)
    oracle.token_window(b["labels"] for b in batches)
    for i, batch in enumerate(batches):
        oracle.backward(lambda m, batch=batch: token_loss_sum(m["m"], batch), sync=i == len(batches) - 1)
    return {name: p.grad.tolist() for name, p in oracle.params["m"].items()}  # plain data across processes


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_oracle_at_a_sync_holds_the_gradient_of_the_token_mean_over_every_rank_and_micro_batch(world_size):
    got = run_on_ranks(_oracle_token_grads, world_size)
    # the specification computed in one process: every valid token of the window on every rank,
    # summed, divided by their number
    with seeded(derive_seed(1, "tiny_lm")):
        model = TinyLM().double()
    every = [b for r in range(world_size) for b in _rank_batches(r)]
    tokens = sum(int(valid_tokens(b)) for b in every)
    loss = sum(token_loss_sum(model, b).double() for b in every) / tokens
    loss.backward()
    for rank in range(world_size):
        for name, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(got[rank][name], dtype=torch.float64), p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world_size, tokens, steps", [(1, 11, 1), (2, 37, 2), (3, 37, 2), (3, 53, 3), (4, 91, 2),
                                                      (6, 101, 3), (3, 1000003, 5)])
def test_token_seeds_are_the_backward_seeds_of_the_two_documented_loops_bit_for_bit(world_size, tokens, steps):
    def seed_of(loss_of):
        summed = torch.tensor(1.0, requires_grad=True)
        (loss_of(summed) / steps).backward()  # Accelerator.backward divides by the steps
        return summed.grad

    guide, other = token_seeds(world_size, tokens, steps)
    guide_loop = seed_of(lambda s: s * steps * world_size / tokens)
    transformers_loop = seed_of(lambda s: s / torch.tensor(tokens) * steps * world_size)
    assert torch.equal(guide, guide_loop)
    assert torch.equal(other if other is not None else guide, transformers_loop)
    if world_size & (world_size - 1) == 0 and steps & (steps - 1) == 0:
        assert other is None  # powers of two scale exactly: one seed


def test_fitted_weights_recover_planted_weights_and_misweighted_names_them():
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(50, generator=gen) for _ in range(3)]
    base = torch.randn(50, generator=gen)
    expected_value = base + sum(parts)
    expected = Expectation(expected_value, rounding_allowance(expected_value))
    actual = base + 1.25 * parts[0] + 0.8 * parts[1] + 1.0 * parts[2]
    weights = fitted_weights(actual, base, parts)
    assert weights == pytest.approx([1.25, 0.8, 1.0], rel=1e-6)  # fp32 inputs
    value = base + sum(w * p for w, p in zip(weights, parts))
    reweighted = Expectation(value, rounding_allowance(value))
    kind, factor = diagnose(actual, Hypotheses(expected=expected, reweighted=reweighted, weight=weights[1]))
    assert (kind, factor) == (FailureKind.MISWEIGHTED, pytest.approx(0.8))
    # noise no weights explain stays a mismatch
    noisy = actual + 0.5 * torch.randn(50, generator=gen)
    weights = fitted_weights(noisy, base, parts)
    value = base + sum(w * p for w, p in zip(weights, parts))
    kind, _ = diagnose(noisy, Hypotheses(expected=expected, reweighted=Expectation(value, rounding_allowance(value)),
                                         weight=weights[0]))
    assert kind is FailureKind.MISMATCH
    # weights of 1 (a rounding-level difference) are no misweighting
    tiny = expected_value + 1e-6
    weights = fitted_weights(tiny, base, parts)
    value = base + sum(w * p for w, p in zip(weights, parts))
    kind, _ = diagnose(tiny, Hypotheses(expected=expected, reweighted=Expectation(value, rounding_allowance(value)),
                                        weight=weights[0]))
    assert kind is FailureKind.MISMATCH


def test_a_defect_can_name_the_variants_and_the_fewest_ranks_that_show_it():
    only = Diagnosis("not_synced", when={"sync_each_batch": True})
    assert only.applies_to({"sync_each_batch": True, "precision": "fp32"})
    assert not only.applies_to({"sync_each_batch": False})
    assert Diagnosis("misweighted", ranks=2).observable(2) and not Diagnosis("misweighted", ranks=2).observable(1)
    assert Diagnosis("misweighted").observable(1)
    assert canary_unobservable_summary([Diagnosis("misweighted", model="model", ranks=2)], 1).endswith(
        "which world size 1 cannot show (it needs 2 ranks)")
    info = next(c for c in case_catalogue.discover(ROOT / "cases") if c.name == "accumulate_token_loss").info
    z1 = {"wrapper": "deepspeed-z1", "precision": "fp32"}
    assert info.detects_for(Variant("a", {**z1, "sync_each_batch": False})) == ()
    assert {d.kind for d in info.detects_for(Variant("b", {**z1, "sync_each_batch": True}))} == \
        {"not_synced", "comm_missing"}


@pytest.fixture(scope="module")
def token_cells():
    """The token cases' cells at world size 2 on one pool, by (case, variant)."""
    by_name = {c.name: c for c in case_catalogue.discover(ROOT / "cases")}
    wanted = [("accumulate_token_loss", "sync_each_batch=false-fp32"),
              ("accumulate_token_loss", "sync_each_batch=true-bf16"),
              ("accumulate_token_mean", "sync_each_batch=false-fp32"),
              ("accumulate_token_local_count", "sync_each_batch=false-fp32"),
              ("accumulate_token_loss", "sync_each_batch=false-fp32-wrapper=fsdp2"),
              ("accumulate_token_loss_transformers", "sync_each_batch=false-fp32")]
    cells = {}
    with Runner(world_size=2) as runner:
        for case_name, variant_name in wanted:
            case = by_name[case_name]
            variants = cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
            cells[case_name, variant_name] = runner.run(Target(case, next(v for v in variants if v.name == variant_name)))
    return cells


def test_the_documented_token_loss_passes_in_fp32_bf16_and_under_fsdp2(token_cells):
    for key in [("accumulate_token_loss", "sync_each_batch=false-fp32"),
                ("accumulate_token_loss", "sync_each_batch=true-bf16"),
                ("accumulate_token_loss", "sync_each_batch=false-fp32-wrapper=fsdp2")]:
        cell = token_cells[key]
        assert cell.status == Status.PASS, (key, cell.summary)
        assert cell.grad_checks > 0 and cell.vacuous_checks < cell.grad_checks


def test_a_mean_per_micro_batch_is_misweighted_from_the_first_window(token_cells):
    cell = token_cells["accumulate_token_mean", "sync_each_batch=false-fp32"]
    assert cell.status == Status.DETECTED, cell.summary
    grads = [f for f in cell.failures if f.checked == "grad"]
    assert grads and {f.kind for f in grads} == {"misweighted"}
    assert min(f.step for f in grads) == 1
    assert all(f.factor is not None and abs(f.factor - 1.0) > 1e-3 for f in grads)


def test_a_count_not_gathered_weighs_each_rank_by_all_tokens_over_its_own(token_cells):
    cell = token_cells["accumulate_token_local_count", "sync_each_batch=false-fp32"]
    assert cell.status == Status.DETECTED, cell.summary
    synced = [f for f in cell.failures if f.checked == "grad" and "weights by rank" in f.message]
    assert synced and {f.kind for f in synced} == {"misweighted"}
    for failure in synced:
        text = failure.message.split("weights by rank: ")[1].split(")")[0]
        weights = [float(w) for w in text.split(", ")]
        # rank r's tokens weigh N / n_r, and the n_r add up to N
        assert sum(1.0 / w for w in weights) == pytest.approx(1.0, rel=1e-4)
        assert failure.factor == pytest.approx(weights[failure.rank], rel=1e-5)


def test_a_transformers_causal_lm_with_num_items_in_batch_passes(token_cells):
    pytest.importorskip("transformers")
    cell = token_cells["accumulate_token_loss_transformers", "sync_each_batch=false-fp32"]
    assert cell.status == Status.PASS, cell.summary


def test_both_documented_orders_pass_at_three_ranks_and_three_steps_where_they_round_apart(run_pytest):
    session = run_pytest("tests/planted/token_cases.py", "--world-sizes", "3", "--wrappers", "ddp", "-q", timeout=300)
    cells = session.cells()
    assert len(cells) == 4
    for key, cell in cells.items():
        assert cell["status"] == "pass", (key, cell["summary"])
