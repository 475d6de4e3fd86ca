"""The wrapper a watched script's Accelerator asks for (``python -m harness watch``, docs/script.md
"FSDP and DeepSpeed"): its ``fsdp_plugin`` or ``deepspeed_plugin``, or the plugin ``accelerate launch``
makes from its config (``ACCELERATE_USE_FSDP``/``ACCELERATE_USE_DEEPSPEED``), becomes the cell's wrapper.

The cell then runs under the harness's own plugin for that wrapper (harness/wrappers/prepare.py), the
one the oracle models, with the script's settings carried over where they do not change a gradient
and read where they say what the gradients must be: the FSDP version and ZeRO stage (the wrapper),
FSDP2's ``MixedPrecisionPolicy`` (the cell's reduce dtype), DeepSpeed's accumulation steps and
clipping norm (the contract's steps, the oracle's clip). A setting the harness needs otherwise is
said in the cell's ``forced``; any other setting of the script's plugin is refused in one line naming
it, since the oracle would not model what it changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from harness.rank.script.loss import WHO
from harness.rank.watch import LoopRefused
from harness.wrappers.registry import of_identity, spec

# Accelerator arguments that ask for a wrapper the harness does not follow under a script
UNFOLLOWED = ("deepspeed_plugins", "megatron_lm_plugin", "parallelism_config", "torch_tp_plugin")
# FSDP plugin fields that change no gradient (when parameters are gathered and freed, how state is
# saved, how weights are loaded): the script's values are carried over to the cell's plugin
FSDP_CARRIED = ("reshard_after_forward", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                "state_dict_type", "state_dict_config", "optim_state_dict_config")
# FSDP2 plugin fields that say which modules are sharded units of their own (a Trainer's plugin wraps
# each decoder layer): carried over, as the oracle reads FSDP2's reduction layout from the model as
# prepared (harness/rank/oracle/sharded_reduce.py); FSDP1's nested units rename the parameters the
# checks read, and are refused
FSDP2_CARRIED = ("auto_wrap_policy", "transformer_cls_names_to_wrap", "min_num_params")
# FSDP plugin fields the harness sets (harness/wrappers/prepare.py says why): FSDP1's parameters kept
# as the user's, and no broadcast of rank 0's weights, nor loading them on rank 0 alone (accelerate
# refuses the broadcast on a CPU host; the oracle starts from the weights the ranks hold after
# prepare, whatever they are)
FSDP_FORCED = ("use_orig_params", "sync_module_states", "cpu_ram_efficient_loading")
# FSDP plugin settings accelerate refuses on a CPU host ("not supported on cpu"), which accelerate launch and
# Trainer's FSDP1 arguments set: the cell does without them there, and says so
REFUSED_ON_CPU = ("sync_module_states", "cpu_ram_efficient_loading")
# FSDP plugin fields read into the cell's wrapper and dtype policy
FSDP_READ = ("fsdp_version", "mixed_precision_policy")
# DeepSpeed config keys the script may set: read (the stage, the steps, the clip), or with no effect
# on a gradient (the batch bookkeeping, the print interval, a save option)
DEEPSPEED_READ = ("zero_optimization.stage", "gradient_accumulation_steps", "gradient_clipping")
DEEPSPEED_CARRIED = ("train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
                     "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                     "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path")


@dataclass
class Asked:
    """The wrapper a script's Accelerator asks for, as the cell runs it."""

    wrapper: str
    plugin: Any  # the script's plugin (or the one accelerate launch's settings make)
    policy: dict[str, str | None] = field(default_factory=lambda: {"reduce": None, "grad_accum": None})
    num_steps: int | None = None  # DeepSpeed's own accumulation steps, where the script gives them
    clip: float | None = None  # DeepSpeed's clipping norm (accelerate's default 1.0), applied in its step
    forced: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # the launcher's settings changed


def asked_wrapper(given: dict[str, Any], precision: str) -> Asked | None:
    """The wrapper ``given`` (the script's Accelerator arguments) asks for, its plugin taken out of
    ``given``; None for DDP (or one process). ``precision``: the cell's, as the harness names it."""
    unfollowed = next((k for k in UNFOLLOWED if given.get(k) is not None), None)
    if unfollowed:
        raise LoopRefused(f"{WHO}: the script's Accelerator asks for {unfollowed}: the harness follows a script "
                          "under DDP, FSDP or DeepSpeed ZeRO (one plugin)")
    fsdp, deepspeed = given.pop("fsdp_plugin", None), given.pop("deepspeed_plugin", None)
    launched: dict[str, tuple[Any, Any]] = {}  # what the harness changes of accelerate launch's settings
    if fsdp is None and deepspeed is None:
        # accelerate launch's config, as accelerate reads it (state.py): a plugin made of the environment
        import accelerate.utils

        if launched_deepspeed():
            deepspeed = accelerate.utils.DeepSpeedPlugin()
        elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            fsdp, launched = _launched_fsdp()
    if fsdp is not None and deepspeed is not None:
        raise LoopRefused(f"{WHO}: the script's Accelerator asks for both FSDP and DeepSpeed")
    if fsdp is None and deepspeed is None:
        return None
    asked = _fsdp(fsdp, precision) if fsdp is not None else _deepspeed(deepspeed)
    asked.forced.update(launched)
    precisions = spec(asked.wrapper).precisions
    if precision not in precisions:
        raise LoopRefused(f"{WHO}: the script runs {asked.wrapper} in {precision}; the harness models {asked.wrapper} "
                          f"in {' and '.join(precisions)}")
    return asked


def launched_deepspeed() -> bool:
    """Whether ``accelerate launch``'s config asks for DeepSpeed (``--use_deepspeed``), as accelerate reads it."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _launched_fsdp() -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """The FSDP plugin ``accelerate launch``'s config makes, and what the harness changes of it:
    ``sync_module_states`` and ``cpu_ram_efficient_loading`` (which asks for the first), which
    accelerate launch sets by default and accelerate refuses on a CPU host ("not supported on cpu"),
    and the cell does without (``FSDP_FORCED``)."""
    import accelerate.utils

    forced: dict[str, tuple[Any, Any]] = {}
    for name in REFUSED_ON_CPU:
        variable = f"FSDP_{name.upper()}"
        if os.environ.get(variable, "false").lower() in ("true", "1", "yes"):
            os.environ[variable] = "false"  # the script's environment, put back after the cell
            forced[f"fsdp_plugin.{name}"] = (True, False)
    return accelerate.utils.FullyShardedDataParallelPlugin(), forced


def _fsdp(plugin: Any, precision: str) -> Asked:
    version = int(getattr(plugin, "fsdp_version", None) or 1)
    its = of_identity("fsdp", version)
    if its is None:
        raise LoopRefused(f"{WHO}: the script's FSDP plugin asks for fsdp_version={version}")
    asked = Asked(its.name, plugin)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is not None:
        # a policy with a reduce dtype: the wrapper's ``reduce`` axis (FSDP2's MixedPrecisionPolicy)
        takes_reduce = its.mixed_axis is not None and its.mixed_axis[0] == "reduce"
        reduce = _reduce_of(policy) if takes_reduce and precision == "bf16" else None
        if reduce is None:
            raise LoopRefused(f"{WHO}: the script's FSDP plugin gives mixed_precision_policy={policy}; the harness "
                              "models FSDP2 under mixed_precision='bf16' with MixedPrecisionPolicy(param_dtype="
                              "torch.bfloat16, reduce_dtype=torch.float32 or torch.bfloat16), or accelerate's own")
        asked.policy["reduce"] = None if reduce == "accelerate" else reduce
    from harness.wrappers import probe

    with _without_launcher_settings():
        default = type(plugin)(**({"fsdp_version": version} if probe.takes_parameter(type(plugin), "fsdp_version")
                                  else {}))
    carried = FSDP_CARRIED + (FSDP2_CARRIED if version == 2 else ())
    _refuse_other_fields(plugin, default, carried + FSDP_FORCED + FSDP_READ, "FSDP plugin")
    return asked


def _reduce_of(policy: Any) -> str | None:
    """The cell's ``reduce`` for an FSDP2 ``MixedPrecisionPolicy``: "fp32" or "bf16" for the policy the
    harness makes with it (harness/wrappers/prepare.py), "accelerate" for accelerate's own bf16 policy
    (param, reduce and output dtype bf16), None for any other."""
    made = (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)
    if made[0] == torch.bfloat16 and made[2] is None and made[3]:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(made[1])
    if made == (torch.bfloat16, torch.bfloat16, torch.bfloat16, True):
        return "accelerate"
    return None


def _deepspeed(plugin: Any) -> Asked:
    config = dict(getattr(plugin, "deepspeed_config", None) or {})
    stage = int((config.get("zero_optimization") or {}).get("stage", getattr(plugin, "zero_stage", 0) or 0))
    its = of_identity("deepspeed", stage)
    if its is None:
        raise LoopRefused(f"{WHO}: the script's DeepSpeed plugin asks for ZeRO stage {stage}; the harness models "
                          "ZeRO-1, 2 and 3")
    asked = Asked(its.name, plugin)
    steps = config.get("gradient_accumulation_steps", "auto")
    if steps != "auto":
        asked.num_steps = int(steps)  # accelerate takes DeepSpeed's where the two differ (accelerator.py)
    clip = config.get("gradient_clipping", "auto")
    clip = 1.0 if clip == "auto" else float(clip)  # accelerate fills "auto" with 1.0 (accelerator.py)
    asked.clip = clip if clip > 0 else None
    import accelerate.utils

    with _without_launcher_settings():
        default = _flat(accelerate.utils.DeepSpeedPlugin(zero_stage=stage).deepspeed_config)
    mine = _flat(config)
    for key in sorted(set(default) | set(mine)):
        if key in DEEPSPEED_READ or key in DEEPSPEED_CARRIED or key not in mine or default.get(key) == mine[key]:
            continue  # (a key the script's config leaves out takes DeepSpeed's default, as the harness's plugin)
        if key.startswith(("bf16.", "fp16.")) and mine.get(key) in ("auto", False):
            continue  # the Accelerator's mixed_precision decides, as in the harness's own plugin
        raise LoopRefused(f"{WHO}: the script's DeepSpeed config sets {key}={mine.get(key, '(unset)')!r}; the harness "
                          "models ZeRO with its stage, accumulation steps and clipping norm, the rest as accelerate "
                          "makes it (no offload)")
    return asked


@contextlib.contextmanager
def _without_launcher_settings() -> Iterator[None]:
    """No ``accelerate launch`` settings in the environment (a plugin reads its defaults there): what
    a plugin is by default, to tell what the script or its launcher set."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _refuse_other_fields(plugin: Any, default: Any, allowed: tuple[str, ...], what: str) -> None:
    for f in dataclasses.fields(plugin):
        if f.name in allowed:
            continue
        mine, theirs = getattr(plugin, f.name), getattr(default, f.name)
        if mine != theirs:
            mine = getattr(mine, "__qualname__", mine) if callable(mine) else mine  # a policy by its name
            raise LoopRefused(f"{WHO}: the script's {what} sets {f.name}={mine!r} (accelerate's default: {theirs!r}); "
                              "the harness does not model what it changes in the gradients")


def carry_over(asked: Asked, made: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Carry the script's gradient-neutral settings over to the cell's plugin in ``made`` (the
    Accelerator's arguments); what differs still, as ``{setting: (the script's, the cell's)}``."""
    forced = dict(asked.forced)
    if spec(asked.wrapper).family == "fsdp":
        cell = made["fsdp_plugin"]
        for name in FSDP_CARRIED + (FSDP2_CARRIED if asked.wrapper == "fsdp2" else ()):
            if hasattr(cell, name):
                setattr(cell, name, getattr(asked.plugin, name))
        for name in FSDP_FORCED:
            mine, theirs = getattr(asked.plugin, name, None), getattr(cell, name, None)
            if mine != theirs:
                forced[f"fsdp_plugin.{name}"] = (mine, theirs)
    elif asked.clip is not None:  # the cell's plugin clips nothing unless told (harness/wrappers/deepspeed_cpu.py)
        cell = made["deepspeed_plugin"]
        cell.gradient_clipping = cell.deepspeed_config["gradient_clipping"] = asked.clip
    return forced
