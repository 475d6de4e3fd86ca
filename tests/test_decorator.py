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
