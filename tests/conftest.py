"""Helpers for the harness's own tests: run pytest sessions in subprocesses and count their processes."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANTED = "tests/planted/planted_cases.py"


@dataclass
class Session:
    returncode: int
    stdout: str
    stderr: str
    report_dir: Path
    token: str
    seconds: float

    @property
    def matrix(self) -> dict:
        return json.loads((self.report_dir / "matrix.json").read_text())

    def cells(self) -> dict[tuple[str, str, int], dict]:
        return {(c["case"], c["variant"], c["world_size"]): c for c in self.matrix["cells"]}


def processes_with(token: str) -> list[int]:
    """PIDs of live processes that a session started: those whose environment carries ``token``
    (the session and all it started), and the ranks forked from this process's shared fork server
    (their environment is the server's). This process runs one test at a time and its own pools'
    ranks come from another server, so a rank of the shared server still there after a test's
    sessions ended is one of theirs that outlived its session."""
    found = []
    server = SHARED_RANK_SERVER["pid"]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            if "\nState:\tZ" in status:
                continue
            if token.encode() in (entry / "environ").read_bytes() or f"\nPPid:\t{server}\n" in status:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for_no_processes(token: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(token)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def wait_until(condition, process: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    """Poll ``condition`` until it holds: the moment to act on is one the run signals (a file it
    writes, a report it updates), never one a sleep guesses. Fails if the run ends first or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}:\n{process.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def signal_another_thread(pid: int, signum: int) -> None:
    """Send ``signum`` to a thread of process ``pid`` other than its main one (``tgkill``): the kernel
    may deliver a signal sent to the whole process to any thread that does not block it."""
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, f"process {pid} has no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, others[0], signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {others[0]}, {signum})")


@contextlib.contextmanager
def killed_if_failing(process: subprocess.Popen):
    """If the block fails (a wait or ``communicate`` timing out), the session and every process in
    its group are killed: a failing test leaves no run behind."""
    try:
        yield
    except BaseException as exc:
        if process.poll() is None:
            why = _why_it_hangs(process)
            with contextlib.suppress(ProcessLookupError):  # the rest of its group
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise AssertionError(f"{exc}\n{why}") from exc
        raise


def _why_it_hangs(process: subprocess.Popen) -> str:
    """What a session that did not end was doing: the processes of its group, and the stacks of its
    threads (SIGABRT makes pytest's faulthandler write them to stderr before the process aborts)."""
    listing = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-g", str(process.pid)],
                             capture_output=True, text=True).stdout
    process.send_signal(signal.SIGABRT)
    try:
        stdout, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "(no stacks: the session did not abort within 30 s)"
    return (f"the session's processes:\n{listing}\nits stdout's end:\n{(stdout or '')[-3000:]}\n"
            f"its stderr's end (the stacks):\n{(stderr or '')[-6000:]}")


# The tests start hundreds of Python processes (sessions, xdist workers, ranks), each of which
# compiles the harness and the case files from source where bytecode is never written
# (PYTHONDONTWRITEBYTECODE, set on some machines, CI's among them). The processes the tests start
# write it, into the checkout's __pycache__ folders (which git ignores), and read it from then on.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# One fork server for the ranks of every pytest session this process starts (SHARED_SERVER_VARIABLE,
# harness/controller/rank_server.py): each session would otherwise import torch and accelerate into a
# server of its own, about 2.6 s of CPU, and the tests start about a hundred. Started once the tests
# to run are known, where one of them is a test of the suite that is not quick (a session under test
# loads this file too when it collects tests/planted/). A test of what a session's own server does
# (its start as the case files are collected; the end of the run's ranks when the run is
# interrupted) passes the variable empty: that session starts its own.
SHARED_RANK_SERVER: dict = {"server": None, "pid": None}


def _of_the_suite(item) -> bool:
    """A test of the harness's own suite that is not quick: not a cell of a session under test, which
    loads this file too when it collects a case file of tests/planted/."""
    return item.path.parent == TESTS_DIR and not is_quick(item)


def pytest_collection_finish(session):
    from harness.controller import rank_server

    if SHARED_RANK_SERVER["server"] is not None or not any(_of_the_suite(item) for item in session.items):
        return
    if rank_server.rank_context().get_start_method() != "forkserver":
        return
    try:
        server, value = rank_server.start_shared_server()
    except OSError:  # no fork server here (the sessions start their own, and fail as they would)
        return
    SHARED_RANK_SERVER.update(server=server, pid=json.loads(value)["pid"])
    os.environ[rank_server.SHARED_SERVER_VARIABLE] = value


def pytest_unconfigure(config):
    if SHARED_RANK_SERVER["server"] is not None:
        from harness.controller import rank_server

        rank_server.end_shared_server(SHARED_RANK_SERVER["server"])
        SHARED_RANK_SERVER.update(server=None, pid=None)
        os.environ.pop(rank_server.SHARED_SERVER_VARIABLE, None)


# pytest plugins of this suite's own environment (hypothesis, for its property tests; anyio, which
# huggingface_hub's HTTP client brings) that a session under test would load from their entry points
# and never use: about 0.13 s of CPU a session, on a hundred sessions a run
NOT_THE_SESSIONS_PLUGINS = "-p no:hypothesispytest -p no:anyio"


def plain_env() -> dict[str, str]:
    """This process's environment for a command under test: not an xdist worker's, and none of the
    run's own pytest options (only NOT_THE_SESSIONS_PLUGINS)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTEST_ADDOPTS"] = NOT_THE_SESSIONS_PLUGINS
    return env


def session_env(token: str, **extra: str) -> dict[str, str]:
    return {**plain_env(), "HARNESS_TEST_TOKEN": token, "PYTHONPATH": str(ROOT), **extra}


def start_pytest(args: list[str], report_dir: Path, *, ctrl_c: str = "handled",
                 **extra_env: str) -> tuple[subprocess.Popen, str]:
    """A pytest session in a process group of its own. ``ctrl_c``: ``"handled"``, as a terminal's
    foreground job starts, whatever this test run inherited (a script's background job, ``cmd &`` or
    ``nohup``, starts with SIGINT ignored, and so would every session started from it); ``"ignored"``:
    as such a background job starts."""
    token = f"harness-test-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    disposition = {"handled": signal.SIG_DFL, "ignored": signal.SIG_IGN}[ctrl_c]
    process = subprocess.Popen(command, cwd=ROOT, env=session_env(token, **extra_env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    return process, token


def _finished(args: list[str], report_dir: Path, timeout: float = 600, **extra_env: str) -> Session:
    started = time.monotonic()
    process, token = start_pytest(list(args), report_dir, **extra_env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        stdout, stderr = process.communicate()
        raise AssertionError(f"pytest {' '.join(args)} did not finish in {timeout} s:\n{stdout[-3000:]}")
    return Session(process.returncode, stdout, stderr, report_dir, token, time.monotonic() - started)


# One serial run of the planted "model left out of no_sync" case at world sizes 1 and 2 (a fail at 2,
# a pass at 1), shared by the tests that read it: its cells (tests/test_plugin.py), its terminal
# output (tests/test_progress.py) and its matrix as a diff's base (tests/test_diff.py). Each session
# costs seconds of rank start-up; what they assert does not depend on running it apart.
LEFT_OUT_RUN = [PLANTED, "-k", "left_out", "--world-sizes", "1,2"]


@pytest.fixture(scope="session")
def left_out_run(tmp_path_factory) -> Session:
    return _finished(LEFT_OUT_RUN, tmp_path_factory.mktemp("left-out-run") / "reports")


@pytest.fixture
def run_pytest(tmp_path):
    """Run ``python -m pytest ARGS`` from the checkout's root and return what came of it."""
    counter = iter(range(1000))

    def run(*args: str, timeout: float = 600, report_dir: Path | None = None, **extra_env: str) -> Session:
        return _finished(list(args), report_dir or tmp_path / f"reports-{next(counter)}", timeout, **extra_env)

    return run


BROWSER_MISSING = ("headless Chromium not found: install Debian's chromium package (apt-get install chromium) "
                   "or set HARNESS_CHROMIUM to a Chromium/Chrome binary")


TESTS_DIR = Path(__file__).resolve().parent
# `pytest tests/` runs its files on this many xdist workers, each file whole on one (its shared runs
# are module fixtures). Half the suite's time is one process waiting on another (a session starting,
# a rank importing torch, a launch waiting out a timeout), so two files at once use the second core:
# 6 min 53 s in one process, 4 min 48 s on two workers, on an idle 2-core machine.
SUITE_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest tests/` (the whole suite, or `-m quick` of it) runs on SUITE_WORKERS xdist workers,
    file by file, unless the command says otherwise (`-n 0` for one process, `-n 4`, `--dist`); on
    any number of workers a file stays whole on one unless `--dist` says otherwise (xdist's default,
    load, ran a file's module fixture once on each worker that took one of its tests: two sessions
    writing tests/test_report_pages.py's fixed report folder at once under `pytest -n auto tests/`).
    A run of some files or tests stays in one process, as does a worker itself."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.collectonly or config.option.usepdb:
        return
    if not any(Path(arg).resolve() == TESTS_DIR for arg in config.args):
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = SUITE_WORKERS
    if config.option.dist == "no":
        config.option.dist = "loadfile"
        # in the order of collection, LONGEST_FILES first (xdist's own order is by count of tests, most
        # first: the files of many quick tests, then the long ones, the longest last of all)
        config.option.loadscopereorder = False


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: needs headless Chromium (uses the `browser` fixture, tests/browser.py)")
    # `pytest tests/` (the README's command, which CI runs) ends with the 15 slowest tests, where the
    # suite's time goes; --durations given on the command line wins
    if config.option.durations is None:
        config.option.durations = 15
    # the suite's own pools (hundreds) fork from a server that has also imported what only some cells
    # use (harness/rank/process/preload_all.py), as the sessions' shared one has
    if _names_the_suite(config) and config.option.markexpr != "quick":
        from harness.controller import rank_server

        rank_server.preload_all()


def _names_the_suite(config) -> bool:
    """Whether the command names tests of the suite itself (tests/, or files in it), not only those of
    tests/planted/ that a session under test collects (it loads this file too)."""
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == TESTS_DIR or path.parent == TESTS_DIR:
            return True
    return False


# The quick subset, `pytest -m quick tests/` (under a minute; docs/contributing.md): the tests of the
# harness's logic (closeness, diagnosis, records, options, the matrix files, diff, compare, merge,
# render, progress, layout, launcher detection, the workflow scripts...), none of which starts a
# pool of ranks, a pytest session of cells or a browser. Every test of these modules is quick but
# those that use a fixture of SLOW_FIXTURES (a pytest session, a browser, a shared run of cells) and
# those named in NOT_QUICK (ranks or subprocess runs of their own, or a long property search).
QUICK_MODULES = {
    "test_checks", "test_closeness", "test_comparison", "test_decorator", "test_diagnosis", "test_diff", "test_docs",
    "test_faults", "test_fp16", "test_launch", "test_layout", "test_matrix_input", "test_matrix_page", "test_merge",
    "test_options", "test_oracle", "test_progress", "test_report", "test_schedule", "test_selfcheck", "test_sweep",
    "test_timeline", "test_tokens", "test_unchecked", "test_verdict", "test_versions", "test_workflow",
    "test_wrappers", "test_mesh", "test_suite",
}
SLOW_FIXTURES = {"run_pytest", "left_out_run", "perturbed_run", "browser", "planted", "fault_cells", "token_cells", "agents_run", "pool_run",
                 "faults_run", "faults_session", "two_ranks", "runner", "installed", "mesh_cells", "terminal_layouts"}
NOT_QUICK = {
    "test_a_raise_is_an_error_naming_rank_and_host_and_the_launch_goes_on",
    "test_a_rank_that_dies_is_an_error_and_every_later_cell_is_not_run",
    "test_a_world_size_other_than_the_launchers_stops_every_rank_with_one_line",
    "test_accelerate_launch_is_a_launch_whose_settings_do_not_change_the_cells",
    "test_srun_variables_are_a_launch",
    "test_when_the_launcher_stops_a_nodes_ranks_the_running_cell_still_names_who_died",
    "test_fault_injection_is_imported_only_for_a_cell_with_a_fault",
    "test_near_valid_matrices_are_exit_0_1_or_2",
    "test_two_ranks_a_hand_averaged_loop_matches_the_oracles_all_reduce_and_is_not_vacuous",
    "test_no_false_alarm_over_seeds",
    "test_selfcheck_command_exits_1_on_an_uncaught_fault_and_writes_its_table_and_json",
    "test_selfcheck_command_rejects_bad_arguments_in_one_line",
    "test_a_sweep_with_this_interpreter_writes_the_table_and_the_comparison",
    "test_a_real_cell_with_one_bad_rank_draws_that_rank_failing_at_every_step_and_the_other_agreeing",
    "test_the_oracle_at_a_sync_holds_the_gradient_of_the_token_mean_over_every_rank_and_micro_batch",
    "test_with_the_flight_recorder_the_same_cells_check_collectives_and_say_nothing_of_it",
    "test_without_the_flight_recorder_each_cell_says_what_it_did_not_check_and_the_canary_is_skip",
    "test_a_run_with_cells_below_the_range_stops_at_start_with_one_line",
    "test_a_run_without_cells_is_left_alone",
    "test_a_file_that_imports_the_harness_has_the_fork_server_started_as_it_is_collected",
    "test_a_rank_is_compared_with_its_own_shard_of_the_full_tensor_even_when_the_split_is_uneven",
    "test_the_flight_recorder_sees_ddp_reduce_in_a_synced_backward_only",
    "test_an_hsdp_replicate_reduction_that_misses_micro_batches_or_never_runs_fails",
    "test_two_agents_of_two_processes_make_a_two_by_two_mesh",
    "test_a_serial_run_names_a_long_cell_while_it_runs_and_its_letter_lands_on_a_line_that_names_its_file",
    "test_under_xdist_the_controller_names_a_long_cell_while_it_runs",
}


def is_quick(item) -> bool:
    module = getattr(item, "module", None)
    name = getattr(item, "originalname", None) or item.name.partition("[")[0]
    return (module is not None and module.__name__ in QUICK_MODULES and name not in NOT_QUICK
            and not SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))


# The files that take longest (from 20 s to a minute and a quarter each, in a serial run), longest
# first: the xdist workers take files in collection order (``loadscopereorder`` off), and a long file
# taken last would leave the other worker idle at the end.
LONGEST_FILES = ("test_selfcheck.py", "test_launch.py", "test_plugin.py", "test_script.py", "test_fused_check.py",
                 "test_script_wrappers.py", "test_progress.py", "test_wrappers.py", "test_watch.py", "test_trainer.py",
                 "test_mesh.py", "test_example.py", "test_deepspeed.py", "test_sensitivity.py", "test_rank_faults.py",
                 "test_matrix_input.py", "test_parallel.py")


def pytest_collection_modifyitems(items):
    first = {name: n for n, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: within a file, as written
    # Every test that uses the browser fixture carries the marker, so `-m "not browser"` leaves them out.
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
        if is_quick(item):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the whole session (tests/browser.py), killed at its end. Skips with
    the reason when there is none or it cannot start, unless HARNESS_REQUIRE_BROWSER=1 (CI), where
    that fails instead."""
    from browser import Browser, BrowserError, find_chromium

    def unavailable(reason: str):
        if os.environ.get("HARNESS_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason} (HARNESS_REQUIRE_BROWSER=1)", pytrace=False)
        pytest.skip(reason)

    path = find_chromium()
    if path is None:
        unavailable(BROWSER_MISSING)
    try:
        started = Browser.start(path)
    except (BrowserError, OSError) as error:
        unavailable(f"headless Chromium ({path}) could not start: {error}")
    with started:
        yield started
