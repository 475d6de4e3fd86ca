"""The diagnosis of what a wrong gradient is instead: not synced, synced early, stale, scaled, or a mismatch."""

import pytest
import torch

from harness.rank.closeness import Expectation
from harness.rank.diagnosis import Hypotheses, diagnose, fitted_scale


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
