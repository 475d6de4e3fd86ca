"""The oracle's fp16: the loss scaled by a gradient scaler, the gradients unscaled before a clip, the
step through the scaler. Judged against torch's own GradScaler and autocast on CPU (accelerate runs
fp16 only on an accelerator device, where the catalogue's fp16 cells check the rest)."""

from __future__ import annotations

import pytest
import torch

from harness.rank.judging.checks import checked
from harness.rank.judging.recorder import Recorder
from harness.rank.models import make_model, regression_loss
from harness.rank.oracle.core import Oracle
from harness.rank.oracle.schedule import accumulation_schedule
from harness.wrappers.cell import CellConfig


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen)


def fp16_loop(num_steps: int, *, clip: float | None = None, fault: str | None = None) -> Recorder:
    """A user's fp16 loop as accelerate runs it (forward under autocast, outputs back to fp32, the
    loss divided by the steps and scaled, unscale before a clip, the step through the scaler),
    checked against the oracle after every backward, clip and step. ``fault``: ``unscaled`` (the loss
    is not scaled) or ``bypass`` (the optimizer steps on the scaled gradients, past the scaler)."""
    model = make_model("regressor", 7)
    recorder = Recorder(rank=0)
    oracle = checked(Oracle({"model": model}, CellConfig(precision="fp16", num_steps=num_steps), recorder=recorder,
                            optimizer=sgd))
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    models = {"model": model}
    for point in accumulation_schedule(5, epochs=2, num_steps=num_steps):
        x, y = batch(point.index)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) / num_steps
        (loss if fault == "unscaled" else scaler.scale(loss)).backward()
        oracle.backward(lambda m: regression_loss(m["model"], (x, y)), sync=point.sync)
        oracle.check_grads(point, models)
        if point.optimizer_step:
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                oracle.clip_grad_norm(clip)
                oracle.check_grads(point, models)
            if fault is None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, models, {"model": optimizer})
    return recorder


@pytest.mark.parametrize("num_steps", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_correct_fp16_loop_with_a_gradient_scaler_matches_the_oracle(num_steps, clip):
    recorder = fp16_loop(num_steps, clip=clip)
    assert recorder.failures == []
    assert recorder.grad_checks >= 10


def test_an_unscaled_fp16_backward_is_wrong_scale_by_the_scale():
    recorder = fp16_loop(2, fault="unscaled")
    first = recorder.failures[0]
    assert (first.step, first.kind) == (1, "wrong_scale")
    assert first.factor == 1 / 65536  # the default initial scale, exactly


def test_a_step_past_the_scaler_is_a_parameter_mismatch_where_the_gradients_were_right():
    recorder = fp16_loop(1, fault="bypass")
    assert {f.checked for f in recorder.failures} == {"param"}
    assert recorder.failures[0].step == 1
