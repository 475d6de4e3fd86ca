"""Helpers for the harness's own tests: run pytest sessions in subprocesses and count their processes."""

from __future__ import annotations

import contextlib
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
    """PIDs of live processes whose environment carries ``token`` (a session and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:
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


@contextlib.contextmanager
def killed_if_failing(process: subprocess.Popen):
    """If the block fails (a wait or ``communicate`` timing out), the session and every process in
    its group are killed: a failing test leaves no run behind."""
    try:
        yield
    except BaseException:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        raise


def session_env(token: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HARNESS_TEST_TOKEN"] = token
    env["PYTHONPATH"] = str(ROOT)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra)
    return env


def start_pytest(args: list[str], report_dir: Path, **extra_env: str) -> tuple[subprocess.Popen, str]:
    token = f"harness-test-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    process = subprocess.Popen(command, cwd=ROOT, env=session_env(token, **extra_env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    return process, token


@pytest.fixture
def run_pytest(tmp_path):
    """Run ``python -m pytest ARGS`` from the checkout's root and return what came of it."""
    counter = iter(range(1000))

    def run(*args: str, timeout: float = 600, report_dir: Path | None = None) -> Session:
        directory = report_dir or tmp_path / f"reports-{next(counter)}"
        started = time.monotonic()
        process, token = start_pytest(list(args), directory)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            stdout, stderr = process.communicate()
            raise AssertionError(f"pytest {' '.join(args)} did not finish in {timeout} s:\n{stdout[-3000:]}")
        return Session(process.returncode, stdout, stderr, directory, token, time.monotonic() - started)

    return run


BROWSER_MISSING = ("headless Chromium not found: install Debian's chromium package (apt-get install chromium) "
                   "or set HARNESS_CHROMIUM to a Chromium/Chrome binary")


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: needs headless Chromium (uses the `browser` fixture, tests/browser.py)")


def pytest_collection_modifyitems(items):
    # Every test that uses the browser fixture carries the marker, so `-m "not browser"` leaves them out.
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


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
