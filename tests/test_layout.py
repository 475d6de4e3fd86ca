"""The house rules of the layout, as tests.

``harness/`` keeps the entry points and the core every side shares; each subpackage is one side:
``rank`` (inside a rank), ``wrappers`` (the wrapper a cell trains under, on the rank side),
``controller`` (the local controller in pytest's process), ``launch`` (under a launcher), ``matrix``
(the report data), ``render`` (every text a person reads), ``selfcheck`` (planted faults and the
self-check). Each may import only what ``MAY_IMPORT`` says, no module takes part in an import circle
(imports inside functions counted, ``TYPE_CHECKING`` ones too), no class reads or writes another object's
private members, the rank side imports nothing of the controller, the records depend on nothing, and
fault injection stays off the path of a real cell.

The rank side is layered, each layer importing only those below it (``RANK_LAYERS``, bottom first), and
each layer of harness/rank/ is a folder of its own but the case's side, directly in harness/rank/:
``rank.numerics`` (closeness, gloo's ring order, the oracle's collectives and the recording of the
wrapper's, the RNG) <- ``wrappers`` <- ``rank.oracle`` (the replicas, the schedule, the reductions, the
token weights: what every rank must hold) <- ``rank.judging`` (the checks, the diagnoses, the recorder,
the judging of the reductions) <- ``rank.watch`` (a loop followed as it is, and what a script's watch
shares with it) <- ``rank`` (the case's side: the context, the Trainer, the models and data) <-
``rank.script`` (a script run as it is, and its watch) <- ``rank.process`` (a rank's process: its main
loop, one cell's run, what it preloads).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"

# Directly in harness/: the entry points (the public API, ``python -m harness``, the pytest11 plugin)
# and the core that every side shares (records and messages, texts, the case decorator and catalogue,
# the garbage collector around the big imports).
ENTRY = {"harness", "harness.__main__", "harness.cli", "harness.plugin"}
CORE = {"harness.records", "harness.messages", "harness.timeline", "harness.text", "harness.wording",
        "harness.versions", "harness.decorator", "harness.catalogue", "harness.heap"}
SUBPACKAGES = ("rank", "wrappers", "controller", "launch", "matrix", "render", "selfcheck")
# The rank side's layers, bottom first: each may import those before it, none after it.
RANK_LAYERS = ("rank.numerics", "wrappers", "rank.oracle", "rank.judging", "rank.watch", "rank", "rank.script",
               "rank.process")
# harness/rank/<folder>/: each a layer of its own, in the order above; "rank" is what lies directly in harness/rank/
LAYER_PACKAGES = ("numerics", "oracle", "judging", "watch", "script", "process")
# Outside harness/rank/process/, of the rank's process: the case file a watched script's session collects.
RANK_PROCESS = {"harness.rank.script.cells"}
# The planted faults run inside the ranks (the self-check's ``run`` is the controller's).
FAULT_MODULES = {"harness.selfcheck.planted", "harness.selfcheck.faults", "harness.selfcheck.faults_deepspeed",
                 "harness.selfcheck.faults_fsdp", "harness.selfcheck.faults_tokens",
                 "harness.selfcheck.faults_upstream", "harness.selfcheck.perturbations"}


def side(name: str) -> str:
    """A module's side: its subpackage, ``faults`` for a planted fault, else ``core`` or ``entry``."""
    if name in FAULT_MODULES:
        return "faults"
    parts = name.split(".")
    if name in RANK_PROCESS:
        return "rank.process"
    if len(parts) >= 3 and parts[1] == "rank" and parts[2] in LAYER_PACKAGES:
        return f"rank.{parts[2]}"
    if len(parts) >= 2 and parts[1] in SUBPACKAGES:
        return parts[1]
    return "entry" if name in ENTRY else "core"


def below(layer: str) -> set[str]:
    """The rank side's layers under ``layer``."""
    return set(RANK_LAYERS[:RANK_LAYERS.index(layer)])


# What each side may import besides itself (by side; a few single modules by name).
MAY_IMPORT = {
    "core": {"harness.wrappers.registry"},  # the decorator checks wrapper names; names imports nothing
    **{layer: {"core"} | below(layer) for layer in RANK_LAYERS},
    "faults": {"core", *RANK_LAYERS},
    "matrix": {"core"},
    "render": {"core", "matrix", "selfcheck", "faults"},  # the self-check's report
    "controller": {"core", "matrix", "harness.wrappers.registry", "harness.rank", "harness.rank.process",
                   "harness.rank.process.main", "harness.rank.process.environment"},  # a pool's ranks
    "selfcheck": {"core", "controller", "matrix", "faults", "harness.wrappers.registry", "harness.wrappers.prepare"},
    "launch": {"core", "controller", "harness.rank", "rank.process", "harness.rank.oracle.schedule", "harness.plugin"},
    "entry": {"core", *RANK_LAYERS, "faults", "matrix", "render", "controller", "launch", "selfcheck", "entry"},
}
MAY_IMPORT["rank.process"].add("harness.selfcheck.faults")  # the runner plants a cell's fault
RANK_SIDE_SIDES = {"core", *RANK_LAYERS, "faults"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def harness_imports(path: Path, *, types: bool = False) -> set[str]:
    """The harness modules a file imports at run time, anywhere in it (under TYPE_CHECKING too with
    ``types``: two modules that need each other's types are one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("harness"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (PACKAGE / node.module.removeprefix("harness").lstrip(".").replace(".", "/") / f"{a.name}.py").exists())
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {f"harness.{p}" for p in SUBPACKAGES} | {f"harness.rank.{p}" for p in LAYER_PACKAGES}


def allowed(importer: str, imported: str) -> bool:
    if imported in PACKAGES:
        return True  # a subpackage's __init__, which imports nothing (test below): a name for its modules
    rules = MAY_IMPORT[side(importer)]
    return side(imported) in (rules | {side(importer)}) or imported in rules


def test_every_module_is_known_to_these_rules():
    assert "harness.rank.process.main" in MODULES and "harness.text" in MODULES
    top = {name for name in MODULES if name.count(".") == 1 and name.split(".")[1] not in SUBPACKAGES} | {"harness"}
    assert top == ENTRY | CORE, f"modules directly in harness/ beyond the entry points and the core: {sorted(top - ENTRY - CORE)}"
    assert len(top) <= 13
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(SUBPACKAGES), packages


def test_the_distribution_ships_every_package():
    """pyproject.toml lists the packages a wheel carries: one left out installs a harness that cannot
    import itself (tests/test_example.py installs one)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {_module_name(p / "__init__.py") for p in [PACKAGE, *PACKAGE.rglob("*")] if (p / "__init__.py").exists()}
    assert listed - {"harness.cases"} == found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_side_imports_only_what_its_rules_allow(name):
    wrong = sorted(m for m in harness_imports(MODULES[name]) if m != "harness" and not allowed(name, m))
    assert not wrong, f"{name} ({side(name)}) may import {sorted(MAY_IMPORT[side(name)])}; it imports {wrong}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if side(n) in RANK_SIDE_SIDES))
def test_the_rank_side_imports_nothing_of_the_controller(name):
    outside = {m for m in harness_imports(MODULES[name])
               if m not in ("harness", "harness.selfcheck") and side(m) not in RANK_SIDE_SIDES}
    assert not outside, f"{name} (rank side) imports {sorted(outside)}"


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _graph(*, types: bool = False) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        # importing harness.a.b runs harness/a/__init__.py first: the package is imported too
        found = set()
        for m in harness_imports(path, types=types):
            parts = m.split(".")
            found.update(".".join(parts[:n]) for n in range(2, len(parts) + 1))
        graph[name] = {m for m in found if m in MODULES and m != name}
    return graph


def test_no_import_circles():
    assert import_circles(_graph()) == []


def test_no_import_circles_even_among_type_imports():
    assert import_circles(_graph(types=True)) == []


def test_the_circle_finder_finds_a_planted_circle():
    graph = _graph()
    graph["harness.matrix.schema"] = graph["harness.matrix.schema"] | {"harness.matrix.file"}
    assert ["harness.matrix.file", "harness.matrix.schema"] in import_circles(graph)


def test_the_subpackages_import_nothing_when_imported():
    """A subpackage's __init__ holds its rules, no code: importing harness.wrappers.registry (from the
    decorator, torch-free) must not pull in the rest of the package."""
    for package in PACKAGES:
        assert harness_imports(MODULES[package]) == set(), package


# A library's own private members the harness must touch (not a harness class's), by module: the fork
# server multiprocessing keeps (rank_server adopts a shared one) and FSDP1's flat parameter's members.
LIBRARY_PRIVATES = {"harness.controller.rank_server": {"server._lock"}, "harness.wrappers.sharding": {"flat_param._params"}}


def reached_privates(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """By module, each ``x._name`` where ``_name`` is a private member a harness class defines (a method, or
    an attribute it sets on ``self``) and ``x`` is not that object itself (``self``, ``cls``, ``super()``)."""
    defined = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    defined.add(node.attr)
    defined = {n for n in defined if n.startswith("_") and not n.startswith("__")}
    found: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in defined:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.setdefault(name, set()).add(ast.unparse(node))
    return found


def test_no_class_reads_or_writes_another_objects_private_members():
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
    reached = {name: found - LIBRARY_PRIVATES.get(name, set()) for name, found in reached_privates(trees).items()}
    assert not {name: found for name, found in reached.items() if found}


def test_the_private_member_rule_finds_a_planted_reach():
    planted = ast.parse("class A:\n    def __init__(self):\n        self._state = 1\n\n"
                        "class B:\n    def look(self, a):\n        return a._state + self._own()\n\n"
                        "    def _own(self):\n        return 0\n")
    assert reached_privates({"planted": planted}) == {"planted": {"a._state"}}


def shadowed_methods(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """By class, the methods (its own or a base's among these classes) that an attribute it sets on ``self``
    shadows: ``self.windows = ...`` hides ``def windows``, a name of the case API, on every instance."""
    classes: dict[str, list[tuple[set[str], set[str], list[str]]]] = {}
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and not any("property" in ast.unparse(d) or ast.unparse(d).endswith(".setter")
                                   for d in n.decorator_list)}
            attributes = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                          and isinstance(n.value, ast.Name) and n.value.id == "self"}
            classes.setdefault(cls.name, []).append((methods, attributes, [ast.unparse(b).split(".")[-1]
                                                                          for b in cls.bases]))

    def members(name: str, seen: tuple[str, ...] = ()) -> tuple[set[str], set[str]]:
        methods: set[str] = set()
        attributes: set[str] = set()
        for own, set_here, bases in classes.get(name, []):
            methods |= own
            attributes |= set_here
            for base in (b for b in bases if b not in seen):
                more = members(base, (*seen, name))
                methods |= more[0]
                attributes |= more[1]
        return methods, attributes

    return {name: found for name in classes if (found := members(name)[0] & members(name)[1])}


def test_no_attribute_shadows_a_method_of_its_class():
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
    assert shadowed_methods(trees) == {}


def test_the_shadowing_rule_finds_a_planted_attribute_over_a_base_method():
    planted = ast.parse("class Base:\n    def windows(self):\n        return []\n\n"
                        "class Context(Base):\n    def __init__(self):\n        self.windows = None\n")
    assert shadowed_methods({"planted": planted}) == {"Context": {"windows"}}


# A module a newcomer can read in one sitting, a function on one screen (issue 57).
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def long_parts(path: Path) -> tuple[int, list[tuple[str, int]]]:
    """A module's lines, and its functions (methods and nested ones too) of more than
    MAX_FUNCTION_LINES lines, docstring and signature counted."""
    source = path.read_text(encoding="utf-8")
    functions = [(f"{node.name} (line {node.lineno})", node.end_lineno - node.lineno + 1)
                 for node in ast.walk(ast.parse(source))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    return len(source.splitlines()), functions


def test_no_module_is_over_450_lines_and_no_function_over_80():
    found = {name: long_parts(path) for name, path in MODULES.items()}
    modules = {name: lines for name, (lines, _) in found.items() if lines > MAX_MODULE_LINES}
    functions = {name: long for name, (_, long) in found.items() if long}
    assert not modules, f"modules over {MAX_MODULE_LINES} lines: {modules}"
    assert not functions, f"functions over {MAX_FUNCTION_LINES} lines: {functions}"


def test_the_length_rule_finds_a_long_module_and_a_long_function(tmp_path):
    planted = tmp_path / "long.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    planted.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n" + "# a line\n" * MAX_MODULE_LINES)
    lines, functions = long_parts(planted)
    assert lines > MAX_MODULE_LINES and functions == [("long (line 5)", MAX_FUNCTION_LINES + 1)]


def test_the_records_depend_on_nothing():
    assert harness_imports(MODULES["harness.records"]) == set()
    tree = ast.parse(MODULES["harness.records"].read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "enum", "typing", "harness"}, imported


def test_statuses_and_failure_kinds_are_their_public_names():
    from harness.records import FailureKind, Status

    assert [str(s) for s in Status] == ["pass", "fail", "error", "skip", "unsupported", "detected", "missed"]
    assert f"{FailureKind.NOT_SYNCED}" == "not_synced" and FailureKind.NOT_SYNCED == "not_synced"
    assert json.dumps({"status": Status.FAIL}) == '{"status": "fail"}'


# Runs one world-size-1 cell on this process's rank side, as a pool's rank would, and reports which
# harness modules that imported.
_RUN_ONE_CELL = """
import json, sys
import torch
from harness.catalogue import load_case_file
from harness.controller.cells import cell_spec
from harness.controller.options import resolve
from harness.rank.process.cell import run_rank_cell

case = load_case_file("cases/test_accumulate.py")[0]
variant = next(v for v in case.info.variants if v.name == "steps=2-fp32")
settings = resolve(world_sizes="1", backend="gloo", report_dir="reports", case_timeout="60", seed="1234",
                   fault=sys.argv[1] or None)
before = set(sys.modules)
result = run_rank_cell(cell_spec(case, variant, 1, settings, label="layout"), 0, torch.device("cpu"))
print(json.dumps({"outcome": str(result.outcome), "failures": len(result.failures), "detail": result.detail,
                  "faults_imported": "harness.selfcheck.faults" in sys.modules,
                  "controller": sorted(m for m in set(sys.modules) - before
                                       if m.startswith("harness") and m not in %r)}))
""" % (sorted(n for n in MODULES if side(n) in RANK_SIDE_SIDES) + ["harness.selfcheck"],)


@pytest.mark.parametrize("fault", ["", "loss_not_scaled"])
def test_fault_injection_is_imported_only_for_a_cell_with_a_fault(fault):
    done = subprocess.run([sys.executable, "-c", _RUN_ONE_CELL, fault], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["outcome"] == "ok", seen["detail"]
    assert seen["controller"] == []
    assert seen["faults_imported"] is bool(fault)
    assert (seen["failures"] > 0) is bool(fault)  # the planted fault did act: the rank found it


def test_the_public_api_and_the_plugin_import_no_torch():
    """The controller (pytest, every xdist worker) never needs torch: the decorator, the public names
    that need none, the plugin, and the cells of `python -m harness watch` (whose controller imports no
    case file of the user's) load without it; RankContext and Oracle import it on first use."""
    from harness.messages import WATCH_ENVIRONMENT

    probe = ("import sys, harness, harness.plugin, harness.rank.script.cells\n"
             "from harness import case, grid, Diagnosis, MicroStep, PRECISIONS, ALL_PRECISIONS\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "from harness import RankContext, Oracle\n"
             "assert 'torch' in sys.modules and RankContext.__module__ == 'harness.rank.context'\n"
             "assert sorted(harness.__all__) == sorted(n for n in harness.__all__ if hasattr(harness, n))\n")
    watched = json.dumps({"path": "train.py", "argv": [], "name": "train", "precisions": [], "loss": None,
                          "num_steps": None, "contract": "accelerate"})
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", WATCH_ENVIRONMENT: watched})
    assert done.returncode == 0, done.stderr[-3000:]
