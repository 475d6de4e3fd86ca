"""The garbage collector around the big imports (harness/heap.py): a session pauses it from the first
file that names the harness to the end of its collection, and then freezes what is alive; a run of no
such file is left as it is; the fork server the ranks are forked from preloads with it paused, so a
rank starts with torch's objects frozen and the collector running. Real sessions, real ranks."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

from conftest import ROOT
from distributed import run_on_ranks

from harness import heap

# a plugin of the session under test: the collector as each test module is imported, and after the
# collection (trylast: after the harness plugin's own hook)
PROBE = '''
import gc, json, os
import pytest

def record(event, **what):
    with open(os.environ["HEAP_PROBE"], "a", encoding="utf-8") as out:
        out.write(json.dumps({"event": event, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), **what}) + "\\n")

def pytest_collectstart(collector):
    if isinstance(collector, pytest.Module):
        record("import", module=collector.path.name)

@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    record("collected")
'''
PLAIN = "import torch\n\n\ndef test_plain():\n    assert torch.ones(1).item() == 1\n"
CASES = "import torch\n\nfrom harness import case\n\n\ndef test_not_a_case():\n    assert case\n"


def _collected(run_pytest, tmp_path: Path, *files: str) -> list[dict]:
    (tmp_path / "heap_probe.py").write_text(PROBE, encoding="utf-8")
    for name, text in zip(files, (PLAIN, CASES)):
        (tmp_path / name).write_text(text, encoding="utf-8")
    out = tmp_path / "probe.jsonl"
    session = run_pytest("-p", "heap_probe", "--collect-only", *(str(tmp_path / name) for name in files),
                         PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", HEAP_PROBE=str(out))
    assert session.returncode == 0, session.stdout[-3000:] + session.stderr[-3000:]
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def test_a_session_pauses_the_collector_from_its_first_case_file_to_the_end_of_its_collection(run_pytest, tmp_path):
    plain, cases, collected = _collected(run_pytest, tmp_path, "test_a_plain.py", "test_b_cases.py")
    # a module that does not name the harness, imported first, is imported as any run would
    assert (plain["module"], plain["enabled"], plain["frozen"]) == ("test_a_plain.py", True, 0)
    # from the first that does, paused: torch (imported by the first) is not walked as it grows
    assert (cases["module"], cases["enabled"]) == ("test_b_cases.py", False)
    # after the collection the collector runs, and what the imports left alive is out of its reach
    assert collected["enabled"] and collected["frozen"] > 100_000, collected


def test_a_run_of_no_file_that_names_the_harness_is_left_as_it_is(run_pytest, tmp_path):
    plain, collected = _collected(run_pytest, tmp_path, "test_a_plain.py")
    assert plain["enabled"] and collected["enabled"] and collected["frozen"] == 0, collected


def _collector(rank: int, world_size: int) -> tuple[bool, int]:
    return gc.isenabled(), gc.get_freeze_count()


def test_a_rank_starts_with_the_servers_imports_frozen_and_the_collector_running():
    for enabled, frozen in run_on_ranks(_collector, 2):
        assert enabled and frozen > 100_000, (enabled, frozen)


def test_a_pause_inside_another_leaves_the_collector_paused_to_the_outer_one():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    outer = heap.pause()
    try:
        with heap.imports_frozen():
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() == frozen  # the inner pause ended nothing
    finally:
        heap.resume(outer)
    assert outer and gc.isenabled() and gc.get_freeze_count() >= frozen
    assert heap.pause() is True and heap.pause() is False  # paused already: someone else's pause
    heap.resume(True)
    assert gc.isenabled()
