"""A script that draws each window's batches first and weighs every valid label token of the global
window alike (``num_items_in_batch``), checked as it is: ``python -m harness watch`` pairs each backward
with the batch its forward was given, chooses the token contract where the script passes
``num_items_in_batch`` to its model and says so, and calls the oracle's replica as the script called its
model (docs/script.md, "Windows drawn ahead and token counts"). The correct loop passes; each one-line
mistake fails at its first step naming how its tokens are weighed. Real ranks, gloo, the installed
accelerate and transformers, real processes."""

from __future__ import annotations

import pytest

from conftest import ROOT
from test_script import HAND_LOOP, assert_refused, kinds, shown, watch

pytest.importorskip("transformers")

TOKEN_LOOP = ROOT / "tests" / "planted" / "scripts" / "token_loop.py"
CHOSEN = "contract: tokens, as the script passes num_items_in_batch to its model"


def test_a_window_drawn_ahead_and_weighed_by_its_tokens_passes_and_says_the_contract_it_chose(tmp_path):
    result, cells = watch(tmp_path / "reports", TOKEN_LOOP, "--world-sizes", "1,2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert shown("python -m harness watch tests/planted/scripts/token_loop.py --world-sizes 1,2") == \
        {key: cell["status"] for key, cell in cells.items() if key != "environment"}
    assert cells["environment"]["script"]["contract"] is None  # not asked: chosen from the script
    for ws in (1, 2):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and CHOSEN in cell["summary"], cell["summary"]
        # the gradients of every one of the 20 micro-batches (10 a rank at world size 2), and the parameters after each
        assert cell["grad_checks"] == 20 and cell["checks"] == 2 * cell["grad_checks"], cell["summary"]
    assert cells[("as-written", 2)]["comm_checks"] == 20
    assert cells[("as-written", 2)]["vacuous_checks"] == 0


SHARE = "times their share of the token mean over the window on every rank"
# each one-line mistake: how the first step's gradients are weighed, as the message says it
MISTAKES = {
    "local_count": SHARE,
    "not_times_processes": f"weigh 0.5 {SHARE}",
    # accelerate's own example counts the first label of each row, which the model never predicts
    "unshifted_count": SHARE,
}


def weight(failure: dict) -> float:
    return float(failure["message"].split("weigh ")[1].split(" times")[0])


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_one_line_mistake_in_a_token_weighted_loop_fails_at_its_first_step(tmp_path, mistake):
    result, cells = watch(tmp_path / "reports", TOKEN_LOOP, "--nproc", "2", args=("--mistake", mistake))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail", cell["summary"]
    assert CHOSEN in cell["summary"]
    first = min(cell["failures"], key=lambda f: f["step"])
    assert first["step"] == 1 and kinds(cell) == {"misweighted"}, cell["summary"]
    assert MISTAKES[mistake] in first["message"], first["message"]
    if mistake == "unshifted_count":  # fewer targets than counted: every token weighs less than its share
        assert 0.7 < weight(first) < 1.0, first["message"]
    if mistake == "local_count":
        # each rank divides by its own count n_r, not the window's N: its tokens weigh N / n_r, one weight
        # a rank, whose reciprocals add up to 1
        weights = [weight(next(f for f in cell["failures"] if f["rank"] == rank and f["step"] == 1))
                   for rank in (0, 1)]
        assert all(w > 1 for w in weights) and abs(sum(1 / w for w in weights) - 1) < 0.01, weights


def test_the_token_contract_asked_of_a_loop_that_draws_one_batch_a_backward_is_refused(tmp_path):
    # the window's count is needed at its first backward, before the loop has drawn the rest of it
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "2", "--num-steps", "2", "--contract",
                          "tokens", args=("--accumulation", "2"))
    assert cells["environment"]["script"]["contract"] == "tokens"
    assert_refused(result, cells[("as-written", 2)], "the script had drawn 1 of the window's 2 micro-batches by then")


def test_a_forward_set_on_the_model_that_closes_over_it_is_refused_and_a_method_is_not():
    # the oracle's replica is a copy of the model; a forward set on the instance as a closure over the model
    # would still run the rank's model from the copy, which a method set with types.MethodType does not
    import copy
    import types

    from torch import nn

    from harness.rank.script.script_watch import refuse_rank_forwards
    from harness.rank.watch import LoopRefused

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    head = model[1]
    head.forward = types.MethodType(lambda self, x: nn.Linear.forward(self, x) * 2, head)
    refuse_rank_forwards({"model": copy.deepcopy(model)}, [model])  # rebound to the copy: followed
    head.forward = lambda x: nn.Linear.forward(head, x) * 2
    with pytest.raises(LoopRefused, match=r"forward on its model \(model\.1\) that calls the model itself"):
        refuse_rank_forwards({"model": copy.deepcopy(model)}, [model])
