"""The live progress line: what it says, when it is written (a fake clock), and that a real run
writes it on lines of its own, serial and under xdist, and writes none under -q."""

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import LEFT_OUT_RUN, PLANTED, ROOT, killed_if_failing, start_pytest, wait_for_no_processes

from harness.controller.cell_costs import CASE_PRIOR, PRIOR_CELLS, PRIOR_COST, cell_kind, prior_cost
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


def test_the_time_left_weighs_each_cell_by_what_its_kind_has_cost_and_a_kind_not_yet_run_by_its_prior(monkeypatch):
    monkeypatch.setattr("harness.controller.progress.PRIOR_CELLS", 0.0)  # a kind measured: its cells alone
    fsdp2, compiled = PRIOR_COST[("fsdp2", 2)], PRIOR_COST[("compiled", 2)]
    ids = ([f"cases/test_a.py::test_a[steps={i}-fp32-ws2]" for i in range(10)]
           + [f"cases/test_a.py::test_a[steps={i}-fp32-wrapper=fsdp2-ws2]" for i in range(10)]
           + [f"cases/test_c.py::test_c[steps={i}-fp32-compile=eager-ws2]" for i in range(4)])
    clock, lines = Clock(), []
    p = Progress(lines.append, clock=clock)
    p.expect(len(ids), ids)
    assert [cell_kind(i) for i in ids[::10]] == [("ddp", 2), ("fsdp2", 2), ("compiled", 2)]
    assert cell_kind("t.py::test_trainer_causal_lm[steps=2-fp32-wrapper=deepspeed-z1-ws4]") == ("trainer", 4)
    assert cell_kind("t.py::test_a[steps=2-fp32-wrapper=fsdp2-mesh=hsdp-ws4]") == ("fsdp2 mesh", 4)
    # a kind that skips (FSDP on one rank) costs nothing; at a world size not measured, its cost at two
    # times a DDP cell's growth
    assert prior_cost(("fsdp2", 1)) == 0.0 and prior_cost(("fsdp2", 3)) == pytest.approx(fsdp2 * 1.45)
    clock.now += 8
    p.cell_done("pass", "a", nodeid=ids[0], seconds=0.5)  # the first: its time is the pools' start-up
    for i in ids[1:10]:  # the DDP cells, 0.5 s each on one worker: 4.5 s
        clock.now += 0.5
        p.cell_done("pass", "a", nodeid=i, seconds=0.5)
    # 10 fsdp2 cells never measured, at the prior's cost of a DDP cell (0.5 s) each, and 4 compiled at
    # theirs, at the pace of 4.5 s of cells in 4.5 s (the cases, not in the catalogue, of average cost)
    assert p.left(clock.now) == pytest.approx(10 * fsdp2 * 0.5 + 4 * compiled * 0.5)
    for i in ids[10:20]:  # fsdp2 measured at 2 s a cell: its own cost replaces the prior's
        clock.now += 2
        p.cell_done("pass", "a", nodeid=i, seconds=2.0)
    # the compiled prior scaled to what was measured: (4.5 + 0.5 + 20) s of cells over 10 + 18 of prior
    scale = 25.0 / (10 * 1.0 + 10 * fsdp2)
    assert p.left(clock.now) == pytest.approx(4 * compiled * scale)
    assert p.line(clock.now).endswith(f"{duration(4 * compiled * scale)} left")
    # without the ids (or the cells' times) every cell costs the same, as before
    plain, plain_clock, _ = progress(total=24)
    plain.cell_done("pass", "a", nodeid=ids[0], seconds=1.0)
    plain_clock.now += 1
    plain.cell_done("pass", "a", nodeid=ids[10], seconds=5.0)
    assert plain.left(plain_clock.now) == 22


def test_a_case_that_cost_more_than_its_kind_at_one_world_size_is_expected_to_at_the_next(monkeypatch):
    monkeypatch.setattr("harness.controller.progress.PRIOR_CELLS", 0.0)
    def ids(case, world_size):
        return [f"cases/test_{case}.py::test_{case}[steps={i}-fp32-ws{world_size}]" for i in range(4)]

    clock = Clock()
    p = Progress([].append, clock=clock)
    p.expect(16, ids("a", 2) + ids("b", 2) + ids("a", 4) + ids("b", 4))
    clock.now += 8
    for test, seconds in [(t, 1.0) for t in ids("a", 2)] + [(t, 3.0) for t in ids("b", 2)] + [(t, 2.0) for t in ids("a", 4)]:
        p.cell_done("pass", "c", nodeid=test, seconds=seconds)
        clock.now += seconds
    clock.now -= 1.0  # the first cell's end starts the clock: the pace is one cell-second a second
    # at two ranks b cost three times a: a DDP cell at two ranks costs 2 s for a case of average cost,
    # a 0.5 of it and b 1.5; a's four-rank cells (2 s) make a four-rank cell of average cost 4 s, so
    # b's four left cost 6 s each, not the 2 s of the four-rank cells run so far
    assert p.left(clock.now) == pytest.approx(4 * 6.0, rel=1e-3)  # (the fit settles within its rounds)


def test_a_case_not_yet_run_costs_its_prior_factor_and_a_kinds_first_cells_are_weighed_with_its_prior():
    """The catalogue's costly cases come late (a Trainer's, the transformers token loss): one not yet run
    costs its measured factor over the catalogue (CASE_PRIOR), not an average case's; and a kind's cost
    is its cells' with its prior counted as PRIOR_CELLS more, so that a pool's first cells of a kind
    (which pay what the pool had not warmed) do not stand for all of them."""
    dear = max(CASE_PRIOR, key=CASE_PRIOR.__getitem__)
    cheap = min(CASE_PRIOR, key=CASE_PRIOR.__getitem__)
    cheap_ids = [f"cases/x.py::{cheap}[steps={i}-fp32-ws2]" for i in range(10)]
    dear_ids = [f"cases/x.py::{dear}[steps={i}-fp32-ws2]" for i in range(5)]
    clock = Clock()
    p = Progress([].append, clock=clock)
    p.expect(15, cheap_ids + dear_ids)
    clock.now += 8
    p.cell_done("pass", "a", nodeid=cheap_ids[0], seconds=1.0)
    for test in cheap_ids[1:]:
        clock.now += 1.0
        p.cell_done("pass", "a", nodeid=test, seconds=1.0)
    # the cheap case's cells cost 1 s at its factor: a DDP cell of a catalogue-average case costs
    # 1 / factor, blended with its prior scaled to the same cells (the same here: the scale is fitted
    # to them), and the dear case's cells that times theirs
    average = 1.0 / CASE_PRIOR[cheap]
    assert p.left(clock.now) == pytest.approx(5 * average * CASE_PRIOR[dear])
    assert CASE_PRIOR[dear] > 2 * CASE_PRIOR[cheap]  # (what the old estimate, at a factor of 1, missed)
    # a new kind's first cell took four times its prior: with the prior as PRIOR_CELLS cells beside it,
    # the kind's cells left cost (4 + PRIOR_CELLS) / (1 + PRIOR_CELLS) times the prior (scaled), not 4
    # (a case of the user's own: of average cost)
    plain = [f"cases/x.py::test_mine[steps={i}-fp32-ws2]" for i in range(10)]
    ids = [f"cases/x.py::test_mine[steps={i}-fp32-wrapper=fsdp1-ws2]" for i in range(6)]
    prior = PRIOR_COST[("fsdp1", 2)]  # an fsdp1 cell, where a DDP cell costs 1 s
    q = Progress([].append, clock=clock)
    q.expect(16, plain + ids)
    q.cell_done("pass", "a", nodeid=plain[0], seconds=1.0)
    for test, seconds in [(t, 1.0) for t in plain[1:]] + [(ids[0], 4 * prior)]:
        clock.now += seconds
        q.cell_done("pass", "a", nodeid=test, seconds=seconds)
    scale = (10 * 1.0 + 4 * prior) / (10 * 1.0 + prior)  # every cell measured over every prior
    expected = (4 * prior + PRIOR_CELLS * prior * scale) / (1 + PRIOR_CELLS)
    assert q.left(clock.now) == pytest.approx(5 * expected, rel=1e-6)


def test_under_xdist_the_time_left_is_the_last_workers_from_what_each_was_given_and_what_is_not_given_yet(monkeypatch):
    monkeypatch.setattr("harness.controller.progress.PRIOR_CELLS", 0.0)
    ws2 = [f"cases/test_a.py::test_a[steps={i}-fp32-ws2]" for i in range(12)]
    ws4 = [f"cases/test_a.py::test_a[steps={i}-fp32-ws4]" for i in range(6)]
    ws1 = [f"cases/test_a.py::test_a[steps={i}-fp32-ws1]" for i in range(4)]
    clock, queues = Clock(), {"given": {}, "queued": []}
    p = Progress([].append, clock=clock)
    p.expect(len(ws2 + ws4 + ws1), ws2 + ws4 + ws1)
    p.queues = lambda: (queues["given"], queues["queued"])
    clock.now += 8
    p.cell_done("pass", "a", nodeid=ws2[0], seconds=1.0, worker="gw0")
    p.cell_done("pass", "a", nodeid=ws4[0], seconds=3.0, worker="gw1")
    for n in range(1, 3):  # gw0: a 1 s cell every 1.25 s; gw1: a 3 s cell every 3.25 s (0.25 s between cells)
        clock.now += 3.75
        for i in range(3 * n - 2, 3 * n + 1):
            p.cell_done("pass", "a", nodeid=ws2[i], seconds=1.0, worker="gw0")
        p.cell_done("pass", "a", nodeid=ws4[n], seconds=3.0, worker="gw1")
    # what passes between cells: the workers' wall time (7.5 s each) less their cells' (6 s each), a cell
    between = (1.5 + 1.5) / (6 + 2)
    # the ws1 cells, none measured: their prior (0.6 of a ws2 cell's) scaled to the cells measured
    ws1_cell = 0.6 * (7 * 1.0 + 3 * 3.0) / (7 * 1.0 + 3 * 1.9)
    # gw0 has 5 ws2 cells left, gw1 3 ws4 cells, the longer; the ws1 unit goes to gw0, which has the
    # least left, and makes it the last to end
    queues["given"] = {"gw0": ws2[7:], "gw1": ws4[3:]}
    queues["queued"] = [ws1]
    assert 5 * (1.0 + between) < 3 * (3.0 + between) < 5 * (1.0 + between) + 4 * (ws1_cell + between)
    assert p.left(clock.now) == pytest.approx(5 * (1.0 + between) + 4 * (ws1_cell + between))
    # with gw1 at its last cell, the ws1 unit goes to gw1, which then ends last
    queues["given"] = {"gw0": ws2[7:], "gw1": ws4[5:]}
    assert p.left(clock.now) == pytest.approx(3.0 + between + 4 * (ws1_cell + between))
    queues["queued"] = []  # and with nothing left to give, the worker with the most
    assert p.left(clock.now) == pytest.approx(5 * (1.0 + between))
    # where the scheduler cannot be read (xdist changing it under the reading thread), the estimate by
    # the cells left shared evenly among the workers, as without xdist's scheduler
    def changing():
        raise RuntimeError("dictionary changed size during iteration")

    p.queues = changing
    cell = {2: 1.0, 4: 3.0, 1: ws1_cell}  # by world size
    left = sum(cell[world_size] for _, world_size in p.left_by_id.values())
    assert p.left(clock.now) == pytest.approx((clock.now - 1008) * left / (6 * 1.0 + 3 * 3.0))  # the cells after the first


def test_what_xdists_scheduler_has_left_is_read_by_worker_and_by_world_size_not_yet_given():
    """harness/controller/scheduling.py's reading of xdist's own LoadScopeScheduling (the plugin's scheduler,
    the real class), driven as xdist's controller drives it, with two stand-in workers."""
    from harness.controller.scheduling import work_left, world_size_scheduler

    class Worker:
        def __init__(self, name):
            self.gateway, self.shutting_down, self.sent = SimpleNamespace(id=name), False, []

        def send_runtest_some(self, indices):
            self.sent += indices

        def shutdown(self):
            self.shutting_down = True

    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True))
    scheduler = world_size_scheduler(config, None, one_scope=False)
    ids = [f"cases/test_a.py::test_a[steps={i}-fp32-ws{w}]" for w, n in [(1, 3), (2, 5), (4, 4)] for i in range(n)]
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, ids)
    scheduler.schedule()
    ws1, ws2, ws4 = ids[:3], ids[3:8], ids[8:]
    # the largest world sizes first, one to each worker; the third waits for the first worker near its end
    assert work_left(scheduler) == ({"gw0": ws2, "gw1": ws4}, [ws1])
    for index in range(3, 6):
        scheduler.mark_test_complete(workers[0], index)
    given, queued = work_left(scheduler)
    assert given == {"gw0": ws2[3:] + ws1, "gw1": ws4} and queued == []


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
    """What terminal_writer uses of pytest's terminal reporter under xdist: a line of ``width``
    characters open, no file's header (xdist's letters come bare)."""

    def __init__(self, width: int) -> None:
        self._tw = SimpleNamespace(width_of_current_line=width)
        self.currentfspath = None
        self.calls = []

    def write(self, text):
        self.calls.append(text)
        self._tw.width_of_current_line = 0 if text.endswith("\n") else self._tw.width_of_current_line + len(text)


def config(verbose, reporter):
    return SimpleNamespace(getoption=lambda name, default=None: verbose,
                           pluginmanager=SimpleNamespace(get_plugin=lambda name: reporter))


def test_quiet_runs_have_no_terminal_line():
    assert terminal_writer(config(-1, Reporter(0))) is None
    assert terminal_writer(config(-2, Reporter(0))) is None
    terminal_writer(config(0, None))("-p no:terminal: nowhere to write, no error")


def test_under_xdist_a_line_waits_for_the_letters_line_to_end_or_ends_it_when_it_cannot_wait():
    letters = Reporter(12)
    lines = terminal_writer(config(0, letters))
    lines("gradient-sync: 1/9 cells")
    lines.flush()
    assert letters.calls == []  # pytest is in the middle of a line of letters
    lines("gradient-sync: 1/9 cells · running a[fp32-ws2] for 12s", urgent=True)
    assert letters.calls == ["\n", "gradient-sync: 1/9 cells\n",
                             "gradient-sync: 1/9 cells · running a[fp32-ws2] for 12s\n"]


# Where the lines land in a real pytest's terminal output: a session of two files of our own, its
# conftest writing through TerminalLines as the harness's plugin does (after each report, before each
# file's header, at the end), a failing test's line where the plugin writes a failing cell's, and a
# long cell's line (urgent) from inside a test, with pytest's capture lifted as the plugin lifts it.
LAYOUT_CONFTEST = '''
import pytest
from harness.controller.progress import TerminalLines

LINES = {}

def pytest_configure(config):
    LINES["lines"], LINES["capture"] = TerminalLines(config), config.pluginmanager.getplugin("capturemanager")

@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    LINES["lines"].file = report.nodeid.split("::", 1)[0]
    LINES["lines"].flush()
    if report.when == "call" and report.failed:
        LINES["lines"](f"gradient-sync: fail: {report.nodeid}")

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    LINES["lines"].next_file(nodeid)

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    LINES["lines"]("gradient-sync: done")
    LINES["lines"].flush(end=True)

@pytest.fixture
def long_cell():
    def say(text):
        with LINES["capture"].global_and_fixture_disabled():
            LINES["lines"](text, urgent=True)
    return say
'''
LAYOUT_TESTS = {
    # 130 tests: their letters wrap at 80 columns; long ones at 3 (on the file's first line) and 100
    # (on a wrapped one); failing ones at 3 and 101 (each line waits for the end of a line of letters)
    # and 90 (its line is still waiting when the long one at 100 comes)
    "test_a.py": """
import pytest
@pytest.mark.parametrize("i", range(130))
def test_x(i, long_cell):
    if i in (3, 100):
        long_cell(f"gradient-sync: running test_x[{i}] for 11s")
    assert i not in (3, 90, 101)
""",
    "test_b.py": """
def test_y(long_cell):
    long_cell("gradient-sync: running test_y for 11s")
def test_z():
    pass
""",
}
A_LETTERS = "".join("F" if i in (3, 90, 101) else "." for i in range(130))


@pytest.fixture(scope="module")
def terminal_layouts(tmp_path_factory):
    """The layout session's stdout between its "collected" line and its summary, as lines: plain and -v."""
    root = tmp_path_factory.mktemp("layout")
    (root / "conftest.py").write_text(LAYOUT_CONFTEST)
    for name, text in LAYOUT_TESTS.items():
        (root / name).write_text(text)
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    outputs = {}
    for mode in ("plain", "verbose"):
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:gradsync_harness",
                   "-p", "no:xdist", "-p", "no:randomly", "-o", "addopts=", "--color=no", "test_a.py", "test_b.py",
                   *(["-v"] if mode == "verbose" else [])]
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
        lines = done.stdout.splitlines()
        first = next(n for n, line in enumerate(lines) if line.startswith("collect")) + 2
        last = next(n for n, line in enumerate(lines) if line.startswith("=") and n > first)
        outputs[mode] = lines[first:last]
    return outputs


PROGRESS_LINES = ["gradient-sync: running test_x[3] for 11s", "gradient-sync: fail: test_a.py::test_x[3]",
                  "gradient-sync: fail: test_a.py::test_x[90]", "gradient-sync: running test_x[100] for 11s",
                  "gradient-sync: fail: test_a.py::test_x[101]", "gradient-sync: running test_y for 11s",
                  "gradient-sync: done"]
PERCENT = re.compile(r" +\[ *\d+%\]$")


def test_in_a_plain_run_every_letter_stays_on_a_line_of_its_files_letters_and_each_progress_line_has_one_of_its_own(
        terminal_layouts):
    lines = terminal_layouts["plain"]
    assert lines[-1] == "" and "" not in lines[:-1], lines  # one empty line before the summary, as pytest's own
    lines = lines[:-1]
    assert [line for line in lines if line.startswith("gradient-sync: ")] == PROGRESS_LINES, lines
    letters, file = {}, None
    for n, line in enumerate(lines):
        if line.startswith("gradient-sync: "):
            if line.startswith("gradient-sync: running"):
                # pytest's line, ended for the long test's line, is taken up again with its file's name
                assert lines[n + 1].startswith("test_"), lines
            continue
        head, _, rest = line.partition(".py ")
        if rest or line.endswith(".py "):
            file = head + ".py"
        else:
            rest = line  # a line of letters wrapped at the edge
        assert file is not None, lines
        letters[file] = letters.get(file, "") + PERCENT.sub("", rest)
    assert letters == {"test_a.py": A_LETTERS, "test_b.py": ".."}, lines
    # a failing test's line waits for the line of letters to end at the edge
    assert PERCENT.search(lines[lines.index("gradient-sync: fail: test_a.py::test_x[3]") - 1]), lines
    # the long tests' lines come at once, inside the line of letters: their own file's name on it
    assert lines[lines.index("gradient-sync: running test_x[3] for 11s") - 1] == "test_a.py ..."
    assert lines[lines.index("gradient-sync: running test_y for 11s") - 1] == "test_b.py "


def test_in_a_verbose_run_each_test_has_one_line_with_its_word_and_a_long_tests_is_taken_up_after_its_line(
        terminal_layouts):
    lines = terminal_layouts["verbose"]
    assert lines[-1] == "" and "" not in lines[:-1], lines
    lines = lines[:-1]
    assert [line for line in lines if line.startswith("gradient-sync: ")] == PROGRESS_LINES, lines
    worded = [line.split()[0] for line in lines if re.search(r" (PASSED|FAILED) +\[ *\d+%\]$", line)]
    assert worded == [f"test_a.py::test_x[{i}]" for i in range(130)] + ["test_b.py::test_y", "test_b.py::test_z"]
    for name, test in (("test_x[3]", "test_a.py::test_x[3]"), ("test_x[100]", "test_a.py::test_x[100]"),
                       ("test_y", "test_b.py::test_y")):
        n = lines.index(f"gradient-sync: running {name} for 11s")
        assert lines[n - 1] == f"{test} " and lines[n + 1].startswith(f"{test} "), lines[n - 1:n + 2]
    # a failing test's line right after that test's
    n = lines.index("gradient-sync: fail: test_a.py::test_x[90]")
    assert lines[n - 1].startswith("test_a.py::test_x[90] FAILED"), lines[n - 1:n + 1]


# end to end: small runs (world sizes 1-2, one case or two)
FUSED = ["cases/test_fused_loss.py", "-k", "fp32-ws"]
LINE = re.compile(r"^gradient-sync: .*$", re.MULTILINE)


def letters_of(stdout: str, file: str) -> str:
    """The letters on a serial run's lines that begin with ``file``'s name (pytest's header)."""
    headers = [line for line in stdout.splitlines() if line.startswith(file + " ")]
    return "".join(re.sub(r" +\[ *\d+%\]$", "", line[len(file) + 1:]) for line in headers)


def test_a_serial_run_writes_a_failing_cell_and_a_closing_line_without_splitting_the_dots(left_out_run):
    # largest world size first: the failing ws2 cell, then the passing ws1 one
    session = left_out_run
    assert session.returncode == 1
    # (a line for a long cell, where the machine is slow enough to make one, is the next test's)
    lines = [line for line in LINE.findall(session.stdout) if " · running " not in line]
    assert len(lines) == 2, session.stdout[-3000:]
    # pytest's letters for the file, both on lines that name it
    letters = letters_of(session.stdout, os.path.relpath(PLANTED, ROOT))
    assert letters == "F.", session.stdout[-3000:]
    assert re.fullmatch(r"gradient-sync: 1/2 cells · 1 fail · fail: planted_left_out_of_no_sync\[fp32-ws2\]",
                        lines[0])
    assert re.fullmatch(r"gradient-sync: 2/2 cells · 1 fail · done in \d+s", lines[1])
    # the closing line comes before the summary
    assert session.stdout.index(lines[1]) < session.stdout.index("gradient-sync matrix")
    assert wait_for_no_processes(session.token) == []


def read_until_running(process, seen: list[str], timeout_s: float = 300) -> bool:
    """Read the session's stdout into ``seen``, line by line, until a long cell's line comes (True)
    or the output ends or ``timeout_s`` passes (False). Straight from the pipe, never more than what
    is there: what comes after is left in the pipe for ``communicate`` (a buffered reader would hold
    some of it, where ``communicate`` does not look)."""
    fd, text = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if b"\n" not in text:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 1) if ready else b""  # a byte at a time: nothing past the line is taken
            if not chunk:
                return False
            text += chunk
            continue
        line, _, text = text.partition(b"\n")
        seen.append(line.decode())
        if " · running " in seen[-1]:
            return True
    return False


def test_a_serial_run_names_a_long_cell_while_it_runs_and_its_letter_lands_on_a_line_that_names_its_file(tmp_path):
    """The left-out case's ws2 cell, held on purpose (rank 0 waits on a FIFO, rank 1 in the first
    collective) until its line has come: at any machine's speed the cell runs long, is named while it
    runs, and then fails; its F lands after the line, on a line that begins with the file's name."""
    release = tmp_path / "release"
    os.mkfifo(release)
    process, token = start_pytest(LEFT_OUT_RUN, tmp_path / "r", PYTHONUNBUFFERED="1", PLANTED_RELEASE=str(release))
    seen = []
    with killed_if_failing(process):
        assert read_until_running(process, seen), seen
        # a writer for the FIFO, held to the end: rank 0's open returns, now or whenever it comes to it
        # (Linux opens a FIFO for reading and writing at once, with or without a reader)
        writer = os.open(release, os.O_RDWR)
        try:
            rest, _ = process.communicate(timeout=600)
        finally:
            os.close(writer)
    stdout = "\n".join(seen) + "\n" + rest
    assert process.returncode == 1, stdout[-3000:]
    file = os.path.relpath(PLANTED, ROOT)
    running = [line for line in LINE.findall(stdout) if " · running " in line]
    assert re.fullmatch(r"gradient-sync: 0/2 cells · running test_planted_left_out_of_no_sync\[fp32-ws2\] "
                        r"for [1-9]\d+s", running[0]), stdout[-3000:]
    lines = stdout.splitlines()
    n = lines.index(running[0])
    assert lines[n - 1] == f"{file} " and lines[n + 1].startswith(f"{file} F"), lines[n - 1:n + 2]
    letters = letters_of(stdout, file)
    assert letters == "F.", stdout[-3000:]
    done = [line for line in LINE.findall(stdout) if " · running " not in line]
    assert [re.sub(r"\d+s$", "Ns", line) for line in done] == [
        "gradient-sync: 1/2 cells · 1 fail · fail: planted_left_out_of_no_sync[fp32-ws2]",
        "gradient-sync: 2/2 cells · 1 fail · done in Ns"], stdout[-3000:]
    assert "" not in lines[n - 1:lines.index(done[-1])], stdout[-3000:]  # no empty line among them
    assert wait_for_no_processes(token) == []


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


def test_under_xdist_the_controller_names_a_long_cell_while_it_runs(tmp_path):
    """A cell that runs on (it blocks until the run is ended) is named, with how long it has run,
    while it runs, by the controller, which hears of the cell from the worker that runs it (a serial
    run's: the test above)."""
    blocking = [PLANTED, "-k", "planted_blocks_half_way and not finishes", "--world-sizes", "1",
                "--case-timeout", "3600"]
    process, token = start_pytest(["-n", "1", *blocking], tmp_path / "r", PYTHONUNBUFFERED="1")
    seen = []
    with killed_if_failing(process):
        read_until_running(process, seen)
        assert any(re.fullmatch(r"gradient-sync: 0/1 cells · running test_planted_blocks_half_way\[blocks-ws1\] "
                                r"for [1-9]\d+s", s) for s in seen), seen
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
    assert wait_for_no_processes(token) == []
