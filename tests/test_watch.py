"""Training loops checked as they are (``ctx.watch``, harness/rank/watch/loop.py): the example project's
unedited loops pass at world sizes 1, 2 and 4 in fp32 and bf16; each usual mistake of a loop that
accumulates fails with its diagnosis; what the watch cannot infer is an error of one line saying
what to give instead. Real ranks, gloo, the installed accelerate."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, plain_env
from test_docs import GUIDE, counts_line, documented_run, fenced_blocks

EXAMPLE = ROOT / "examples" / "my_project"
CASES = "tests/planted/watch_cases.py"


def run_example(project: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``pytest ARGS`` from the example's own folder, as a user runs it (its pyproject puts
    my_project on the path), against this checkout's harness; the result and the cells by key."""
    result = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"],
                            cwd=project, env=plain_env(), capture_output=True, text=True, timeout=900)
    matrix = json.loads((project / "reports" / "matrix.json").read_text())
    return result, {(c["case"], c["variant"], c["world_size"]): c for c in matrix["cells"]}


def copy_example(tmp_path: Path) -> Path:
    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    return project


def test_the_guide_shows_the_examples_loops_and_cases_as_they_are():
    blocks = fenced_blocks(GUIDE.read_text(encoding="utf-8"))
    loop = (EXAMPLE / "my_project" / "loop.py").read_text()
    cases = (EXAMPLE / "watched" / "test_train_loop.py").read_text()
    shown_loop = next(b for b in blocks if b.startswith("def train(accelerator"))
    shown_cases = next(b for b in blocks if b.startswith('@case("my_training_loop"'))
    assert loop.endswith(shown_loop + "\n") and cases.endswith(shown_cases + "\n")


def test_the_examples_unedited_loops_pass_at_one_two_and_four_ranks_in_fp32_and_bf16(tmp_path):
    project = copy_example(tmp_path)
    result, got = run_example(project, "watched/", "-n", "2", "--world-sizes", "1,2,4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cells = list(got.values())
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
    # what docs/writing-a-case.md shows of this run
    guide = GUIDE.read_text(encoding="utf-8")
    shown = documented_run(guide, "cd examples/my_project && pytest -n auto watched/")
    assert {key: cell["status"] for key, cell in got.items()} == \
        {(case, variant, ws): status for (case, variant), by_ws in shown.rows.items() for ws, status in by_ws.items()}
    assert shown.counts == counts_line([cell["status"] for cell in cells])
    quoted = re.search(r"Its `my_loop_by_hand\[steps=2-fp32\]` cell at world size 2 reads\s+`([^`]+)`", guide)
    assert quoted and got[("my_loop_by_hand", "steps=2-fp32", 2)]["summary"] == quoted.group(1)


def test_the_guides_manual_loop_mistake_fails_as_the_guide_shows(tmp_path):
    # the forward run before no_sync is entered, as the guide's diff plants it in the example's loop
    project = copy_example(tmp_path)
    guide = GUIDE.read_text(encoding="utf-8")
    diff = next(b for b in fenced_blocks(guide) if "+            loss = loss_fn(model, batch) / accumulation_steps" in b)
    before = "".join(line[1:] + "\n" for line in diff.splitlines() if line.startswith("-"))
    after = "".join(line[1:] + "\n" for line in diff.splitlines() if line.startswith("+"))
    loop = project / "my_project" / "loop.py"
    assert loop.read_text().count(before) == 1, "the guide's diff no longer applies to loop.py"
    loop.write_text(loop.read_text().replace(before, after))
    shown = documented_run(guide, 'pytest watched/ --world-sizes 2 -k "by_hand and fp32"')
    result, got = run_example(project, "watched/", "--world-sizes", "2", "-k", "by_hand and fp32")
    assert result.returncode == 1
    assert {(case, variant): {ws: cell["status"]} for (case, variant, ws), cell in got.items()} == shown.rows
    assert shown.counts in result.stdout.splitlines()
    for line in shown.text.splitlines():
        if line.startswith(("Diagnoses: ", "collectives of the backward on rank 0", "gradient of 'model.body.0.weight'")):
            assert line in result.stdout.splitlines(), line


def test_each_usual_mistake_fails_with_its_diagnosis_and_what_cannot_be_inferred_is_refused(run_pytest):
    session = run_pytest(CASES, "--world-sizes", "2", "-p", "no:randomly")
    cells = session.cells()

    def kinds(case: str, variant: str) -> set[str]:
        cell = cells[(case, variant, 2)]
        assert cell["status"] == "fail", (case, variant, cell["summary"])
        return {f["kind"] for f in cell["failures"]}

    # the correct loops pass: accelerate's idiom and accumulation by hand (each window's batches drawn
    # one a backward, or all before its first backward), under DDP and FSDP2, with dropout of 0.5
    # replayed for the oracle without the case asking
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
        # named: the gradient held before the window's next micro-batch was scaled down (by the clip)
        grads = [f for f in clipped["failures"] if f["checked"] == "grad"]
        assert grads and {f["kind"] for f in grads} == {"misweighted"}, clipped["summary"]
        # (after the sync, one weight a rank: "weighs 0.0079 (rank 0), 0.0081 (rank 1) times itself")
        held = grads[0]["message"].split("held before them weighs ")[1].split(" times itself")[0]
        assert all(0.0 < float(w.split(" ")[0]) < 0.1 for w in held.split(", ")), grads[0]["message"]
    # under FSDP2 a parameter mismatch: the oracle cannot load the loop's DTensor optimizer state and
    # judges on with its own (a fail, not the error its optimizer step would raise)
    other = cells[("watch_fsdp2_other_optimizer", "fp32-wrapper=fsdp2", 2)]
    assert other["status"] == "fail" and {(f["checked"], f["kind"]) for f in other["failures"]} == {("param", "mismatch")}
    refused = {
        "out_of_order": "the loop's backward took batch 2 of epoch 0 of the prepared dataloader 1 before batch 1 of "
                        "epoch 0 of the prepared dataloader 1, drawn before it",
        "unprepared_data": "accelerator.backward with no batch drawn since the last backward from a dataloader "
                           "the loop prepared",
        "own_accelerator": "the loop made a second Accelerator; take the one the case gives it",
        "clip_unspecified": "give ctx.watch clip_grad_norm= the norm",
        "two_losses_a_batch": "a second accelerator.backward on batch 1 of epoch 0 of the prepared dataloader 1",
        # the second loss of a window's first batch, the window's second batch drawn already: not taken for it
        "two_losses_ahead": "a second accelerator.backward on batch 1 of epoch 0 of the prepared dataloader 1",
    }
    for loop, words in refused.items():
        cell = cells[("watch_refused", f"loop={loop}", 2)]
        assert cell["status"] == "error"
        assert cell["summary"].startswith("ranks 0, 1 raised harness.rank.watch.LoopRefused: ctx.watch: "), cell["summary"]
        assert words in cell["summary"] and "\n" not in cell["summary"], cell["summary"]
    assert session.returncode == 1
