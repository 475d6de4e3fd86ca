"""The catalogue: the cases defined in case files, found by path; the one way a case file is loaded.

pytest collects case files its own way; everything else (a rank running a cell, the self-check, the
benchmarks) loads them here, each file once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness.decorator import CaseInfo, case_info


class CatalogueError(Exception):
    """A case directory or file that cannot be used; the message is one line."""


@dataclass(frozen=True)
class CaseRef:
    """A case and where it is defined: the file and the name of its test function."""

    info: CaseInfo
    path: Path
    attr: str

    @property
    def name(self) -> str:
        return self.info.name


_modules: dict[str, ModuleType] = {}


def _import(path: Path) -> ModuleType:
    key = str(path)
    module = _modules.get(key)
    if module is not None:
        return module
    if not path.is_file():
        raise CatalogueError(f"{path}: no such case file")
    name = f"harness_case_{path.stem}_{abs(hash(key))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CatalogueError(f"{path}: cannot import")
    module = importlib.util.module_from_spec(spec)
    # as pytest's default import mode does: the first folder above the file that is not a package
    # goes on sys.path, so that a case file imports its neighbours the same way in every process
    base = path.parent
    while (base / "__init__.py").is_file() and base.parent != base:
        base = base.parent
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _modules[key] = module
    return module


def load_case_file(path: str | os.PathLike[str]) -> list[CaseRef]:
    """Every case in one file, in order of definition (the file is imported once per process)."""
    resolved = Path(path).resolve()
    module = _import(resolved)
    refs = []
    for attr, value in vars(module).items():
        info = case_info(value)
        if info is not None:
            refs.append(CaseRef(info=info, path=resolved, attr=attr))
    return refs


def portable_location(path: str | os.PathLike[str]) -> tuple[str, str]:
    """Where a case file is, in terms another host can resolve: ``("catalogue", name)`` in the
    installed catalogue, ``("cwd", relative path)`` under the working directory, else ``("", "")``
    (only the absolute path). A launch's ranks on other nodes run from the same directory of the same
    checkout or installation, not from a shared filesystem."""
    return _portable_location(str(path), os.getcwd())


@functools.lru_cache(maxsize=None)
def _portable_location(path: str, cwd: str) -> tuple[str, str]:  # once per file, not once per cell
    resolved = Path(path).resolve()
    try:
        return "catalogue", str(resolved.relative_to(installed_cases_dir().resolve()))
    except (ValueError, CatalogueError):
        pass
    try:
        return "cwd", str(resolved.relative_to(Path(cwd).resolve()))
    except ValueError:
        return "", ""


def locate(anchor: str, relpath: str, absolute: str) -> Path:
    """The case file that ``portable_location`` described, on this host; CatalogueError naming the
    host when it is not here."""
    candidates = []
    if anchor == "catalogue":
        candidates.append(installed_cases_dir() / relpath)
    elif anchor == "cwd":
        candidates.append(Path.cwd() / relpath)
    candidates.append(Path(absolute))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise CatalogueError(f"{relpath or absolute}: no such case file on host {socket.gethostname()} (in {Path.cwd()}); "
                         "every node of a launch needs the same files, run from the same directory")


def find_case(path: str | os.PathLike[str], attr: str) -> CaseInfo:
    """The case defined as ``attr`` in the file at ``path``."""
    info = case_info(getattr(_import(Path(path).resolve()), attr, None))
    if info is None:
        raise CatalogueError(f"{path} has no case function {attr}")
    return info


def installed_cases_dir() -> Path:
    """Where the built-in catalogue is: the package ``harness.cases`` (``cases/`` of the checkout in an
    editable install, ``harness/cases/`` inside an installed one)."""
    spec = importlib.util.find_spec("harness.cases")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CatalogueError("the built-in catalogue (the package harness.cases) is not installed")
    return Path(locations[0])


def default_cases_dir() -> Path:
    """``cases/`` in the working directory, else the built-in catalogue."""
    here = Path("cases")
    return here if here.is_dir() else installed_cases_dir()


def discover(cases_dir: str | os.PathLike[str]) -> list[CaseRef]:
    """Every case in ``cases_dir/test_*.py``, by file name, then in order of definition."""
    directory = Path(cases_dir)
    if not directory.is_dir():
        raise CatalogueError(f"{directory}: no such case directory")
    found: list[CaseRef] = []
    defined_in: dict[str, Path] = {}
    for path in sorted(directory.glob("test_*.py")):
        for ref in load_case_file(path):
            if ref.name in defined_in:
                raise CatalogueError(f"case {ref.name!r} is defined in {defined_in[ref.name]} and in {ref.path}")
            defined_in[ref.name] = ref.path
            found.append(ref)
    if not found:
        raise CatalogueError(f"{directory}: no cases in test_*.py")
    return found
