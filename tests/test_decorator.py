"""The case decorator: canaries name what they must produce, and a case name identifies one function."""

import pytest

from harness import Diagnosis, Variant, case
from harness.decorator import case_info


def test_a_canary_must_name_the_diagnoses_it_produces():
    with pytest.raises(TypeError, match="not canary=True"):
        case("decorator_test_bare_canary", canary=True)
    with pytest.raises(TypeError, match="takes Diagnosis"):
        case("decorator_test_string_canary", canary=["not_synced"])

    @case("decorator_test_canary", variants=[Variant("v")], canary=Diagnosis("not_synced", model="gen"))
    def test_canary(ctx):
        pass

    info = case_info(test_canary)
    assert info.canary and info.detects == (Diagnosis("not_synced", model="gen"),)
    assert str(info.detects[0]) == "not_synced in gen"
    assert not info.detects[0].observable(1) and info.detects[0].observable(2)
    assert Diagnosis("stepped_early").observable(1)


def test_a_case_name_is_one_function():
    def define(name):
        @case(name, variants=[Variant("v")])
        def test_one(ctx):
            pass

        return test_one

    first = define("decorator_test_twice")
    assert case_info(define("decorator_test_twice")).name == "decorator_test_twice"  # the same function again

    with pytest.raises(ValueError, match="case 'decorator_test_twice' is defined twice: .*test_decorator.py:"):
        @case("decorator_test_twice", variants=[Variant("v")])
        def test_other(ctx):
            pass

    assert case_info(first).name == "decorator_test_twice"


def test_a_defect_of_some_releases_is_expected_only_while_the_installed_release_has_it():
    from harness import versions

    torch_version = versions.installed("torch")
    still = Diagnosis("wrong_scale", model="model", fixed_in={"torch": "999.0"}, upstream="pytorch/pytorch#149768")
    gone = Diagnosis("wrong_scale", model="model", fixed_in={"torch": "2.0"})
    assert still.applies_to({}) and still.present() and not gone.applies_to({}) and not gone.present()
    assert still.described() == "wrong_scale in model (pytorch/pytorch#149768, fixed in torch 999.0)"
    assert still == Diagnosis("wrong_scale", model="model", fixed_in=(("torch", "999.0"),),
                              upstream="pytorch/pytorch#149768")
    # the catalogue's own: torch before 2.10 adds clip_grad_norm_'s epsilon on every rank under FSDP2
    from pathlib import Path

    from harness.catalogue import find_case

    root = Path(__file__).resolve().parent.parent
    info = find_case(root / "cases" / "test_accumulate_optim.py", "test_accumulate_clip_grad")
    fsdp2 = Variant("steps=2-fp32-wrapper=fsdp2", {"steps": 2, "precision": "fp32", "wrapper": "fsdp2"})
    declared = info.detects_for(fsdp2)
    assert bool(declared) == (versions._release(torch_version) < (2, 10))
    assert [d.upstream for d in info.defects["fsdp2"]] == ["pytorch/pytorch#149768"]


def test_a_defect_that_a_later_release_brought_is_expected_only_from_that_release_on():
    before = Diagnosis("wrong_scale", model="model", since={"torch": "999.0"})
    after = Diagnosis("wrong_scale", model="model", since={"torch": "2.0"}, fixed_in={"torch": "999.0"},
                      upstream="huggingface/transformers#47688")
    assert not before.present() and not before.applies_to({})
    assert after.present() and after.applies_to({})
    assert after.described() == ("wrong_scale in model (huggingface/transformers#47688, since torch 2.0, "
                                 "fixed in torch 999.0)")
    assert after == Diagnosis("wrong_scale", model="model", since=(("torch", "2.0"),), fixed_in={"torch": "999.0"},
                              upstream="huggingface/transformers#47688")


def test_a_declared_raise_names_the_words_the_library_raises():
    assert Diagnosis("raised", match="uniform gradient dtype").match == "uniform gradient dtype"
    with pytest.raises(ValueError, match="match= is given with kind 'raised' only"):
        Diagnosis("raised")
    with pytest.raises(ValueError, match="match= is given with kind 'raised' only"):
        Diagnosis("not_synced", match="anything")
    with pytest.raises(Exception, match="unterminated|missing"):
        Diagnosis("raised", match="(unclosed")


def test_only_the_declared_words_raised_inside_the_library_count():
    import torch

    from harness.rank.process.raises import declared_raise

    declared = [Diagnosis("raised", match="positive integer"), Diagnosis("not_synced")]
    try:
        torch.utils.data.BatchSampler(range(4), batch_size=0, drop_last=False)
    except ValueError as exc:
        failure = declared_raise(declared, exc, rank=1, step=3)
        other = declared_raise([Diagnosis("raised", match="uniform gradient dtype")], exc, rank=1, step=3)
    assert failure is not None and other is None
    assert (failure.rank, failure.step, failure.kind, failure.checked) == (1, 3, "raised", "raise")
    assert failure.message.startswith("torch raised ValueError: batch_size should be a positive integer value")
    assert "(torch/utils/data/sampler.py:" in failure.message
    try:  # the same words, raised here: not the library's
        raise ValueError("batch_size should be a positive integer value")
    except ValueError as exc:
        assert declared_raise(declared, exc, rank=1, step=3) is None
