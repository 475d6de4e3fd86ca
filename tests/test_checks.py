"""A failure of a check reads like assert_close, with where, what and the diagnosis added."""

import torch

from harness.rank.judging.recorder import make_failure
from harness.rank.numerics.closeness import Expectation, difference


def exact(values):
    return Expectation.rounded(torch.tensor(values))


def test_failure_message_names_where_and_what_and_what_was_allowed_there():
    d = difference(torch.tensor([1.0, 2.0, 3.0]), exact([1.0, 4.0, 3.0]))
    failure = make_failure(rank=1, step=3, where="step 3 (epoch 0, batch 2)", model="gen", param="weight",
                           checked="grad", kind="not_synced", factor=None, diff=d)
    lines = failure.message.splitlines()
    assert lines[0].startswith("gradient of 'gen.weight' on rank 1 at step 3 (epoch 0, batch 2): not synced")
    assert lines[1] == "Mismatched elements: 1 / 3 (33.3%)"
    assert lines[2] == "Greatest absolute difference: 2 at index (1,) (up to 9.5e-07 allowed there)"
    assert lines[3].startswith("Greatest relative difference: 0.5 at index (1,) (up to 2.4e-07 allowed there)")
    assert (failure.rank, failure.step, failure.model, failure.param, failure.kind) == (1, 3, "gen", "weight", "not_synced")
    assert failure.atol == d.allowed_abs
    param = make_failure(rank=0, step=2, where="step 2", model="m", param="w", checked="param",
                         kind="step_skipped", factor=None, diff=d)
    assert param.message.startswith("update of parameter 'm.w' on rank 0 at step 2: the optimizer did not step")
