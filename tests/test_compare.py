"""Comparison with the oracle and the diagnosis of what a wrong gradient is instead."""

import torch

from harness.compare import Hypotheses, Tolerance, diagnose, difference, distinguishable, fitted_scale, make_failure

FP32 = Tolerance.for_precision("fp32")
BF16 = Tolerance.for_precision("bf16")


def hyp(**kw):
    local = torch.tensor([1.0, 2.0, 3.0])
    synced = torch.tensor([2.0, -1.0, 0.5])
    previous = torch.tensor([0.3, 0.7, -0.2])
    base = dict(expected=synced, local=local, synced=synced, previous=previous, expected_sync=True)
    base.update(kw)
    return Hypotheses(**base)


def test_difference_reports_like_assert_close():
    d = difference(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 4.0, 3.0]), FP32)
    assert (d.mismatched, d.numel) == (1, 3)
    assert d.max_abs == 2.0 and d.max_abs_index == (1,)
    assert d.max_rel == 0.5
    assert not d.close


def test_difference_is_quiet_within_tolerance_and_loud_just_outside():
    expected = torch.tensor([1.0, -2.0])
    assert difference(expected * (1 + 5e-6), expected, FP32).close
    assert not difference(expected * (1 + 5e-5), expected, FP32).close
    assert difference(expected * (1 + 1e-2), expected, BF16).close
    assert not difference(expected * (1 + 5e-2), expected, BF16).close


def test_nan_never_matches():
    d = difference(torch.tensor([float("nan")]), torch.tensor([1.0]), FP32)
    assert not d.close


def test_index_of_a_matrix_is_unravelled():
    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 2] = 1.0
    assert difference(a, b, FP32).max_abs_index == (1, 2)


def test_diagnoses_not_synced():
    h = hyp()
    assert diagnose(h.local, h, FP32) == ("not_synced", None)


def test_diagnoses_synced_early():
    h = hyp(expected=torch.tensor([1.0, 2.0, 3.0]), expected_sync=False)
    assert diagnose(h.synced, h, FP32) == ("synced_early", None)


def test_diagnoses_wrong_scale_with_its_factor():
    h = hyp()
    kind, factor = diagnose(h.expected * 2.0, h, FP32)
    assert kind == "wrong_scale" and abs(factor - 2.0) < 1e-9


def test_diagnoses_stale_gradient_left_from_the_last_window():
    h = hyp()
    assert diagnose(h.expected + h.previous, h, FP32)[0] == "stale"


def test_anything_else_is_a_mismatch():
    h = hyp()
    assert diagnose(torch.tensor([9.0, 9.0, -9.0]), h, FP32) == ("mismatch", None)


def test_no_sync_diagnosis_when_synced_and_local_are_alike():
    same = torch.tensor([1.0, 2.0, 3.0])
    h = hyp(local=same, synced=same, expected=same * 3)
    assert diagnose(same, h, FP32)[0] != "not_synced"


def test_distinguishable_needs_a_margin_far_beyond_the_tolerance():
    a = torch.tensor([1.0, 1.0])
    assert not distinguishable(a, a * (1 + 2e-5), FP32)
    assert distinguishable(a, a * 1.01, FP32)
    assert not distinguishable(a, a * 1.01, BF16)


def test_fitted_scale():
    e = torch.tensor([1.0, -2.0])
    assert abs(fitted_scale(e * 3, e) - 3.0) < 1e-12
    assert fitted_scale(e, torch.zeros(2)) is None


def test_failure_message_names_where_and_what():
    d = difference(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 4.0, 3.0]), FP32)
    failure = make_failure(rank=1, step=3, where="step 3 (epoch 0, batch 2)", model="gen", param="weight",
                           checked="grad", kind="not_synced", factor=None, diff=d, tol=FP32)
    lines = failure.message.splitlines()
    assert lines[0].startswith("gradient of 'gen.weight' on rank 1 at step 3 (epoch 0, batch 2): not synced")
    assert lines[1] == "Mismatched elements: 1 / 3 (33.3%)"
    assert lines[2] == "Greatest absolute difference: 2 at index (1,) (up to 1e-06 allowed)"
    assert lines[3].startswith("Greatest relative difference: 0.5 at index (1,)")
    assert (failure.rank, failure.step, failure.model, failure.param, failure.kind) == (1, 3, "gen", "weight", "not_synced")
