"""The fault registry: every fault patches something and puts back exactly what was there."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from harness.selfcheck import planted
from harness.selfcheck.faults import FAULTS, apply_fault, resolve
from harness.selfcheck.perturbations import perturbation

TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _classes():
    """Every class (or module) a fault may patch, with a snapshot of its own attributes."""
    import accelerate.accelerator
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.state import GradientState
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    classes = [accelerate.accelerator, Accelerator, AcceleratedOptimizer, AcceleratedScheduler, GradientState, DataLoaderDispatcher,
               DataLoaderShard, DeepSpeedEngineWrapper, FSDPModule, FullyShardedDataParallel, _fsdp_collectives,
               _fsdp_param_group]
    try:  # DeepSpeed's own classes, where a fault patches DeepSpeed itself (the [deepspeed] extra)
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.engine import DeepSpeedEngine

        classes += [BF16_Optimizer, DeepSpeedEngine]
    except ImportError:
        pass
    if TRANSFORMERS:  # transformers' Trainer, where a fault patches it (the Trainer cases' faults)
        from transformers import Trainer, TrainingArguments

        classes += [Trainer, TrainingArguments]
    return classes


def _snapshot():
    return {cls: dict(vars(cls)) for cls in _classes()}


def _changes(before, after):
    changed = []
    for cls in before:
        for name in set(before[cls]) | set(after[cls]):
            if before[cls].get(name, planted._ABSENT) is not after[cls].get(name, planted._ABSENT):
                changed.append(f"{cls.__name__}.{name}")
    return sorted(changed)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_fault_patches_and_restores_the_original_attributes(name):
    if name.startswith("trainer_") and not TRANSFORMERS:
        pytest.skip("transformers is not installed: a Trainer fault patches nothing there (by design)")
    before = _snapshot()
    for rank in (0, 1):
        with apply_fault(name, rank=rank):
            during = _snapshot()
            assert _changes(before, during), f"{name} patched nothing on rank {rank}"
        assert _changes(before, _snapshot()) == []


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_fault_restores_the_originals_when_the_body_raises(name):
    before = _snapshot()
    with pytest.raises(RuntimeError, match="case body"):
        with apply_fault(name, rank=1):
            raise RuntimeError("case body")
    assert _changes(before, _snapshot()) == []


def test_every_fault_has_a_one_line_description():
    for fault in FAULTS.values():
        assert fault.description and "\n" not in fault.description, fault.name
        assert fault.name == fault.name.strip() and " " not in fault.name


def test_static_and_property_attributes_come_back_as_what_they_were():
    from accelerate import Accelerator
    from accelerate.state import GradientState

    with apply_fault("trigger_noop", rank=0):
        pass
    assert isinstance(inspect.getattr_static(Accelerator, "trigger_sync_in_backward"), staticmethod)
    with apply_fault("no_dataloader_end_sync", rank=0):
        pass
    assert isinstance(inspect.getattr_static(GradientState, "end_of_dataloader"), property)


def test_an_inherited_attribute_is_removed_again_not_copied_down():
    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    with planted._patched(Child, "method", lambda self: "patched"):
        assert Child().method() == "patched"
    assert "method" not in vars(Child) and Child().method() == "base"


def test_patching_a_missing_attribute_is_an_error():
    class Plain:
        pass

    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        with planted._patched(Plain, "missing", None):
            pass


def test_no_fault_is_no_patch():
    before = _snapshot()
    with apply_fault(None, rank=0):
        assert _changes(before, _snapshot()) == []


def test_perturbations_resolve_by_name_and_bad_names_are_rejected():
    assert resolve("perturb:0.001").description == perturbation(1e-3).description
    assert resolve("perturb_once:1e-05@3").description == perturbation(1e-5, only=3).description
    assert resolve("perturb_once:1e-05").name == "perturb_once:1e-05@1"
    for bad in ("perturb:lots", "perturb_once:1e-5@two", "perturb:1e-5@2", "perturb_once:1e-5@0"):
        with pytest.raises(ValueError, match=r"fault 'perturb"):
            resolve(bad)
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        resolve("nope")


def test_there_are_at_least_eight_sync_faults():
    sync_faults = [name for name in FAULTS if "perturb" not in name and name != "rank_grad_perturbed"]
    assert len(sync_faults) >= 8


def test_a_single_event_perturbation_scales_one_rank_after_one_backward_only():
    """perturb_once:r@n: rank 1's gradients scaled by 1 + r after its n-th backward of the cell, and
    never again; the other ranks untouched."""
    import torch
    from accelerate import Accelerator

    from harness.wrappers.probe import reset_accelerate as _reset_accelerate

    def grads_after_backwards(rank):
        _reset_accelerate()
        model = torch.nn.Linear(2, 1, bias=False)
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(model)
        seen = []
        with apply_fault("perturb_once:0.5@2", rank=rank):
            for _ in range(3):
                model.zero_grad()
                accelerator.backward(model(torch.ones(1, 2)).sum())
                seen.append(float(model.weight.grad[0, 0]))
        _reset_accelerate()
        return seen

    assert grads_after_backwards(1) == [1.0, 1.5, 1.0]
    assert grads_after_backwards(0) == [1.0, 1.0, 1.0]


def test_a_perturbation_under_half_a_bf16_ulp_leaves_a_bf16_gradient_as_it_was():
    """Why the cells whose wrapper holds a gradient in bf16 at the perturbed backward (FSDP2 and FSDP1
    under accelerate's bf16 policy, between syncs) let 1e-6 and 1e-3 through (bench/README.md): x * (1 + r)
    rounds back to x in bf16 for every x while r is under half its smallest relative ulp, 2^-9 (1.95e-3),
    so there is no error left in the wrapper's state to find; 1e-2 moves nearly every element."""
    import torch

    from harness.selfcheck.perturbations import _scale

    grad = (torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 10).to(torch.bfloat16)
    for relative in (1e-6, 1e-3, 2.0 ** -9 * 0.99):
        scaled = grad.clone()
        _scale(scaled, relative)
        assert torch.equal(scaled, grad), relative
    scaled = grad.clone()
    _scale(scaled, 1e-2)
    assert (scaled != grad).float().mean() > 0.9
