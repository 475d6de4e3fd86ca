"""How ``pytest tests/`` runs the suite (tests/conftest.py): on SUITE_WORKERS xdist workers, each file
whole on one of them, in the order of collection with LONGEST_FILES first (xdist's own reordering of
files by their count of tests turned off: it put the files of many quick tests first and the long ones
last, leaving a worker idle at the end); a command that says otherwise keeps what it says."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest


def _config(*args: str, numprocesses=None, dist="no"):
    option = SimpleNamespace(numprocesses=numprocesses, dist=dist, collectonly=False, usepdb=False,
                             loadscopereorder=True)
    return SimpleNamespace(option=option, args=list(args), pluginmanager=SimpleNamespace(hasplugin=lambda name: True))


def test_the_suite_runs_its_files_whole_on_two_workers_in_collection_order():
    config = _config(str(conftest.TESTS_DIR))
    conftest.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist, config.option.loadscopereorder) == \
        (conftest.SUITE_WORKERS, "loadfile", False)


def test_a_command_that_names_its_own_distribution_or_files_keeps_it():
    config = _config(str(conftest.TESTS_DIR), numprocesses=4, dist="load")
    conftest.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist, config.option.loadscopereorder) == (4, "load", True)
    config = _config(str(conftest.TESTS_DIR / "test_suite.py"))
    conftest.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist) == (None, "no")


def test_the_longest_files_are_handed_out_first_and_each_file_whole():
    names = sorted(p.name for p in conftest.TESTS_DIR.glob("test_*.py"))
    assert set(conftest.LONGEST_FILES) <= set(names)
    items = [SimpleNamespace(path=Path(name), nodeid=f"tests/{name}::test_{n}", name=f"test_{n}", module=None,
                             fixturenames=(), add_marker=lambda marker: None)
             for name in names for n in range(3 if name in conftest.LONGEST_FILES else 40)]
    conftest.pytest_collection_modifyitems(items)
    order = list(dict.fromkeys(item.path.name for item in items))
    assert order[:len(conftest.LONGEST_FILES)] == list(conftest.LONGEST_FILES)
