"""The garbage collector while a process imports torch and what builds on it.

Importing torch and accelerate makes about 300,000 objects that live as long as the process. While
they are being made, the collector walks all of them again at every full collection, and after it,
at every full collection of the process's life. Paused while they are imported, and with what is
alive then frozen out of its reach (``gc.freeze``), a session of one cell takes about 1.2 s of CPU
instead of 2.1 on an adopted fork server, and 2.6 s instead of 3.9 on its own (bench/README.md, "The
controller's imports"). Everything made later is collected as before.

Paused: by the plugin, from the first case file a session imports to the end of its collection
(harness/plugin.py); by the fork server the pools' ranks are forked from, while it preloads
(harness/rank/process/preload.py); by a launched rank, while it imports the rank side and joins
(harness/launch/main.py); by ``python -m harness selfcheck``, while it reads the catalogue.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


def pause() -> bool:
    """Pause the collector; False where it was paused already (someone else's pause, left to them)."""
    if not gc.isenabled():
        return False
    gc.disable()
    return True


def resume(paused: bool) -> None:
    """End a pause of ``pause``'s (``paused``: what it returned): the collector runs again, and what
    is alive now is out of its reach from now on."""
    if paused:
        gc.enable()
        gc.freeze()


@contextlib.contextmanager
def imports_frozen() -> Iterator[None]:
    """The collector paused for the block, and what is alive after it frozen, whatever the block did."""
    paused = pause()
    try:
        yield
    finally:
        resume(paused)
