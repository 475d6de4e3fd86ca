"""The watch of a script's own Accelerator (``python -m harness watch``, harness/rank/script/run.py): the
models, optimizers and schedulers it prepares found as it prepares them, and the oracle made of them
before its first batch, with copies of its optimizers and schedulers as it made them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from harness.rank.watch.forwards import NUM_ITEMS, Forward
from harness.rank.watch.loaders import Drawn, dataloader_options
from harness.rank.oracle.schedule import TOKENS, MicroStep
from harness.rank.script.loss import WHO, counted_labels, model_loss
from harness.rank.script.moves import has_modes, mirror_modes, refuse_loads
from harness.rank.script.trainers import follow_logged_norms, name_of, scheduler_of, weighs_tokens
from harness.rank.watch import LoopRefused
from harness.rank.watch.loop import Watch
from harness.wrappers.prepared import unwrap

if TYPE_CHECKING:
    from harness.rank.watch.cell import WatchedCell


class ScriptWatch(Watch):
    """The watch of a script's own Accelerator: its models, optimizers and schedulers are found as the
    script prepares them, and the oracle is made of them before the first batch is drawn. It follows the
    Accelerator's calls from its making on (the script has the Accelerator before any ``with``)."""

    who = WHO

    def __init__(self, ctx: WatchedCell, accelerator: Any, *, loss: Callable[[Any, Any], torch.Tensor],
                 num_steps: int, contract: str | None, clip_in_step: float | None = None,
                 trainer: Any = None) -> None:
        super().__init__(ctx, accelerator, {}, loss=loss, clip_grad_norm=clip_in_step, scheduler=False,
                         num_steps=num_steps)
        self.contract_asked = contract  # the command's --contract, None where the script shows which it means
        # the transformers Trainer that built the Accelerator (harness/rank/script/trainers.py), or None:
        # its windows end with each epoch, and a loss it does not weigh by tokens is the window's mean
        self.trainer = trainer
        self.norms: list[tuple[Any, MicroStep]] = []  # the oracle's norm at each clip before a step, and where
        if trainer is not None:
            self.contract["sync_with_dataloader"] = True
        default = "full_batch" if trainer is not None else "accelerate"
        self.contract_name = contract if contract in ("accelerate", "full_batch") else default  # the oracle's
        self.tokens = contract == TOKENS  # each window weighed by its valid label tokens on every rank
        self.chosen = False  # the contract was chosen from what the script shows (without --contract)
        # DeepSpeed clips inside its optimizer step, to its config's norm whatever the script's
        # clip_grad_norm_ asks (accelerate's returns the engine's norm and clips nothing): the oracle
        # clips there too, and the gradients are judged clipped by the parameters the step makes
        self.clip_in_step = clip_in_step is not None
        # each trainable model as the script gave it to prepare, copied before a wrapper that shards it
        # in place (FSDP2) or partitions it (ZeRO-3) does; the oracle's replicas start from these with
        # the weights the ranks hold after prepare (``_make_oracle``)
        self.as_given: dict[int, nn.Module] = {}
        self.groups_as_made: dict[int, list[dict[str, Any]]] = {}  # each optimizer's, by id, before prepare
        self.stepped_before: dict[int, bool] = {}  # whether it held state before prepare, by id
        # each model's parameter names by the id of the parameter as given to prepare (FSDP2 swaps in
        # its own parameters), by the id of the model
        self.names_as_given: dict[int, dict[int, str]] = {}
        self.raw_optimizers: list[tuple[torch.optim.Optimizer, Any]] = []  # (as made, as prepared)
        self.raw_schedulers: list[Any] = []  # as made
        self.made = False  # the oracle is made (at the first batch drawn)
        self._instrument(accelerator)

    def _preparing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        prepare = super()._preparing(original)

        @functools.wraps(original)
        def noting(*args: Any, **kwargs: Any) -> Any:
            for given in args:
                if isinstance(given, torch.optim.Optimizer) and id(given) not in self.groups_as_made:
                    # ZeRO gives the optimizer its flat partitions and fills its state as it prepares it
                    self.groups_as_made[id(given)] = [{"params": list(g["params"])} for g in given.param_groups]
                    self.stepped_before[id(given)] = bool(given.state)
                elif isinstance(given, nn.Module) and id(given) not in self.names_as_given:
                    self.names_as_given[id(given)] = {id(p): n for n, p in given.named_parameters()}
                    if self.ctx.spec.sharded and any(p.requires_grad for p in given.parameters()):
                        with _plain_forward([given]):
                            self.as_given[id(given)] = copy.deepcopy(given)
            return prepare(*args, **kwargs)

        return noting

    def _groups(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The optimizer's groups with their hyperparameters as they stand (a scheduler made after
        prepare sets the learning rate) and their parameters as the script made them."""
        made = self.groups_as_made.get(id(optimizer))
        if made is None or len(made) != len(optimizer.param_groups):
            return optimizer.param_groups
        return [{**now, "params": then["params"]} for now, then in zip(optimizer.param_groups, made)]

    def _names(self, model: nn.Module) -> dict[int, str]:
        """``model``'s parameter names by the ids of its parameters, as given to prepare and as now."""
        return {**self.names_as_given.get(id(model), {}), **{id(p): n for n, p in model.named_parameters()}}

    def _param_ids(self, model: nn.Module) -> set[int]:
        return set(self._names(model))

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

    # the token contract

    def _weigh(self, drawn: Drawn, point: MicroStep) -> None:
        """The token contract, where the command asked for it or, asked for none, where the script
        passes ``num_items_in_batch`` to its model (said in the cell's summary); at the first backward
        of each window, the oracle counts the window's tokens."""
        said = self.ctx.recorder.said
        if self.contract_asked is None and not self.chosen:  # once, at the first backward, on every rank alike
            self.chosen = True
            if self.trainer is None:
                self.tokens = self.forwards.counted
                if self.tokens:
                    said["contract"] = "tokens, as the script passes num_items_in_batch to its model"
            else:
                self.tokens = weighs_tokens(self.trainer)
                said["contract"] = (f"tokens, as the script's {name_of(self.trainer)} weighs the window's tokens"
                                    if self.tokens else
                                    f"full_batch (the mean over each window's micro-batches), as the script's "
                                    f"{name_of(self.trainer)} divides its loss by them")
        if not self.tokens or not self._opens_window(point):
            return
        length = self.ctx.made_schedules.lengths[point.index]
        window = [drawn, *drawn.loader.drawn][:length]
        if len(window) < length:
            raise LoopRefused(f"{WHO}: the token contract weighs each window by the valid label tokens of all its "
                              f"micro-batches on every rank, counted at its first backward; the script had drawn "
                              f"{len(window)} of the window's {length} micro-batches by then: draw a window's batches "
                              "before its first backward (as a loop that passes num_items_in_batch does)")
        model = next(iter(self.originals.values()))
        self.oracle.token_window([counted_labels(model, d.batch) for d in window])

    def _opens_window(self, point: MicroStep) -> bool:
        """Whether ``point`` is the first micro-step of its accumulation window."""
        flat = [p for epoch in self.schedule for p in epoch]
        at = flat.index(point)
        return at == 0 or flat[at - 1].optimizer_step

    def _loss_of(self, forward: Forward | None) -> Callable[[Any, Any], torch.Tensor]:
        """The model's own loss called as the script called its model (its keywords replayed; under the
        token contract, summed over the batch's tokens), or the function ``--loss`` names."""
        if self.loss is not model_loss:
            return self.loss
        keywords = forward.replayed(tokens=self.tokens) if forward is not None else {}
        if forward is None and self.tokens:
            keywords = {NUM_ITEMS: 1}
        return lambda model, batch: model_loss(model, batch, keywords)

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
            if self.stepped_before.get(id(before), bool(before.state)):
                raise LoopRefused(f"{WHO}: the script's {type(before).__name__} has stepped before its first batch "
                                  "(state loaded from a checkpoint?); the oracle starts from an optimizer as made")
            name = self._owner(before)
            by_model[name].append(before)
            self.optimizers[name].append(after)
            self.asked.count_steps(name, after)

        def optimizers_of(name: str) -> Callable[[nn.Module], tuple[torch.optim.Optimizer, ...]]:
            def make(replica: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
                made = []
                for raw in by_model[name]:
                    clone = copied_optimizer(raw, self._groups(raw), self._names(self.originals[name]), replica)
                    copies[id(clone)] = raw
                    made.append(clone)
                return tuple(made)

            return make

        made_by_trainer = scheduler_of(self.trainer) if self.trainer is not None else None
        if made_by_trainer is not None and not any(made_by_trainer is s for s in self.raw_schedulers):
            self.raw_schedulers.append(made_by_trainer)  # Trainer steps it itself, once an optimizer step
        # a scheduler made over the optimizer as made, or as prepared (after accelerator.prepare)
        raw_of = {id(after): before for before, after in self.raw_optimizers}
        schedulers = {id(raw_of.get(id(s.optimizer), s.optimizer)): s for s in self.raw_schedulers}
        unscheduled = [type(b).__name__ for b, _ in self.raw_optimizers if id(b) not in schedulers]
        if len(schedulers) != len(self.raw_schedulers) or (schedulers and unscheduled):
            raise LoopRefused(f"{WHO}: the script's schedulers do not each drive one of its optimizers "
                              f"({len(self.raw_schedulers)} schedulers, {len(self.raw_optimizers)} optimizers); the "
                              "harness follows one scheduler an optimizer, or none")

        def scheduler(optimizer: torch.optim.Optimizer) -> Any:
            raw = copies[id(optimizer)]
            made = schedulers[id(raw)]
            return copy.deepcopy(made, memo={id(raw): optimizer, id(made.optimizer): optimizer})

        split, _ = dataloader_options(self.accelerator)
        with_optimizer = bool(getattr(self.accelerator, "step_scheduler_with_optimizer", True))
        if schedulers and not with_optimizer:
            raise LoopRefused(f"{WHO}: the script's Accelerator steps its schedulers apart from the optimizers "
                              "(step_scheduler_with_optimizer=False); the harness follows schedulers accelerate "
                              "steps with them")
        self.check_lr = bool(schedulers)
        engine = self._engine()
        if self.clip_in_step and engine is not None:  # the norm it clips to, as configured (a Trainer fills it late)
            self.clip = float(engine.gradient_clipping()) or None
        with _plain_forward(self.originals.values()):
            self.oracle = self.ctx.oracle_for(
                self.originals, weights=self._weights(), num_steps=self.contract["num_steps"],
                optimizers={name: optimizers_of(name) for name in self.originals if by_model[name]},
                scheduler=scheduler if schedulers else None,
                scheduler_steps=1 if split or self.trainer is not None else self.ctx.world_size,
                contract=self.contract_name, replay_rng=self.replay)
        refuse_rank_forwards(self.oracle.replicas, self.originals.values())
        for prepared in self.prepared.values():  # once copied: a replica holds no hook of the watch's
            self._follow_forwards(prepared)
        self._follow_moves(copies)
        if self.trainer is not None:
            follow_logged_norms(self.trainer, self._logged_norm)

    def _logged_norm(self, step: int, logged: float) -> None:
        """A ``grad_norm`` the script's Trainer logged at its ``step``-th optimizer step, against the
        oracle's norm of that step's clip (under DeepSpeed, which clipped inside the step's backward, the
        step is settled first: Trainer logs once its step and schedule are done)."""
        if step == len(self.norms) + 1 and self.unsettled is not None and self.unsettled.optimizer_step:
            self._settle()
        if self.stopped or not 0 < step <= len(self.norms) or len(self.originals) != 1:
            return
        norm, point = self.norms[step - 1]
        self.oracle.checks.grad_norm(point, next(iter(self.originals)), logged, norm,  # type: ignore[union-attr]
                                     who=f"logged by {name_of(self.trainer)}")

    def _follow_moves(self, copies: Mapping[int, torch.optim.Optimizer]) -> None:
        """What moves the parameters outside an optimizer step from now on (harness/rank/script/moves.py):
        an optimizer's mode switch made on its oracle copies too, a load of a state refused."""
        following = lambda: not self.stopped  # noqa: E731
        mirrors: dict[int, list[torch.optim.Optimizer]] = {}
        for clones in self.oracle.optimizers.values():
            for clone in clones:
                mirrors.setdefault(id(copies[id(clone)]), []).append(clone)
        for raw, _ in self.raw_optimizers:
            if has_modes(raw):
                mirror_modes(raw, mirrors.get(id(raw), []), before=self._settle, patch=self._patch,
                             following=following)
        models = {id(m): m for prepared in self.prepared.values() for m in (prepared, unwrap(prepared))}
        refuse_loads(models.values(), [raw for raw, _ in self.raw_optimizers], patch=self._patch,
                     following=following)

    def _weights(self) -> dict[str, nn.Module] | None:
        """Under a wrapper that shards or partitions the models: each one as given to prepare, holding
        the full weights the ranks hold now (gathered); None under DDP, whose models are whole."""
        if not self.ctx.spec.sharded:
            return None
        from harness.wrappers.sharding import observe

        weights = {}
        for name, model in self.originals.items():
            given = self.as_given[id(model)]
            full = observe(self.prepared[name], [n for n, _ in given.named_parameters()], sync=False).full_params()
            with torch.no_grad():
                for pname, p in given.named_parameters():
                    p.copy_(full[pname].to(p.dtype))
            weights[name] = given
        return weights

    def _clip_oracle(self, point: Any) -> None:
        if not self.clip_in_step:
            super()._clip_oracle(point)
        else:
            self.oracle.clip_grad_norm(self.clip, reciprocal=True,  # type: ignore[arg-type]
                                       measured=self._engine_norm())
            self.clipped = True
        if len(self.originals) == 1:
            self.norms.append((self.oracle.norms[next(iter(self.originals))], point))

    def _engine(self) -> Any:
        """The DeepSpeed engine the script prepared, where it prepared one model (None otherwise)."""
        models = list(self.prepared.values())
        return models[0] if len(models) == 1 and callable(getattr(models[0], "get_global_grad_norm", None)) else None

    def _engine_norm(self) -> Any:
        """The norm DeepSpeed's step clipped by (its engine's global gradient norm, in its dtype), for the
        oracle to clip by where it is the oracle's within the rounding of its sum; None for several models."""
        engine = self._engine()
        return engine.get_global_grad_norm() if engine is not None else None

    def _clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        if self.clip_in_step:
            return original
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


def copied_optimizer(raw: torch.optim.Optimizer, param_groups: list[dict[str, Any]], names: Mapping[int, str],
                     replica: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``raw``'s class over ``replica``'s parameters, group by group (``param_groups``:
    ``raw``'s as the script made it) with the hyperparameters as they stand (a scheduler made before may
    have set the learning rate already)."""
    params = dict(replica.named_parameters())
    groups = []
    for group in param_groups:
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


def refuse_rank_forwards(replicas: Mapping[str, nn.Module], models: Any) -> None:
    """A forward the script set on a module of its model (an instance attribute) that the oracle's copy would
    still run on the rank's own module: a closure over it, or a partial or method bound to it, which a copy
    does not rebind (a method set with ``types.MethodType`` is rebound to the copy). Refused, since the
    oracle's replica would then train the rank's model."""
    mine = {id(m) for model in models for m in model.modules()}
    for name, replica in replicas.items():
        for where, module in replica.named_modules():
            forward = vars(module).get("forward")
            if forward is None:
                continue
            function = getattr(forward, "__func__", getattr(forward, "func", forward))
            held = [getattr(forward, "__self__", None), *getattr(forward, "args", ())]
            for cell in getattr(function, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    held.append(cell.cell_contents)
            if any(isinstance(h, nn.Module) and id(h) in mine for h in held):
                raise LoopRefused(f"{WHO}: the script set a forward on its model ({name}{'.' + where if where else ''}) "
                                  "that calls the model itself (a closure or a partial over it): the oracle's copy "
                                  "would run the rank's model; set it as a method (types.MethodType), which a copy "
                                  "rebinds")


@contextlib.contextmanager
def _plain_forward(models: Any) -> Iterator[None]:
    """The models with accelerate's mixed-precision forward (an instance attribute ``prepare`` sets, the
    forward it wrapped kept as ``_original_forward``) put aside, so that the oracle's copies run the
    forward it wrapped under the oracle's precision: the class's, or one the script's library set on the
    instance (TRL's ``add_fused_lm_head``, which computes the same loss through its LM head in tiles, in
    another order than the class's forward). A forward of the instance's own that accelerate did not wrap
    is kept as it is."""
    held = []
    for model in models:
        own = vars(model)
        if "forward" not in own or "_original_forward" not in own:
            continue
        held.append((model, own.pop("forward")))
        wrapped = own["_original_forward"]
        if getattr(wrapped, "__func__", None) is not getattr(type(model), "forward", None):
            own["forward"] = wrapped  # the instance's own forward, under accelerate's
    try:
        yield
    finally:
        for model, forward in held:
            vars(model)["forward"] = forward
