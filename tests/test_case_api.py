"""The public case API as a user meets it: their own model, data and optimizers through the real
plugin, the mistakes it refuses with a reason, case names unique across every source, and a plugin
that stays out of pytest runs without cells."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT, session_env

API = "tests/planted/api_cases.py"


def test_a_users_own_model_dataset_and_optimizers_pass_and_each_mistake_says_what_it_is(run_pytest):
    # DDP cells only: every assertion here is on a DDP cell. Under the default `--wrappers auto`
    # (deepspeed installed) the same file also ran 36 FSDP/DeepSpeed cells no assertion read, most of
    # them errors that each cost a pool restart: 90 s of this suite's 11 minutes for nothing checked.
    session = run_pytest(API, "--world-sizes", "1,2", "--wrappers", "ddp", "-p", "no:randomly")
    cells = session.cells()
    for ws in (1, 2):
        # dropout replayed, two optimizers on one model, the user's dataset with and without drop_last
        # (a different batch count per rank: a wrong count would be a schedule failure)
        # (and with split_batches)
        for drop_last in ("false", "true"):
            for split in ("false", "true"):
                own = cells[("api_own_model", f"steps=2-drop_last={drop_last}-split={split}", ws)]
                assert own["status"] == "pass", own["summary"]
        # the oracle's forward without the case's RNG state draws other dropout masks
        assert cells[("api_dropout_not_replayed", "steps=2", ws)]["status"] == "fail"
        steps_twice = cells[("api_steps_twice", "steps=2", ws)]
        assert steps_twice["status"] == "error"
        assert "num_steps=3 here, but the Accelerator was given num_steps=2" in steps_twice["summary"]
    differs = cells[("api_model_differs", "steps=2", 2)]
    assert differs["status"] == "error"
    assert differs["summary"].startswith("ranks 0, 1 raised ValueError")
    assert "(rank 1 differs from rank 0)" in differs["summary"]
    assert "do not have the same weights on every rank" in differs["summary"]
    assert session.returncode == 1


def write_case(path, name):
    path.write_text(textwrap.dedent(f"""
        from harness import case

        @case({name!r})
        def test_{path.parent.name}(ctx):
            ctx.skip("never runs")
    """))


def test_a_case_name_defined_in_two_sources_is_a_collection_error_naming_both(tmp_path):
    for folder in ("ours", "theirs"):
        (tmp_path / folder).mkdir()
        write_case(tmp_path / folder / f"test_{folder}.py", "same_name")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "ours", "theirs"],
                            cwd=tmp_path, env=session_env("api-unique"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "case 'same_name' is defined twice" in output
    assert str(tmp_path / "ours" / "test_ours.py") in output and str(tmp_path / "theirs" / "test_theirs.py") in output


def test_a_users_case_named_like_one_of_the_catalogue_is_refused_beside_the_catalogue(tmp_path):
    (tmp_path / "mine").mkdir()
    write_case(tmp_path / "mine" / "test_mine.py", "fused_loss")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(ROOT / "cases"),
                             str(tmp_path / "mine"), "--collect-only", "-q"],
                            cwd=tmp_path, env=session_env("api-unique"), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "case 'fused_loss' is defined twice" in output
    assert str(ROOT / "cases" / "test_fused_loss.py") in output


def test_a_pytest_run_without_cells_is_left_alone(tmp_path):
    (tmp_path / "test_plain.py").write_text(textwrap.dedent("""
        import signal

        import pytest

        def test_plain():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

        @pytest.mark.parametrize("size", [2, 4], ids=["fp32-ws2", "fp32-ws4"])
        def test_ids_like_cells(size, request):
            assert "harness_case" not in request.node.keywords
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v"], cwd=tmp_path,
                            env=session_env("api-plain"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # a user's tests keep their order, whatever their ids look like
    # (the harness runs its cells largest world size first)
    assert result.stdout.index("test_ids_like_cells[fp32-ws2]") < result.stdout.index("test_ids_like_cells[fp32-ws4]")
    assert "--world-sizes" in subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=tmp_path,
                                             env=session_env("api-plain"), capture_output=True, text=True,
                                             timeout=300).stdout  # the plugin is loaded (its entry point)
    assert "gradient-sync matrix" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["test_plain.py"]
