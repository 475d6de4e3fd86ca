"""A script that trains with transformers' ``Trainer`` or a subclass of it, checked as it is: ``python -m
harness watch`` finds the Trainer building the script's Accelerator and holds its training to Trainer's
contract (harness/rank/script/trainers.py, docs/script.md "Trainer and TRL scripts"): windows of its
accumulation steps, the window's token mean where it weighs tokens, else the window's mean over its
micro-batches, its own learning-rate schedule and clip. A plain Trainer passes; a subclass whose
``compute_loss`` returns the model's mean loss (transformers issue #35856's class) fails at its first step
with the weight its micro-batches got; the same subclass declaring ``loss_is_scaled_for_ga = False``
passes. Real ranks, gloo, the installed accelerate and transformers, real processes."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT
from test_launch import free_port
from test_script import assert_refused, kinds, shown, watch

pytest.importorskip("transformers")

TRAINER_SCRIPT = ROOT / "tests" / "planted" / "scripts" / "trainer_script.py"
SFT_SCRIPT = ROOT / "tests" / "planted" / "scripts" / "sft_script.py"
FORCED = {"TrainingArguments.use_cpu": "False -> True", "cpu": "False -> True"}


def test_a_trainer_script_passes_held_to_the_token_mean_of_each_window(tmp_path):
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--world-sizes", "1,2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert shown("python -m harness watch tests/planted/scripts/trainer_script.py --world-sizes 1,2") == \
        {key: cell["status"] for key, cell in cells.items() if key != "environment"}
    for ws in (1, 2):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and cell["max_abs_diff"] == 0.0, cell["summary"]
        assert "contract: tokens, as the script's Trainer weighs the window's tokens" in cell["summary"]
        assert cell["forced"] == FORCED, cell["forced"]
        # 20 micro-batches in 10 windows of 2 on one rank, 5 a rank on two: every backward's gradients,
        # the gradients after each window's clip (Trainer's max_grad_norm), every micro-step's parameters
        # and each step's learning rate (its warm-up)
        assert cell["grad_checks"] == 30, cell["summary"]
        # and the 10 grad_norms the Trainer logged (logging_steps=1; 5 a rank at world size 2), each against
        # the oracle's norm of that step's clip, beside the 80 checks the clip's own return took part in
        assert cell["checks"] == 90, cell["summary"]
    assert cells[("as-written", 2)]["comm_checks"] == 20


def test_a_trainers_short_last_window_of_each_epoch_is_its_own(tmp_path):
    # 42 rows in batches of 2: 21 micro-batches an epoch at world size 1 (11 a rank at 2), in windows of 2
    # whose last of each epoch has one micro-batch, two epochs: each short window is the token mean of its
    # own micro-batch, as Trainer takes it
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--world-sizes", "1,2",
                          args=("--rows", "42", "--epochs", "2"))
    assert result.returncode == 0, result.stdout[-3000:]
    for ws, backwards in ((1, 42), (2, 44)):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and cell["max_abs_diff"] == 0.0, cell["summary"]
        # every backward, and the gradients after the clip of each of the 22 (12 a rank) windows
        assert cell["grad_checks"] == backwards + (22 if ws == 1 else 24), cell["summary"]


def test_a_subclass_that_returns_the_models_mean_loss_fails_with_its_weight(tmp_path):
    # Trainer takes the loss of a model that accepts loss kwargs as scaled for the accumulation already,
    # so the window's mean losses are added, not averaged: each micro-batch weighs about twice its share
    # of the token mean (exactly twice where every micro-batch holds as many tokens)
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2", args=("--trainer", "mean_loss"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail", cell["summary"]
    assert "contract: tokens, as the script's MeanLossTrainer weighs the window's tokens" in cell["summary"]
    first = [f for f in cell["failures"] if f["step"] == 1]
    assert first and kinds({"failures": first}) == {"misweighted"}, cell["summary"]
    weight = float(first[0]["message"].split("weigh ")[1].split(" times")[0])
    assert 1.5 < weight < 3.5, first[0]["message"]


def test_a_subclass_that_declares_its_loss_unscaled_is_held_to_the_mean_of_its_micro_batches(tmp_path):
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2",
                          args=("--trainer", "mean_loss_flagged"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "pass", cell["summary"]
    assert ("contract: full_batch (the mean over each window's micro-batches), as the script's "
            "FlaggedMeanLossTrainer divides its loss by them") in cell["summary"]


def test_a_trl_sft_trainer_script_passes_in_its_own_bf16_and_in_fp32(tmp_path):
    # TRL computes the loss from the model's log-probabilities through a forward of its own, set on the
    # model (add_fused_lm_head): the oracle's replica runs that forward too, bit for bit
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    result, cells = watch(tmp_path / "reports", SFT_SCRIPT, "--world-sizes", "1,2", **offline)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert shown("python -m harness watch tests/planted/scripts/sft_script.py --world-sizes 1,2") == \
        {key: cell["status"] for key, cell in cells.items() if key != "environment"}
    for ws in (1, 2):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and cell["max_abs_diff"] == 0.0, cell["summary"]
        assert "contract: tokens, as the script's SFTTrainer weighs the window's tokens" in cell["summary"]
        assert "mixed_precision" not in cell["forced"]  # SFTConfig's own bf16, run as written


def test_a_trainer_under_deepspeed_keeps_its_own_config_and_passes(tmp_path):
    # TrainingArguments(deepspeed=...) with every value "auto": Trainer fills its config from its arguments
    # (train_batch_size from the world size, counted again once the cell's Accelerator counts the ranks of
    # a CPU host), DeepSpeed clips inside its step at max_grad_norm by the norm it measured, and the
    # grad_norm the Trainer logs is the engine's
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--world-sizes", "1,2", args=("--zero", "2"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for ws in (1, 2):
        cell = cells[("as-written", ws)]
        assert cell["status"] == "pass" and cell["max_abs_diff"] == 0.0, cell["summary"]
        assert cell["wrapper"] == "deepspeed-z2" and not cell.get("forced"), cell  # DeepSpeed runs with cpu=False
        # ZeRO-2 hides the gradients between its boundaries: each window's 10 (5 a rank) read whole at its
        # boundary and 10 hidden; every micro-step's parameters, each step's learning rate, and the 10
        # grad_norms logged, each against the oracle's norm of that step's clip
        assert (cell["grad_checks"], cell["checks"]) == (20, 70), cell["summary"]


def test_a_subclass_with_the_mean_loss_under_zero3_fails_where_deepspeed_reduces(tmp_path):
    # the same misweighted windows as under DDP, read at each boundary (ZeRO-3 partitions the gradients
    # between them)
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2",
                          args=("--zero", "3", "--trainer", "mean_loss"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail" and cell["wrapper"] == "deepspeed-z3", cell["summary"]
    first = min(f["step"] for f in cell["failures"])
    assert first == 2 and kinds(cell) == {"misweighted"}, cell["summary"]


def test_a_trainer_under_accelerate_launchs_fsdp_config_passes(tmp_path):
    # accelerate launch --use_fsdp: the Trainer makes no plugin of its own, the Accelerator takes the
    # launcher's; what accelerate refuses on a CPU host is done without and said
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "1",
                "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()))
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, launcher=launcher)
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "pass" and cell["wrapper"] == "fsdp1", cell["summary"]
    assert cell["forced"] == {**FORCED, "fsdp_plugin.sync_module_states": "True -> False",
                              "fsdp_plugin.cpu_ram_efficient_loading": "True -> False"}, cell["forced"]


def test_a_trainers_own_fsdp2_wraps_each_decoder_layer_and_passes(tmp_path):
    # TrainingArguments(fsdp=..., fsdp_config={"version": 2}): Trainer's plugin shards each decoder layer
    # as a unit of its own (its auto-wrap policy, carried over): the oracle reads the reduction's layout
    # from the model as prepared
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2", args=("--fsdp", "2"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "pass" and cell["wrapper"] == "fsdp2", cell["summary"]


@pytest.mark.parametrize("args, says", [
    # FSDP1's nested units rename the parameters the checks read
    (("--fsdp", "1"), "the script's FSDP plugin sets auto_wrap_policy='transformer_auto_wrap_policy'"),
    (("--fsdp", "2", "--bf16"), "the script's Trainer trains under fsdp2 in bf16; the harness follows a Trainer "
                                "under FSDP in fp32"),
])
def test_what_a_trainer_under_fsdp_cannot_be_followed_in_is_refused_in_one_line(tmp_path, args, says):
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2", args=args)
    assert_refused(result, cells[("as-written", 2)], says)


def test_a_trainer_under_deepspeed_in_bf16_is_a_skip_on_a_cpu_host(tmp_path):
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--nproc", "2", args=("--zero", "2", "--bf16"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "skip", cell["summary"]
    assert "a Trainer under DeepSpeed runs bf16 and fp16 on a GPU host only" in cell["summary"]


def test_tokens_averaged_per_rank_are_misweighted_at_two_ranks_only(tmp_path):
    # average_tokens_across_devices=False: each rank divides by its own window's tokens, and DDP averages the
    # ranks' means: a rank with fewer tokens weighs each of them more than the global window's token mean
    result, cells = watch(tmp_path / "reports", TRAINER_SCRIPT, "--world-sizes", "1,2", args=("--tokens-per-rank",))
    assert cells[("as-written", 1)]["status"] == "pass", cells[("as-written", 1)]["summary"]
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail" and kinds(cell) == {"misweighted"}, cell["summary"]
    assert min(f["step"] for f in cell["failures"]) == 1
