"""transformers' ``Trainer.train()`` checked step by step, unmodified (docs/trainer.md).

``checked_trainer(ctx, model, ...)`` builds the ``Trainer`` a case (or a user's own case) trains,
with one ``TrainerCallback`` added and two observers that any training loop permits: a forward
pre-hook on the model (which micro-batch each forward ran, as Trainer feeds it) and step hooks on
the optimizer Trainer made (the gradients the step uses, after Trainer's clip; the parameters after
it). Nothing of Trainer is patched; under DeepSpeed, Trainer's class is subclassed once
(``_on_this_host``), to give the Accelerator it builds what the harness gives its own.

The expectation is what a Trainer user means, full-batch equivalence: each optimizer step's update
is the one the mean loss over every sample (every valid token, for a causal LM) of that step's
global batch would give, all micro-batches on all ranks, clipped at ``max_grad_norm``,
stepped by the optimizer and scheduler Trainer was configured with. The oracle computes it from the
micro-batches the ranks really ran (harness/rank/oracle/core.py, in token mode: each micro-batch's summed
loss, weighed by the window's count on every rank); it never reads what Trainer divides by.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from typing import Any, Callable, Mapping

import torch
from torch import nn

from harness import wording
from harness.rank.hf_models import transformers_or_skip
from harness.rank.oracle.interfaces import ClipNorm
from harness.rank.oracle.schedule import MicroStep, batches_per_rank
from harness.rank.tokens import IGNORE_INDEX
from harness.records import Failure, FailureKind
from harness.wrappers.prepare import remember_wrappers
from harness.wrappers.prepared import torch_optimizer
from harness.wrappers.probe import takes_parameter

# What the loss of one micro-batch is, by the model's task: "tokens" (a causal LM: every valid token
# of the window weighs the same; position t predicts label t+1) or "samples" (a classifier: every
# sample weighs the same).
LOSSES = ("tokens", "samples")

# Set for every checked Trainer, whatever the case gives: the checks read every step's grad_norm
# from Trainer's logs, and nothing is written or reported elsewhere.
FIXED_ARGUMENTS = {"logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
                   "dataloader_num_workers": 0}


def _summed_token_loss(model: nn.Module, batch: Mapping[str, torch.Tensor], router_weight: float = 0.0
                       ) -> torch.Tensor:
    """A causal LM's token losses summed, from its logits: position t predicts label t+1; plus a MoE
    router's auxiliary loss (the model's ``aux_loss``) times ``router_weight`` where given."""
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    logits = outputs["logits"]
    summed = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                         batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
                                         reduction="sum")
    if router_weight:
        summed = summed + router_weight * outputs["aux_loss"].float()
    return summed


def _summed_sample_loss(model: nn.Module, batch: Mapping[str, torch.Tensor], router_weight: float = 0.0
                        ) -> torch.Tensor:
    """A classifier's per-sample cross-entropies summed (plus a MoE router's loss, as above)."""
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    summed = nn.functional.cross_entropy(outputs["logits"].float(), batch["labels"].reshape(-1), reduction="sum")
    if router_weight:
        summed = summed + router_weight * outputs["aux_loss"].float()
    return summed


def router_coefficient(model: nn.Module) -> float:
    """The weight of a MoE model's router auxiliary loss in its training loss (``router_aux_loss_coef``
    where the model returns it: ``output_router_logits``), else 0."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _counted(batch: Mapping[str, torch.Tensor], loss: str) -> torch.Tensor:
    """What the window's mean is over, in this micro-batch: its valid targets, or its samples."""
    return batch["labels"][:, 1:] if loss == "tokens" else batch["labels"].reshape(-1)


class TrainerWatch:
    """The observers of one checked Trainer, on one rank, and the checks they run."""

    def __init__(self, ctx: Any, trainer: Any, model: nn.Module, oracle: Any, schedule: list[MicroStep], *,
                 loss: str, made_output_dir: str | None) -> None:
        self.ctx = ctx
        self.trainer = trainer
        self.oracle = oracle
        self.schedule = schedule
        self.points = iter(schedule)
        self.loss = loss
        self.summed: Callable[..., torch.Tensor] = _summed_token_loss if loss == "tokens" else _summed_sample_loss
        self.max_grad_norm = float(trainer.args.max_grad_norm or 0.0)
        self.router_coef = router_coefficient(model)
        # the micro-batches this rank's model ran since the last optimizer step, with their micro-steps
        self.window: list[tuple[MicroStep, dict[str, torch.Tensor]]] = []
        self.point: MicroStep | None = None
        # the oracle's gradient norm before clipping, how far the rank's may be from it, and the
        # micro-step of the optimizer step, by optimizer step
        self.norms: list[tuple[ClipNorm, MicroStep]] = []
        self.logged_norms = 0  # the grad_norms Trainer has logged so far
        self.forwards = 0
        self.steps = 0
        self.misplaced = False  # a window of Trainer's was not the schedule's (said once)
        self._hooked: Any = None
        self.made_output_dir = made_output_dir  # the output folder the harness made for Trainer, if any
        # DeepSpeed steps inside the window's last accelerator.backward (accelerate's engine wrapper) and
        # clips inside that step: the window is judged after it (``on_optimizer_step``), the gradients
        # as the engine read them before its clip (harness/wrappers/deepspeed_cpu.py), the clip by the
        # parameters and Trainer's grad_norm
        self.in_engine = ctx.spec.family == "deepspeed"
        self.handles = [model.register_forward_pre_hook(self._forward, with_kwargs=True)]

    # the observers

    def _forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        batch = {k: v.detach().clone() for k, v in kwargs.items()
                 if isinstance(v, torch.Tensor) and k != "num_items_in_batch"}
        self.forwards += 1
        point = next(self.points, None)
        self.ctx.at_step = point.index if point is not None else self.forwards
        if point is None:  # more micro-batches than the schedule has: the count is judged at the end
            return
        self.window.append((point, batch))

    def hook_optimizer(self, optimizer: Any) -> None:
        """Trainer's optimizer (accelerate's wrapper around it, or the torch optimizer itself; under
        DeepSpeed, the torch optimizer inside ZeRO's, which steps ZeRO's flat partitions)."""
        inner = torch_optimizer(optimizer)
        if inner is self._hooked:
            return
        self._hooked = inner
        if self.in_engine:  # ZeRO-3 steps it once per sub-group of parameters: judged at on_optimizer_step
            return
        self.handles.append(inner.register_step_pre_hook(lambda *_: self._before_step()))
        self.handles.append(inner.register_step_post_hook(lambda *_: self._after_step()))

    def _before_step(self) -> None:
        """Trainer has synced and clipped the window's gradients: the oracle computes the gradient of
        the mean loss over the micro-batches of the window Trainer really took (every rank's), and the
        gradients, the learning rate and the clip are judged. Where Trainer's window is not the one
        of the schedule, that is said once (``schedule``), and each later step is still judged on its
        own window: one misplaced step does not turn every later check red."""
        oracle, models = self.oracle, {"model": self.trainer.model_wrapped}
        batches, self.window = self.window, []
        if not batches:
            self.point = None
            return
        tokens = oracle.token_window([_counted(b, self.loss) for _, b in batches])
        # a MoE router's auxiliary loss is no token's: the contract weighs it router_aux_loss_coef times
        # the mean over the window's micro-batches on every rank (what one micro-batch a step on one
        # rank gives). The closure's sum is scaled by world_size / N, so the term enters it times
        # N / (world_size * micro-batches)
        router = self.router_coef * tokens / (oracle.config.world_size * len(batches))
        last = len(batches) - 1
        for n, (_, batch) in enumerate(batches):
            oracle.backward(lambda m, batch=batch: self.summed(m["model"], batch, router), sync=n == last)
        planned = [p for p, _ in batches]
        self.point = dataclasses.replace(planned[-1], sync=True, optimizer_step=True)
        if not self.misplaced and (not planned[-1].optimizer_step or any(p.optimizer_step for p in planned[:-1])):
            self.misplaced = True
            end = _window_end(self.schedule, planned[0])
            recorder = self.ctx.recorder
            recorder.add(Failure(
                rank=recorder.rank, step=planned[-1].index, model="trainer", param="window",
                kind=FailureKind.SCHEDULE, max_abs_diff=float(abs(planned[-1].index - end.index)), checked="schedule",
                message=wording.trainer_window_text(rank=recorder.rank, first=planned[0].where(),
                                                    last=planned[-1].where(), due=end.where(),
                                                    steps=self.trainer.args.gradient_accumulation_steps),
            ))
        if self.in_engine:  # read before the engine's clip
            oracle.check_grads(self.point, models)
        if self.max_grad_norm > 0:
            oracle.clip_grad_norm(self.max_grad_norm, reciprocal=self.in_engine, measured=self._engine_norm())
            self.norms.append((oracle.norms["model"], self.point))
        if not self.in_engine:
            oracle.check_grads(self.point, models)
        oracle.check_lr(self.point, {"model": self._hooked})
        # a wrong rate is said above, at every step it is wrong; the oracle's update uses Trainer's, so
        # that the parameter checks judge the gradient, not the rate again (its scheduler still sets
        # its own rate at its next step)
        ours = [g for optimizer in oracle.optimizers["model"] for g in optimizer.param_groups]
        for group, theirs in zip(ours, self._hooked.param_groups):
            group["lr"] = theirs["lr"]

    def _engine_norm(self) -> torch.Tensor | float | None:
        """The norm DeepSpeed's step clipped by (its global gradient norm, in its dtype), None elsewhere."""
        return self.trainer.model_wrapped.get_global_grad_norm() if self.in_engine else None

    def stepped(self) -> None:
        """Trainer's optimizer step is over (``on_optimizer_step``): under DeepSpeed, where the engine
        stepped in the window's last backward, the window is judged now."""
        if self.in_engine:
            self._before_step()
            self._after_step()

    def _after_step(self) -> None:
        if self.point is None:
            return
        self.steps += 1
        self.oracle.step(self.point)
        self.oracle.check_params(self.point, {"model": self.trainer.model_wrapped}, {"model": self._hooked})

    def logged(self, logs: Mapping[str, Any]) -> None:
        """Trainer's logs after an optimizer step: its grad_norm is judged at once (a failure's place in
        the cell's list is its time)."""
        if "grad_norm" in logs and logs["grad_norm"] is not None:
            self.logged_norms += 1
            self._judge_norm(self.logged_norms - 1, float(logs["grad_norm"]))

    # after train()

    def finish(self) -> None:
        """The counts of the whole run: micro-batches and optimizer steps against the schedule; the
        run's output folder goes (the harness made it; nothing is saved there)."""
        for handle in self.handles:
            handle.remove()
        if self.made_output_dir is not None and self.trainer.args.output_dir == self.made_output_dir:
            shutil.rmtree(self.made_output_dir, ignore_errors=True)  # never a folder the case gave
        recorder = self.ctx.recorder
        expected_steps = sum(1 for p in self.schedule if p.optimizer_step)
        for what, seen, expected in (("micro-batches (forwards in training)", self.forwards, len(self.schedule)),
                                     ("optimizer steps", self.steps, expected_steps)):
            if seen != expected:
                recorder.add(Failure(
                    rank=recorder.rank, step=0, model="trainer", param=what.split()[0], kind=FailureKind.SCHEDULE,
                    max_abs_diff=float(abs(seen - expected)), checked="schedule",
                    message=wording.trainer_count_text(rank=recorder.rank, what=what, seen=seen, expected=expected),
                ))

    def _judge_norm(self, n: int, logged: float) -> None:
        """The n-th grad_norm Trainer logged (the norm its clip measured, before clipping) against the
        oracle's at the n-th optimizer step."""
        if self.max_grad_norm <= 0 or n >= len(self.norms):
            return
        norm, point = self.norms[n]
        self.oracle.checks.grad_norm(point, "model", logged, norm, who="logged by Trainer")


def _window_end(schedule: list[MicroStep], point: MicroStep) -> MicroStep:
    """The micro-step that ends ``point``'s accumulation window in the schedule."""
    for p in schedule[schedule.index(point):]:
        if p.optimizer_step:
            return p
    return schedule[-1]


def checked_trainer(ctx: Any, model: nn.Module, *, train_dataset: Any, data_collator: Any = None,
                    loss: str = "tokens", trainer_class: Any = None, **arguments: Any) -> Any:
    """A ``transformers.Trainer`` over ``model`` whose ``train()`` is checked at every optimizer step
    (docs/trainer.md). Call it where a case would build its Trainer, then call ``train()``.

    ``arguments`` go to ``TrainingArguments`` (``gradient_accumulation_steps``,
    ``per_device_train_batch_size``, ``num_train_epochs``, ``max_grad_norm``, ``optim``,
    ``average_tokens_across_devices``, ...); the harness adds where it runs (the output folder, CPU or
    the rank's GPU, the cell's precision and wrapper, the seed) and ``FIXED_ARGUMENTS``.
    ``loss``: ``"tokens"`` for a causal LM (labels aligned with the inputs, -100 where ignored),
    ``"samples"`` for a classifier. ``trainer_class``: your own ``Trainer`` subclass (under
    DeepSpeed the Trainer made is of a subclass of it, ``_on_this_host``).

    The cell is ``skip`` where transformers is not installed or cannot run with this torch, and where
    Trainer cannot run the cell's wrapper or precision on this device (saying why)."""
    transformers = transformers_or_skip(ctx)
    if loss not in LOSSES:
        raise ValueError(f"checked_trainer: loss={loss!r}; known: {', '.join(LOSSES)}")
    for key, value in FIXED_ARGUMENTS.items():
        if key in arguments and arguments[key] != value:
            raise ValueError(f"checked_trainer: {key}={arguments[key]!r}; the checks need {key}={value!r}")
    if arguments.get("max_steps", -1) != -1 or float(arguments.get("num_train_epochs", 3)) % 1:
        raise ValueError("checked_trainer: give a whole num_train_epochs and no max_steps (the schedule is by epochs)")
    for key in arguments:  # an option this release does not have: the cell does not apply here
        if not takes_parameter(transformers.TrainingArguments, key):
            ctx.skip(f"transformers {transformers.__version__} has no TrainingArguments({key}=...)")
    where = _where(ctx, transformers, made_folder="output_dir" not in arguments)
    try:
        args = transformers.TrainingArguments(**{**where, **FIXED_ARGUMENTS, **arguments})
        trainer = _on_this_host(ctx, trainer_class or transformers.Trainer)(
            model=model, args=args, train_dataset=train_dataset, data_collator=data_collator)
    except ImportError as exc:
        # transformers' own word on this accelerate ("Using the Trainer with PyTorch requires
        # accelerate>=1.1.0"): a pairing that does not run Trainer at all, not a harness error
        import accelerate

        shutil.rmtree(where.get("output_dir", ""), ignore_errors=True)
        ctx.skip(f"transformers {transformers.__version__} cannot run Trainer with accelerate "
                 f"{accelerate.__version__}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    steps = args.gradient_accumulation_steps
    per_rank = batches_per_rank(len(train_dataset), batch_size=args.per_device_train_batch_size,
                                world_size=ctx.world_size, drop_last=args.dataloader_drop_last)
    schedule = ctx.schedule(per_rank, epochs=int(args.num_train_epochs), num_steps=steps)
    total = sum(1 for p in schedule if p.optimizer_step)
    oracle = ctx.oracle({"model": model}, num_steps=steps, optimizers=lambda replica: _optimizer(trainer, replica),
                        scheduler=lambda optimizer: _scheduler(transformers, args, optimizer, total))
    watch = TrainerWatch(ctx, trainer, model, oracle, schedule, loss=loss, made_output_dir=where.get("output_dir"))

    class HarnessWatch(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            watch.hook_optimizer(trainer.optimizer)
            # Trainer prepared the model with an Accelerator of its own: its wrapper, for the oracle to
            # read how it reduces (DDP's buckets: harness/rank/oracle/averaging.py)
            remember_wrappers(getattr(trainer, "model_wrapped", None))

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            watch.stepped()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            watch.logged(logs or {})

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            watch.finish()

    trainer.add_callback(HarnessWatch())
    return trainer


def _where(ctx: Any, transformers: Any, *, made_folder: bool) -> dict[str, Any]:
    """The TrainingArguments that place the run on this rank: its device, precision, seed, and (where
    ``made_folder``, the case giving none) an output folder made for it."""
    where: dict[str, Any] = {"seed": int(ctx.seed) % 2**31}
    if ctx.spec.family == "deepspeed":
        where["deepspeed"] = _deepspeed_config(ctx, transformers)
    elif ctx.device.type == "cpu":
        where["use_cpu"] = True
        where["ddp_backend"] = "gloo"
    if ctx.precision == "bf16":
        where["bf16"] = True
    elif ctx.precision == "fp16":
        where["fp16"] = True
    if ctx.spec.fsdp_version == 2:  # Trainer's FSDP2; FSDP1 and DeepSpeed have no Trainer cell yet
        if ctx.device.type == "cpu":
            # the harness's own FSDP2 cells set FSDP on their Accelerator after building it
            # (harness/wrappers/prepare.py, fsdp_on_cpu); Trainer builds its own, and decides from it
            # in its constructor whether it runs FSDP: not open to that without patching Trainer
            ctx.skip("wrapper=fsdp2: Trainer cannot run FSDP on CPU here (accelerate selects FSDP for a "
                     "multi-GPU run only, and Trainer builds its own Accelerator); the cell runs on a GPU host")
        if ctx.world_size < 2:
            ctx.skip("wrapper=fsdp2 runs at world size 2 and more: at world size 1 accelerate applies no wrapper")
        # Trainer's FSDP2, its own plugin from these arguments (each decoder layer a unit, as Trainer wraps)
        where["fsdp"] = "full_shard"
        where["fsdp_config"] = {"version": ctx.spec.fsdp_version}
    elif ctx.spec.sharded and ctx.spec.family != "deepspeed":
        ctx.skip(f"wrapper={ctx.wrapper}: no Trainer cell under FSDP1")
    if made_folder:  # once nothing skips
        where["output_dir"] = tempfile.mkdtemp(prefix=f"trainer-rank{ctx.rank}-")
    return where


def _deepspeed_config(ctx: Any, transformers: Any) -> dict[str, Any]:
    """Trainer's DeepSpeed config for the cell: ZeRO at its stage and every other value ``"auto"``, which
    transformers fills from the TrainingArguments (``HfTrainerDeepSpeedConfig``): the micro-batch
    size, the accumulation steps, ``gradient_clipping`` from ``max_grad_norm``, bf16 from ``bf16``.
    It names no optimizer and no scheduler: Trainer makes its own and hands them to DeepSpeed. No
    ``train_batch_size``: transformers would fill it from the world size it counts before the
    Accelerator is corrected on a CPU host (``_on_this_host``); DeepSpeed computes it."""
    from harness.wrappers import deepspeed_cpu

    deepspeed_cpu.require(ctx.wrapper)
    if not hasattr(transformers.TrainerCallback, "on_optimizer_step"):
        ctx.skip(f"wrapper={ctx.wrapper}: transformers {transformers.__version__} has no on_optimizer_step "
                 "callback, where the checks judge a step DeepSpeed took inside backward")
    if ctx.precision != "fp32" and ctx.device.type == "cpu":
        # TrainingArguments refuses bf16 without a GPU unless use_cpu, and use_cpu makes accelerate
        # drop DeepSpeed (harness/wrappers/deepspeed_cpu.py, accelerator_kwargs)
        ctx.skip(f"wrapper={ctx.wrapper} {ctx.precision}: Trainer runs {ctx.precision} on CPU only with use_cpu=True, "
                 "under which accelerate drops DeepSpeed; the cell runs on a GPU host")
    deepspeed_cpu.without_shared_memory_comm(ctx.device.type)
    config: dict[str, Any] = {"zero_optimization": {"stage": ctx.spec.zero_stage},
                              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    if ctx.config.grad_accum is not None:  # the variant's grad_accum=fp32: DeepSpeed's BF16_Optimizer
        config["data_types"] = {"grad_accum_dtype": ctx.config.grad_accum}
    return config


def _on_this_host(ctx: Any, trainer_class: Any) -> Any:
    """``trainer_class``, or under DeepSpeed a subclass of it whose Accelerator, once Trainer has built
    it, gets what the harness gives its own DeepSpeed Accelerators (harness/wrappers/deepspeed_cpu.py,
    ``after_construction``: on a CPU host the real world size, and the engine's boundary gradients
    read as it steps). Nothing else of Trainer is changed."""
    if ctx.spec.family != "deepspeed":
        return trainer_class
    from harness.wrappers import deepspeed_cpu

    stage = ctx.spec.zero_stage

    class OnThisHost(trainer_class):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            deepspeed_cpu.after_construction(self.accelerator, stage=stage)

    OnThisHost.__name__ = OnThisHost.__qualname__ = trainer_class.__name__
    return OnThisHost


def _optimizer(trainer: Any, replica: nn.Module) -> torch.optim.Optimizer:
    """The optimizer Trainer makes (its class and settings, weight decay where Trainer applies it), over
    the replica's parameters."""
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, replica)
    decay = set(trainer.get_decay_parameter_names(replica))
    named = [(n, p) for n, p in replica.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return cls(groups, **kwargs)  # both groups, an empty one too, as Trainer makes them


def _scheduler(transformers: Any, args: Any, optimizer: torch.optim.Optimizer, total: int) -> Any:
    """The learning-rate schedule Trainer makes for ``total`` optimizer steps."""
    return transformers.get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                      num_warmup_steps=args.get_warmup_steps(total), num_training_steps=total,
                                      scheduler_specific_kwargs=args.lr_scheduler_kwargs)
