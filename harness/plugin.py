"""The pytest plugin: options, one test item per cell, rank pools per process, and the merged matrix."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import signal
from pathlib import Path
from typing import Any

import pytest

from harness import heap
from harness.catalogue import CaseRef
from harness.controller.cells import CELL_ID_END, cell_id, run_cell
from harness.controller.options import DEFAULT_CASE_TIMEOUT_S, DEFAULT_SEED, OptionError, Settings, resolve
from harness.controller.pool import Pools, PoolSet
from harness.controller.progress import TICK_S, Progress, terminal_writer
from harness.controller.scheduling import work_left, world_size_scheduler
from harness.decorator import case_info
from harness.matrix.diff import selection_id
from harness.matrix.schema import Cell, Matrix, merge_cells, with_unavailable_checks
from harness.messages import watched
from harness.rank.process.environment import launcher_settings
from harness.records import BAD_STATUSES, GOOD_STATUSES
from harness.controller.script import script_environment
from harness.render.matrix import terminal_summary
from harness.render.reports import CellTexts, check_report_dir, write_reports
from harness.wording import cell_message, skip_reason
from harness.wrappers.prepare import cell_variants

# the plugin object `python -m harness launch` gives rank 0's pytest (harness/launch/main.py)
LAUNCH_PLUGIN = "harness-launch"
SETTINGS = pytest.StashKey[Settings]()
STATE = pytest.StashKey["HarnessState"]()
CELL_PROPERTY = "harness_cell"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "gradient-sync harness (cells of case x variant x world size)")
    group.addoption("--world-sizes", default="auto", metavar="LIST",
                    help="comma list of world sizes (1,2,4) or auto: 1,2,4 on CPU; powers of two up to "
                         "the GPU count with nccl. Default: auto.")
    group.addoption("--backend", default="auto", metavar="NAME",
                    help="auto, gloo or nccl. auto: nccl when every rank can have its own GPU, else gloo "
                         "on CPU. Default: auto.")
    group.addoption("--report-dir", default="reports", metavar="DIR",
                    help="where matrix.json, matrix.md and matrix.html go. Default: reports.")
    group.addoption("--case-timeout", default=str(DEFAULT_CASE_TIMEOUT_S), metavar="SECONDS",
                    help="seconds one cell may take before its ranks are declared hung and the cell "
                         f"is an error. Default: {DEFAULT_CASE_TIMEOUT_S:g}.")
    group.addoption("--seed", default=str(DEFAULT_SEED), metavar="N",
                    help=f"base seed for models and data; each rank derives its own. Default: {DEFAULT_SEED}.")
    group.addoption("--wrappers", default="auto", metavar="LIST",
                    help="the wrappers cells train under: a comma list of ddp, fsdp2, fsdp1, deepspeed-z1, "
                         "deepspeed-z2, deepspeed-z3 (each at every variant it applies to), or auto: ddp at "
                         "every variant and every other wrapper at each case's lead variants. Default: auto.")
    group.addoption("--meshes", default="auto", metavar="LIST",
                    help="the device meshes FSDP2 cells also run on, at world sizes of 4 and more: a comma "
                         "list of hsdp, tp, cp, or none, or auto: each case's own. Default: auto.")
    from harness.selfcheck.faults import FAULTS, PERTURBATION_FORMS  # no torch: the patches import it in the ranks

    group.addoption("--harness-fault", default=None, metavar="NAME",
                    help="inject a named sync fault into accelerate inside the ranks (used by "
                         "'python -m harness selfcheck'; never for a real run). NAME is one of "
                         f"{', '.join(sorted(FAULTS))}, or {PERTURBATION_FORMS}.")


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class HarnessState:
    """Per pytest process: its pools (workers and serial runs) and the cells it has seen."""

    def __init__(self, config: pytest.Config, settings: Settings, launch: Any = None) -> None:
        self.config = config
        self.settings = settings
        self.launch = launch  # under a launcher (harness/launch/main.py): its ranks stand in for local pools
        self.pools: Pools = launch.pools if launch is not None else PoolSet(backend=settings.backend)
        self.cells: list[Cell] = []
        self.expected_ids: set[str] = set()
        self.interrupted = False
        self.reports_written: list[str] = []
        self.matrix: Matrix | None = None
        self.created = ""
        self.write_error = ""
        self.signals_installed = False
        self.case_file_seen = False
        self.collector_paused = False
        self._environment: dict[str, Any] | None = None
        # a long cell's line: from a thread under xdist's controller (its workers run the cells); where
        # the cells run in this process, from the wait for their ranks, with pytest's capture lifted
        in_process = config.getoption("dist", "no") == "no"  # xdist registers its controller later
        self.progress = Progress(None if _is_worker(config) else terminal_writer(config),
                                 tick_s=None if in_process else TICK_S)
        capture = config.pluginmanager.getplugin("capturemanager")
        if in_process and capture is not None:
            self.progress.urgent_context = capture.global_and_fixture_disabled
        self.while_waiting = self.progress.tick if in_process else None
        self.cell_texts = CellTexts()  # each cell's JSON made once, though the reports are rewritten after every cell

    # registered as a plugin object, so that these are hooks of this process's state

    @pytest.hookimpl(trylast=True)  # after pytest's own letter or word for the report
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        lines = self.progress.write
        if lines is not None:
            lines.file = report.nodeid.split("::", 1)[0]
            self.progress.flush()  # a line that waited for pytest's line of dots to end, if it just did
        if report.when in ("call", "teardown"):  # (a worker that crashed reports its test as a call)
            self.progress.cell_ended(_cell_name(report.nodeid))
        if report.when != "call":
            return
        cells = [Cell.from_dict(value) for name, value in report.user_properties if name == CELL_PROPERTY]
        self.cells += cells
        if cells and not _is_worker(self.config):
            # every finished cell reaches the reports at once: a run killed outright keeps them
            try:
                self.write_reports(complete=False)
            except OSError as exc:
                self.write_error = f"{exc.filename or self.settings.report_dir}: {exc.strerror or exc}"
            for cell in cells:
                self.progress.cell_done(cell.status, f"{cell.case}[{cell.variant}-ws{cell.world_size}]",
                                        nodeid=report.nodeid, seconds=cell.duration_s, worker=_worker_of(report))

    @pytest.hookimpl(tryfirst=True)  # before pytest writes the header of a new file
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        lines = self.progress.write
        if lines is not None and not self.config.pluginmanager.hasplugin("dsession"):  # serial: xdist has no headers
            self.progress.flush(next_file=nodeid)
        if nodeid in self.expected_ids:  # under xdist too: the controller hears of each cell a worker starts
            self.progress.cell_started(_cell_name(nodeid))

    def write_reports(self, *, complete: bool) -> None:
        """(Re)write the three reports from the cells so far, each file replaced atomically."""
        if not self.created:
            self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        cells = merge_cells(self.cells)
        matrix = Matrix(environment=with_unavailable_checks(self.environment(), cells), cells=cells,
                        created=self.created, complete=complete)
        self.reports_written = [str(p) for p in write_reports(matrix, self.settings.report_dir, texts=self.cell_texts)]
        self.matrix = matrix

    def before_case_files(self, file_path: Path) -> None:
        """When the first test module that names the harness is about to be imported, pause the
        garbage collector until the collection ends (harness/heap.py), and start what the pools'
        ranks are forked from (harness/rank/process/preload.py): it imports torch on one core while this
        process imports the case files (and torch) on the other, a second or two of every run; not
        under a launcher (whose ranks are its own) or in a run that only collects. The plugin is
        loaded in every pytest run where the harness is installed: one with no such file is left as it is."""
        if self.case_file_seen or file_path.suffix != ".py" or "harness" not in _source(file_path):
            return
        self.case_file_seen = True
        self.collector_paused = heap.pause()
        if self.launch is None and not self.config.option.collectonly:
            self.pools.prepare()

    def pytest_keyboard_interrupt(self, excinfo: Any) -> None:
        self.interrupted = True

    def environment(self) -> dict[str, Any]:
        if self._environment is not None:
            return self._environment
        environment: dict[str, Any] = {
            "python": platform.python_version(),
            "torch": _installed_version("torch"),
            "accelerate": _installed_version("accelerate"),
            "backend": self.settings.backend, "device": self.settings.device,
            "world_sizes": list(self.settings.world_sizes),
            "wrappers": self.settings.wrappers if isinstance(self.settings.wrappers, str)
            else ",".join(self.settings.wrappers),
            "meshes": self.settings.meshes if isinstance(self.settings.meshes, str)
            else ",".join(self.settings.meshes) or "none",
            "seed": self.settings.seed,
        }
        if self.settings.fault is not None:  # a matrix made under an injected fault must say so
            environment["fault"] = self.settings.fault
        environment["selection"] = self.selection()
        script = watched()
        if script is not None:  # `python -m harness watch SCRIPT`: the script and what the command asked
            environment["script"] = script_environment(script)
        if self.launch is not None:  # the launcher, nodes, processes per node, hosts and devices
            environment.update(self.launch.environment())
        # the ranks drop these (harness/rank/process/environment.py): the matrix says that they were there
        ignored = self.launch.dropped if self.launch is not None else launcher_settings()
        if ignored and script is None:
            environment["ignored_launcher_settings"] = ignored
        self._environment = environment
        return environment

    def selection(self) -> dict[str, Any]:
        """What this run selected besides --world-sizes and --wrappers: its paths, -k and -m, and the
        cells that came of them with those two (``python -m harness diff`` tells a cell the
        candidate did not select from one it lost). Known once collection is done, before any cell."""
        option = self.config.option
        return {"args": [str(a) for a in self.config.args], "keyword": getattr(option, "keyword", "") or "",
                "markers": getattr(option, "markexpr", "") or "",
                "selected": sorted(selection_id(i) for i in self.expected_ids)}


def _source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _installed_version(distribution: str) -> str:
    # from the package metadata: the controller never needs to import torch or accelerate
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    launch = config.pluginmanager.get_plugin(LAUNCH_PLUGIN)
    try:
        settings = resolve(
            world_sizes=config.getoption("world_sizes"),
            backend=config.getoption("backend"),
            report_dir=config.getoption("report_dir"),
            case_timeout=config.getoption("case_timeout"),
            seed=config.getoption("seed"),
            fault=config.getoption("harness_fault"),
            wrappers=config.getoption("wrappers"),
            meshes=config.getoption("meshes"),
            gpu_count=0 if launch is not None else None,
        )
        if launch is not None:
            settings = launch.adapt(config, settings)
        fault = settings.fault
        if fault is not None:  # fault injection is imported only when one is asked for
            from harness.selfcheck.faults import resolve as resolve_fault

            try:
                resolve_fault(fault)
            except ValueError as exc:
                raise OptionError(f"--harness-fault: {exc}") from None
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not _is_worker(config):
        problem = check_report_dir(settings.report_dir)
        if problem is not None:
            raise pytest.UsageError(f"--report-dir: {problem}")
    config.stash[SETTINGS] = settings
    state = HarnessState(config, settings, launch)
    config.stash[STATE] = state
    config.pluginmanager.register(state, "harness-state")
    config.addinivalue_line("markers", "harness_case: a gradient-sync cell (added by the harness plugin)")


def _end_on_signals(state: HarnessState) -> None:
    """From the first cell on (and only in a run that has cells: the plugin is loaded in every pytest
    run where the harness is installed), SIGTERM and SIGHUP end the run as Ctrl-C does."""
    if state.signals_installed:
        return
    state.signals_installed = True

    def terminate(signum: int, frame: Any) -> None:
        # Ctrl-C, SIGTERM and SIGHUP (a closed terminal or SSH session) end the run the same way:
        # pytest's interrupt path, which still writes the reports of the finished cells and tears the
        # pools down. Under a launcher, a cell that is running first ends naming whoever failed (the
        # launcher stops a node's ranks when one of them dies), and no later cell runs.
        on_signal = getattr(state.pools, "on_signal", None)
        if on_signal is not None and on_signal(signum):
            return
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, terminate)
    if _is_worker(state.config) and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # xdist's controller ends a worker with SIGINT (execnet's shutdown sends it to the worker). A
        # worker of a script's background job (`pytest -n 4 ... &`, nohup) inherits Ctrl-C ignored,
        # and would be killed 15 s later without tearing its pools down
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    info = case_info(metafunc.function)
    if info is None:
        return
    settings = metafunc.config.stash[SETTINGS]
    variants = cell_variants(info.variants, info.wrappers, settings.wrappers,
                             info.meshes if settings.meshes == "auto" else [m for m in info.meshes if m in settings.meshes])
    params = [(info, variant, ws) for variant in variants for ws in settings.world_sizes]
    metafunc.parametrize(
        "harness_cell", params, ids=[cell_id(v.name, ws) for _, v, ws in params], indirect=True
    )


def pytest_collectstart(collector: pytest.Collector) -> None:
    # a test module about to be imported (not every file pytest passes on its way to the arguments)
    state = collector.config.stash.get(STATE, None)
    if state is not None and isinstance(collector, pytest.Module):
        state.before_case_files(collector.path)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # A case with no cell under this run's --wrappers (a DDP-only case under --wrappers fsdp2) is
    # not a test of this run: deselected, not reported as an empty parameter set.
    empty = [i for i in items if case_info(getattr(i, "function", None)) is not None and not _cell_world_size(i)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [i for i in items if i not in empty]
    # Largest world size first: under xdist it is the biggest group of cells, handed out first;
    # in a serial run it keeps each pool's cells together.
    harness_items = [i for i in items if _cell_world_size(i)]
    if not harness_items:
        return
    _stop_below_range(config)
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda i: (0 if _cell_world_size(i) else 1, -_cell_world_size(i), order[id(i)]))
    for item in harness_items:
        item.add_marker("harness_case")
    _end_on_signals(config.stash[STATE])


def pytest_collection_finish(session: pytest.Session) -> None:
    # After deselection (-k, -m): the cells this run is expected to finish.
    state = session.config.stash[STATE]
    heap.resume(state.collector_paused)  # the collection is over, or failed
    state.collector_paused = False
    state.expected_ids = {i.nodeid for i in session.items if _cell_world_size(i)}
    state.progress.expect(len(state.expected_ids), state.expected_ids)


def _cell_name(nodeid: str) -> str:
    """A cell as the progress line names it: its test's name and parameters (``test_case[fp32-ws2]``)."""
    return nodeid.split("::", 1)[-1]


def _worker_of(report: pytest.TestReport) -> str:
    """The xdist worker that ran the report's test (``gw0``; xdist sets ``report.node``), "" in a serial run."""
    return str(getattr(getattr(getattr(report, "node", None), "gateway", None), "id", ""))


def _cell_world_size(item: pytest.Item) -> int:
    """The world size of a harness cell; 0 for any other test (the plugin is loaded in every pytest
    run of an environment where it is installed: a user's own test whose id ends in ``-ws2]`` is
    not a cell)."""
    callspec = getattr(item, "callspec", None)
    cell = callspec.params.get("harness_cell") if callspec is not None else None  # (case, variant, world size)
    return cell[2] if isinstance(cell, tuple) else 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Send all cells of one world size to one worker (harness/controller/scheduling.py); the progress
    line's estimate reads what each worker has left from it."""
    if config.getoption("dist", "load") != "load":
        return None
    scheduler = world_size_scheduler(config, log, one_scope=config.stash[SETTINGS].backend == "nccl")
    state = config.stash.get(STATE, None)
    if state is not None:
        state.progress.queues = functools.partial(work_left, scheduler)
    return scheduler


def _stop_below_range(config: pytest.Config) -> None:
    """A run with cells on a torch or accelerate below the supported range stops here, with one line
    naming the range (harness/versions.py). A run without cells is left alone."""
    if _is_worker(config):
        return  # the controller says it, once, when the workers' collections come in
    from harness.versions import below_range

    problem = below_range()
    if problem is not None:
        raise pytest.UsageError(problem)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    if any(CELL_ID_END.search(i) for i in ids):
        _stop_below_range(node.config)
    state = node.config.stash.get(STATE, None)
    if state is not None and not state.expected_ids:
        state.expected_ids = {i for i in ids if CELL_ID_END.search(i)}
        state.progress.expect(len(state.expected_ids), state.expected_ids)
    if state is not None and state.expected_ids:
        _end_on_signals(state)


class CellRunner:
    """The ``harness_cell`` fixture: runs its cell on the pool of its world size (harness/controller/cells.py)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        info, self.variant, self.world_size = request.param
        self.item = request.node
        self.state: HarnessState = request.config.stash[STATE]
        self.case = CaseRef(info=info, path=Path(self.item.path).resolve(), attr=self.item.function.__name__)

    def run(self) -> None:
        cell = run_cell(self.state.pools, self.case, self.variant, self.world_size, self.state.settings,
                        node=self.item.nodeid, while_waiting=self.state.while_waiting)
        self.item.user_properties.append((CELL_PROPERTY, cell.to_dict()))
        if cell.status in GOOD_STATUSES:
            return
        if cell.status in BAD_STATUSES:
            pytest.fail(cell_message(cell), pytrace=False)
        pytest.skip(skip_reason(cell))


@pytest.fixture
def harness_cell(request: pytest.FixtureRequest) -> CellRunner:
    return CellRunner(request)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    state.interrupted = state.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED
    state.progress.finish()  # the closing progress line (controller or serial run), before the summary
    state.progress.flush(end=True)
    # after an interruption the ranks may be busy in a cell: do not wait for them
    state.pools.close(graceful=not state.interrupted)
    # With no finished cell (a usage error, an interruption before the first cell) there is nothing
    # to report, and a previous run's reports are left as they are.
    if _is_worker(session.config) or not state.cells:
        return
    finished = {c.nodeid for c in state.cells}
    state.write_reports(complete=not state.interrupted and state.expected_ids <= finished)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None:
        state.pools.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    matrix = state.matrix if state is not None else None
    if matrix is None:
        return
    title, lines = terminal_summary(matrix, [os.path.relpath(p) for p in state.reports_written], state.write_error,
                                    width=terminalreporter._tw.fullwidth)  # the terminal's columns (80 when not a terminal)
    terminalreporter.write_sep("=", title)
    for line in lines:
        terminalreporter.write_line(line)
