"""The diagnosis of what a wrong gradient is instead: not synced, synced early, stale, scaled, misweighted, or
a mismatch."""

import contextlib

import pytest
import torch

from harness.rank.judging.diagnosis import Hypotheses, Reweighing, Scaling, diagnose, diagnose_with, fitted_scale
from harness.rank.numerics.closeness import Expectation


def exact(values):
    return Expectation.rounded(torch.tensor(values))


def hyp(**kw):
    local = exact([1.0, 2.0, 3.0])
    synced = exact([2.0, -1.0, 0.5])
    previous = exact([0.3, 0.7, -0.2])
    base = dict(expected=synced, local=local, synced=synced, previous=previous, expected_sync=True)
    base.update(kw)
    return Hypotheses(**base)


def test_diagnoses_not_synced():
    h = hyp()
    assert diagnose(h.local.value, h) == ("not_synced", None)


def test_diagnoses_synced_early():
    h = hyp(expected=exact([1.0, 2.0, 3.0]), expected_sync=False)
    assert diagnose(h.synced.value, h) == ("synced_early", None)


def test_diagnoses_wrong_scale_with_its_factor_even_a_small_one():
    h = hyp()
    kind, factor = diagnose(h.expected.value * 2.0, h)
    assert kind == "wrong_scale" and abs(factor - 2.0) < 1e-9
    kind, factor = diagnose(h.expected.value * (1 + 1e-5), h)
    assert kind == "wrong_scale" and factor == pytest.approx(1 + 1e-5, rel=1e-7)


def test_a_factor_that_reads_as_one_is_no_scale():
    # off by 3e-7 relative, beyond one rounding: a mismatch, never "scaled by 1"
    h = hyp()
    assert diagnose(h.expected.value * (1 + 3e-7), h) == ("mismatch", None)


def test_diagnoses_stale_gradient_left_from_the_last_window():
    h = hyp()
    assert diagnose(h.expected.value + h.previous.value, h)[0] == "stale"


def test_anything_else_is_a_mismatch():
    assert diagnose(torch.tensor([9.0, 9.0, -9.0]), hyp()) == ("mismatch", None)


def test_no_sync_diagnosis_when_synced_and_local_are_alike():
    same = exact([1.0, 2.0, 3.0])
    h = hyp(local=same, synced=same, expected=exact([3.0, 6.0, 9.0]))
    assert diagnose(same.value, h)[0] != "not_synced"


def test_fitted_scale():
    e = torch.tensor([1.0, -2.0])
    assert abs(fitted_scale(e * 3, e) - 3.0) < 1e-12
    assert fitted_scale(e, torch.zeros(2)) is None


# The scale-shaped hypotheses fitted to a model's whole gradient (harness/rank/judging/diagnosis.py): one
# factor for the model, the weights of each contribution since the last check, and those with the
# gradient held before them.

def _model(values):
    return {name: Expectation.rounded(torch.tensor(v)) for name, v in values.items()}


def test_one_factor_for_the_model_names_a_scale_that_a_tensor_of_one_element_cannot():
    expected = _model({"weight": [1.0, -2.0, 0.5, 3.0], "bias": [0.7]})
    # a reduction rounded apart: the weights right but for noise, the one-element bias off; its own fit
    # would call any value "scaled"
    actual = {"weight": expected["weight"].value * (1 + 3e-3 * torch.tensor([1.0, -1.0, 1.0, -1.0])),
              "bias": torch.tensor([0.9])}
    scaling = Scaling.fit(expected, actual)
    assert not scaling.explained
    hyp = Hypotheses(expected=expected["bias"], scaled=scaling.expectations["bias"], factor=scaling.factor,
                     model_explained=(scaling.explained, True, True))
    assert diagnose(actual["bias"], hyp) == ("mismatch", None)
    # the whole model times 3: named with the factor, the bias too
    tripled = {p: e.value * 3 for p, e in expected.items()}
    scaling = Scaling.fit(expected, tripled)
    assert scaling.explained and scaling.factor == pytest.approx(3.0)
    hyp = Hypotheses(expected=expected["bias"], scaled=scaling.expectations["bias"], factor=scaling.factor,
                     model_explained=(scaling.explained, True, True))
    assert diagnose(tripled["bias"], hyp) == ("wrong_scale", pytest.approx(3.0))


def _backward_of(seed: float, dtype=torch.float32, autocast=None):
    """A small model's gradients of a loss seeded with ``seed`` (the loss times it), as a backward runs it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    context = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with context:
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    (loss * torch.tensor(seed, dtype=dtype)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [3, 5, 1 / 3])
def test_a_loss_seeded_with_a_factor_that_is_not_a_power_of_two_is_named_wrong_scale(factor, autocast):
    # the contract's loss divided by 3 steps; the rank's divided by 3 / factor: its backward rounds every
    # product anew (in bf16 and fp16 its low-precision intermediates too), so it is not factor times the
    # contract's bit for bit, and an elementwise test of the scaled hypothesis alone would give up
    expected = {n: Expectation.rounded(g) for n, g in _backward_of(1 / 3, autocast=autocast).items()}
    actual = _backward_of(factor / 3, autocast=autocast)
    scaling = Scaling.fit(expected, actual)
    assert scaling.explained and scaling.factor == pytest.approx(factor, rel=1e-2)
    for name in expected:
        hyp = Hypotheses(expected=expected[name], scaled=scaling.expectations[name], factor=scaling.factor,
                         model_explained=(scaling.explained, True, True))
        kind, fitted = diagnose(actual[name], hyp)
        assert kind == "wrong_scale" and fitted == pytest.approx(factor, rel=1e-2), name


def test_noise_of_a_rounding_is_no_scale_and_no_reweighing():
    gen = torch.Generator().manual_seed(5)
    value = torch.randn(200, generator=gen)
    expected = {"w": Expectation.rounded(value)}
    # a bf16 rounding of every element (a reduction in bf16): no factor and no weight explains it
    actual = {"w": value.bfloat16().float()}
    scaling = Scaling.fit(expected, actual)
    assert not scaling.explained
    part = {"w": 0.5 * value}
    reweighing = Reweighing.fit(expected, actual, [part], low=torch.bfloat16)
    assert not reweighing.explained


def test_the_gradient_held_before_the_micro_batches_since_the_last_check_is_weighed_too():
    # a clip inside the window: the gradient held at the last check scaled by 0.25 before the next
    # backward added to it; a zero_grad inside it: the held gradient gone (weight 0)
    gen = torch.Generator().manual_seed(9)
    held, new = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    expected = {"w": Expectation.rounded(held + new)}
    for weight in (0.25, 0.0):
        actual = {"w": weight * held + new}
        fixed = Reweighing.fit(expected, actual, [{"w": new}])
        assert not fixed.explained  # the new micro-batch's weight alone explains nothing
        rebased = Reweighing.fit(expected, actual, [{"w": new}], free_base=True)
        assert rebased.explained
        assert rebased.earlier == pytest.approx(weight, abs=1e-6) and rebased.weights == [pytest.approx(1.0)]
        hyp = Hypotheses(expected=expected["w"], reweighted=fixed.expectations["w"], weight=fixed.weight_of(0),
                         rebased=rebased.expectations["w"], rebased_weight=rebased.weight_of(0),
                         scaled=Scaling.fit(expected, actual).expectations["w"],
                         factor=Scaling.fit(expected, actual).factor,
                         model_explained=(Scaling.fit(expected, actual).explained, fixed.explained, rebased.explained))
        kind, _, which = diagnose_with(actual["w"], hyp)
        assert (kind, which) == ("misweighted", "rebased")


def test_a_scale_and_a_reweighing_that_both_explain_it_name_the_one_that_fits_exactly():
    # a window whose two micro-batches are alike: keeping only the last is about half the gradient, but
    # the earlier micro-batch weighed 0 fits exactly
    gen = torch.Generator().manual_seed(2)
    first = torch.randn(60, generator=gen)
    second = first * 1.02 + 0.01 * torch.randn(60, generator=gen)
    expected = {"w": Expectation.rounded(first + second)}
    actual = {"w": second}
    scaling = Scaling.fit(expected, actual)
    rebased = Reweighing.fit(expected, actual, [{"w": second}], free_base=True)
    hyp = Hypotheses(expected=expected["w"], scaled=scaling.expectations["w"], factor=scaling.factor,
                     rebased=rebased.expectations["w"], rebased_weight=rebased.weight_of(0),
                     model_explained=(scaling.explained, True, rebased.explained))
    assert diagnose_with(actual["w"], hyp)[2] == "rebased"


def test_the_weights_of_several_micro_batches_since_the_last_check_are_each_fitted_by_rank():
    # FSDP and DeepSpeed hide the gradient between syncs: the sync's check sees two micro-batches of
    # two ranks at once; the last one left out (DeepSpeed PR #7985's shape) weighs 0 on both ranks
    gen = torch.Generator().manual_seed(4)
    parts = [{"w": torch.randn(50, generator=gen)} for _ in range(4)]  # backward 1 of ranks 0, 1; backward 2
    expected = {"w": Expectation.rounded(sum(p["w"] for p in parts))}
    actual = {"w": parts[0]["w"] + parts[1]["w"]}
    reweighing = Reweighing.fit(expected, actual, parts, backwards=2)
    assert reweighing.explained
    assert reweighing.weights == [pytest.approx(w, abs=1e-6) for w in (1, 1, 0, 0)]
    assert reweighing.weight_of(1) == pytest.approx(0.0, abs=1e-6)  # rank 1's last micro-batch's


def test_a_misweighted_message_names_each_micro_batchs_weights_and_the_gradient_held_before_them():
    from harness.rank.numerics.closeness import difference
    from harness.wording import mismatch_text

    e = Expectation.rounded(torch.tensor([1.0, 2.0]))
    diff = difference(torch.tensor([0.5, 1.0]), e)
    text = mismatch_text(what="gradient of 'model.w'", where="on rank 0 at step 2", kind="misweighted", factor=0.0,
                         diff=diff, weights=[1.0, 1.0, 0.0, 0.0], backwards=2, unit="micro-batches")
    assert "the weights of the 2 since the last check, each by rank: 1, 1; 0, 0" in text
    text = mismatch_text(what="gradient of 'model.w'", where="on rank 0 at step 2", kind="misweighted", factor=1.0,
                         diff=diff, weights=[1.0, 1.0], earlier=0.25, unit="micro-batches")
    assert "(weights by rank: 1, 1), and the gradient held before them weighs 0.25 times itself" in text


def test_in_a_weighed_window_an_exact_weight_under_a_bf16_ulp_of_its_terms_is_told_apart():
    # a token window under bf16: one rank's gradient scaled by 1.001 after its backward (in fp32) is within
    # the low dtype's rounding of its terms, where a re-rounded backward may land; but fitted exactly, MARGIN
    # times closer than the token mean's weights over the model, which no re-rounding makes: a weight of 1.001
    gen = torch.Generator().manual_seed(6)
    part = torch.randn(80, generator=gen)
    expected = {"w": Expectation.rounded(part)}
    actual = {"w": part * 1.001}
    reweighing = Reweighing.fit(expected, actual, [{"w": part}], low=torch.bfloat16)
    assert reweighing.explained and reweighing.weights == [pytest.approx(1.001)]
    hyp = Hypotheses(expected=expected["w"], reweighted=reweighing.expectations["w"], weight=reweighing.weight_of(0),
                     weighed=True, model_explained=(False, reweighing.explained, True))
    assert diagnose(actual["w"], hyp) == ("misweighted", pytest.approx(1.001))


def test_in_a_weighed_window_a_factor_no_weights_explain_is_still_a_scale():
    # a token window under bf16 whose gradient held before the micro-batch since the last check (weight 1,
    # fixed) is scaled by 1.01 with it (one rank's whole gradient scaled after its backward): no weight of
    # the micro-batch explains that; one factor for the model does
    gen = torch.Generator().manual_seed(6)
    held, part = torch.randn(80, generator=gen), torch.randn(80, generator=gen)
    expected = {"w": Expectation.rounded(held + part)}
    actual = {"w": (held + part) * 1.01}
    reweighing = Reweighing.fit(expected, actual, [{"w": part}], low=torch.bfloat16)
    assert not reweighing.explained
    scaling = Scaling.fit(expected, actual)
    hyp = Hypotheses(expected=expected["w"], reweighted=reweighing.expectations["w"], weight=reweighing.weight_of(0),
                     scaled=scaling.expectations["w"], factor=scaling.factor, weighed=True,
                     model_explained=(scaling.explained, reweighing.explained, True))
    assert diagnose(actual["w"], hyp) == ("wrong_scale", pytest.approx(1.01))


def test_after_a_sync_each_rank_held_gradient_has_its_own_weight_and_alike_ones_share_one():
    """At a sync the gradient each rank held before the micro-batches since the last check enters the
    average with a weight of its own (a clip scales each by its own norm); where every rank held the same
    (the average of an earlier sync in the window, then dropped by a zero_grad) one weight says all, not
    two that cancel each other out."""
    gen = torch.Generator().manual_seed(12)
    held0, held1, new0, new1 = (torch.randn(60, generator=gen) for _ in range(4))
    parts = [{"w": new0 / 2}, {"w": new1 / 2}]
    expected = {"w": Expectation.rounded((held0 + held1 + new0 + new1) / 2)}
    clipped = {"w": (0.4 * held0 + 0.7 * held1 + new0 + new1) / 2}
    by_rank = Reweighing.fit(expected, clipped, parts, free_base=True, held=[{"w": held0 / 2}, {"w": held1 / 2}])
    assert by_rank.explained and by_rank.earlier == [pytest.approx(0.4), pytest.approx(0.7)]
    assert by_rank.weights == [pytest.approx(1.0), pytest.approx(1.0)]
    one = Reweighing.fit(expected, clipped, parts, free_base=True)  # one weight for their average: no fit
    assert not one.explained
    same = {"w": Expectation.rounded(held0 + (new0 + new1) / 2)}
    dropped = {"w": (new0 + new1) / 2}
    alike = Reweighing.fit(same, dropped, parts, free_base=True, held=[{"w": held0 / 2}, {"w": held0 / 2}])
    assert alike.explained and alike.earlier == pytest.approx(0.0, abs=1e-6)
