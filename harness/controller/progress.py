"""The live progress line of a run: cells done of expected, bad cells so far, the time left, and a
cell that has run long."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterable, Optional

from harness.controller.cell_costs import PRIOR_CELLS, case_of, case_prior, cell_kind, fit, prior_cost
from harness.records import BAD_STATUSES, Status

# How often a line is written while cells pass (a cell that ends bad is written at once): often
# enough to show a long run is alive, rarely enough to keep a CI log readable.
INTERVAL_S = 10.0
# A cell running this long is named in a line of its own, and again every INTERVAL_S while it runs (a
# model of 1e8 parameters, or a rank stuck until --case-timeout): a long cell is not a stopped run.
LONG_CELL_S = 10.0
TICK_S = 1.0  # how often the controller looks for one
_BAD_ORDER = (Status.FAIL, Status.ERROR, Status.MISSED)


def duration(seconds: float) -> str:
    """``45s``, ``1m52s``, ``2h05m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Counts finished cells and writes a line through ``write`` (None: counts, writes nothing).

    A line is written when a cell ends and ``interval_s`` has passed since the last line (or since
    the start), at once when a cell ends fail, error or missed (naming it), and once by ``finish``;
    and, while a cell started with ``cell_started`` has run for ``long_s`` or more, every
    ``interval_s`` naming it and how long it has run (``tick``: from a thread of its own once a cell
    started, every ``tick_s``; with ``tick_s`` None, by whoever waits for the cell, as a serial run's
    controller does). Where it lands in pytest's output (never inside its line of dots, but for a long
    cell's) is ``TerminalLines``' part.
    """

    def __init__(self, write: Optional[Callable[..., None]], clock: Callable[[], float] = time.monotonic,
                 interval_s: float = INTERVAL_S, long_s: float = LONG_CELL_S, tick_s: float | None = TICK_S) -> None:
        self.write = write
        self.clock = clock
        self.interval_s = interval_s
        self.long_s = long_s
        self.tick_s = tick_s  # None: no thread (``tick`` is called by hand)
        self.running: dict[str, float] = {}  # the cells running, by name: since when
        # what a long cell's line is written inside: in a process that runs the cell itself, pytest's
        # capture of the test's output is lifted for it (the plugin sets it)
        self.urgent_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.total = 0
        self.done = 0
        self.bad: dict[str, int] = {}
        self.started = self.last_written = clock()
        self.first_done = 0.0  # when the first cell ended: the time before it is mostly pools starting
        self.expected = False
        self.finished = False
        # the estimate by kind (``cell_kind``), where the run's cells are known by id: the kind of each
        # cell not yet done; each cell done, timed (its case, kind, seconds and whether it ran: not skip
        # or unsupported); and the seconds of the cells done after the first (what the wall time since
        # the first cell bought)
        self.left_by_id: dict[str, tuple[str, int]] = {}
        self.cells_timed: list[tuple[str, tuple[str, int], float, bool]] = []
        self.seconds_after_first = 0.0
        # under xdist, what each worker has left and what no worker has been given yet (the plugin's
        # scheduler: harness/controller/scheduling.py, ``work_left``); and by worker, the clock at its
        # first and last cell's end, and the seconds and the count of its cells after the first
        self.queues: Callable[[], tuple[dict[str, list[str]], list[list[str]]]] | None = None
        self.workers: dict[str, list[float]] = {}

    def expect(self, total: int, ids: Iterable[str] = ()) -> None:
        """The run's cell count is known: its cells start now (the clock starts at the first call).
        ``ids``: their test ids, for an estimate of the time left that weighs each by its kind."""
        if not self.expected and not self.done:
            self.started = self.last_written = self.clock()
        self.expected = True
        self.total = total
        ids = list(ids)
        if ids and not self.done:
            self.left_by_id = {i: cell_kind(i) for i in ids}

    def cell_started(self, name: str) -> None:
        """A cell started (it is named by ``tick`` if it runs long)."""
        with self._lock:
            self.running[name] = self.clock()
        if self.write is not None and self.tick_s is not None and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_until_finished, name="harness-progress-tick", daemon=True)
            self._ticker.start()

    def cell_ended(self, name: str) -> None:
        """The cell is no longer running (its result, if any, came through ``cell_done``)."""
        with self._lock:
            self.running.pop(name, None)

    def tick(self) -> None:
        """The line for a cell that has run ``long_s`` or more, at most once an interval."""
        with self._lock:
            if self.write is None or self.finished or not self.running:
                return
            now = self.clock()
            name, since = min(self.running.items(), key=lambda item: item[1])
            if now - since < self.long_s or now - self.last_written < self.interval_s:
                return
            more = f" (and {len(self.running) - 1} more)" if len(self.running) > 1 else ""
            self._write(self.line(now) + f" · running {name} for {duration(now - since)}{more}", now, urgent=True)

    def flush(self, *, end: bool = False, next_file: str | None = None) -> None:
        """The writer's ``flush`` (``end``: the run's summary follows; or ``next_file``), under the lock
        the ticking thread writes under."""
        if not isinstance(self.write, TerminalLines):
            return
        with self._lock:
            if next_file is not None:
                self.write.next_file(next_file)
            else:
                self.write.flush(end=end)

    def _tick_until_finished(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    def cell_done(self, status: str, name: str = "", *, nodeid: str = "", seconds: float | None = None,
                  worker: str = "") -> None:
        """A cell ended with ``status``; ``nodeid`` and ``seconds``, its test id and how long it ran,
        teach the estimate what its kind and its case cost; ``worker``, the xdist worker that ran it, the
        time that passes on a worker between two cells."""
        with self._lock:
            self._cell_done(status, name)
            self._learn(nodeid, seconds, worker, ran=status not in (Status.SKIP, Status.UNSUPPORTED))

    def _learn(self, nodeid: str, seconds: float | None, worker: str, *, ran: bool) -> None:
        kind = self.left_by_id.pop(nodeid, None)
        if kind is None or seconds is None:
            return
        self.cells_timed.append((case_of(nodeid), kind, seconds, ran))
        if self.done > 1:
            self.seconds_after_first += seconds
        now = self.clock()
        if worker not in self.workers:
            self.workers[worker] = [now, now, 0.0, 0]
        else:
            _, _, before, cells = self.workers[worker]
            self.workers[worker][1:] = [now, before + seconds, cells + 1]

    def _cell_done(self, status: str, name: str) -> None:
        self.done += 1
        if self.done == 1:
            self.first_done = self.clock()
        bad = status in BAD_STATUSES
        if bad:
            self.bad[str(status)] = self.bad.get(str(status), 0) + 1
        if self.write is None or (self.total and self.done >= self.total):
            return  # the last cell's line is finish's
        now = self.clock()
        if bad:
            self._write(self.line(now) + f" · {status}: {name}", now)
        elif now - self.last_written >= self.interval_s:
            self._write(self.line(now), now)

    def finish(self) -> None:
        """The closing line, once, when any cell finished: how long the cells took, or where they stopped."""
        self._stop.set()
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        if self.write is None or self.finished or not self.done:
            return
        self.finished = True
        now = self.clock()
        short = self.total and self.done < self.total
        self._write(self.line(now, final=True) + f" · {'stopped after' if short else 'done in'} "
                    f"{duration(now - self.started)}", now)

    def line(self, now: float, *, final: bool = False) -> str:
        counted = f"{self.done}/{self.total}" if self.total >= self.done else str(self.done)
        parts = [f"gradient-sync: {counted} cells"]
        parts += [f"{self.bad[s]} {s}" for s in _BAD_ORDER if self.bad.get(s)]
        if not final and 1 < self.done < self.total:
            parts.append(f"{duration(self.left(now))} left")
        return " · ".join(parts)

    def left(self, now: float) -> float:
        """The time left: the wall time since the first cell ended (the wait for it is the pools'
        start-up, paid once) times what the cells left cost over what the cells done since cost (under
        xdist, ``_left_by_worker``). Without the cells' ids or times, every cell costs the same.

        A cell left costs its kind's cost for a case of average cost times its case's factor
        (cell_costs.fit, over the cells done). A kind not yet measured costs its ``prior_cost`` scaled to
        the cells measured (their seconds over their priors); a case not yet run, its ``case_prior``.
        The catalogue runs its cheap cases first: a case met later at its factor of 1 (an average case)
        promised a third too little in the run's first quarter (issue 76). Measured factors average 1
        over the cells that ran, the priors over the whole catalogue: each is taken to the latter,
        by the mean prior of the cells that ran (``norm``)."""
        elapsed = now - self.first_done
        if not self.left_by_id or self.seconds_after_first <= 0:
            return elapsed / (self.done - 1) * (self.total - self.done)
        timed = self.cells_timed
        scale = sum(s for _, _, s, _ in timed) / max(
            sum(prior_cost(kind) * case_prior(case) for case, kind, _, _ in timed), 1e-9)
        _, cases = fit(timed)
        ran = [case for case, _, _, ran in timed if ran]
        norm = sum(case_prior(case) for case in ran) / len(ran) if ran else 1.0

        # a kind's cost: its cells' seconds so far over their cases' factors (on the priors' scale), with
        # its prior (scaled) as PRIOR_CELLS more cells of an average case
        seconds: dict[tuple[str, int], float] = {}
        units: dict[tuple[str, int], float] = {}
        for case, kind, s, _ in timed:
            seconds[kind] = seconds.get(kind, 0.0) + s
            units[kind] = units.get(kind, 0.0) + cases.get(case, 1.0) * norm
        kind_cost = {kind: (seconds[kind] + PRIOR_CELLS * prior_cost(kind) * scale) / (units[kind] + PRIOR_CELLS)
                     for kind in units}

        def cost(test: str) -> float:
            kind, case = self.left_by_id[test], case_of(test)
            factor = cases[case] * norm if case in cases else case_prior(case)
            return (kind_cost[kind] if kind in kind_cost else prior_cost(kind) * scale) * factor

        by_worker = self._left_by_worker(cost)
        if by_worker is not None:
            return by_worker
        return elapsed * sum(cost(test) for test in self.left_by_id) / self.seconds_after_first

    def _left_by_worker(self, cost: Callable[[str], float]) -> float | None:
        """Under xdist's scheduler (``queues``): the time until the last worker is done. Each worker runs
        the cells it was given one after another, and each unit not yet given goes to the worker with
        the least left, as xdist hands them out; a cell costs its kind's seconds and what passes on a
        worker between two cells (the workers' wall time less their cells' seconds, a cell: pytest's own
        work, a pool's start). The cells left divided among the workers as if they shared them evenly
        misread a run whose last world size is left to one worker while the other has finished (issue
        76). None where it cannot be told."""
        timed = [w for w in self.workers.values() if w[3] > 0]
        if self.queues is None or not timed:
            return None
        try:
            given, queued = self.queues()
        except (RuntimeError, AttributeError, KeyError):  # read while xdist changed it, or another xdist
            return None
        if not given:
            return None
        between = max(0.0, sum(last - first - seconds for first, last, seconds, _ in timed)
                      / sum(cells for *_, cells in timed))

        def seconds(tests: list[str]) -> float:
            return sum(cost(t) + between for t in tests if t in self.left_by_id)

        left = {worker: seconds(tests) for worker, tests in given.items()}
        for unit in queued:
            least = min(left, key=left.__getitem__)
            left[least] += seconds(unit)
        return max(left.values())

    def _write(self, line: str, now: float, *, urgent: bool = False) -> None:
        assert self.write is not None
        self.last_written = now
        if urgent:
            with self.urgent_context():
                self.write(line, urgent=True)
        else:
            self.write(line)


class TerminalLines:
    """Writes progress lines into pytest's terminal output on lines of their own, without splitting
    pytest's line of dots (or letters): a line that comes while one is open waits for its end.

    Under ``-v`` every test has a line of its own, and a progress line is written at once. Else it is
    written when the reporter's line is empty (pytest has just ended a line of dots at the edge: call
    ``flush`` after each report), when a serial run moves on to another file (``next_file``: pytest's
    header for it starts a line anyway), and at the end of the run (``flush(end=True)``). A long
    cell's line (``urgent``) cannot wait: it ends pytest's open line where it is, and pytest's line is
    taken up again after it with what pytest had written at its start (the file's name, or under
    ``-v`` the test's), so that the running test's letter or word lands on a line that names it.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.pending: list[str] = []
        self.at_once = (config.getoption("verbose", 0) or 0) > 0
        self.file = ""  # the file of the last reported test (a serial run's header)

    def _reporter(self) -> Any:
        # looked up at each line: the terminal reporter is registered after the harness's configure
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def __call__(self, line: str, *, urgent: bool = False) -> None:
        """Write ``line``; ``urgent`` (a long cell's): at once, ending pytest's line of dots if one is open."""
        self.pending.append(line)
        self.flush(force=self.at_once or urgent)

    def flush(self, *, force: bool = False, end: bool = False, header_next: bool = False) -> None:
        """Write the waiting lines if pytest's line is empty, or (``force``) ending it. ``end``: the
        run's summary follows; ``header_next``: pytest starts a file's header next (``next_file``)."""
        reporter = self._reporter()
        if reporter is None:  # -p no:terminal
            self.pending.clear()
            return
        if not self.pending:
            return
        width = _line_width(reporter)
        if width and not (force or end or header_next):
            return
        # pytest's own state of its line (its reporter's ``currentfspath``): the file whose header
        # opens the line of letters (a path), the test whose word is to come under -v (its location),
        # -2 under -v once the word is written, None where no line of pytest's is open (under xdist)
        opened = getattr(reporter, "currentfspath", None)
        if width:
            reporter.write("\n")  # not ensure_newline: it forgets the open header, so pytest writes it twice
        *lines, last = self.pending
        self.pending.clear()
        for line in lines:
            reporter.write(line + "\n")
        if header_next or (opened == -2 and not end):
            # pytest's next write starts with a newline (a file's header; under -v the next test's
            # line, or its ensure_newline): it ends this line, with no empty line between
            reporter.write(last)
            if header_next:
                reporter.currentfspath = None  # no "[ 40%]" for the line just ended: next_file wrote it
            return
        reporter.write(last + "\n")
        if end:
            reporter.currentfspath = None  # pytest's summary starts with ensure_newline: no second empty line
            return
        if not width or opened is None:
            return  # the letters go on on the next line, as after pytest's own wrap at the edge
        if isinstance(opened, str):  # -v: the running test's location, its word to come
            reporter.write(opened)
        else:  # the file's header, its letters to come
            reporter.write(_relative(opened, getattr(reporter, "startpath", None)) + " ")

    def next_file(self, nodeid: str) -> None:
        """A serial run's next test starts (``pytest_runtest_logstart``, before pytest's own): in
        another file than the last, pytest is about to end the dots' line; the waiting lines go first."""
        file = nodeid.split("::", 1)[0]
        if self.file and file != self.file and self.pending:
            reporter = self._reporter()
            fill = getattr(reporter, "_write_progress_information_filling_space", None)
            if fill is not None and getattr(reporter, "_show_progress_info", False) and _line_width(reporter):
                fill()  # the line's "[ 40%]", which pytest would have written before its next header
            self.flush(header_next=True)
        self.file = file


def _relative(path: Any, start: Any) -> str:
    """A file's name as pytest's header writes it (relative to where pytest was started)."""
    try:
        return os.path.relpath(path, start) if start is not None else str(path)
    except (TypeError, ValueError):
        return str(path)


def _line_width(reporter: Any) -> int:
    return getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0)


def terminal_writer(config: Any) -> Optional[TerminalLines]:
    """Where the progress lines go in pytest's terminal output; None under ``-q``."""
    if (config.getoption("verbose", 0) or 0) < 0:
        return None
    return TerminalLines(config)
