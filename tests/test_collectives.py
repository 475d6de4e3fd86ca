"""The oracle's collectives (harness/rank/numerics/collectives.py) on real gloo ranks: one all-reduce carries several
reductions and rank 0's waiting copies, bit for bit what they would be alone; a copy waits for the
next all-reduce of its dtype or for ``finish``; digests name the ranks that differ. And the flight
recorder's reading of a backward (harness/rank/numerics/accounting.py) from its records' own times."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

from harness.rank.numerics.accounting import _issued_since


def _issued() -> int:
    import torch.distributed as dist

    return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())


def _tensors(rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return {"w": torch.randn(3, 4, generator=generator, dtype=dtype),
            "b": torch.randn(4, generator=generator, dtype=dtype)}


def _reductions(rank: int, world_size: int) -> dict[str, object]:
    from harness.rank.numerics.collectives import Collectives, Reduction

    collectives = Collectives(rank=rank, world_size=world_size)
    a, b = _tensors(rank), _tensors(rank + 10)
    carried = {k: v.abs().double() * 1e-7 for k, v in a.items()}
    wide = _tensors(rank, torch.float64)
    alone = [collectives.reduce_all([r])[0] for r in (Reduction(a, carried), Reduction(b), Reduction(wide))]
    before = _issued()
    together = collectives.reduce_all([Reduction(a, carried), Reduction(b), Reduction(wide)])
    issued = _issued() - before
    same = all(torch.equal(x[k].value, y[k].value) and torch.equal(x[k].allowed, y[k].allowed)
               for x, y in zip(alone, together) for k in x)
    expected = sum(_tensors(r)["w"] for r in range(world_size)) / world_size
    return {"same": same, "issued": issued, "dtypes": [str(together[i]["w"].value.dtype) for i in range(3)],
            "average": torch.allclose(together[0]["w"].value, expected, rtol=1e-6)}


def test_one_all_reduce_per_dtype_carries_several_reductions_each_bit_for_bit_as_alone():
    for result in run_on_ranks(_reductions, 2):
        assert result["same"] and result["average"]
        assert result["issued"] == 2  # float32 (two reductions) and float64 (one)
        assert result["dtypes"] == ["torch.float32", "torch.float32", "torch.float64"]


def _waiting(rank: int, world_size: int) -> dict[str, object]:
    from harness.rank.numerics.collectives import Collectives, Reduction

    collectives = Collectives(rank=rank, world_size=world_size)
    got: dict[str, dict] = {}
    collectives.later(_tensors(rank), lambda copy: got.setdefault("first", copy), wait=True)
    collectives.later(_tensors(rank, torch.float64), lambda copy: got.setdefault("wide", copy), wait=True)
    waited = sorted(got)
    before = _issued()
    collectives.reduce_all([Reduction(_tensors(rank + 10))])  # float32: the first copy rides along
    after_reduce = (_issued() - before, sorted(got))
    collectives.finish()  # the float64 copy alone
    after_finish = (_issued() - before, sorted(got))
    collectives.finish()  # nothing waits: no collective
    rank0, rank0_wide = _tensors(0), _tensors(0, torch.float64)
    return {"waited": waited, "after_reduce": after_reduce, "after_finish": after_finish,
            "last": _issued() - before,
            "rank0": all(torch.equal(got["first"][k], rank0[k]) and torch.equal(got["wide"][k], rank0_wide[k])
                         for k in rank0)}


def test_rank0_copies_wait_for_the_next_all_reduce_of_their_dtype_or_finish_and_are_rank0s_bit_for_bit():
    for result in run_on_ranks(_waiting, 3):
        assert result["waited"] == []
        assert result["after_reduce"] == (1, ["first"])
        assert result["after_finish"] == (2, ["first", "wide"])
        assert result["last"] == 2
        assert result["rank0"]


def _at_once(rank: int, world_size: int) -> bool:
    from harness.rank.numerics.collectives import Collectives

    got = []
    Collectives(rank=rank, world_size=world_size).later(_tensors(rank), got.append, wait=False)
    return len(got) == 1 and all(torch.equal(got[0][k], v) for k, v in _tensors(0).items())


def test_a_copy_that_need_not_wait_comes_at_once():
    assert run_on_ranks(_at_once, 2) == [True, True]


def _digests(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    from harness.rank.numerics.collectives import Collectives

    collectives = Collectives(rank=rank, world_size=world_size)
    alike = [torch.arange(6.0).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)]
    apart = [t.clone() for t in alike]
    if rank == 2:
        apart[1][0] += 2.0**-7  # bfloat16's next value after 1: one bit
    return collectives.same_everywhere(alike), collectives.same_everywhere(apart)


def test_digests_name_every_rank_that_differs_from_rank0_on_every_rank():
    assert run_on_ranks(_digests, 3) == [([], [2])] * 3


def test_a_digest_tells_apart_what_a_sum_of_the_words_cannot():
    """Bytes alike give one digest; two words swapped, one bit changed, a reshape, another dtype of the
    same bytes, and a difference past the first chunk each give another."""
    from harness.rank.numerics.collectives import DIGEST_CHUNK, digest

    values = torch.randn(2 * DIGEST_CHUNK + 3)  # a chunk of 64-bit words, a second of one word, 4 bytes over
    base = digest([values])
    assert digest([values.clone()]) == base
    swapped = values.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    swapped_words = values.clone()
    swapped_words[[2 * 10, 2 * 10 + 1, 2 * 12, 2 * 12 + 1]] = values[[2 * 12, 2 * 12 + 1, 2 * 10, 2 * 10 + 1]]
    one_bit = values.clone()
    one_bit.view(torch.int32)[2 * DIGEST_CHUNK] ^= 1  # the second chunk's word
    tail = values.clone()
    tail[-1] = torch.nextafter(tail[-1], torch.tensor(float("inf")))
    others = [digest([t]) for t in (swapped, swapped_words, one_bit, tail)]
    others += [digest([values[:-3].reshape(2, -1)]), digest([values[:-3]]), digest([values[:-3].view(torch.int32)])]
    assert base not in others[:4] and len({tuple(d) for d in others}) == len(others)
    assert all(0 <= word < 1 << 16 for word in base) and len(base) == 6  # 16-bit words, exact in fp32


def _rank0_values(rank: int, world_size: int) -> tuple[bool, list[float], bool]:
    from harness.rank.numerics.collectives import Collectives

    collectives = Collectives(rank=rank, world_size=world_size)
    alike = {"w": torch.arange(6.0).reshape(2, 3)}
    same = collectives.rank0_values(alike)["w"] is alike["w"]  # no copy travels where every digest agrees
    apart = {"w": torch.arange(6.0).reshape(2, 3) + (1e-6 if rank == 1 else 0.0)}
    got = collectives.rank0_values(apart)["w"]
    return same, got.reshape(-1).tolist(), got is apart["w"]


def test_rank0s_copy_travels_only_where_a_digest_differs_and_then_to_every_rank():
    got = run_on_ranks(_rank0_values, 3)
    assert all(same for same, _, _ in got)
    assert all(values == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] for _, values, _ in got)  # rank 1's own is not rank 0's
    assert [own for _, _, own in got] == [False, False, False]  # a broadcast, on every rank


def _entry(record_id: int, at_ns: int, name: str = "gloo:all_reduce") -> dict:
    return {"record_id": record_id, "time_created_ns": at_ns, "profiling_name": name, "input_sizes": [[4]]}


def test_a_backward_is_read_from_the_records_made_since_it_began():
    ring = [_entry(7, 100), _entry(8, 200, "gloo:broadcast"), _entry(9, 300), _entry(10, 301)]
    backward = _issued_since(ring, 250)
    assert backward.complete and backward.reductions == [("gloo:all_reduce", 4), ("gloo:all_reduce", 4)]
    assert _issued_since(ring, 400).reductions == [] and _issued_since(ring, 400).complete


def test_a_backward_whose_records_the_ring_may_have_lost_is_not_claimed_complete():
    full_of_new = [_entry(7, 300), _entry(8, 301)]  # nothing from before the backward is left
    assert not _issued_since(full_of_new, 250).complete
    never_wrapped = [_entry(0, 300), _entry(1, 301)]  # the first record ever made: nothing was lost
    assert _issued_since(never_wrapped, 250).complete
    assert not _issued_since(None, 250).complete
    assert not _issued_since([{"record_id": 3, "profiling_name": "gloo:all_reduce"}], 250).complete


def test_only_a_check_before_its_schedules_last_point_waits_for_the_next_collective():
    """A check that could be the case's last sends rank 0's copy at once: a collective of the
    harness's after the case returned could meet a rank's stray one (tests/test_rank_faults.py's
    hang_in_collective must stay a hang)."""
    from harness.rank.context import RankContext

    ctx = RankContext(case="c", variant="fp32", params={"precision": "fp32"}, rank=0, world_size=2, seed=1,
                      device=torch.device("cpu"))
    schedule = ctx.schedule(5, epochs=2, num_steps=2)
    assert [ctx.made_schedules.more_after(p) for p in schedule] == [True] * (len(schedule) - 1) + [False]
    assert not ctx.made_schedules.more_after(1)  # a step given as a number: the case may end after it


def _fsdp2_reduce_scatter(rank, world_size, dtype_name):
    """Gradients of uneven shapes laid out as FSDP2 lays out one reduce-scatter's input (each padded
    along dim 0 and chunked, chunk c of every gradient concatenated: ``torch._chunk_cat``), through
    gloo's reduce-scatter with ReduceOp.AVG, against the oracle: its ring order (``ring_average``)
    and its bound for an unknown order (a Reduction ``summed_in`` the dtype)."""
    import torch
    import torch.distributed as dist

    from harness.rank.numerics.collectives import Collectives, Reduction
    from harness.rank.numerics.ring_order import ring_order_holds, ring_segments

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    shapes = [(5, 3), (2, 2), (5,), (world_size * 3, 1)]  # chunks of odd size at 2, 3 and 4 ranks

    def grads(r):
        g = torch.Generator().manual_seed(50 + r)
        return {i: (torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g) * 3)).to(dtype)
                for i, s in enumerate(shapes)}

    mine = grads(rank)
    rows = [-(-s[0] // world_size) for s in shapes]
    padded = [torch.cat([t, t.new_zeros((r * world_size - t.shape[0],) + t.shape[1:])]) for t, r in zip(mine.values(), rows)]
    flat_input = torch._chunk_cat(padded, dim=0, num_chunks=world_size).reshape(-1)
    out = torch.empty(flat_input.numel() // world_size, dtype=dtype)
    dist.reduce_scatter_tensor(out, flat_input, op=dist.ReduceOp.AVG)
    collectives = Collectives(rank=rank, world_size=world_size)
    wide = {i: t.float() for i, t in mine.items()}
    segments = dict(enumerate(ring_segments([torch.Size(s) for s in shapes], world_size)))
    ring = collectives.ring_average(wide, segments, dtype)
    [bound] = collectives.reduce_all([Reduction(wide, summed_in=dtype)])
    every = [grads(r) for r in range(world_size)]
    in_rank_order = {i: _summed_in_rank_order([e[i] for e in every], dtype) / world_size for i in mine}
    mine_of = []  # this rank's rows of each expectation, in the output's order
    for i, r in enumerate(rows):
        mine_of.append((ring[i].value[rank * r:(rank + 1) * r], bound[i].value[rank * r:(rank + 1) * r],
                        bound[i].allowed[rank * r:(rank + 1) * r]))
    at, ring_differ, outside, order_matters = 0, 0, 0, 0
    for i, ((ring_rows, bound_rows, allowed), r, s) in enumerate(zip(mine_of, rows, shapes)):
        n = r * (s[1] if len(s) > 1 else 1)
        got = out[at:at + n].float()[:ring_rows.numel()].reshape(ring_rows.shape)
        ring_differ += int((got != ring_rows).sum())
        outside += int(((got - bound_rows).abs() > allowed).sum())
        order_matters += int((got != in_rank_order[i][rank * r:(rank + 1) * r].float()).sum())
        at += n
    return ring_order_holds(world_size, dtype), ring_differ, outside, order_matters


def _summed_in_rank_order(values, dtype):
    total = values[0]
    for v in values[1:]:
        total = (total + v).to(dtype)
    return total


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gloos_reduce_scatter_of_fsdp2s_layout_is_the_ring_order_bit_for_bit_and_within_the_bound(world_size, dtype):
    """FSDP2's reduce-scatter on gloo, uneven shapes and odd chunks included (segments that are not
    the chunks): the oracle's ring order reproduces every element of every rank's shard, and the
    bound kept for an unknown order (another backend) holds it too."""
    results = run_on_ranks(_fsdp2_reduce_scatter, world_size, dtype)
    for why, ring_differ, outside, _ in results:
        assert (why, ring_differ, outside) == ("", 0, 0)
    if world_size > 2 and dtype == "bf16":  # not vacuous: the order shows, summed from rank 0 up it differs
        assert sum(order_matters for *_, order_matters in results) > 0


def _fsdp1_reduce_scatter(rank, world_size):
    """Gradients laid out as FSDP1's padded flat gradient (alignment padding between parameters, the
    whole padded to a multiple of the world size), each rank's divided by FSDP1's predivide factor,
    through gloo's reduce-scatter with ReduceOp.SUM, then divided by the postdivide factor (as
    FSDP1's ``_reduce_grad`` does), against ``ring_average`` with the same factors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    from harness.rank.numerics.collectives import Collectives
    from harness.rank.numerics.ring_order import flat_segments, ring_order_holds

    dtype = torch.bfloat16
    pre = float(DefaultState._get_gradient_predivide_factor(world_size))
    post = world_size / pre
    spans = [(0, 15), (16, 2), (24, 7)]  # numels 15, 2, 7 at aligned offsets, with gaps
    total = -(-31 // world_size) * world_size

    def grads(r):
        g = torch.Generator().manual_seed(70 + r)
        return {i: (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)).to(dtype)
                for i, (_, n) in enumerate(spans)}

    mine = grads(rank)
    flat_input = torch.zeros(total, dtype=dtype)
    for (offset, n), t in zip(spans, mine.values()):
        flat_input[offset:offset + n] = t
    if pre > 1:
        flat_input.div_(pre)
    out = torch.empty(total // world_size, dtype=dtype)
    dist.reduce_scatter_tensor(out, flat_input, op=dist.ReduceOp.SUM)
    if post > 1:
        out.div_(post)
    segments = dict(enumerate(flat_segments(spans, total, world_size)))
    ring = Collectives(rank=rank, world_size=world_size).ring_average(
        {i: t.float() for i, t in mine.items()}, segments, dtype, pre=pre, post=post)
    expected = torch.zeros(total)
    for (offset, n), i in zip(spans, ring):
        expected[offset:offset + n] = ring[i].value
    chunk = total // world_size
    differ = int((out.float() != expected[rank * chunk:(rank + 1) * chunk]).sum())
    return ring_order_holds(world_size, dtype, average=False), differ, (pre, post)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloos_reduce_scatter_of_fsdp1s_flat_gradient_with_its_divide_factors_is_reproduced_bit_for_bit(world_size):
    """FSDP1's bf16 reduction on gloo (pre-divide, SUM, post-divide: 2 then 1 at two ranks, 2 then 1.5
    at three, which rounds, 2 then 2 at four), over a padded flat gradient whose segments are not its chunks:
    ``ring_average`` with ``flat_segments`` gives every rank's shard exactly."""
    results = run_on_ranks(_fsdp1_reduce_scatter, world_size)
    for why, differ, factors in results:
        assert (why, differ) == ("", 0), factors
    assert {factors for *_, factors in results} == {{2: (2.0, 1.0), 3: (2.0, 1.5), 4: (2.0, 2.0)}[world_size]}


def _ddp_all_reduce(rank, world_size):
    """A real DDP model (the C++ reducer's buckets) on gloo: each rank's local gradients, reproduced as the
    oracle reproduces DDP's sync (harness/rank/oracle/averaging.py: the layout read off the wrapper after the
    backward, ``ring_average``), against DDP's own synced gradients, over three steps (DDP rebuilds its
    buckets after the first); and against the plain sum-then-divide, which rounds apart somewhere at
    three ranks and more (the test is not vacuous)."""
    import copy

    import torch
    from torch import nn

    from harness.rank.numerics.collectives import Collectives
    from harness.rank.numerics.ring_order import all_reduce_order_holds, flat_segments
    from harness.wrappers import prepared, sharding

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 17), nn.Tanh(), nn.Linear(17, 5), nn.Tanh(), nn.Linear(5, 3))
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    prepared.remember(ddp)
    collectives = Collectives(rank=rank, world_size=world_size)
    differ, plain_differ, scales_seen = 0, 0, set()
    for step in range(3):
        x = torch.randn(8, 13, generator=torch.Generator().manual_seed(100 * step + rank)) * 10
        ddp.zero_grad()
        local.zero_grad()
        ddp(x).pow(2).sum().backward()
        local(x).pow(2).sum().backward()
        read = sharding.ddp_reduce_layout(model, world_size)
        assert not isinstance(read, str), read
        layout, scales = read
        scales_seen.add(scales)
        grads = {n: p.grad for n, p in local.named_parameters()}
        segments = {n: flat_segments([layout[n][:2]], layout[n][2], world_size)[0] for n in grads}
        exact = collectives.ring_average(grads, segments, torch.float32, pre=float(world_size), post=1.0,
                                         pre_scales=scales)
        every = [torch.empty_like(torch.cat([g.reshape(-1) for g in grads.values()])) for _ in range(world_size)]
        torch.distributed.all_gather(every, torch.cat([g.reshape(-1) for g in grads.values()]))
        plain = sum(every[1:], every[0]) / world_size
        synced = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
        differ += int((torch.cat([exact[n].value.reshape(-1) for n in grads]) != synced).sum())
        plain_differ += int((plain != synced).sum())
    return all_reduce_order_holds(world_size, torch.float32), differ, plain_differ, scales_seen


@pytest.mark.parametrize("world_size", [3, 4])
def test_ddps_sync_on_gloo_is_reproduced_bit_for_bit_from_its_buckets(world_size):
    """DDP multiplies each rank's gradient by 1/N (1/3 rounds) into its bucket and gloo's ring sums
    the bucket: the oracle's reproduction is DDP's synced gradient in every element of every step, and
    the order matters (summed from rank 0 up and divided, some element differs)."""
    results = run_on_ranks(_ddp_all_reduce, world_size)
    for why, differ, _, scales in results:
        assert (why, differ, scales) == ("", 0, {True})
    assert sum(plain for _, _, plain, _ in results) > 0



def _all_reduce_sizes(rank, world_size):
    """Gloo's all-reduce (SUM) of flat buffers of many sizes, odd ones included, against ``ring_sum``
    over ``flat_segments``: the order ``all_reduce_order_holds`` probes at one size holds at every size."""
    import torch
    import torch.distributed as dist

    from harness.rank.numerics.ring_order import flat_segments, ring_sum

    differ = {}
    for total in (1, 7, 37, 1001, 65537, (1 << 20) + 3):
        g = torch.Generator().manual_seed(total)
        every = [torch.randn(total, generator=g) * torch.exp(torch.randn(total, generator=g) * 3)
                 for _ in range(world_size)]
        out = every[rank].clone()
        dist.all_reduce(out)
        differ[total] = int((out != ring_sum(every, flat_segments([(0, total)], total, world_size)[0],
                                               torch.float32)).sum())
    return differ


@pytest.mark.parametrize("world_size", [3, 4])
def test_gloos_all_reduce_sums_each_segment_down_the_ring_at_every_size(world_size):
    for differ in run_on_ranks(_all_reduce_sizes, world_size):
        assert set(differ.values()) == {0}, differ
