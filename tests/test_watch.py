"""Training loops checked as they are (``ctx.watch``, harness/rank/watch.py): the example project's
unedited loops pass at world sizes 1, 2 and 4 in fp32 and bf16; each usual mistake of a loop that
accumulates fails with its diagnosis; what the watch cannot infer is an error of one line saying
what to give instead. Real ranks, gloo, the installed accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "my_project"
CASES = "tests/planted/watch_cases.py"


def test_the_examples_unedited_loops_pass_at_one_two_and_four_ranks_in_fp32_and_bf16(tmp_path):
    # from the example's own folder, as a user runs it (its pyproject puts my_project on the path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    result = subprocess.run([sys.executable, "-m", "pytest", "watched/", "-n", "2", "--world-sizes", "1,2,4",
                             "-p", "no:cacheprovider", "--report-dir", str(tmp_path)],
                            cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cells = json.loads((tmp_path / "matrix.json").read_text())["cells"]
    by_status: dict[str, set] = {}
    for cell in cells:
        by_status.setdefault(cell["status"], set()).add((cell["case"], cell["variant"], cell["world_size"]))
    # every cell but the wrapped ones at one rank (a pool of one process: accelerate wraps nothing)
    assert set(by_status) == {"pass", "skip"}
    assert all("wrapper=" in variant and ws == 1 for _, variant, ws in by_status["skip"])
    passed = by_status["pass"]
    for case in ("my_training_loop", "my_loop_by_hand"):
        for precision in ("fp32", "bf16"):
            for ws in (1, 2, 4):
                assert any(c == case and v.endswith(precision) and w == ws for c, v, w in passed), (case, precision, ws)
    for cell in cells:
        if cell["status"] == "pass" and cell["world_size"] > 1:
            # every backward and every micro-step checked, the collectives of each backward counted
            assert cell["grad_checks"] > cell["vacuous_checks"] and cell["comm_checks"] > 0, cell["summary"]


def test_each_usual_mistake_fails_with_its_diagnosis_and_what_cannot_be_inferred_is_refused(run_pytest):
    session = run_pytest(CASES, "--world-sizes", "2", "-p", "no:randomly")
    cells = session.cells()

    def kinds(case: str, variant: str) -> set[str]:
        cell = cells[(case, variant, 2)]
        assert cell["status"] == "fail", (case, variant, cell["summary"])
        return {f["kind"] for f in cell["failures"]}

    # the correct loops pass: accelerate's idiom and accumulation by hand, under DDP and FSDP2, with
    # dropout of 0.5 replayed for the oracle without the case asking
    for (case, variant, ws), cell in cells.items():
        if case in ("watch_accumulate", "watch_by_hand"):
            assert cell["status"] == "pass", (case, variant, cell["summary"])
    for precision in ("fp32", "bf16"):
        # the guide's bug: accelerator.backward divides by the steps, and the loop does too
        assert "wrong_scale" in kinds("watch_loss_divided_twice", precision)
        divided = cells[("watch_loss_divided_twice", precision, 2)]["failures"][0]
        assert (divided["step"], divided["kind"]) == (1, "wrong_scale") and "scaled by 0.5" in divided["message"]
        # by hand, under an Accelerator given the steps as well
        assert "wrong_scale" in kinds("watch_by_hand_divided_twice", precision)
        # the forward outside no_sync: DDP all-reduces a micro-batch that must not sync
        assert {"comm_unexpected", "synced_early"} <= kinds("watch_by_hand_mistake", f"mistake=forward_outside_no_sync-{precision}")
        # one optimizer stepping every micro-batch
        assert "stepped_early" in kinds("watch_by_hand_mistake", f"mistake=one_optimizer_every_batch-{precision}")
        # the forward through the unwrapped module: DDP's hooks never fire, nothing is averaged
        assert {"comm_missing", "not_synced"} <= kinds("watch_by_hand_mistake", f"mistake=unwrapped_forward-{precision}")
        # a clip of the local gradients inside the window: the window's gradient is not the specification's
        clipped = cells[("watch_by_hand_mistake", f"mistake=clip_in_window-{precision}", 2)]
        assert clipped["status"] == "fail" and clipped["failures"][0]["step"] == 2, clipped["summary"]
    refused = {
        "windows_first": "the loop drew 2 batches from its prepared dataloader 1 before one backward",
        "unprepared_data": "accelerator.backward with no batch drawn since the last backward from a dataloader "
                           "the loop prepared",
        "own_accelerator": "the loop made a second Accelerator; take the one the case gives it",
        "clip_unspecified": "give ctx.watch clip_grad_norm= the norm",
    }
    for loop, words in refused.items():
        cell = cells[("watch_refused", f"loop={loop}", 2)]
        assert cell["status"] == "error"
        assert cell["summary"].startswith("ranks 0, 1 raised harness.rank.watch.LoopRefused: ctx.watch: "), cell["summary"]
        assert words in cell["summary"] and "\n" not in cell["summary"], cell["summary"]
    assert session.returncode == 1
