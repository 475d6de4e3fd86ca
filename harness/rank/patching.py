"""Attributes set for as long as a watch lasts (harness/rank/watch.py), and put back after it."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable


def patch(owner: Any, name: str, value: Any, restore: list[Callable[[], None]]) -> None:
    """Set ``owner.name`` to ``value`` and add to ``restore`` what puts it back: an instance's own
    attribute (a method patched on one instance) is put back by removing it."""
    had = name in vars(owner)
    before = vars(owner).get(name)
    setattr(owner, name, value)

    def put_back() -> None:
        if had:
            setattr(owner, name, before)
        else:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)

    restore.append(put_back)


def refuse_construction(cls: type, refusal: Exception, restore: list[Callable[[], None]]) -> None:
    """Make constructing ``cls`` raise ``refusal`` until ``restore``'s entry runs."""
    original = cls.__init__

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> None:
        raise refusal

    cls.__init__ = init  # type: ignore[misc]
    restore.append(lambda: setattr(cls, "__init__", original))
