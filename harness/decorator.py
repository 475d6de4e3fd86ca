"""The @case decorator and what it declares: variants (grid), the diagnoses a canary must produce,
and the two exceptions a case body raises to say a cell does not apply."""

from __future__ import annotations

import inspect
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from harness.records import SYNC_KINDS


class Unsupported(Exception):
    """Raised on a rank when the installed accelerate (or ``library``: the installed torch, say) lacks
    an API or a support the case needs."""

    def __init__(self, api: str, detail: str = "", *, library: str = "accelerate") -> None:
        self.api = api
        self.detail = detail
        super().__init__(f"installed {library} lacks {api}" + (f" ({detail})" if detail else ""))


class SkipCell(Exception):
    """Raised on a rank when the cell does not apply here; the message is the reason."""


@dataclass(frozen=True)
class Variant:
    """One named configuration of a case, e.g. ``steps=2-bf16``."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Diagnosis:
    """A failure a canary must produce: its ``kind``, in ``model`` when given; ``when`` (variant
    parameters, e.g. ``{"sync_each_batch": True}``): only the cells of variants that have them must
    (for a known defect that one option of a case shows); ``ranks``: the fewest ranks that can show
    it (a count of tokens not summed over the ranks is right on one rank); ``also``: other kinds that
    show it as well (a gradient scaled by the world size reads ``wrong_scale``, and ``misweighted`` in a
    window weighed by tokens, where any wrong weight is a misweighting)."""

    kind: str
    model: str | None = None
    when: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()
    ranks: int = 1
    # a defect of some releases only: the first release of each package that no longer has it
    # (``{"torch": "2.11"}``); on a later installed release the cell is judged as any other
    fixed_in: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    # and the first release of each package that has it (``{"transformers": "4.46"}``); on an earlier
    # installed release the cell is judged as any other
    since: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    upstream: str = ""  # where the defect is reported (``pytorch/pytorch#149768``), named in the summary
    # for kind ``raised``: a regular expression the exception's ``Type: message`` must contain (re.search)
    match: str = ""
    also: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.kind == "raised") != bool(self.match):
            raise ValueError(f"Diagnosis({self.kind!r}): match= is given with kind 'raised' only, and 'raised' "
                             "needs it (what the library's exception says, e.g. match='uniform gradient dtype')")
        if self.match:
            re.compile(self.match)  # a bad pattern fails where the case is declared, not in a rank
        object.__setattr__(self, "also", (self.also,) if isinstance(self.also, str) else tuple(self.also))
        items = self.when.items() if isinstance(self.when, Mapping) else self.when
        object.__setattr__(self, "when", tuple(sorted((str(k), v) for k, v in items)))
        fixed = self.fixed_in.items() if isinstance(self.fixed_in, Mapping) else self.fixed_in
        object.__setattr__(self, "fixed_in", tuple(sorted((str(k), str(v)) for k, v in fixed)))
        since = self.since.items() if isinstance(self.since, Mapping) else self.since
        object.__setattr__(self, "since", tuple(sorted((str(k), str(v)) for k, v in since)))

    def applies_to(self, params: Mapping[str, Any]) -> bool:
        """Whether a cell of these variant parameters must show it (with the installed releases)."""
        return all(params.get(key) == value for key, value in self.when) and self.present()  # type: ignore[misc]

    def present(self) -> bool:
        """Whether the installed releases have it: below every ``fixed_in`` release, and none below a
        ``since`` release."""
        from harness.versions import below

        return (all(below(package, release) for package, release in self.fixed_in)  # type: ignore[misc]
                and not any(below(package, release) for package, release in self.since))  # type: ignore[misc]

    def described(self) -> str:
        """The diagnosis with where it is reported and the release that fixed it, for a summary."""
        where = [self.upstream] if self.upstream else []
        where += [f"since {package} {release}" for package, release in self.since]  # type: ignore[misc]
        where += [f"fixed in {package} {release}" for package, release in self.fixed_in]  # type: ignore[misc]
        return str(self) + (f" ({', '.join(where)})" if where else "")

    def matches(self, kind: str, model: str) -> bool:
        return (kind == self.kind or kind in self.also) and (self.model is None or model == self.model)

    @property
    def fewest_ranks(self) -> int:
        """The fewest ranks that can show it: ``ranks``, and two for a sync kind."""
        return max(self.ranks, 2 if self.kind in SYNC_KINDS else 1)

    def observable(self, world_size: int) -> bool:
        """Whether a cell of this world size can show it (sync needs two ranks)."""
        return world_size >= self.fewest_ranks

    def __str__(self) -> str:
        return " or ".join((self.kind, *self.also)) + (f" in {self.model}" if self.model else "")


# Defects of the installed torch or backend that the ranks find by probing it (one collective at a rank's
# start-up: harness/rank/numerics/backend_defects.py), never by reading a version number: a cell one of them
# touches is judged as a canary of it, ``detected`` naming where it is reported and the release that
# fixed it, and every other cell as usual (docs/wrappers.md, "Known defects declared as such").

# gloo's reduce_scatter_tensor with ReduceOp.AVG returns the sum (two ranks holding 1 and 2 get 3, not
# 1.5), which FSDP2 issues for its fp32 and bf16 gradients: every sync of an FSDP2 cell on CPU leaves the
# gradients scaled by the size of the group it reduce-scatters over (a misweighting, in a window weighed
# by tokens). Measured here: torch 2.7.1 and 2.8.0 sum; 2.9.0, 2.9.1, 2.10.0, 2.11.0 and 2.13.0 average
# (pytorch/pytorch#162338 was closed by PR #171458 in 2.11, which added the tests).
GLOO_AVG_SUMS = "gloo_avg_reduce_scatter_sums"

PROBED: dict[str, Diagnosis] = {
    GLOO_AVG_SUMS: Diagnosis("wrong_scale", also=("misweighted",), ranks=2,
                             upstream="pytorch/pytorch#162338: gloo's AVG reduce-scatter sums, fixed in torch 2.9.0"),
}


def probed(names: list[str] | tuple[str, ...] | set[str]) -> tuple[Diagnosis, ...]:
    """The diagnoses of the probed defects ``names`` (what the ranks report touched a cell), in the
    table's order; a name this harness does not know (a rank of another version) is refused."""
    unknown = sorted(set(names) - set(PROBED))
    if unknown:
        raise ValueError(f"unknown probed defect {unknown[0]!r}; known: {', '.join(PROBED)}")
    return tuple(diagnosis for name, diagnosis in PROBED.items() if name in names)


@dataclass(frozen=True)
class CaseInfo:
    """What the harness knows of a case: its name, variants, body, and for a canary (a pattern known
    to be wrong) the diagnoses it must produce."""

    name: str
    variants: tuple[Variant, ...]
    body: Callable[..., None]
    detects: tuple[Diagnosis, ...]
    description: str
    wrappers: tuple[str, ...] = ()  # the wrappers the case applies to (harness/wrappers/registry.py)
    # a known defect of the library under one wrapper: the diagnoses its cells must produce
    defects: Mapping[str, tuple[Diagnosis, ...]] = field(default_factory=dict)
    meshes: tuple[str, ...] = ()  # the meshes the case also runs on, under FSDP2 (harness/wrappers/mesh.py)

    @property
    def canary(self) -> bool:
        return bool(self.detects)

    def detects_for(self, variant: Variant) -> tuple[Diagnosis, ...]:
        """What a cell of ``variant`` must produce: the canary's diagnoses, or those of a known
        defect under the variant's wrapper (judged as a canary's: ``detected``, or ``missed`` the
        day a release fixes it)."""
        declared = self.detects or self.defects.get(str(variant.params.get("wrapper", "ddp")), ())
        return tuple(d for d in declared if d.applies_to(variant.params))


def _format_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def compiled(*variants: Variant, backend: str = "aot_eager") -> tuple[Variant, ...]:
    """The variants again, each under ``torch.compile`` with ``backend`` (``Accelerator(dynamo_backend=...)``),
    named ``<variant>-compile=<backend>``. ``aot_eager`` traces forward and backward through
    dynamo and AOTAutograd and needs no C compiler."""
    return tuple(Variant(f"{v.name}-compile={backend}", {**v.params, "compile": backend}) for v in variants)


def grid(**axes: Iterable[Any]) -> tuple[Variant, ...]:
    """The cross product of the axes, named ``key=value`` joined by ``-``.

    An axis called ``precision`` is named by its value alone (``fp32``, ``bf16``), as are string
    values of an axis called ``form``.
    """
    names = list(axes)
    values = [list(axes[name]) for name in names]
    variants = []
    for combo in itertools.product(*values):
        parts = []
        for name, value in zip(names, combo):
            if name in ("precision", "form"):
                parts.append(_format_value(value))
            else:
                parts.append(f"{name}={_format_value(value)}")
        variants.append(Variant("-".join(parts), dict(zip(names, combo))))
    return tuple(variants)


# The precisions a case runs in by default: fp32, and bf16 autocast (``mixed_precision="bf16"``).
PRECISIONS = ("fp32", "bf16")
# With fp16 too (``mixed_precision="fp16"``: autocast and a gradient scaler), which accelerate runs
# only on an accelerator device: on CPU its cells are ``skip``, saying so.
ALL_PRECISIONS = ("fp32", "bf16", "fp16")


# Every case defined in this process, by name: where it is defined (file, qualified name, line).
_DEFINED: dict[str, tuple[str, str, int]] = {}


def _register(name: str, body: Callable[..., None]) -> None:
    """Record where case ``name`` is defined; a second definition elsewhere is an error naming both
    (two cases of one name would make cells with one identity, and a report keeps only one).
    The same function loaded again (a rank or the self-check imports case files anew) is no second."""
    code = body.__code__
    here = (os.path.realpath(code.co_filename), body.__qualname__, code.co_firstlineno)
    there = _DEFINED.setdefault(name, here)
    if there[:2] != here[:2]:
        raise ValueError(f"case {name!r} is defined twice: {there[0]}:{there[2]} ({there[1]}) and "
                         f"{here[0]}:{here[2]} ({here[1]}); a case name identifies its cells and must be unique")


def case(
    name: str,
    *,
    variants: Iterable[Variant] = grid(precision=PRECISIONS),
    canary: Diagnosis | Iterable[Diagnosis] = (),
    wrappers: Iterable[str] | None = None,
    defects: Mapping[str, Diagnosis | Iterable[Diagnosis]] | None = None,
    meshes: Iterable[str] = (),
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare a case. The decorated function runs on every rank with a ``RankContext``.

    The decorator returns a pytest test function (it takes the ``harness_cell`` fixture that the
    harness plugin provides); keep the function's ``test_`` name so that pytest collects it.

    A canary is a usage pattern known to be wrong: ``canary`` names the diagnoses the harness must
    produce for it (``Diagnosis("not_synced", model="gen")``). Its cell is ``detected`` when every one
    of them that the world size can show was found, ``missed`` otherwise: finding some other failure
    does not prove that the checks which should catch it work.

    ``wrappers``: the wrappers the case applies to (``ddp``, ``fsdp2``, ``fsdp1``, ``deepspeed-z1``,
    ...; default: every one). A case that uses an API of one wrapper only (DDP's
    ``trigger_sync_in_backward``, ``DistributedDataParallelKwargs``) names it: ``wrappers=["ddp"]``.

    ``defects``: a known defect of accelerate (or the wrapper) under one wrapper, by wrapper name, as
    the diagnoses its cells show (``{"deepspeed-z1": Diagnosis("not_synced")}``). Those cells are
    judged as a canary's, so the run stays green while the defect lasts and turns red (``missed``)
    when a release fixes it; say in the case why it is a defect.

    ``meshes``: the device meshes the case also runs on (``hsdp``, ``tp``, ``cp``: accelerate's
    ``ParallelismConfig`` under FSDP2, at world sizes of 4 and more; docs/wrappers.md, "Meshes"). Each
    adds the cells ``<lead variant>-mesh=<name>-wrapper=fsdp2`` (the case must apply to ``fsdp2``).
    A canary's diagnoses apply to its mesh cells too; a ``Diagnosis`` can name its mesh with
    ``when={"mesh": ...}``.
    """
    from harness.wrappers.registry import MESHES, WRAPPERS, mesh_wrappers

    applies = tuple(WRAPPERS if wrappers is None else wrappers)
    unknown = [w for w in applies if w not in WRAPPERS]
    if unknown or not applies:
        raise ValueError(f"case {name!r}: wrappers= takes names among {', '.join(WRAPPERS)}; "
                         f"got {unknown[0] if unknown else 'none'}")
    known = _defects(name, defects or {}, applies)
    mesh_names = tuple(meshes)
    meshed = [s.name for s in mesh_wrappers()]
    if any(m not in MESHES for m in mesh_names) or (mesh_names and not set(meshed) & set(applies)):
        raise ValueError(f"case {name!r}: meshes= takes names among {', '.join(MESHES)}, for a case that "
                         f"applies to {' or '.join(meshed)}; got {list(mesh_names)}")
    detects = _canary(name, canary)
    variant_list = _variants(name, variants)

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        if not body.__name__.startswith("test_"):
            raise ValueError(f"case {name!r}: name the function test_..., not {body.__name__!r}")
        _register(name, body)

        def test(harness_cell: Any) -> None:
            harness_cell.run()

        test.__name__ = body.__name__
        test.__qualname__ = body.__qualname__
        test.__module__ = body.__module__
        test.__doc__ = body.__doc__
        test.__harness_case__ = CaseInfo(  # type: ignore[attr-defined]
            name=name,
            variants=variant_list,
            body=body,
            detects=detects,
            description=inspect.getdoc(body) or "",
            wrappers=applies,
            defects=known,
            meshes=mesh_names,
        )
        return test

    return decorate


def _defects(name: str, defects: Mapping[str, Diagnosis | Iterable[Diagnosis]],
             applies: tuple[str, ...]) -> dict[str, tuple[Diagnosis, ...]]:
    """``@case``'s ``defects=``, each wrapper's diagnoses as a tuple."""
    known: dict[str, tuple[Diagnosis, ...]] = {}
    for wrapper, diagnoses in defects.items():
        if wrapper not in applies:
            raise ValueError(f"case {name!r}: defects= names wrapper {wrapper!r}, which the case does not apply to")
        known[wrapper] = (diagnoses,) if isinstance(diagnoses, Diagnosis) else tuple(diagnoses)
        if not known[wrapper] or not all(isinstance(d, Diagnosis) for d in known[wrapper]):
            raise TypeError(f"case {name!r}: defects[{wrapper!r}] takes Diagnosis(kind, model=...) objects")
    return known


def _canary(name: str, canary: Any) -> tuple[Diagnosis, ...]:
    """``@case``'s ``canary=``, as a tuple of diagnoses."""
    if canary is True:
        raise TypeError(f"case {name!r}: a canary names the diagnoses it must produce, "
                        "e.g. canary=Diagnosis('not_synced', model='gen'), not canary=True")
    detects = (canary,) if isinstance(canary, Diagnosis) else tuple(canary or ())
    if not all(isinstance(d, Diagnosis) for d in detects):
        raise TypeError(f"case {name!r}: canary= takes Diagnosis(kind, model=...) objects, "
                        f"not {[type(d).__name__ for d in detects if not isinstance(d, Diagnosis)][0]}")
    return detects


def _variants(name: str, variants: Iterable[Variant]) -> tuple[Variant, ...]:
    """``@case``'s ``variants=``: at least one, each name once."""
    variant_list = tuple(variants)
    if not variant_list:
        raise ValueError(f"case {name!r} has no variants")
    seen = set()
    for variant in variant_list:
        if variant.name in seen:
            raise ValueError(f"case {name!r} has the variant {variant.name!r} twice")
        seen.add(variant.name)
    return variant_list


def case_info(function: Any) -> CaseInfo | None:
    """The CaseInfo of a function made by ``@case``, else None."""
    return getattr(function, "__harness_case__", None)
