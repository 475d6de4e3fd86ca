"""The controller side of a pool, driven directly: start-up failures and the typed protocol."""

import time

import pytest

from harness.controller.pool import PoolSet, PoolStartError
from harness.messages import CellSpec, ProtocolError, RankResult, Ready, RunCell, expect


def test_messages_of_an_unknown_type_are_rejected_not_ignored():
    assert isinstance(expect(Ready(rank=0, pid=1), Ready, RankResult), Ready)
    with pytest.raises(ProtocolError, match="unexpected message RunCell"):
        expect(RunCell(spec=None), RankResult)  # type: ignore[arg-type]


def test_a_pool_that_cannot_start_names_the_rank_and_is_not_retried_in_the_session():
    pools = PoolSet(backend="no-such-backend")
    try:
        with pytest.raises(PoolStartError) as first:
            pools.get(2)
        assert "of 2 failed to start" in str(first.value)
        assert "no-such-backend" in str(first.value)  # the rank's own traceback comes along
        started = time.monotonic()
        with pytest.raises(PoolStartError, match="failed earlier in this session"):
            pools.get(2)
        assert time.monotonic() - started < 1.0
        assert not any(p.processes for p in pools.pools.values())
    finally:
        pools.close()


def test_a_cell_of_a_missing_case_file_is_an_error_on_every_rank_and_the_pool_lives_on(tmp_path):
    pools = PoolSet(backend="gloo")
    try:
        pool = pools.get(2)
        spec = CellSpec(case="nothing", variant="v", variant_params={}, world_size=2, seed=1, backend="gloo",
                        case_file=str(tmp_path / "missing.py"), case_attr="test_nothing")
        outcome = pool.run(spec, timeout_s=60)
        assert [f.what for f in outcome.faults] == ["raised", "raised"]
        assert "missing.py" in outcome.faults[0].detail
        assert not pool.alive  # after any fault the pool is rebuilt for the next cell
        assert pools.get(2).alive
    finally:
        pools.close()
