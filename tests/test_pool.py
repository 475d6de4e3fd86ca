"""The controller side of a pool, driven directly: start-up failures and the typed protocol."""

import os
import subprocess
import sys

import pytest

from harness.controller.pool import PoolSet, PoolStartError
from harness.controller.rank_server import SHARED_SERVER_VARIABLE, start_rank_server
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
        generations = {size: pool.generation for size, pool in pools.pools.items()}
        with pytest.raises(PoolStartError, match="failed earlier in this session"):
            pools.get(2)
        # not retried: no pool started ranks again (a start counts a generation), none is left running
        assert {size: pool.generation for size, pool in pools.pools.items()} == generations == {2: 1}
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


ENVIRONMENT_CASE = '''
import os

from harness import Variant, case


@case("environment", wrappers=["ddp"], variants=[Variant("v")])
def test_environment(ctx):
    raise LookupError(f"mark={os.environ.get('HARNESS_TEST_MARK', 'unset')}")
'''


def test_ranks_see_the_controllers_environment_as_it_was_when_their_pool_started(tmp_path, monkeypatch):
    """Ranks are forked from a server that was started before (harness/rank/process/preload.py), with the
    environment of that moment: what a rank sees is the controller's when the pool starts."""
    start_rank_server()
    monkeypatch.setenv("HARNESS_TEST_MARK", "first")
    case_file = tmp_path / "environment_case.py"
    case_file.write_text(ENVIRONMENT_CASE)
    spec = CellSpec(case="environment", variant="v", variant_params={}, world_size=2, seed=1, backend="gloo",
                    case_file=str(case_file), case_attr="test_environment")
    pools = PoolSet(backend="gloo")
    try:
        details = [f.detail for f in pools.get(2).run(spec, timeout_s=60).faults]
        assert len(details) == 2 and all("LookupError: mark=first" in d for d in details), details
        monkeypatch.setenv("HARNESS_TEST_MARK", "second")  # the pool restarts after the fault
        details = [f.detail for f in pools.get(2).run(spec, timeout_s=60).faults]
        assert len(details) == 2 and all("LookupError: mark=second" in d for d in details), details
    finally:
        pools.close()


def test_where_the_fork_server_cannot_start_the_ranks_are_spawned(tmp_path):
    """The server's socket is a file in the temporary folder; under a deep TMPDIR its path is longer
    than a Unix socket's address may be. The run is the same, its ranks spawned."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    script = (
        "from harness.controller import rank_server\n"
        "from harness.controller.pool import PoolSet\n"
        "pools = PoolSet(backend='gloo')\n"
        "try:\n"
        "    assert pools.get(2).alive\n"
        "finally:\n"
        "    pools.close()\n"
        "print(rank_server._rank_server['failed'], '|', rank_server.rank_context().get_start_method())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(deep), SHARED_SERVER_VARIABLE: ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "AF_UNIX path too long | spawn"
