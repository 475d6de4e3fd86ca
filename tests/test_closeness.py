"""Closeness to the oracle within bounds derived from the arithmetic: the allowances, the difference
measured as assert_close measures it, and when two hypotheses can be told apart."""

import random

import pytest
import torch

from harness.rank.numerics.closeness import (
    Expectation,
    difference,
    distinguishable,
    norm_rounding,
    reduction_allowance,
    rounding_allowance,
)

EPS32 = torch.finfo(torch.float32).eps


def exact(values):
    return Expectation.rounded(torch.tensor(values))


def test_difference_reports_like_assert_close_with_the_allowance_where_it_is_greatest():
    d = difference(torch.tensor([1.0, 2.0, 3.0]), exact([1.0, 4.0, 3.0]))
    assert (d.mismatched, d.numel) == (1, 3)
    assert d.max_abs == 2.0 and d.max_abs_index == (1,)
    assert d.allowed_abs == pytest.approx(2 * EPS32 * 4.0, rel=1e-6)
    assert d.max_rel == 0.5
    assert not d.close


def test_a_rounding_allowance_is_two_ulps_of_the_larger_value():
    expected = torch.tensor([1.0, -2.0])
    assert difference(expected * (1 + EPS32), Expectation.rounded(expected)).close
    assert not difference(expected * (1 + 1e-6), Expectation.rounded(expected)).close
    # zeros are held to the floor alone: the smallest normal number, not a relative bound
    zero = Expectation.rounded(torch.zeros(1))
    assert difference(torch.tensor([1e-39]), zero).close
    assert not difference(torch.tensor([1e-30]), zero).close


def test_bf16_autocast_gradients_are_fp32_and_get_fp32_allowances():
    g = torch.tensor([0.5, -0.25])
    assert torch.equal(rounding_allowance(g), 2 * EPS32 * g.double().abs() + torch.finfo(torch.float32).tiny)
    low = g.to(torch.bfloat16)
    assert float(rounding_allowance(low)[0]) == pytest.approx(2 * torch.finfo(torch.bfloat16).eps * 0.5)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_reduction_bound_holds_divide_then_sum_against_sum_then_divide_in_any_order(world_size):
    """The bound is derived, not tuned: check it against the two orders DDP and the oracle use, on
    values chosen to cancel and to round badly, in every summation order of the ranks."""
    rng = random.Random(world_size)
    worst = 0.0
    for _ in range(200):
        grads = torch.tensor([[rng.choice([-1, 1]) * rng.uniform(0.5, 2.0) * 10.0 ** rng.randint(-3, 3)
                               for _ in range(16)] for _ in range(world_size)], dtype=torch.float32)
        magnitude = grads.double().abs().sum(0)
        allowed = reduction_allowance(magnitude, dtype=torch.float32)
        for _ in range(6):
            oracle_order = rng.sample(range(world_size), world_size)
            rank_order = rng.sample(range(world_size), world_size)
            oracle = torch.zeros(16)
            rank_side = torch.zeros(16)
            for r, q in zip(oracle_order, rank_order):
                oracle = oracle + grads[r]
                rank_side = rank_side + grads[q] / world_size
            oracle = oracle / world_size
            gap = (oracle.double() - rank_side.double()).abs()
            assert bool((gap <= allowed).all())
            worst = max(worst, float((gap / allowed).max()))
    # from three ranks on the orders differ somewhere, so the bound was tested, not trivially met
    # (two ranks: a + b is b + a and halving is exact, so DDP and the oracle agree bit for bit)
    assert worst > 0.0 if world_size > 2 else worst == 0.0
    print(f"world size {world_size}: worst difference {worst:.3f} of the allowance")


def test_a_one_off_error_of_1e5_exceeds_the_reduction_bound():
    grads = torch.tensor([[0.3, -0.2, 0.1], [0.5, 0.1, -0.4]])
    average = grads.sum(0) / 2
    expected = Expectation(average, reduction_allowance(grads.double().abs().sum(0), dtype=torch.float32))
    assert difference(average, expected).close
    assert not difference(average * (1 + 1e-5), expected).close


def test_nan_never_matches():
    assert not difference(torch.tensor([float("nan")]), exact([1.0])).close


def test_index_of_a_matrix_is_unravelled():
    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 2] = 1.0
    assert difference(a, Expectation.rounded(b)).max_abs_index == (1, 2)


def test_distinguishable_needs_a_margin_far_beyond_both_allowances():
    a = torch.tensor([1.0, 1.0])
    assert not distinguishable(Expectation.rounded(a), Expectation.rounded(a * (1 + 8 * EPS32)))
    assert distinguishable(Expectation.rounded(a), Expectation.rounded(a * (1 + 1e-4)))


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_the_clip_coefficient_bound_holds_for_norms_summed_in_any_order_and_shard_split(shards):
    """A clip's coefficient max_norm / (norm + 1e-6) computed from the squares summed in two orders
    (the oracle's whole gradient, a rank's shards then across the ranks) stays within
    norm_rounding of each other: derived from the arithmetic, and met by real orders."""
    rng = random.Random(shards)
    worst = 0.0
    for _ in range(300):
        count = rng.randint(8, 64)
        grads = torch.tensor([rng.choice([-1, 1]) * rng.uniform(0.5, 2.0) * 10.0 ** rng.randint(-6, -3)
                              for _ in range(count)], dtype=torch.float32)
        norm = float(torch.linalg.vector_norm(grads.double()))
        max_norm = norm / 3

        def coefficient(order, pieces):
            squares = [grads[i] * grads[i] for i in order]
            cut = [len(order) * k // pieces for k in range(pieces + 1)]
            partials = [torch.stack(squares[a:b]).sum() if b > a else torch.zeros(()) for a, b in zip(cut, cut[1:])]
            total = torch.zeros(())
            for p in rng.sample(partials, len(partials)):
                total = total + p
            return float(torch.tensor(max_norm, dtype=torch.float32) / (total.sqrt() + 1e-6))

        whole = coefficient(list(range(count)), 1)
        sharded = coefficient(rng.sample(range(count), count), shards)
        allowed = norm_rounding(count, torch.float32)
        gap = abs(whole - sharded) / whole
        assert gap <= allowed
        worst = max(worst, gap / allowed)
    assert worst > 0.0  # the orders did differ: the bound was tested
    print(f"{shards} shards: worst difference {worst:.3f} of the allowance")


# The comparisons run in fp32, chunk by chunk, and must decide as a float64 comparison of every element
# does (closeness.all_close, all_close_updates, any_distinguishable): against a float64 reference, on
# values at their allowance's edge, non-finite ones, zero (0-dim) allowances and tensors of more than a chunk.

def _as_float64(pairs):
    from harness.rank.numerics.closeness import _abs_diff

    diffs = [_abs_diff(a.double(), e.value.double()) for a, e in pairs]
    close = all(not bool((d > e.allowed.double().expand_as(d)).any()) for d, (_, e) in zip(diffs, pairs))
    return close, max(float(d.max()) for d in diffs)


def _edge(generator, n, allowed):
    return (torch.rand(n, generator=generator) * 2 - 1) * allowed * float(
        torch.tensor([0.999, 1.0, 1.0001, 0.5, 3.0])[torch.randint(5, (1,), generator=generator)])


@pytest.mark.parametrize("seed", range(12))
def test_fp32_comparisons_decide_as_float64_ones_do(seed):
    from harness.rank.numerics.closeness import all_close, no_allowance

    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for n in (1, 5, 100, 70_000, (1 << 20) + 3)[:2 + seed % 4]:
        value = torch.randn(n, generator=generator) * 10.0 ** (seed % 7 - 3)
        allowed = rounding_allowance(value) if seed % 3 else no_allowance()
        actual = value + _edge(generator, n, allowed if allowed.dim() else rounding_allowance(value))
        if seed % 5 == 0:
            actual[0] = float("nan")
            actual[-1] = float("inf")
        pairs.append((actual.float(), Expectation(value, allowed)))
    assert all_close(pairs) == _as_float64(pairs)


@pytest.mark.parametrize("seed", range(8))
def test_fp32_update_comparisons_decide_as_float64_ones_do(seed):
    from harness.rank.numerics.closeness import _abs_diff, all_close_updates

    generator = torch.Generator().manual_seed(seed)
    triples = []
    for n in (7, 70_000, (1 << 20) + 5)[:1 + seed % 3]:
        before = torch.randn(n, generator=generator) * 10.0 ** (seed % 5 - 2)
        after = before - torch.randn(n, generator=generator) * 10.0 ** -(seed % 6)
        actual = after + _edge(generator, n, rounding_allowance(after, before))
        triples.append((actual, after, before))
    diffs = [_abs_diff(a.double() - b.double(), o.double() - b.double()) for a, o, b in triples]
    expected = (all(not bool((d > rounding_allowance(o, b).double()).any()) for d, (_, o, b) in zip(diffs, triples)),
                max(float(d.max()) for d in diffs))
    assert all_close_updates(triples) == expected


@pytest.mark.parametrize("seed", range(8))
def test_telling_hypotheses_apart_in_fp32_decides_as_float64_does(seed):
    from harness.rank.numerics.closeness import any_distinguishable

    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for n in (3, 70_000, (1 << 20) + 1)[:1 + seed % 3]:
        local = torch.randn(n, generator=generator)
        synced = local * (1 + (torch.rand(n, generator=generator) * 2 - 1) * [1e-7, 1e-6, 1e-5, 0.0][seed % 4])
        pairs.append((Expectation.rounded(local), Expectation(synced, rounding_allowance(synced) * (1 + seed % 2))))
    reference = any(bool(((a.value.double() - b.value.double()).abs()
                          > 10.0 * (a.allowed.double() + b.allowed.double())).any()) for a, b in pairs)
    assert any_distinguishable(pairs) == reference
    # a bare tensor first stands for its rounding allowance, made chunk by chunk
    assert any_distinguishable([(a.value, b) for a, b in pairs]) == reference


def test_a_zero_allowance_is_one_number_for_every_element():
    from harness.rank.numerics.closeness import all_close, no_allowance

    zero = Expectation(torch.tensor([1.0, -2.0]), no_allowance())
    assert zero.allowed.dim() == 0 and zero.allowed.dtype == torch.float32
    assert all_close([(torch.tensor([1.0, -2.0]), zero)]) == (True, 0.0)
    assert not all_close([(torch.tensor([1.0, -2.0 * (1 + EPS32)]), zero)])[0]
    assert not difference(torch.tensor([1.0, -2.0 * (1 + EPS32)]), zero).close


def test_an_element_whose_fp32_difference_rounds_onto_its_allowance_is_measured_in_float64():
    """1 - 2^-24 minus -2^-30 is 1 - 2^-24 + 2^-30 exactly, over an allowance of 1 - 2^-24, but rounds
    to the allowance in fp32: only the margin the fp32 test keeps sends it to float64, where it fails."""
    from harness.rank.numerics.closeness import all_close

    allowance = torch.tensor([1 - 2.0 ** -24])
    actual, value = torch.tensor([1 - 2.0 ** -24]), torch.tensor([-2.0 ** -30])
    assert float((actual - value).abs()) == float(allowance)  # in fp32: on the bound
    assert all_close([(actual, Expectation(value, allowance))])[0] is False
