"""The case decorator: turns a rank-side function into a parametrized pytest case."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping


class Unsupported(Exception):
    """Raised on a rank when the installed accelerate lacks an API the case needs."""

    def __init__(self, api: str, detail: str = "") -> None:
        self.api = api
        self.detail = detail
        super().__init__(f"installed accelerate lacks {api}" + (f" ({detail})" if detail else ""))


class SkipCell(Exception):
    """Raised on a rank when the cell does not apply here; the message is the reason."""


@dataclass(frozen=True)
class Variant:
    """One named configuration of a case, e.g. ``steps=2-bf16``."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CaseInfo:
    """What the harness knows of a case: its name, variants, body and whether it is a canary."""

    name: str
    variants: tuple[Variant, ...]
    body: Callable[..., None]
    canary: bool
    description: str


def _format_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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


PRECISIONS = ("fp32", "bf16")


def case(
    name: str,
    *,
    variants: Iterable[Variant] = grid(precision=PRECISIONS),
    canary: bool = False,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare a case. The decorated function runs on every rank with a ``RankContext``.

    The decorator returns a pytest test function (it takes the ``harness_cell`` fixture that the
    harness plugin provides); keep the function's ``test_`` name so that pytest collects it.
    A canary is a usage pattern known to be wrong: the harness must detect it.
    """
    variant_list = tuple(variants)
    if not variant_list:
        raise ValueError(f"case {name!r} has no variants")
    seen = set()
    for variant in variant_list:
        if variant.name in seen:
            raise ValueError(f"case {name!r} has the variant {variant.name!r} twice")
        seen.add(variant.name)

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        if not body.__name__.startswith("test_"):
            raise ValueError(f"case {name!r}: name the function test_..., not {body.__name__!r}")

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
            canary=canary,
            description=inspect.getdoc(body) or "",
        )
        return test

    return decorate


def case_info(function: Any) -> CaseInfo | None:
    """The CaseInfo of a function made by ``@case``, else None."""
    return getattr(function, "__harness_case__", None)
