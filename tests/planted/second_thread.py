"""A pytest plugin (``-p tests.planted.second_thread``) that starts one thread besides the session's main
one, asleep for the whole session: the thread a test sends Ctrl-C to when it shows that a signal landing
on a thread other than the main one still interrupts the run.

A session's own threads are not to be relied on for that: the one a serial session has besides its main
thread is OpenBLAS's server (numpy's, loaded with torch), and with ``OMP_NUM_THREADS=1`` or
``OPENBLAS_NUM_THREADS=1`` in the environment, or on one core, OpenBLAS starts none."""

import threading

_never = threading.Event()
threading.Thread(target=_never.wait, name="planted-second-thread", daemon=True).start()
