"""A training loop checked as it is: ``ctx.watch(accelerator, models, loss=...)`` around the user's
own training function (docs/writing-a-case.md#a-loop-as-it-is-ctxwatch).

The loop gets the case's Accelerator, instrumented on this instance only (the class and every other
Accelerator are untouched), and the objects it prepares: each ``accelerator.backward`` belongs to the
drawn batch its model's forward was given (harness/rank/watch/forwards.py; else the one batch drawn since the
last backward), which has the micro-step the accumulation contract gives it (the schedule, from the
loader's length): a loop that draws a window's batches first is followed too; ``accumulate`` says where the loop reads
``sync_gradients``; ``clip_grad_norm_`` where it clips and what norm it got. The oracle runs the
specification's loss on its replicas from a copy of the very batch the loop drew, under the RNG state
the loop's forward ran under (dropout draws the same masks), and every backward and every micro-step's
parameters are checked with the same checks as a hand-written case. What the watch cannot infer from
these calls is refused in one line (``LoopRefused``) that says what to give instead.

What a sync really did is not read from ``no_sync`` or ``trigger_sync_in_backward``: the collectives
each backward issued are counted (harness/rank/numerics/accounting.py), and the gradients judged; nor are the
optimizers' ``step`` and ``zero_grad`` counted: their effect on every parameter is judged at every
micro-step, which a step that changes nothing (an optimizer without gradients) does not fail.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from harness import wording
from harness.rank.watch import LoopRefused
from harness.rank.watch.asked import Asked
from harness.rank.watch.forwards import Forward, Forwards, tensors_of
from harness.rank.watch.loaders import WATCH_ATTRIBUTE, Drawn, Loader, dataloader_options, follow_iteration
from harness.rank.numerics.rng import rng_state, under_rng_state
from harness.rank.watch.patching import patch, refuse_construction
from harness.rank.oracle.schedule import MicroStep, accumulation_schedule
from harness.wrappers.prepared import unwrap

if TYPE_CHECKING:
    from harness.rank.oracle.core import Oracle
    from harness.rank.watch.cell import WatchedCell

# the Accelerator's methods that prepare objects; each call's results are adopted once it returns
PREPARE = ("prepare", "prepare_model", "prepare_data_loader", "prepare_optimizer", "prepare_scheduler")


class Watch:
    """The oracle and the checks of one case's loop, run from the calls the loop makes anyway.
    Made by ``RankContext.watch``, which gives it ``oracle``, a maker of its oracle from the watch's replay
    of the loop's RNG; a context manager around the loop."""

    who = "ctx.watch"  # what the watch's refusals say they come from

    def __init__(
        self,
        ctx: WatchedCell,
        accelerator: Any,
        models: Mapping[str, nn.Module],
        *,
        loss: Callable[[Any, Any], torch.Tensor],
        clip_grad_norm: float | None,
        scheduler: bool,
        num_steps: int,
        oracle: Callable[[Callable[[Any], Any]], Oracle] | None = None,
    ) -> None:
        self.ctx = ctx
        self.accelerator = accelerator
        self.oracle: Oracle  # made of ``oracle`` below (a script's watch makes its own at its first batch)
        self.originals = dict(models)
        self.prepared: dict[str, nn.Module] = {}
        self.optimizers: dict[str, list[Any]] = {name: [] for name in models}
        self.loss = loss
        self.clip = clip_grad_norm
        self.check_lr = scheduler
        accumulation = ctx.accumulation_settings()
        self.contract = dict(num_steps=num_steps, sync_with_dataloader=accumulation.sync_with_dataloader,
                             sync_each_batch=accumulation.sync_each_batch)
        self.schedule: list[list[MicroStep]] = []  # the contract's micro-steps, by epoch of the training loader
        self.loaders: dict[int, Loader] = {}  # by id of the prepared loader
        self.last_drawn: Loader | None = None
        self.backed: Drawn | None = None  # the batch the last backward took
        self._restore: list[Callable[[], None]] = []
        # each training forward paired with the drawn batch it was given (a window drawn ahead)
        self.forwards = Forwards(ctx.device, self._undone, self._restore)
        self.asked = Asked(self._restore)  # the loop's accumulate and no_sync blocks, its optimizers' steps
        self.drawn_since_backward: list[Loader] = []
        self.training: Loader | None = None  # the loader whose batches the backwards take
        self.unsettled: MicroStep | None = None  # backed, its optimizer step and parameters not yet judged
        self.clipped = False  # the oracle clipped this window
        self.backwards = 0
        self.unsuppressed = 0  # backwards that synced where their window has none, the loop never asking not to
        self.stopped = ""  # why the watch stopped checking (the schedule failed): the rest passes through
        self.rng_states: dict[int, Any] = {}
        self._iterations: set[type] = set()  # the loader classes whose iteration tells the watch
        if oracle is not None:
            self.oracle = oracle(self.replay)

    # the context manager

    def __enter__(self) -> Watch:
        self._instrument(self.accelerator)
        self._refuse_second_accelerator()
        return self

    def _instrument(self, accelerator: Any) -> None:
        """The Accelerator's methods the watch follows, patched on this instance only."""
        for method in PREPARE:
            if hasattr(accelerator, method):
                self._patch(accelerator, method, self._preparing(getattr(accelerator, method)))
        self._patch(accelerator, "backward", self._backward(accelerator.backward))
        self._patch(accelerator, "accumulate", self.asked.accumulate(accelerator.accumulate))
        if hasattr(accelerator, "no_sync"):
            self._patch(accelerator, "no_sync", self.asked.no_sync(accelerator.no_sync))
        if hasattr(accelerator, "clip_grad_norm_"):
            self._patch(accelerator, "clip_grad_norm_", self._clip(accelerator.clip_grad_norm_))

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        if kind is not None:
            return
        self._settle()
        if not self.backwards and not self.stopped:
            raise LoopRefused(f"{self.who}: the loop ran no accelerator.backward, so nothing was checked; the loop "
                              "must call accelerator.backward(loss) on batches drawn from a dataloader it prepared")

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` for as long as the watch lasts."""
        patch(owner, name, value, self._restore)

    def _refuse_second_accelerator(self) -> None:
        """A loop that makes its own Accelerator runs outside the watch (and shares accelerate's
        process-wide state with the case's): refused when it is made."""
        from accelerate import Accelerator

        refuse_construction(Accelerator, LoopRefused(
            f"{self.who}: the loop made a second Accelerator; take the one the case gives it (ctx.accelerator(...), "
            "with the Accelerator's arguments there) as a parameter"), self._restore)

    # what the loop prepares

    def _preparing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def prepare(*args: Any, **kwargs: Any) -> Any:
            given = list(args)  # the objects; keywords are options (device_placement=...)
            result = original(*args, **kwargs)
            results = list(result) if isinstance(result, (tuple, list)) and len(given) != 1 else [result]
            if len(results) == len(given):
                for before, after in zip(given, results):
                    self._adopt(before, after)
            return result

        return prepare

    def _adopt(self, before: Any, after: Any) -> None:
        """One object the loop prepared: a model of the specification, a dataloader (watched from now
        on), an optimizer (by the model whose parameters it holds), a scheduler."""
        from torch.utils.data import DataLoader

        if isinstance(before, nn.Module):
            name = next((n for n, m in self.originals.items() if m is before or m is unwrap(after)), None)
            if name is None:
                if any(p.requires_grad for p in before.parameters()):
                    raise LoopRefused(f"{self.who}: the loop prepares a model the specification does not name "
                                      f"({type(before).__name__}); give every model it trains to ctx.watch, by name")
                return
            self.prepared[name] = after
            self._follow_forwards(after)
        elif isinstance(before, DataLoader):
            self._watch_loader(before, after)
        elif isinstance(before, torch.optim.Optimizer):
            held = self.optimizers[self._owner(before)]
            if not any(after is known for known in held):  # prepare calls prepare_optimizer: both tell
                held.append(after)
                self.asked.count_steps(self._owner(before), after)

    def _follow_forwards(self, prepared: nn.Module) -> None:
        """Pair the training forwards of a prepared model (or of the one it wraps) with the batches drawn."""
        self.forwards.follow(prepared)
        self.forwards.follow(unwrap(prepared))
        if callable(getattr(prepared, "no_sync", None)) and "no_sync" not in vars(prepared):  # DDP's, FSDP1's own
            self._patch(prepared, "no_sync", self.asked.no_sync(prepared.no_sync))

    def _undone(self) -> list[Drawn]:
        """The batches drawn that no backward has taken yet, of every watched loader."""
        return [d for state in self.loaders.values() for d in state.drawn]

    def _owner(self, optimizer: torch.optim.Optimizer) -> str:
        """The model whose parameters ``optimizer`` holds (each optimizer holds one model's)."""
        if len(self.originals) == 1:
            return next(iter(self.originals))
        held = {id(p) for group in self._groups(optimizer) for p in group["params"]}
        owners = [name for name, model in self.originals.items() if held & self._param_ids(model)]
        if len(owners) != 1:
            raise LoopRefused(f"{self.who}: an optimizer of the loop holds the parameters of "
                              f"{' and '.join(owners) or 'no model the specification names'}; the checks need "
                              "each optimizer to hold one named model's parameters")
        return owners[0]

    def _groups(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """``optimizer``'s parameter groups as the loop made them."""
        return optimizer.param_groups

    def _param_ids(self, model: nn.Module) -> set[int]:
        """The ids of ``model``'s parameters, those an optimizer of it may hold."""
        return {id(p) for p in model.parameters()}

    def _watch_loader(self, raw: Any, prepared: Any) -> None:
        """Follow ``prepared``'s batches: its class's iteration tells the watch of the loaders that
        carry it, for as long as the watch lasts (accelerate's loaders answer ``__class__`` with their
        base loader's, so their class cannot be swapped for one instance; others iterate as before)."""
        if vars(prepared).get(WATCH_ATTRIBUTE) is self:
            return
        state = Loader(number=len(self.loaders) + 1, expected=self._expected(raw))
        self.loaders[id(prepared)] = state
        vars(prepared)[WATCH_ATTRIBUTE] = self
        cls = type(prepared)
        if cls not in self._iterations:
            self._iterations.add(cls)
            follow_iteration(cls, Watch, self._restore)

    def _expected(self, loader: Any) -> int:
        """The batches each rank's prepared loader must yield per epoch, from the loader the loop
        gave ``prepare`` and the Accelerator's dataloader options (accelerate's sharding contract)."""
        from torch.utils.data import IterableDataset

        if isinstance(loader.dataset, IterableDataset):
            raise LoopRefused(f"{self.who}: the loop prepares a DataLoader of an IterableDataset, whose batches per "
                              "rank the harness cannot know; give it a map-style Dataset")
        if loader.batch_size is None:
            raise LoopRefused(f"{self.who}: the loop prepares a DataLoader with a batch_sampler, whose batches per "
                              "rank the harness cannot know; give it batch_size= (and shuffle=, drop_last=) instead")
        split, dispatch = dataloader_options(self.accelerator)
        return self.ctx.expected_batches(len(loader.dataset), loader.batch_size, split_batches=split,
                                         dispatch_batches=dispatch, drop_last=loader.drop_last)

    # the loop's batches

    def iterate(self, loader: Any, batches: Iterator[Any]) -> Iterator[Any]:
        """A watched loader's iteration (``batches``: its own)."""
        state = self.loaders[id(loader)]
        state.epochs += 1
        state.seen = 0
        state.drawn.clear()
        for batch in batches:
            self._drawn(state, batch)
            yield batch
        self._ended(state)

    def _drawn(self, state: Loader, batch: Any) -> None:
        """A batch drawn: the last micro-batch's step is over (the loop draws the next one after it)."""
        self._settle()
        state.seen += 1
        if self.stopped:
            return
        copy = tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, batch)
        own = tensors_of(batch)
        state.drawn.append(Drawn(state, state.epochs - 1, state.seen, copy, rng_state(self.ctx.device), own,
                                 self.backwards))
        self.last_drawn = state
        if state not in self.drawn_since_backward:
            self.drawn_since_backward.append(state)

    def _ended(self, state: Loader) -> None:
        """A watched loader's iteration ran to its end."""
        self._settle()
        if state in self.drawn_since_backward:
            self.drawn_since_backward.remove(state)
        if not state.trained or self.stopped:
            return
        if not self.ctx.recorder.batch_count(what=f"the {state.name()}", epoch=state.epochs - 1, seen=state.seen,
                                             expected=state.expected):
            self.stopped = "its dataloader yielded another number of batches than the contract's"

    # the loop's backward, accumulate and clip

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            paired = None if self.stopped else self._micro_step()
            result = original(*args, **kwargs)
            if paired is not None:
                self._after_backward(*paired)
            return result

        return backward

    def _micro_step(self) -> tuple[Drawn, Forward | None, MicroStep, bool] | None:
        """The micro-step of the backward about to run: the drawn batch its forward was given (else
        the one batch drawn since the last backward), where the contract puts it (None past the
        contract's count: nothing more is judged). What cannot be paired is refused before the
        backward runs."""
        forward = self.forwards.take()
        state = forward.drawn.loader if forward is not None else self.last_drawn
        # no forward given a drawn batch, and none drawn since the last backward: its batch again
        fresh = state is not None and any(d.backwards == self.backwards for d in state.drawn)
        if forward is None and self.backed is not None and not fresh and self.unsettled is not None:
            raise LoopRefused(f"{self.who}: a second accelerator.backward on {self.backed.where()}; the "
                              "specification gives one loss a batch: for a loop with several losses a batch (a GAN's), "
                              "write the case with the oracle beside it (docs/writing-a-case.md)")
        self._settle()  # a window drawn ahead: the last micro-step is over at this backward, not at a draw
        if state is None or not state.drawn:
            raise LoopRefused(f"{self.who}: accelerator.backward with no batch drawn since the last backward from a "
                              "dataloader the loop prepared; the watch pairs each backward with the batch the loop "
                              "drew from a DataLoader it gave accelerator.prepare: prepare the loop's data source")
        if forward is None and len(state.drawn) > 1:
            raise LoopRefused(f"{self.who}: the loop drew {len(state.drawn)} batches from its {state.name()} before "
                              "one backward, and its model's forward was given none of their tensors; the watch "
                              "pairs each backward with the batch its forward took (model(**batch)), or with the one "
                              "batch drawn before it")
        drawn = forward.drawn if forward is not None else state.drawn[0]
        if drawn is not state.drawn[0]:
            raise LoopRefused(f"{self.who}: the loop's backward took {drawn.where()} before {state.drawn[0].where()}, "
                              "drawn before it; the watch follows a loop that takes its batches in the order drawn")
        others = [s.name() for s in self.drawn_since_backward if s is not state]
        if others:
            raise LoopRefused(f"{self.who}: the loop drew from its {' and '.join(others)} and its {state.name()} "
                              "for one backward; the specification's loss takes one batch: give the loop one "
                              "training dataloader (an evaluation loader run to its end between steps is fine)")
        if self.training is not None and state is not self.training:
            raise LoopRefused(f"{self.who}: backwards on batches of the {self.training.name()} and then of the "
                              f"{state.name()}; the watch follows one training dataloader")
        self.training = state
        state.trained = True
        self.backed = state.drawn.pop(0)
        self.drawn_since_backward.clear()
        point = self._point(state, drawn)
        return None if point is None else (drawn, forward, point, self.asked.no_sync_asked())

    def _point(self, state: Loader, drawn: Drawn) -> MicroStep | None:
        """The contract's micro-step for the ``seen``-th batch of the ``epoch``-th iteration (the
        schedule of that many epochs, so that windows run on across epochs where the contract says);
        None for a batch past the contract's count (the epoch's end reports it)."""
        epoch, batch = drawn.epoch, drawn.seen - 1
        if batch >= state.expected:
            self.stopped = "its dataloader yielded more batches than the contract's"
            return None
        ctx = self.ctx
        if len(self.schedule) <= epoch:  # made once per epoch, for every epoch so far
            schedule = accumulation_schedule(state.expected, epochs=epoch + 1, **self.contract)
            self.schedule = [[p for p in schedule if p.epoch == e] for e in range(epoch + 1)]
            ctx.made_schedules.add(schedule)
        point = self.schedule[epoch][batch]
        ctx.at_step = point.index
        return point

    def _after_backward(self, drawn: Drawn, forward: Forward | None, point: MicroStep, asked: bool) -> None:
        oracle = self.oracle
        if self.asked.accumulating:
            oracle.check_sync_flag(point, self.accelerator.sync_gradients)
        judged = point
        if not point.sync and not asked and self.ctx.world_size > 1 and self.ctx.spec.family == "ddp":
            # a backward the loop never asked not to sync (no accumulate, no no_sync): DDP all-reduces it,
            # which costs a collective and leaves the window's update as it is; the rank is judged synced
            # (under FSDP, whose sharded accumulation, and DeepSpeed, whose boundaries are its own, the
            # contract holds as it is)
            judged = dataclasses.replace(point, sync=True)
            self.unsuppressed += 1
            self.ctx.recorder.said["syncs"] = wording.unsuppressed_text(self.unsuppressed)
        batch = drawn.batch
        self.rng_states[point.index] = forward.rng if forward is not None else drawn.rng
        self._weigh(drawn, point)
        single = next(iter(self.originals)) if len(self.originals) == 1 else None
        loss = self._loss_of(forward)

        def closure(replicas: dict[str, nn.Module]) -> torch.Tensor:
            return loss(replicas[single] if single is not None else replicas, batch)

        oracle.backward(closure, sync=judged.sync, rng=point.index)
        oracle.check_grads(judged, self.models())
        self.backwards += 1
        self.unsettled = point
        self.clipped = False

    def _loss_of(self, forward: Forward | None) -> Callable[[Any, Any], torch.Tensor]:
        """The specification's loss of the micro-batch ``forward`` ran (the case's ``loss``)."""
        return self.loss

    def _weigh(self, drawn: Drawn, point: MicroStep) -> None:
        """Before the oracle's backward of ``drawn``: how its window weighs it (the contract's own)."""

    def replay(self, key: int) -> Any:
        """The RNG state the loop's forward of micro-step ``key`` ran under, for the oracle's forward."""
        return under_rng_state(self.rng_states.pop(key), self.ctx.device)

    def _clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
            norm = original(parameters, *args, **kwargs)
            if self.stopped:
                return norm
            if self.clip is None:
                raise LoopRefused(f"{self.who}: the loop clips its gradients (accelerator.clip_grad_norm_) and the "
                                  "specification does not; give ctx.watch clip_grad_norm= the norm they are clipped "
                                  "to before each optimizer step")
            point = self.unsettled
            if point is not None and point.optimizer_step and not self.clipped:
                self._clip_oracle(point)
                name = self._clipped_model(parameters)
                if name is not None and norm is not None:
                    self.oracle.check_grad_norm(point, {name: norm})
            return norm

        return clip_grad_norm_

    def _clip_oracle(self, point: MicroStep) -> None:
        """The specification's clip before the optimizer step at ``point``, and the loop's clipped
        gradients checked against it (the oracle then carries on from them, as after any check)."""
        self.oracle.clip_grad_norm(self.clip)  # type: ignore[arg-type]
        self.clipped = True
        self.oracle.check_grads(point, self.models())

    def _clipped_model(self, parameters: list[Any]) -> str | None:
        """The model whose parameters a clip was given, when they are all of one model's."""
        given = {id(p) for p in parameters}
        for name, model in self.models().items():
            if given and given <= {id(p) for p in model.parameters()}:
                return name
        return None

    # each micro-step's optimizer step and parameters

    def _settle(self) -> None:
        """The last backward's micro-step is over: the oracle clips (where the specification does and
        the loop did not call the clip) and steps where the contract says, and the parameters are
        judged."""
        point, self.unsettled = self.unsettled, None
        if point is None:
            return
        oracle = self.oracle
        if self.clip is not None and point.optimizer_step and not self.clipped:
            self._clip_oracle(point)
        stepped = self.asked.take_steps()
        oracle.step(point)
        optimizers = {name: opts for name, opts in self.optimizers.items() if opts}
        oracle.check_params(point, self.models(), optimizers)
        if not point.optimizer_step:
            for name in stepped:
                oracle.checks.stepped_early(point, name, optimizers.get(name))  # type: ignore[union-attr]
        if self.check_lr and optimizers:
            oracle.check_lr(point, optimizers)

    def models(self) -> dict[str, nn.Module]:
        """The loop's models by name: the prepared ones, else as given (a loop that never prepared one)."""
        return {name: self.prepared.get(name, model) for name, model in self.originals.items()}

