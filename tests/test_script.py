"""A training script checked as it is: ``python -m harness watch SCRIPT`` (harness/rank/script/run.py,
docs/script.md). The example project's unedited script passes at world sizes 1 and 2 in fp32 and bf16;
a script that accumulates by hand passes under its declared window and fails under another; each
mistake planted in one unedited script fails with its diagnosis at its step; what the harness cannot
follow is an error cell of one line; the command's bad input is one line and exit 2; a cell's rerun
command and torchrun run the same. Real ranks, gloo, the installed accelerate, real processes."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, plain_env
from test_docs import documented_run, fenced_blocks
from test_launch import free_port

HAND_LOOP = ROOT / "tests" / "planted" / "scripts" / "hand_loop.py"
EXAMPLE = ROOT / "examples" / "my_project"
CLASSIFIER = EXAMPLE / "scripts" / "train_classifier.py"
PAGE = ROOT / "docs" / "script.md"


def watch(report_dir: Path, script: Path, *options: str, args: tuple[str, ...] = (), cwd: Path | None = None,
          launcher: tuple[str, ...] = (sys.executable,), **settings: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m harness watch SCRIPT OPTIONS -- ARGS``; the result and the matrix's cells by (variant,
    world size)."""
    command = [*launcher, "-m", "harness", "watch", str(script), "--report-dir", str(report_dir), *options]
    if args:
        command += ["--", *args]
    result = subprocess.run(command, cwd=cwd or report_dir.parent, env={**plain_env(), **settings},
                            capture_output=True, text=True, timeout=600)
    matrix_file = report_dir / "matrix.json"
    assert matrix_file.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    matrix = json.loads(matrix_file.read_text())
    return result, {"environment": matrix["environment"],
                    **{(c["variant"], c["world_size"]): c for c in matrix["cells"]}}


def kinds(cell: dict) -> set[str]:
    return {f["kind"] for f in cell["failures"]}


def assert_refused(result: subprocess.CompletedProcess, cell: dict, says: str) -> None:
    """The run exits 1 and the cell is an error of one line, every rank's LoopRefused saying ``says``."""
    ranks = "rank 0" if cell["world_size"] == 1 else "ranks " + ", ".join(map(str, range(cell["world_size"])))
    assert result.returncode == 1 and cell["status"] == "error" and "\n" not in cell["summary"]
    assert cell["summary"].startswith(f"{ranks} raised harness.rank.watch.LoopRefused: watch: "), cell["summary"]
    assert says in cell["summary"]


def shown(command: str) -> dict[tuple[str, int], str]:
    """The cells docs/script.md shows ``command`` giving, by (variant, world size)."""
    run = documented_run(PAGE.read_text(encoding="utf-8"), command)
    return {(variant, ws): status for (_, variant), by_ws in run.rows.items() for ws, status in by_ws.items()}


def test_the_examples_unedited_script_passes_at_one_and_two_ranks_in_fp32_and_bf16(tmp_path):
    result, cells = watch(tmp_path / "reports", CLASSIFIER, "--world-sizes", "1,2", "--precision", "fp32,bf16",
                          args=("--gradient_accumulation_steps", "2"), cwd=EXAMPLE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert shown("cd examples/my_project && python -m harness watch scripts/train_classifier.py --world-sizes 1,2 "
                 "--precision fp32,bf16 -- --gradient_accumulation_steps 2") == \
        {key: cell["status"] for key, cell in cells.items() if key != "environment"}
    environment_ = cells.pop("environment")
    assert environment_["script"]["path"] == str(CLASSIFIER)
    assert environment_["script"]["argv"] == ["--gradient_accumulation_steps", "2"]
    assert set(cells) == {(p, ws) for p in ("fp32", "bf16") for ws in (1, 2)}
    for (precision, world_size), cell in cells.items():
        assert cell["case"] == "train_classifier" and cell["status"] == "pass", cell["summary"]
        # every backward's gradients, and per step the clip's norm, the learning rate and the parameters
        assert cell["grad_checks"] >= 24 and cell["checks"] > 2 * cell["grad_checks"], cell
        if world_size == 2:
            assert cell["comm_checks"] == 24 and cell["vacuous_checks"] < cell["grad_checks"], cell
        # the harness says what it changed of the script's Accelerator arguments
        assert cell["forced"]["cpu"] == "False -> True"
        assert ("mixed_precision" in cell["forced"]) == (precision == "bf16")
        assert "FORCED: cpu False -> True" in cell["summary"]


def test_a_loop_that_accumulates_by_hand_passes_under_its_window_and_fails_under_the_accelerators(tmp_path):
    result, cells = watch(tmp_path / "declared", HAND_LOOP, "--world-sizes", "1,2", "--num-steps", "2",
                          args=("--accumulation", "2", "--shape", "second_accelerator"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {cells[("as-written", ws)]["status"] for ws in (1, 2)} == {"pass"}
    assert "--num-steps 2" in cells[("as-written", 2)]["rerun"]
    # without --num-steps the contract is the script's Accelerator's: one micro-batch a window, whose
    # loss is not divided, synced and stepped at every backward; the script's first backward is local
    # and halved, and it steps every second one
    result, cells = watch(tmp_path / "undeclared", HAND_LOOP, "--nproc", "2", args=("--accumulation", "2"))
    assert result.returncode == 1
    cell = cells[("as-written", 2)]
    assert cell["status"] == "fail" and {"comm_missing", "wrong_scale", "step_skipped"} <= kinds(cell), cell["summary"]


def test_the_full_batch_contract_by_flag_weighs_a_short_window_by_its_own_micro_batches(tmp_path):
    # 5 batches a rank an epoch in windows of 2: the last window has one micro-batch, which the loop
    # divides by 2 as accelerate's contract does (passed above); the full-batch contract wants it whole
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "2", "--num-steps", "2", "--contract",
                          "full_batch", args=("--accumulation", "2"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail" and cells["environment"]["script"]["contract"] == \
        "full_batch"
    first = min(cell["failures"], key=lambda f: f["step"])
    assert (first["step"], first["kind"]) == (5, "misweighted") and "weigh 0.5 times" in first["message"]


# each mistake: the diagnoses its first failing step must name, and that step
MISTAKES = {
    # the sync at step 1 is one the loop never suppressed: not a failure; step 2 ran under no_sync
    "step_at_zero": ({"stepped_early"}, 1),
    "loss_not_divided": ({"wrong_scale"}, 1),
    "no_zero_grad": ({"stale"}, 3),
    "never_syncs": ({"not_synced", "comm_missing"}, 2),
    "clip_every_batch": ({"misweighted"}, 2),
}


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """Each planted mistake of the hand loop, unedited, at world size 2."""
    root = tmp_path_factory.mktemp("mistakes")
    return {mistake: watch(root / mistake, HAND_LOOP, "--nproc", "2", "--num-steps", "2",
                           args=("--accumulation", "2", "--mistake", mistake)) for mistake in MISTAKES}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_mistake_in_an_unedited_script_fails_with_its_diagnosis_at_its_step(mistakes, mistake):
    result, cells = mistakes[mistake]
    expected, step = MISTAKES[mistake]
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail", cell["summary"]
    first = min(f["step"] for f in cell["failures"])
    at_first = {f["kind"] for f in cell["failures"] if f["step"] == first}
    assert first == step and expected <= at_first, (first, at_first, cell["summary"])
    if mistake == "loss_not_divided":
        assert "scaled by 2" in cell["failures"][0]["message"]


def test_the_page_shows_the_mistakes_as_they_fail(mistakes):
    page = PAGE.read_text(encoding="utf-8")
    _, cells = mistakes["step_at_zero"]
    cell = cells[("as-written", 2)]
    assert shown("python -m harness watch tests/planted/scripts/hand_loop.py --nproc 2 --num-steps 2 -- "
                 "--mistake step_at_zero") == {("as-written", 2): cell["status"]}
    quoted = next(b for b in fenced_blocks(page) if b.startswith("optimizer of 'model' on rank 0 at step 1"))
    said = {f["message"].splitlines()[0] for f in cell["failures"]}
    assert all(line in said for line in quoted.splitlines()), quoted
    table = {row.split("|")[1].strip().strip("`"): row.split("|")[3] for row in page.splitlines()
             if row.startswith("| `") and row.split("|")[1].strip().strip("`") in MISTAKES}
    assert set(table) == set(MISTAKES)
    for mistake, (expected, step) in MISTAKES.items():
        assert table[mistake].strip().startswith(f"{step}: ") and all(f"`{k}`" in table[mistake] for k in expected)


def test_an_early_step_is_named_from_the_optimizer_whatever_the_learning_rate(tmp_path):
    # a warm-up from a learning rate of 0: the early step moves no parameter, and is named all the same
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "2", "--num-steps", "2",
                          args=("--accumulation", "2", "--mistake", "step_at_zero", "--warmup"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail", cell["summary"]
    first = [f for f in cell["failures"] if f["step"] == 1]
    assert {(f["kind"], f["param"]) for f in first} == {("stepped_early", "optimizer")}, cell["summary"]
    assert first[0]["message"].endswith("the optimizer stepped where the schedule has no step (its step() ran)")
    # the same warm-up in a loop that steps where the schedule does passes (its rates checked)
    result, cells = watch(tmp_path / "right", HAND_LOOP, "--nproc", "2", "--num-steps", "2",
                          args=("--accumulation", "2", "--warmup"))
    assert result.returncode == 0 and cells[("as-written", 2)]["status"] == "pass", cells[("as-written", 2)]["summary"]


def test_a_sync_the_loop_never_suppressed_passes_saying_what_no_sync_would_save(tmp_path):
    result, cells = watch(tmp_path / "every", HAND_LOOP, "--world-sizes", "1,2", "--num-steps", "2",
                          args=("--accumulation", "2", "--syncs", "every"))
    assert result.returncode == 0, result.stdout[-3000:]
    cell = cells[("as-written", 2)]
    assert cell["status"] == "pass" and cell["comm_checks"] == 20, cell["summary"]
    # 5 batches a rank an epoch in windows of 2, 2 epochs: 4 backwards a rank where a window has no sync
    assert ("syncs: 4 backwards all-reduced inside their windows (the loop never asked for no_sync or accumulate "
            "there): correct, and no_sync would save 4 all-reduces a rank") in cell["summary"]
    assert "syncs:" not in cells[("as-written", 1)]["summary"]
    # a mistake beside it is named as alone: the loss not divided by the steps is scaled by 2 at world size 2 too
    result, cells = watch(tmp_path / "undivided", HAND_LOOP, "--nproc", "2", "--num-steps", "2",
                          args=("--accumulation", "2", "--syncs", "every", "--mistake", "loss_not_divided"))
    cell = cells[("as-written", 2)]
    first = [f for f in cell["failures"] if f["step"] == 1]
    assert {f["kind"] for f in first} == {"wrong_scale"} and "scaled by 2" in first[0]["message"], cell["summary"]


def test_a_schedule_free_optimizers_mode_switches_are_made_on_the_oracles_copy_too(tmp_path):
    # optimizer.train() and .eval() every epoch, as accelerate's schedule_free.py: each moves every
    # parameter outside a step; the oracle's copy of the optimizer switches with it, bit for bit
    pytest.importorskip("schedulefree")
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--world-sizes", "1,2", "--num-steps", "2",
                          args=("--accumulation", "2", "--optimizer", "schedule_free"))
    assert result.returncode == 0, result.stdout[-3000:]
    for ws in (1, 2):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and cell["max_abs_diff"] == 0.0, cell["summary"]


def test_a_failing_cells_rerun_command_runs_it_again_alone(mistakes, tmp_path):
    _, cells = mistakes["step_at_zero"]
    rerun = shlex.split(cells[("as-written", 2)]["rerun"])
    assert rerun[:4] == ["python", "-m", "harness", "watch"] and rerun[-2:] == ["--mistake", "step_at_zero"]
    report_dir = Path(rerun[rerun.index("--report-dir") + 1])
    result = subprocess.run([sys.executable, *rerun[1:]], cwd=tmp_path, env=plain_env(), capture_output=True,
                            text=True, timeout=600)
    again = json.loads((report_dir / "matrix.json").read_text())["cells"]
    assert result.returncode == 1 and [(c["variant"], c["world_size"], c["status"]) for c in again] == [
        ("as-written", 2, "fail")]
    assert kinds(again[0]) == kinds(cells[("as-written", 2)])


def test_a_model_without_a_loss_takes_the_loss_named_on_the_command_line(tmp_path):
    result, cells = watch(tmp_path / "named", HAND_LOOP, "--nproc", "2", "--num-steps", "2", "--loss",
                          "hand_loop:batches_loss", args=("--mistake", "plain_logits"))
    assert result.returncode == 0 and cells[("as-written", 2)]["status"] == "pass", cells[("as-written", 2)]
    result, cells = watch(tmp_path / "unnamed", HAND_LOOP, "--nproc", "1", "--num-steps", "2",
                          args=("--mistake", "plain_logits"))
    cell = cells[("as-written", 1)]
    assert result.returncode == 1 and cell["status"] == "error"
    assert "watch: the model (Classifier) returns no .loss for the script's batches" in cell["summary"]
    assert "give --loss module:function" in cell["summary"]


REFUSED = {
    "iterable": "prepares a DataLoader of an IterableDataset",
    "two_losses": "a second accelerator.backward on batch 1 of epoch 0",
    "unprepared_model": "drew a batch from a prepared dataloader before it prepared a model",
    # its weights put back between epochs: the oracle's copy cannot follow a load
    "reload": "the script loads a state into its Classifier (load_state_dict) after its first batch",
}


@pytest.mark.parametrize("shape", sorted(REFUSED))
def test_a_script_the_harness_cannot_follow_is_an_error_of_one_line_saying_why(tmp_path, shape):
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "1", "--num-steps", "2",
                          args=("--shape", shape))
    assert_refused(result, cells[("as-written", 1)], REFUSED[shape])


def test_a_script_that_exits_with_a_status_is_an_error_saying_what_it_said_last(tmp_path):
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "1", args=("--no-such-option",))
    cell = cells[("as-written", 1)]
    assert result.returncode == 1 and cell["status"] == "error"
    assert cell["summary"] == ("rank 0 raised RuntimeError: watch: the script exited with status 2: hand_loop.py: "
                               "error: unrecognized arguments: --no-such-option")


def test_what_the_script_raises_is_said_with_the_scripts_line_it_came_through(tmp_path):
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "1", args=("--shape", "hub_checkpoint"),
                          HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    cell = cells[("as-written", 1)]
    assert result.returncode == 1 and cell["status"] == "error"
    assert cell["summary"].startswith("rank 0 raised harness.rank.script.run.ScriptFailed: OSError: ")
    line = next(n for n, text in enumerate(HAND_LOOP.read_text().splitlines(), 1) if "no-such-checkpoint" in text)
    call = 'AutoConfig.from_pretrained("gradsync-harness/no-such-checkpoint")'
    assert cell["summary"].endswith(f"(at hand_loop.py:{line}: {call})")
    assert "\n" not in cell["summary"] and "Traceback" in cell["detail"]
    assert "(at " + cell["summary"].split(" (at ")[1] in PAGE.read_text(encoding="utf-8")  # as the page shows it


def test_tiny_model_builds_each_pretrained_model_of_its_own_config_shrunk(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    checkpoint = tmp_path / "my-bert"  # a local checkpoint, as a script names its own
    config = BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(checkpoint)
    script = ROOT / "tests" / "planted" / "scripts" / "pretrained.py"
    sizes = {}
    for tiny in (False, True):
        out = tmp_path / f"sizes-{tiny}.json"
        options = ["--nproc", "2", *(["--tiny-model"] if tiny else [])]
        result, cells = watch(tmp_path / f"reports-{tiny}", script, *options,
                              args=("--checkpoint", str(checkpoint), "--sizes", str(out)))
        cell = cells[("as-written", 2)]
        assert result.returncode == 0 and cell["status"] == "pass", cell["summary"]
        sizes[tiny] = json.loads(out.read_text())
        said = cell.get("forced", {}).get(f"model {checkpoint}")
        assert said == ("pretrained -> tiny (bert: 2 layers, width 32, random weights)" if tiny else None), cell
        assert cells["environment"]["script"]["tiny_model"] is tiny
    assert sizes == {False: {"layers": 4, "width": 64}, True: {"layers": 2, "width": 32}}


def test_the_launchers_accelerate_settings_are_the_scripts_own(tmp_path):
    # as `accelerate launch --gradient_accumulation_steps 2` leaves them: the script's Accelerator() takes two
    # steps a window from there, so its loop that steps at every batch steps early
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--nproc", "2", args=("--accumulation", "1"),
                          ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2", ACCELERATE_MIXED_PRECISION="bf16")
    script = cells["environment"]["script"]
    assert script["accelerate_settings"] == ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_MIXED_PRECISION"]
    assert "ignored_launcher_settings" not in cells["environment"]
    cell = cells[("as-written", 2)]
    first = [f for f in cell["failures"] if f["step"] == 1]
    # (its sync at every batch is one it never asked not to make: not a failure)
    assert cell["status"] == "fail" and {f["kind"] for f in first} == {"stepped_early"}, cell["summary"]
    assert "mixed_precision" not in cell.get("forced", {})


def test_under_torchrun_the_launchers_processes_are_the_ranks(tmp_path):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--num-steps", "2",
                          args=("--mistake", "loss_not_divided"), launcher=launcher)
    assert cells["environment"]["launcher"] == "torchrun"
    cell = cells[("as-written", 2)]
    assert result.returncode != 0 and cell["status"] == "fail" and "wrong_scale" in kinds(cell), cell["summary"]
    # a world size other than the launcher's stops every rank with one line
    other = subprocess.run([*launcher[:-1], f"127.0.0.1:{free_port()}", "-m", "harness", "watch", str(HAND_LOOP),
                            "--world-sizes", "4", "--report-dir", str(tmp_path / "other")], cwd=tmp_path,
                           env=plain_env(), capture_output=True, text=True, timeout=600)
    assert other.returncode != 0 and not (tmp_path / "other" / "matrix.json").exists()
    assert "--world-sizes: the launcher started 2 ranks; under a launcher the world size is the launcher's" in \
        other.stdout + other.stderr


def test_under_accelerate_launch_its_settings_are_the_scripts(tmp_path):
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()))
    # a bf16 cell of a script whose Accelerator() takes bf16 from accelerate launch: nothing to force
    # (run alone, the same cell says mixed_precision 'no' -> 'bf16')
    result, cells = watch(tmp_path / "reports", HAND_LOOP, "--num-steps", "2", "--precision", "bf16",
                          launcher=launcher)
    environment_ = cells["environment"]
    assert environment_["launcher"] == "accelerate launch" and "ignored_launcher_settings" not in environment_
    assert "ACCELERATE_MIXED_PRECISION" in environment_["script"]["accelerate_settings"]
    cell = cells[("bf16", 2)]
    assert result.returncode == 0 and cell["status"] == "pass", cell["summary"]
    assert cell["forced"] == {"cpu": "False -> True"}


@pytest.mark.parametrize("argv, says", [
    (["watch", "no_such_script.py"], "no script at no_such_script.py"),
    (["watch", str(HAND_LOOP), "--nproc", "2", "--world-sizes", "1,2"], "give --nproc or --world-sizes, not both"),
    (["watch", str(HAND_LOOP), "--loss", "no_colon"], "give module:function"),
    (["watch", str(HAND_LOOP), "--precision", "fp64"], "give precisions among fp32, bf16, fp16"),
    (["watch", str(HAND_LOOP), "--world-sizes", "0"], "world sizes of 1 or more"),
])
def test_bad_input_to_the_command_is_one_line_and_exit_2(argv, says):
    result = subprocess.run([sys.executable, "-m", "harness", *argv], env=plain_env(), capture_output=True,
                            text=True, timeout=120)
    # one line saying what was wrong (argparse's usage above it for a malformed option)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and line.startswith("harness watch: error: ") and says in line, result.stderr
    assert "Traceback" not in result.stderr
