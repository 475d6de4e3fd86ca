"""Attributes set for as long as a watch lasts (harness/rank/watch/loop.py), and put back after it."""

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


def after_import(name: str, then: Callable[[Any], None], restore: list[Callable[[], None]]) -> None:
    """Call ``then(module)`` once module ``name`` is imported: now, where it is already, else as soon as
    it is (a finder in front of ``sys.meta_path``, taken out by ``restore``'s entry or after that import),
    so that a library the watched code may never import is not imported for it."""
    import importlib.abc
    import sys

    if name in sys.modules:
        then(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # the real finders find it; this one only wraps its loading
            try:
                import importlib.util

                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                execute(module)
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(self)
                then(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    finder = Finder()
    sys.meta_path.insert(0, finder)

    def take_out() -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)

    restore.append(take_out)
