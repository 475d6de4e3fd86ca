"""A script whose own Accelerator asks for FSDP or DeepSpeed (its plugin, or accelerate launch's config)
runs under that wrapper, the cell saying so (harness/rank/script/plugins.py, docs/script.md "FSDP and
DeepSpeed"): each wrapper passes a correct unedited script and fails a planted mistake with its diagnosis;
DeepSpeed's own clipping is the oracle's; a setting the oracle does not model is one line naming it.
Real ranks, gloo, the installed accelerate and DeepSpeed, real processes."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT
from test_launch import free_port
from test_script import assert_refused, kinds, watch

PLUGIN_LOOP = ROOT / "tests" / "planted" / "scripts" / "plugin_loop.py"
CPU = {"cpu": "False -> True"}  # FSDP's cells on a CPU host; DeepSpeed's run with cpu=False (deepspeed_cpu.py)


@pytest.mark.parametrize("plugin, options, forced", [
    # FSDP2 in bf16 with the script's own MixedPrecisionPolicy (fp32 reduction) and a setting that changes no
    # gradient, carried over
    ("fsdp2", ("--mixed-precision", "bf16", "--reduce-fp32", "--reshard-after-forward", "false"), CPU),
    ("fsdp1", (), {**CPU, "fsdp_plugin.use_orig_params": "False -> True"}),
    # DeepSpeed clips inside its step (accelerate's default norm 1.0; 0.5 here): under plain SGD a clip the
    # oracle left out would change every update by the clip's factor
    ("deepspeed-z1", ("--clip", "0.5", "--sgd"), {}),
    ("deepspeed-z2", ("--mixed-precision", "bf16"), {}),
    ("deepspeed-z3", (), {}),
])
def test_the_scripts_own_plugin_is_the_cells_wrapper(tmp_path, plugin, options, forced):
    result, cells = watch(tmp_path / "reports", PLUGIN_LOOP, "--nproc", "2", args=("--plugin", plugin, *options))
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "pass", cell["summary"]
    assert cell["wrapper"] == plugin and f"under {plugin}, as the script's Accelerator asks" in cell["summary"]
    assert cell.get("forced", {}) == forced
    # every window's gradients judged, and what each backward issued held to the wrapper's collectives
    assert cell["grad_checks"] == 24 and cell["comm_checks"] == 24


@pytest.mark.parametrize("plugin", ["fsdp2", "deepspeed-z2"])
def test_a_mistake_in_a_script_under_its_wrapper_fails_with_its_diagnosis(tmp_path, plugin):
    result, cells = watch(tmp_path / "reports", PLUGIN_LOOP, "--nproc", "2",
                          args=("--plugin", plugin, "--mistake", "loss_times_steps"))
    cell = cells[("as-written", 2)]
    assert result.returncode == 1 and cell["status"] == "fail" and cell["wrapper"] == plugin
    assert "wrong_scale" in kinds(cell) and cell["failures"][0]["step"] == 2, cell["summary"]


REFUSED = {
    "fsdp2 --offload": "the script's FSDP plugin sets cpu_offload=",
    "deepspeed-z1 --offload": "the script's DeepSpeed config sets zero_optimization.offload_optimizer.device='cpu'",
    "fsdp2 --reduce-fp32": "the script's FSDP plugin gives mixed_precision_policy=",
}


@pytest.mark.parametrize("asked", sorted(REFUSED))
def test_a_plugin_setting_the_oracle_does_not_model_is_one_line_naming_it(tmp_path, asked):
    result, cells = watch(tmp_path / "reports", PLUGIN_LOOP, "--nproc", "2", args=("--plugin", *asked.split()))
    assert_refused(result, cells[("as-written", 2)], REFUSED[asked])


def test_fsdp_at_one_rank_is_a_skip_saying_accelerate_wraps_nothing_there(tmp_path):
    result, cells = watch(tmp_path / "reports", PLUGIN_LOOP, "--world-sizes", "1", args=("--plugin", "fsdp2"))
    cell = cells[("as-written", 1)]
    assert cell["status"] == "skip" and "at world size 1 accelerate applies no wrapper" in cell["summary"]


def test_accelerate_launchs_fsdp_config_is_the_scripts_wrapper(tmp_path):
    # `accelerate launch --use_fsdp` sets sync_module_states and cpu_ram_efficient_loading, which accelerate
    # refuses on a CPU host: the cell does without them and says so
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "1",
                "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()))
    result, cells = watch(tmp_path / "reports", PLUGIN_LOOP, launcher=launcher)
    assert cells["environment"]["launcher"] == "accelerate launch"
    cell = cells[("as-written", 2)]
    assert result.returncode == 0 and cell["status"] == "pass" and cell["wrapper"] == "fsdp1", cell["summary"]
    assert cell["forced"]["fsdp_plugin.sync_module_states"] == "True -> False"
    assert cell["forced"]["fsdp_plugin.cpu_ram_efficient_loading"] == "True -> False"
