"""The live progress line: what it says, when it is written (a fake clock), and that a real run
writes it on lines of its own, serial and under xdist, and writes none under -q."""

import os
import re
import select
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import PLANTED, ROOT, killed_if_failing, start_pytest, wait_for_no_processes

from harness.controller.progress import Progress, duration, terminal_writer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(total=10, interval_s=10.0):
    clock, lines = Clock(), []
    p = Progress(lines.append, clock=clock, interval_s=interval_s)
    p.expect(total)
    return p, clock, lines


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (59.4, "59s"), (60, "1m00s"), (112, "1m52s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (7500, "2h05m"), (-3, "0s")])
def test_durations_read_as_seconds_minutes_or_hours(seconds, text):
    assert duration(seconds) == text


def test_the_line_counts_cells_names_only_the_bad_statuses_there_are_and_estimates_the_time_left():
    p, clock, _ = progress(total=522)
    assert p.line(clock.now) == "gradient-sync: 0/522 cells"  # no time before a cell is done
    clock.now += 8  # the pools start: the first cell ends late
    p.cell_done("pass", "c[fp32-ws1]")
    assert p.line(clock.now) == "gradient-sync: 1/522 cells"  # no pace from one cell
    for status in ["pass"] * 110 + ["skip", "unsupported", "detected"] * 2 + ["fail", "error", "fail"]:
        p.cell_done(status, "c[fp32-ws1]")
    clock.now += 119 * 56 / 402  # 119 cells in 16.6 s after the first: 402 more take 56 s
    assert p.line(clock.now) == "gradient-sync: 120/522 cells · 2 fail · 1 error · 56s left"
    p.cell_done("missed", "canary[fp32-ws2]")
    assert p.line(clock.now) == "gradient-sync: 121/522 cells · 2 fail · 1 error · 1 missed · 55s left"


def test_an_unknown_total_shows_the_cells_done_and_no_time():
    lines = []
    p = Progress(lines.append, clock=Clock())
    p.cell_done("pass")
    p.cell_done("fail", "case[fp32-ws2]")
    assert lines == ["gradient-sync: 2 cells · 1 fail · fail: case[fp32-ws2]"]
    p.finish()
    assert lines[-1] == "gradient-sync: 2 cells · 1 fail · done in 0s"


def test_passing_cells_write_a_line_at_most_every_interval_and_the_last_cell_leaves_it_to_finish():
    p, clock, lines = progress(total=6)
    clock.now += 4
    p.cell_done("pass")
    assert lines == []  # 4 s in: not yet
    clock.now += 6
    p.cell_done("pass")
    assert lines == ["gradient-sync: 2/6 cells · 24s left"]  # 10 s since the start; 6 s a cell after the first
    clock.now += 9
    p.cell_done("skip")
    assert len(lines) == 1
    clock.now += 1
    p.cell_done("pass")
    assert lines[-1] == "gradient-sync: 4/6 cells · 11s left"
    clock.now += 5
    p.cell_done("pass")
    clock.now += 20
    p.cell_done("pass")  # the last one: no "0s left"
    assert len(lines) == 2
    p.finish()
    p.finish()
    assert lines[2:] == ["gradient-sync: 6/6 cells · done in 45s"]


def test_a_bad_cell_is_written_at_once_naming_it_and_restarts_the_interval():
    p, clock, lines = progress(total=4)
    clock.now += 1
    p.cell_done("error", "fused_loss[fp32-ws2]")
    assert lines == ["gradient-sync: 1/4 cells · 1 error · error: fused_loss[fp32-ws2]"]
    clock.now += 9.5
    p.cell_done("pass")  # 10.5 s from the start, 9.5 from the last line
    assert len(lines) == 1
    p.cell_done("pass")
    clock.now += 1.5
    p.cell_done("fail", "the_last[bf16-ws1]")  # the last cell: finish says it
    assert len(lines) == 1
    p.finish()
    assert lines[-1] == "gradient-sync: 4/4 cells · 1 fail · 1 error · done in 12s"


def test_the_clock_starts_when_the_cells_are_known_and_a_run_that_stops_short_says_so():
    clock, lines = Clock(), []
    p = Progress(lines.append, clock=clock)
    clock.now += 30  # collection
    p.expect(8)
    clock.now += 5
    p.expect(8)  # xdist: each worker's collection: the clock started at the first
    p.cell_done("pass")
    clock.now += 5
    p.cell_done("pass")  # 10 s from the first expect, not 15 or 40
    assert lines == ["gradient-sync: 2/8 cells · 30s left"]  # 5 s a cell since the first
    p.finish()
    assert lines[1:] == ["gradient-sync: 2/8 cells · stopped after 10s"]


def test_nothing_is_written_with_no_writer_or_before_any_cell():
    p, _, lines = progress()
    p.finish()
    assert lines == []
    silent = Progress(None, clock=Clock(), interval_s=0)
    silent.expect(3)
    silent.cell_done("fail", "c[fp32-ws1]")
    silent.finish()
    assert silent.done == 1 and silent.bad == {"fail": 1}


class Reporter:
    """What terminal_writer uses of pytest's terminal reporter: a line of ``width`` characters is open."""

    def __init__(self, width: int) -> None:
        self._tw = SimpleNamespace(width_of_current_line=width)
        self._show_progress_info = "progress"
        self.calls = []

    def ensure_newline(self):
        self.calls.append("ensure_newline")
        # pytest's ends the line only where it wrote a file name first (not under xdist)
        if self.calls[:1] != ["xdist"]:
            self._tw.width_of_current_line = 0

    def write(self, text):
        self.calls.append(text)
        self._tw.width_of_current_line = 0 if text.endswith("\n") else self._tw.width_of_current_line + len(text)

    def write_line(self, line):
        self.calls.append(line)
        self._tw.width_of_current_line = 0

    def _write_progress_information_filling_space(self):
        self.calls.append("[ 40%]")


def config(verbose, reporter):
    return SimpleNamespace(getoption=lambda name, default=None: verbose,
                           pluginmanager=SimpleNamespace(get_plugin=lambda name: reporter))


def test_quiet_runs_have_no_terminal_line():
    assert terminal_writer(config(-1, Reporter(0))) is None
    assert terminal_writer(config(-2, Reporter(0))) is None
    terminal_writer(config(0, None))("-p no:terminal: nowhere to write, no error")


def test_a_line_that_comes_while_pytest_writes_its_dots_waits_for_the_end_of_their_line():
    dots = Reporter(12)  # pytest is in the middle of a line of dots
    lines = terminal_writer(config(0, dots))
    lines("gradient-sync: 1/9 cells · 1 fail · fail: c[fp32-ws2]")
    assert dots.calls == []  # never splits the dots' line (the file's header would be written again)
    lines.flush()
    assert dots.calls == []
    dots.write(".F. [ 13%]\n")  # pytest ends the line at the edge
    lines.flush()
    assert dots.calls[1:] == ["ensure_newline", "gradient-sync: 1/9 cells · 1 fail · fail: c[fp32-ws2]"]
    lines("gradient-sync: 2/9 cells")  # on an empty line: at once
    assert dots.calls[-1] == "gradient-sync: 2/9 cells"


def test_a_serial_run_writes_the_waiting_lines_when_it_moves_to_another_file_and_at_the_end():
    dots = Reporter(0)
    lines = terminal_writer(config(0, dots))
    lines.next_file("cases/test_a.py::test_x[ws2]")
    dots.write("cases/test_a.py F")
    lines("gradient-sync: 1/3 cells · 1 fail · fail: x[ws2]")
    lines.next_file("cases/test_a.py::test_x[ws1]")  # the same file: its dots go on
    assert dots.calls == ["cases/test_a.py F"]
    dots.write(".")
    lines.next_file("cases/test_b.py::test_y[ws1]")  # pytest is about to start test_b's line
    assert dots.calls[2:] == ["[ 40%]", "ensure_newline", "gradient-sync: 1/3 cells · 1 fail · fail: x[ws2]"]
    dots.write("cases/test_b.py .")
    lines("gradient-sync: 3/3 cells · 1 fail · done in 5s")
    lines.flush(force=True)  # the end of the run
    assert dots.calls[-2:] == ["ensure_newline", "gradient-sync: 3/3 cells · 1 fail · done in 5s"]


def test_under_xdist_the_line_starts_a_line_of_its_own():
    dots = Reporter(12)
    dots.calls.append("xdist")  # no file name first: ensure_newline leaves the line open
    lines = terminal_writer(config(0, dots))
    lines("gradient-sync: 1/9 cells")
    lines.flush(force=True)
    assert dots.calls[1:] == ["ensure_newline", "\n", "gradient-sync: 1/9 cells"]


def test_verbose_runs_write_the_line_at_once():
    fresh = Reporter(30)  # under -v a test's line: the next one starts a line anyway
    terminal_writer(config(1, fresh))("gradient-sync: 1/2 cells")
    assert fresh.calls == ["ensure_newline", "gradient-sync: 1/2 cells"]


# end to end: small runs (world sizes 1-2, one case or two)
FUSED = ["cases/test_fused_loss.py", "-k", "fp32-ws"]
LINE = re.compile(r"^gradient-sync: .*$", re.MULTILINE)


def test_a_serial_run_writes_a_failing_cell_and_a_closing_line_without_splitting_the_dots(left_out_run):
    # largest world size first: the failing ws2 cell, then the passing ws1 one
    session = left_out_run
    assert session.returncode == 1
    # (a line for a long cell, where the machine is slow enough to make one, is not what this counts)
    lines = [line for line in LINE.findall(session.stdout) if " · running " not in line]
    assert len(lines) == 2, session.stdout[-3000:]
    # pytest's line of letters for the file is whole: its name once, both letters on it
    headers = [line for line in session.stdout.splitlines() if line.startswith(os.path.relpath(PLANTED, ROOT))]
    assert len(headers) == 1 and headers[0].split()[1] == "F.", session.stdout[-3000:]
    assert re.fullmatch(r"gradient-sync: 1/2 cells · 1 fail · fail: planted_left_out_of_no_sync\[fp32-ws2\]",
                        lines[0])
    assert re.fullmatch(r"gradient-sync: 2/2 cells · 1 fail · done in \d+s", lines[1])
    # the closing line comes before the summary
    assert session.stdout.index(lines[1]) < session.stdout.index("gradient-sync matrix")
    assert wait_for_no_processes(session.token) == []


def test_under_xdist_the_controller_writes_the_line(run_pytest):
    session = run_pytest("-n", "2", *FUSED, "--world-sizes", "1,2")
    assert session.returncode == 0, session.stdout[-3000:]
    assert re.search(r"^gradient-sync: 2/2 cells · done in \d+s$", session.stdout, re.MULTILINE), session.stdout
    assert wait_for_no_processes(session.token) == []


def test_a_quiet_run_writes_no_progress_line(run_pytest):
    session = run_pytest("-q", *FUSED, "--world-sizes", "1")
    assert session.returncode == 0, session.stdout[-3000:]
    assert session.matrix["cells"][0]["status"] == "pass"
    assert LINE.findall(session.stdout) == []


def long_cells(interval_s=10.0, long_s=10.0):
    clock, lines = Clock(), []
    p = Progress(lambda line, urgent=False: lines.append((line, urgent)), clock=clock, interval_s=interval_s,
                 long_s=long_s, tick_s=None)
    p.expect(4)
    return p, clock, lines


def test_a_cell_that_runs_long_is_named_with_how_long_every_interval_until_it_ends():
    p, clock, lines = long_cells()
    p.cell_started("test_model_size[params=100000000-ws2]")
    clock.now += 9
    p.tick()
    assert lines == []  # not long yet
    clock.now += 2
    p.tick()
    assert lines == [("gradient-sync: 0/4 cells · running test_model_size[params=100000000-ws2] for 11s", True)]
    clock.now += 5
    p.tick()
    assert len(lines) == 1  # once an interval
    clock.now += 6
    p.tick()
    assert lines[-1][0].endswith("running test_model_size[params=100000000-ws2] for 22s")
    p.cell_ended("test_model_size[params=100000000-ws2]")
    p.cell_done("pass", "model_size[params=100000000-ws2]")
    clock.now += 30
    p.tick()
    assert len(lines) == 2  # nothing runs: no line


def test_of_several_long_cells_the_one_running_longest_is_named_and_the_others_counted():
    p, clock, lines = long_cells()
    p.cell_started("a[fp32-ws4]")
    clock.now += 3
    p.cell_started("b[fp32-ws2]")
    clock.now += 12
    p.tick()
    assert lines == [("gradient-sync: 0/4 cells · running a[fp32-ws4] for 15s (and 1 more)", True)]


def test_the_long_cells_line_comes_at_once_even_inside_pytests_line_of_dots():
    dots = Reporter(12)
    lines = terminal_writer(config(0, dots))
    lines("gradient-sync: 1/4 cells")
    assert dots.calls == []  # an ordinary line waits for the dots' line to end
    lines("gradient-sync: 1/4 cells · running a[fp32-ws2] for 12s", urgent=True)
    assert dots.calls == ["ensure_newline", "gradient-sync: 1/4 cells",
                          "gradient-sync: 1/4 cells · running a[fp32-ws2] for 12s"]


def test_a_controller_thread_ticks_once_a_cell_started_and_stops_at_the_end():
    written = threading.Event()
    clock = Clock()
    p = Progress(lambda line, urgent=False: written.set(), clock=clock, long_s=0.0, interval_s=0.0, tick_s=0.001)
    p.expect(2)
    p.cell_started("a[fp32-ws2]")
    assert written.wait(30)  # the thread found the cell running and wrote
    p.cell_done("pass", "a")
    p.finish()
    p._ticker.join(30)
    assert not p._ticker.is_alive()


@pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["serial", "xdist"])
def test_a_run_names_its_long_cell_while_it_runs(tmp_path, xdist):
    """A cell that runs on (it blocks until the run is ended) is named, with how long it has run,
    while it runs: in a serial run, from the wait for its ranks (out of pytest's capture of the test);
    under xdist, by the controller, which hears of the cell from the worker that runs it."""
    process, token = start_pytest([*xdist, PLANTED, "-k", "planted_blocks_half_way and not finishes",
                                   "--world-sizes", "1", "--case-timeout", "3600"], tmp_path / "r", PYTHONUNBUFFERED="1")
    seen = []
    with killed_if_failing(process):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = process.stdout.readline() if ready else ""
            if not line:
                break
            seen.append(line.rstrip("\n"))
            if " · running " in line:
                break
        assert any(re.fullmatch(r"gradient-sync: 0/1 cells · running test_planted_blocks_half_way\[blocks-ws1\] "
                                r"for 1\ds", s) for s in seen), seen
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
    assert wait_for_no_processes(token) == []
