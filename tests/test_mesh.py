"""Meshes (harness/wrappers/mesh.py): accelerate's ParallelismConfig at hsdp, tp and cp under FSDP2.

The layout and the per-dimension accounting are checked on their own; the cells run on real pools of
four gloo ranks with the installed accelerate, and under two torchrun agents of two processes each
(tests/test_launch.py's). accelerate 1.15.0 prepares a tensor-parallel model under FSDP2 only with a
transformers that has ``ReplicateParallel`` (before 5.0): with one on HARNESS_TP_TRANSFORMERS (a
directory put in front of the ranks' path, as .ci/run makes it) the tp cells are checked to pass and
catch; with the installed transformers 5 they are checked to be ``unsupported`` naming it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import Session, start_pytest
from test_launch import two_torchrun_agents

from harness.decorator import SkipCell, Variant
from harness.rank.judging.reductions import judge
from harness.rank.numerics.accounting import Backward
from harness.wrappers.mesh import shape
from harness.wrappers.registry import parse_meshes
from harness.wrappers.prepare import cell_variants

TP_TRANSFORMERS = os.environ.get("HARNESS_TP_TRANSFORMERS", "")


# --- the layout ----------------------------------------------------------------------------------


def test_a_mesh_lays_the_ranks_out_row_major_in_accelerates_order():
    hsdp = shape("hsdp", 4)
    assert hsdp.active == (("dp_replicate", 2), ("dp_shard", 2))
    assert [hsdp.coordinate(r)["dp_replicate"] for r in range(4)] == [0, 0, 1, 1]
    assert hsdp.peers(0, ("dp_shard",)) == [0, 1] and hsdp.peers(0, ("dp_replicate",)) == [0, 2]
    assert hsdp.averaging_group(3) == [0, 1, 2, 3] and hsdp.data_shards == 4
    tp = shape("tp", 4)
    assert tp.active == (("dp_shard", 2), ("tp", 2))
    assert tp.averaging_group(1) == [1, 3] and tp.tensor_parallel_group(1) == [0, 1]
    assert [tp.data_index(r) for r in range(4)] == [0, 0, 1, 1] and tp.data_shards == 2
    cp = shape("cp", 8)
    assert cp.active == (("dp_shard", 4), ("cp", 2))
    assert cp.averaging_group(5) == list(range(8)) and [cp.data_index(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cp.dimensions_of([4, 5], 5) == {"cp"} and cp.dimensions_of(list(range(8)), 0) == {"dp_shard", "cp"}
    assert cp.dimensions_of([0, 3], 0) == set()


@pytest.mark.parametrize("world_size", [1, 2, 3, 6 - 1])
def test_a_world_that_cannot_form_the_mesh_is_a_skip_that_says_so(world_size):
    with pytest.raises(SkipCell, match=rf"mesh=hsdp runs at an even world size of 4 or more .*: {world_size} ranks"):
        shape("hsdp", world_size)


def test_mesh_cells_are_fsdp2s_at_the_lead_variants_and_follow_the_selection():
    variants = [Variant("steps=2-fp32", {"steps": 2, "precision": "fp32"}),
                Variant("steps=3-fp32", {"steps": 3, "precision": "fp32"}),
                Variant("steps=2-bf16", {"steps": 2, "precision": "bf16"}),
                Variant("steps=2-fp32-compile=aot_eager", {"steps": 2, "precision": "fp32", "compile": "aot_eager"})]
    names = [v.name for v in cell_variants(variants, ["ddp", "fsdp2"], "auto", ["hsdp", "cp"]) if "mesh" in v.params]
    assert names == ["steps=2-fp32-mesh=hsdp-wrapper=fsdp2", "steps=2-bf16-mesh=hsdp-wrapper=fsdp2",
                     "steps=2-fp32-mesh=cp-wrapper=fsdp2", "steps=2-bf16-mesh=cp-wrapper=fsdp2"]
    assert not [v for v in cell_variants(variants, ["ddp", "fsdp2"], ("ddp",), ["hsdp"]) if "mesh" in v.params]
    assert parse_meshes("auto") == "auto" and parse_meshes("none") == () and parse_meshes("cp, hsdp") == ("hsdp", "cp")
    with pytest.raises(ValueError, match="unknown mesh 'dp'"):
        parse_meshes("hsdp,dp")


# --- collective accounting per mesh dimension ------------------------------------------------------


def backward(*reductions: tuple[int, tuple[int, ...]]) -> Backward:
    return Backward([("gloo:all_reduce", n) for n, _ in reductions], True, [g for _, g in reductions])


def test_hsdp_reaches_every_peer_through_two_groups_and_a_missing_one_is_named():
    hsdp = shape("hsdp", 4)
    both = backward((58, (0, 1)), (29, (0, 2)))
    assert [v.kind for v in judge([both], [(True, 49)], reduces_every_micro_batch=False, mesh=hsdp, rank=0)] == [None]
    [missing] = judge([backward((58, (0, 1)))], [(True, 49)], reduces_every_micro_batch=False, mesh=hsdp, rank=0)
    assert missing.kind == "comm_missing"
    assert "no gradient reduction over mesh dimension dp_replicate (the groups reduced over span dp_shard)" in missing.why
    # between syncs any gradient reduction is unexpected, as without a mesh
    [early] = judge([backward((58, (0, 1)))], [(False, 49)], reduces_every_micro_batch=False, mesh=hsdp, rank=0)
    assert early.kind == "comm_unexpected"


def test_under_tp_the_layers_own_reductions_are_not_syncs_and_one_over_tp_peers_is_unexpected():
    tp = shape("tp", 4)
    layers = backward((40, (0, 1)), (40, (0, 1)))  # the row-wise layer's partial sums, over rank 0's tp group
    assert [v.kind for v in judge([layers], [(False, 49)], reduces_every_micro_batch=False, mesh=tp, rank=0)] == [None]
    synced = backward((40, (0, 1)), (30, (0, 2)))
    assert [v.kind for v in judge([synced], [(True, 25)], reduces_every_micro_batch=False, mesh=tp, rank=0)] == [None]
    [wrong] = judge([backward((60, (0, 1, 2, 3)))], [(True, 25)], reduces_every_micro_batch=False, mesh=tp, rank=0)
    assert wrong.kind == "comm_unexpected"
    assert "over ranks [0, 1, 2, 3]: ranks [1, 3] are not among rank 0's data-parallel peers [0, 2]" in wrong.why


# --- live cells: pools of four ranks ---------------------------------------------------------------


MESH_CELLS = ["cases/test_accumulate.py", "cases/test_token_loss.py", "--world-sizes", "4",
              "-k", "mesh and (test_accumulate or token_loss or token_mean or all_processes) and not transformers"]


def tp_overlay(extra: dict[str, str]) -> dict[str, str]:
    if TP_TRANSFORMERS:
        extra["PYTHONPATH"] = os.pathsep.join([TP_TRANSFORMERS, str(Path(__file__).resolve().parent.parent)])
    return extra


@pytest.fixture(scope="module")
def mesh_cells(tmp_path_factory):
    return _run(MESH_CELLS, tmp_path_factory.mktemp("mesh") / "reports")


def _run(args: list[str], report_dir: Path) -> Session:
    process, token = start_pytest(list(args), report_dir, **tp_overlay({}))
    try:
        stdout, stderr = process.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        raise
    return Session(process.returncode, stdout, stderr, report_dir, token, 0.0)


def test_hsdp_and_cp_cells_pass_and_their_canaries_are_detected(mesh_cells):
    cells = mesh_cells.cells()
    for mesh in ("hsdp", "cp"):
        for precision in ("fp32", "bf16"):
            assert cells[("accumulate", f"steps=2-{precision}-mesh={mesh}-wrapper=fsdp2", 4)]["status"] == "pass"
            token = f"sync_each_batch=false-{precision}-mesh={mesh}-wrapper=fsdp2"
            assert cells[("accumulate_token_loss", token, 4)]["status"] == "pass"
            assert cells[("accumulate_token_mean", token, 4)]["status"] == "detected"
    # bf16 over the mesh is reproduced bit for bit: HSDP's two reductions of two ranks, cp's ring of four
    assert cells[("accumulate", "steps=2-bf16-mesh=hsdp-wrapper=fsdp2", 4)]["max_abs_diff"] == 0.0
    assert "NOT CHECKED" not in cells[("accumulate", "steps=2-bf16-mesh=cp-wrapper=fsdp2", 4)]["summary"]
    # the token count over the data-parallel ranks scaled by every process: cp peers hold the same batch
    detected = cells[("accumulate_token_all_processes", "sync_each_batch=false-fp32-mesh=cp-wrapper=fsdp2", 4)]
    assert detected["status"] == "detected" and {f["kind"] for f in detected["failures"]} == {"misweighted"}
    # the weights are the data shards', each drawn by two ranks: every token weighs twice its share, in
    # each of the window's two micro-batches (FSDP2 shows the gradient at the sync alone)
    assert ("the weights of the 2 since the last check, each by data shard (ranks 0, 1; ranks 2, 3): 2, 2; 2, 2)"
            in detected["failures"][0]["message"])


def test_tp_cells_pass_with_a_transformers_accelerate_can_prepare_them_with_else_are_unsupported(mesh_cells):
    cells = mesh_cells.cells()
    accumulate = cells[("accumulate", "steps=2-bf16-mesh=tp-wrapper=fsdp2", 4)]
    canary = cells[("accumulate_token_all_processes", "sync_each_batch=false-bf16-mesh=tp-wrapper=fsdp2", 4)]
    if not TP_TRANSFORMERS:
        try:
            from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
        except ImportError:
            assert accumulate["status"] == "unsupported" and "ReplicateParallel" in accumulate["summary"]
            assert canary["status"] == "unsupported"
            pytest.skip("the installed transformers has no ReplicateParallel (5.0 and later): accelerate 1.15.0 "
                        "cannot prepare the tp cells, which are unsupported as asserted; set "
                        "HARNESS_TP_TRANSFORMERS to a directory holding transformers 4.57 to check them")
    assert accumulate["status"] == "pass" and accumulate["max_abs_diff"] == 0.0, accumulate["summary"]
    assert canary["status"] == "detected", canary["summary"]
    assert cells[("accumulate_token_loss", "sync_each_batch=false-fp32-mesh=tp-wrapper=fsdp2", 4)]["status"] == "pass"


@pytest.mark.parametrize("fault, kind, words", [
    ("hsdp_replicate_last_only", "comm_unexpected", "where the contract has no gradient reduction"),
    ("hsdp_replicate_never", "comm_missing", "no gradient reduction over mesh dimension dp_replicate"),
])
def test_an_hsdp_replicate_reduction_that_misses_micro_batches_or_never_runs_fails(fault, kind, words, tmp_path):
    session = _run(["cases/test_accumulate.py", "--world-sizes", "4", "--meshes", "hsdp", "--wrappers", "fsdp2",
                    "-k", "mesh and test_accumulate and fp32", "--harness-fault", fault], tmp_path / "reports")
    [cell] = [c for c in session.matrix["cells"] if "mesh=hsdp" in c["variant"]]
    assert cell["status"] == "fail"
    assert any(f["kind"] == kind and words in f["message"] for f in cell["failures"]), cell["summary"]
    # and the gradients themselves are wrong at the sync, not only the collectives
    assert {f["kind"] for f in cell["failures"] if f["param"] != "collectives"} - {"sync_flag"}


# --- under a launcher: two agents of two processes make the 2 x 2 mesh ------------------------------


def test_two_agents_of_two_processes_make_a_two_by_two_mesh(tmp_path):
    run = two_torchrun_agents(["cases/test_accumulate.py", "--meshes", "hsdp,cp", "--wrappers", "fsdp2",
                               "-k", "mesh and test_accumulate and fp32"], tmp_path / "reports", nproc=2)
    assert run.returncodes == [0, 0], run.log()
    cells = run.cells()
    assert {v: c["status"] for (_, v), c in cells.items() if "mesh" in v} == {
        "steps=2-fp32-mesh=hsdp-wrapper=fsdp2": "pass", "steps=2-fp32-mesh=cp-wrapper=fsdp2": "pass"}
    environment = run.matrix["environment"]
    assert (environment["nodes"], environment["processes_per_node"], environment["meshes"]) == (2, 2, "hsdp,cp")


def test_accelerate_asking_importlib_for_a_missing_transformers_is_accelerates_refusal():
    """accelerate 1.10 to 1.12 read transformers' version through importlib.metadata in their
    tensor-parallel prepare: without transformers the exception is raised in Python's own library,
    for accelerate, and the tp cell is ``unsupported`` naming it (it was an ``error``)."""
    from harness.wrappers.prepare import _raised_in

    namespace: dict = {}
    exec(compile("import importlib.metadata\ndef prepare():\n    importlib.metadata.version('no-such-package-x1')\n",
                 "/venv/lib/python3.11/site-packages/accelerate/accelerator.py", "exec"), namespace)
    with pytest.raises(ImportError) as raised:
        namespace["prepare"]()
    assert _raised_in(raised.value) == "accelerate"
