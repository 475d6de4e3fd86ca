"""A training script checked as it is: ``python -m harness watch train.py`` (docs/script.md).

The script runs unedited on every rank of a cell, as ``__main__`` with its own arguments. The first
``Accelerator`` it constructs is the cell's: built with the script's own arguments (its accumulation
steps, its mixed precision), with only what the cell must force (CPU on a CPU host, a precision the
command asked for), and from there followed as ``ctx.watch`` follows a loop (harness/rank/watch.py):
the models it prepares, their optimizers and schedulers, its training dataloader's batches, its
backwards, accumulate and clip. A second Accelerator, an evaluation loop, ``gather``, metrics and
printing are left alone.

The specification stays the harness's: the oracle's replicas start from the prepared models as every
rank holds them before the first batch; each micro-batch's loss is the model's own ``.loss`` on the
batch (a transformers model given ``labels``) or the function ``--loss`` names; the accumulation
contract is accelerate's with the script's Accelerator's steps, or ``--num-steps`` for a loop that
accumulates by hand; the optimizers and schedulers are copies of the script's as it made them (same
class, same hyperparameters, the schedule from where it stands), stepped where the contract says; a clip
is the norm the script's ``clip_grad_norm_`` asks for. What the harness cannot follow is refused in one
line (``LoopRefused``) saying why, before anything is judged halfway.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import os
import runpy
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from harness.rank.context import MIXED_PRECISION
from harness.rank.tiny_model import tiny_pretrained
from harness.rank.watch import LoopRefused, Watch, _dataloader_options

if TYPE_CHECKING:
    from harness.rank.context import RankContext

WHO = "watch"
# accelerate's mixed_precision values, as the harness names the precisions
PRECISION_OF = {asked: precision for precision, asked in MIXED_PRECISION.items()}
# Accelerator arguments that ask for a wrapper the script watch does not follow yet
WRAPPER_PLUGINS = ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin",
                   "parallelism_config", "torch_tp_plugin")


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The specification's loss of one micro-batch by default: the model's own ``.loss`` on it (a
    transformers model returns one for a batch with ``labels``)."""
    if not isinstance(batch, Mapping):
        raise LoopRefused(f"{WHO}: the script's batches are {type(batch).__name__}, not a mapping of the model's "
                          "inputs, so the model's own .loss cannot be the specification; give --loss module:function")
    outputs = model(**batch)
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise LoopRefused(f"{WHO}: the model ({type(model).__name__}) returns no .loss for the script's batches "
                          f"(keys {sorted(batch)}; a transformers model returns one when the batch has labels); "
                          "give --loss module:function, the loss of one micro-batch")
    return loss


def named_loss(spec: str) -> Callable[[Any, Any], torch.Tensor]:
    """``module:function`` (importable from the working directory or the script's), the loss of one
    micro-batch: ``function(model, batch)``, before any division by the accumulation steps."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise LoopRefused(f"{WHO}: --loss {spec!r}: give module:function")
    try:
        loss = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise LoopRefused(f"{WHO}: --loss {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(loss):
        raise LoopRefused(f"{WHO}: --loss {spec!r} is not a function")
    return loss  # type: ignore[no-any-return]


class ScriptFailed(Exception):
    """The script raised: what, and the script's own line it came through."""


class ScriptWatch(Watch):
    """The watch of a script's own Accelerator: its models, optimizers and schedulers are found as the
    script prepares them, and the oracle is made of them before the first batch is drawn."""

    who = WHO

    def __init__(self, ctx: RankContext, accelerator: Any, *, loss: Callable[[Any, Any], torch.Tensor],
                 num_steps: int, contract: str) -> None:
        super().__init__(ctx, accelerator, {}, loss=loss, clip_grad_norm=None, scheduler=False, num_steps=num_steps)
        self.contract_name = contract
        self.raw_optimizers: list[tuple[torch.optim.Optimizer, Any]] = []  # (as made, as prepared)
        self.raw_schedulers: list[Any] = []  # as made
        self.made = False  # the oracle is made (at the first batch drawn)

    def _adopt(self, before: Any, after: Any) -> None:
        from torch.optim.lr_scheduler import LRScheduler
        from torch.utils.data import DataLoader

        if isinstance(before, (nn.Module, torch.optim.Optimizer, LRScheduler)) and self.made:
            raise LoopRefused(f"{WHO}: the script prepared a {type(before).__name__} after its first batch; the "
                              "harness follows the models, optimizers and schedulers prepared before training starts")
        if isinstance(before, nn.Module):
            if not any(p.requires_grad for p in before.parameters()):
                return  # a frozen model (a teacher, an embedding table): nothing to check
            known = next((n for n, m in self.originals.items() if m is before), None)
            name = known or ("model" if not self.originals else f"model_{len(self.originals) + 1}")
            self.originals[name] = before
            self.prepared[name] = after
            self.optimizers.setdefault(name, [])
        elif isinstance(before, torch.optim.Optimizer):
            if not any(before is b for b, _ in self.raw_optimizers):
                self.raw_optimizers.append((before, after))
        elif isinstance(before, LRScheduler):
            if not any(before is s for s in self.raw_schedulers):
                self.raw_schedulers.append(before)
        elif isinstance(before, DataLoader):
            self._watch_loader(before, after)

    def _drawn(self, state: Any, batch: Any) -> None:
        if not self.made and not self.stopped:
            self._make_oracle()
        super()._drawn(state, batch)

    def _make_oracle(self) -> None:
        """The oracle, of the models as every rank holds them now (prepared, before their first batch),
        with copies of the script's optimizers and schedulers."""
        self.made = True
        if not self.originals:
            raise LoopRefused(f"{WHO}: the script drew a batch from a prepared dataloader before it prepared a model "
                              "with trainable parameters; the harness checks the models given accelerator.prepare")
        copies: dict[int, torch.optim.Optimizer] = {}  # the script's optimizer each oracle optimizer copies, by id
        by_model: dict[str, list[torch.optim.Optimizer]] = {name: [] for name in self.originals}
        for before, after in self.raw_optimizers:
            if before.state:
                raise LoopRefused(f"{WHO}: the script's {type(before).__name__} has stepped before its first batch "
                                  "(state loaded from a checkpoint?); the oracle starts from an optimizer as made")
            name = self._owner(before)
            by_model[name].append(before)
            self.optimizers[name].append(after)

        def optimizers_of(name: str) -> Callable[[nn.Module], tuple[torch.optim.Optimizer, ...]]:
            def make(replica: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
                made = []
                for raw in by_model[name]:
                    clone = copied_optimizer(raw, self.originals[name], replica)
                    copies[id(clone)] = raw
                    made.append(clone)
                return tuple(made)

            return make

        schedulers = {id(s.optimizer): s for s in self.raw_schedulers}
        unscheduled = [type(b).__name__ for b, _ in self.raw_optimizers if id(b) not in schedulers]
        if len(schedulers) != len(self.raw_schedulers) or (schedulers and unscheduled):
            raise LoopRefused(f"{WHO}: the script's schedulers do not each drive one of its optimizers "
                              f"({len(self.raw_schedulers)} schedulers, {len(self.raw_optimizers)} optimizers); the "
                              "harness follows one scheduler an optimizer, or none")

        def scheduler(optimizer: torch.optim.Optimizer) -> Any:
            raw = copies[id(optimizer)]
            made = schedulers[id(raw)]
            return copy.deepcopy(made, memo={id(raw): optimizer})

        split, _ = _dataloader_options(self.accelerator)
        with_optimizer = bool(getattr(self.accelerator, "step_scheduler_with_optimizer", True))
        if schedulers and not with_optimizer:
            raise LoopRefused(f"{WHO}: the script's Accelerator steps its schedulers apart from the optimizers "
                              "(step_scheduler_with_optimizer=False); the harness follows schedulers accelerate "
                              "steps with them")
        self.check_lr = bool(schedulers)
        with _plain_forward(self.originals.values()):
            self.oracle = self.ctx._oracle(
                self.originals, num_steps=self.contract["num_steps"],
                optimizers={name: optimizers_of(name) for name in self.originals if by_model[name]},
                scheduler=scheduler if schedulers else None,
                scheduler_steps=1 if split else self.ctx.world_size,
                contract=self.contract_name, replay_rng=self.replay)

    def _clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        checked = super()._clip(original)

        @functools.wraps(original)
        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if self.clip is None and not self.stopped:
                max_norm = args[0] if args else kwargs.get("max_norm")
                norm_type = args[1] if len(args) > 1 else kwargs.get("norm_type", 2)
                if float(norm_type) != 2.0:
                    raise LoopRefused(f"{WHO}: the script clips to a {norm_type}-norm; the oracle clips the 2-norm")
                self.clip = float(max_norm)
            return checked(parameters, *args, **kwargs)

        return clip_grad_norm_


def copied_optimizer(raw: torch.optim.Optimizer, model: nn.Module, replica: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``raw``'s class over ``replica``'s parameters, group by group with ``raw``'s
    hyperparameters as they stand (a scheduler made before may have set the learning rate already)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(replica.named_parameters())
    groups = []
    for group in raw.param_groups:
        foreign = sum(id(p) not in names for p in group["params"])
        if foreign:
            raise LoopRefused(f"{WHO}: the script's {type(raw).__name__} holds {foreign} parameters of no model it "
                              "prepared; the checks need each optimizer to hold one prepared model's parameters")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [params[names[id(p)]] for p in group["params"]]})
    try:
        return type(raw)(groups)
    except TypeError:
        return type(raw)(groups, **raw.defaults)


class _Tail:
    """The script's standard error, passed on as written, its last line kept: what a script that exits
    with a status (argparse's usage error, say) said last."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.kept = ""

    def write(self, text: str) -> int:
        self.kept = (self.kept + text)[-2000:]
        return int(self.stream.write(text) or 0)

    def last_line(self) -> str:
        lines = [line.strip() for line in self.kept.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def _plain_forward(models: Any) -> Iterator[None]:
    """The models with accelerate's mixed-precision forward (an instance attribute ``prepare`` sets)
    put aside, so that the oracle's copies run their class's forward under the oracle's precision."""
    held = [(m, vars(m).pop("forward")) for m in models if "forward" in vars(m)]
    try:
        yield
    finally:
        for model, forward in held:
            vars(model)["forward"] = forward


class ScriptRun:
    """One run of a script on this rank, its first Accelerator adopted (``run``)."""

    def __init__(self, ctx: RankContext, path: str, argv: list[str], *, loss: str | None = None,
                 num_steps: int | None = None, contract: str = "accelerate", precision: str | None = None,
                 settings: Mapping[str, str] | None = None, tiny_model: bool = False) -> None:
        self.ctx = ctx
        self.path = os.path.abspath(path)
        self.argv = list(argv)
        self.loss_name = loss
        self.loss: Callable[[Any, Any], torch.Tensor] = model_loss
        self.num_steps = num_steps
        self.contract = contract
        self.precision = precision  # the precision the command forces, or None for the script's own
        self.settings = dict(settings or {})  # the launcher's ACCELERATE_* settings: the script's environment
        self.tiny_model = tiny_model  # every pretrained transformers model shrunk (``tiny_pretrained``)
        self.watch: ScriptWatch | None = None

    def run(self) -> None:
        from accelerate import Accelerator

        original = Accelerator.__init__
        run = self

        @functools.wraps(original)
        def init(accelerator: Any, *args: Any, **kwargs: Any) -> None:
            if run.watch is not None:  # a second Accelerator: left alone
                original(accelerator, *args, **kwargs)
                return
            run.adopt(original, accelerator, args, kwargs)

        saved = sys.argv, list(sys.path), sys.stderr
        environment = {name: os.environ.get(name) for name in self.settings}
        os.environ.update(self.settings)
        Accelerator.__init__ = init  # type: ignore[method-assign]
        sys.argv = [self.path, *self.argv]
        sys.path.insert(0, os.path.dirname(self.path))
        sys.stderr = tail = _Tail(sys.stderr)
        failed: BaseException | None = None
        try:
            if self.loss_name:  # importable from the script's directory too
                self.loss = named_loss(self.loss_name)
            with tiny_pretrained(self.ctx.recorder.forced) if self.tiny_model else contextlib.nullcontext():
                runpy.run_path(self.path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                said = tail.last_line()
                failed = RuntimeError(f"{WHO}: the script exited with status {exc.code}"
                                      + (f": {said}" if said else ""))
        except BaseException as exc:
            failed = self._where(exc)
        finally:
            Accelerator.__init__ = original  # type: ignore[method-assign]
            sys.argv, sys.path[:], sys.stderr = saved[0], saved[1], saved[2]
            for name, value in environment.items():  # the next cell of this rank gets none of them
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        watch = self.watch
        if watch is not None:
            watch.__exit__(type(failed) if failed else None, failed, None)
        if failed is not None:
            raise failed
        if watch is None:
            raise LoopRefused(f"{WHO}: the script made no Accelerator (it ran to its end); the harness checks the "
                              "training of a script that trains with accelerate")

    def _where(self, exc: BaseException) -> BaseException:
        """An error the script raised (not the harness's, not an interruption) as ``ScriptFailed``, one
        line that says it and the script's own line it came through (a checkpoint it could not fetch,
        say: which call); the error itself is its cause, its traceback in the cell's detail."""
        from harness.decorator import SkipCell, Unsupported

        if isinstance(exc, (LoopRefused, SkipCell, Unsupported)) or not isinstance(exc, Exception):
            return exc
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == self.path]
        said = " ".join(str(exc).split()) or "(no message)"
        if frames:
            said += f" (at {os.path.basename(self.path)}:{frames[-1].lineno}: {frames[-1].line})"
        failed = ScriptFailed(f"{type(exc).__name__}: {said}")
        failed.__cause__ = exc
        return failed

    def adopt(self, original: Callable[..., None], accelerator: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        """The script's first Accelerator, built as the cell's (``ctx._built``) and watched."""
        ctx = self.ctx
        given = dict(inspect.signature(original).bind(accelerator, *args, **kwargs).arguments)
        given.pop(next(iter(given)))  # the instance
        given.update(given.pop("kwargs", {}) if isinstance(given.get("kwargs"), dict) else {})
        plugins = [k for k in WRAPPER_PLUGINS if given.get(k) is not None]
        if plugins or os.environ.get("ACCELERATE_USE_FSDP") == "true" or \
                os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            raise LoopRefused(f"{WHO}: the script's Accelerator asks for {plugins[0] if plugins else 'a wrapper'}: "
                              "the harness follows a script under DDP (or one process) so far; check its loop "
                              "under FSDP or DeepSpeed with ctx.watch (docs/writing-a-case.md)")
        # `accelerate launch --gradient_accumulation_steps`, read where accelerate reads it
        launched = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        unasked = (given.get("gradient_accumulation_steps") in (None, 1)
                   and not given.get("gradient_accumulation_plugin"))
        if launched and unasked:
            given["gradient_accumulation_steps"] = int(launched)
        asked = str(given.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no")
        if asked not in PRECISION_OF:
            raise LoopRefused(f"{WHO}: the script asks for mixed_precision={asked!r}; the harness checks "
                              f"{', '.join(PRECISION_OF)}")
        forced = {}  # what the cell changes of the script's arguments: was, now
        if self.precision is not None and PRECISION_OF[asked] != self.precision:
            forced["mixed_precision"] = (asked, self.precision)
            asked = MIXED_PRECISION[self.precision]
        ctx.precision = PRECISION_OF[asked]
        given["mixed_precision"] = asked
        if ctx.device.type == "cpu" and not given.get("cpu"):
            forced["cpu"] = (given.get("cpu", False), True)
            given["cpu"] = True
        made = ctx._accelerator_kwargs(given)
        configured = ctx._accumulation().num_steps
        if self.num_steps is not None and configured not in (1, self.num_steps):
            raise LoopRefused(f"{WHO}: --num-steps {self.num_steps} for a script whose Accelerator accumulates "
                              f"{configured} steps; give --num-steps for a loop that accumulates by hand only")
        steps = self.num_steps or configured

        def construct() -> Any:
            original(accelerator, **made)
            return accelerator

        ctx._built(made, construct)
        for key, (was, now) in forced.items():  # said once the Accelerator is made, as it was asked
            ctx.recorder.forced[key] = f"{was!r} -> {now!r}"
        watch = ScriptWatch(ctx, accelerator, loss=self.loss, num_steps=steps, contract=self.contract)
        watch._instrument(accelerator)
        self.watch = watch


def run_script(ctx: RankContext, path: str, argv: list[str], **options: Any) -> None:
    """Run the script at ``path`` with ``argv`` on this rank, every step of its training checked
    (``ScriptRun``'s options: ``loss``, ``num_steps``, ``contract``, ``precision``, ``settings``)."""
    if not os.path.isfile(path):
        raise LoopRefused(f"{WHO}: no script at {path}")
    torch_threads = torch.get_num_threads()
    try:
        ScriptRun(ctx, path, argv, **options).run()
    finally:
        torch.set_num_threads(torch_threads)
