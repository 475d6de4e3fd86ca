"""A script that trains with transformers' ``Trainer`` or a subclass of it (TRL's trainers included),
checked as it is (``python -m harness watch``, docs/script.md "Trainer and TRL scripts").

The Trainer builds the first Accelerator of the script, which becomes the cell's as any script's does
(harness/rank/script/run.py); the harness finds the Trainer building it, and holds its training to
Trainer's own contract, the one a Trainer user means: each optimizer step's update is the one the mean
loss over every valid label token (where the model is given ``num_items_in_batch``), or over the
window's micro-batches (a loss Trainer does not weigh by tokens), of the step's global batch would
give; windows of ``gradient_accumulation_steps`` micro-batches, the last of each epoch shorter; its
clip; its learning-rate schedule, which Trainer steps itself once a step. Whatever a subclass's
``compute_loss`` does to the loss is the user's code, judged by that contract.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, MutableMapping

from harness.decorator import SkipCell
from harness.rank.script.plugins import REFUSED_ON_CPU, launched_deepspeed
from harness.rank.watch.patching import after_import, patch

TRAINER_MODULE = "transformers.trainer"
# why a Trainer under DeepSpeed in bf16 or fp16 does not run on a host without a GPU
DEEPSPEED_LOW_PRECISION = ("a Trainer under DeepSpeed runs bf16 and fp16 on a GPU host only: TrainingArguments refuses "
                           "them without a GPU unless use_cpu=True, under which accelerate drops DeepSpeed")
ARGUMENTS_MODULE = "transformers.training_args"


def trainer_building() -> Any | None:
    """The ``transformers.Trainer`` (or subclass) whose construction is under way on this thread's stack,
    if any: the one building the Accelerator being made."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is None:
        return None
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, module.Trainer):
            return candidate
        frame = frame.f_back
    return None


def on_cpu(forced: MutableMapping[str, str], restore: list[Callable[[], None]]) -> None:
    """On a host without a GPU, every ``TrainingArguments`` the script makes (TRL's configs subclass it)
    runs on the CPU, as the cell's Accelerator does (``use_cpu``: without it Trainer's own
    ``PartialState`` takes no distributed CPU run, and DDP would not wrap the model); said in ``forced``.
    transformers is not imported for a script that does not import it."""

    def place(module: Any) -> None:
        cls = module.TrainingArguments
        original = cls.__post_init__

        def __post_init__(arguments: Any, *args: Any, **kwargs: Any) -> Any:
            deepspeed = bool(arguments.deepspeed) or launched_deepspeed()  # accelerate drops it under use_cpu
            if deepspeed and (arguments.bf16 or arguments.fp16):
                raise SkipCell(DEEPSPEED_LOW_PRECISION)
            if not arguments.use_cpu and not deepspeed:
                arguments.use_cpu = True
                forced["TrainingArguments.use_cpu"] = "False -> True"
            made = original(arguments, *args, **kwargs)
            fsdp = getattr(arguments, "fsdp_plugin_args", None) or {}
            for name in REFUSED_ON_CPU:
                if fsdp.get(name):  # Trainer's FSDP1 arguments set it; the cell does without (plugins.py)
                    fsdp[name] = False
                    forced[f"fsdp_plugin.{name}"] = "True -> False"
            return made

        patch(cls, "__post_init__", __post_init__, restore)

    after_import(ARGUMENTS_MODULE, place, restore)


def count_this_host(trainer: Any) -> None:
    """A Trainer's DeepSpeed config whose ``train_batch_size`` the script left ``"auto"``, filled again with
    the world size the cell's Accelerator now counts. On a host without a GPU, accelerate counts one
    process until the Accelerator is built and corrected (harness/wrappers/deepspeed_cpu.py,
    ``after_construction``), and ``TrainingArguments`` filled the key before that: DeepSpeed would refuse
    the batch sizes at ``train()``. On a GPU host the value is what transformers filled already."""
    import json

    arguments = trainer.args
    given = arguments.deepspeed  # as the script gave it (transformers leaves it as it was): a dict or a path
    if isinstance(given, str):
        with open(given, encoding="utf-8") as file:
            given = json.load(file)
    made = getattr(arguments, "hf_deepspeed_config", None)
    if made is None or not isinstance(given, dict) or given.get("train_batch_size") != "auto":
        return
    made.config["train_batch_size"] = (arguments.world_size * arguments.per_device_train_batch_size
                                       * arguments.gradient_accumulation_steps)


def weighs_tokens(trainer: Any) -> bool:
    """Whether the Trainer means its loss to be the window's token mean: it counts the window's valid label
    tokens (``num_items_in_batch``) for a model that accepts loss kwargs or for its ``compute_loss_func``,
    and then takes the loss as already scaled for the accumulation, unless the class says otherwise
    (``loss_is_scaled_for_ga``, transformers 5); where it does not, it divides a mean loss by the window's
    micro-batches, and the window's mean over them is what it means. Read from the Trainer's own
    declaration, as ``--contract`` would be from the command line, never from the loss it computed."""
    declared = getattr(trainer, "loss_is_scaled_for_ga", None)
    if declared is not None:
        return bool(declared)
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None))


def accumulation_steps(trainer: Any) -> int:
    """The micro-batches of a Trainer's windows (Trainer accumulates them under an Accelerator of one
    step, its last window of an epoch shorter)."""
    return int(trainer.args.gradient_accumulation_steps)


def scheduler_of(trainer: Any) -> Any | None:
    """The learning-rate schedule Trainer made and steps itself, once an optimizer step (it never gives it
    to ``accelerator.prepare``)."""
    return getattr(trainer, "lr_scheduler", None)


def follow_logged_norms(trainer: Any, judge: Callable[[int, float], None]) -> None:
    """``judge(step, grad_norm)`` for each ``grad_norm`` the Trainer logs (the norm its clip measured at
    its optimizer step ``step``, 1-based, as a user reads it in the logs), through a callback: an
    observer any Trainer takes."""
    from transformers import TrainerCallback

    class LoggedNorms(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and logs.get("grad_norm") is not None:
                judge(int(state.global_step), float(logs["grad_norm"]))

    trainer.add_callback(LoggedNorms())


def name_of(trainer: Any) -> str:
    """The Trainer's class, as the summary names it (``SFTTrainer``, a subclass of the script's)."""
    return type(trainer).__name__
