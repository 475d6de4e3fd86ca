"""The documentation against the project: links that resolve, no pointer to files users do not have,
a README short enough to read at once, and every documented output that can drift checked against
what the code says (the option help, the report schema, the fault count, the example's matrices).

The example project's real output is compared with docs/writing-a-case.md by tests/test_example.py,
which runs it anyway; the helpers for reading the documented matrices live here.

``python tests/test_docs.py`` rewrites the generated blocks of docs/options.md from the code (the
``pytest --help`` group of the plugin and every ``python -m harness`` command's ``--help``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
OPTIONS = DOCS / "options.md"
SCHEMA = DOCS / "matrix-schema.md"
GUIDE = DOCS / "writing-a-case.md"
README_MAX_LINES = 300
# the team's private spec files and folders, which users do not have
FORBIDDEN = ("CONTRACT.md", "DESIGN.md", "STYLE.md", "../shared", "shared docs")
HELP_COLUMNS = "100"  # the width the generated help is written at (the checks ignore wrapping)

pytestmark = pytest.mark.quick


def documentation() -> list[Path]:
    """Every Markdown page a user reads: the README, docs/, and the two folders' READMEs."""
    return [README, *sorted(DOCS.rglob("*.md")), ROOT / "reports" / "README.md", ROOT / "bench" / "README.md"]


def text_files_under_docs() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*")) if p.is_file() and p.suffix.lower() not in (".png", ".jpg", ".gif", ".svg")]


# --- reading Markdown ---------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)


def fenced_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks, without their fences."""
    return [block.split("\n", 1)[1].rsplit("\n", 1)[0] if "\n" in block else "" for block in
            (m.group(0) for m in FENCE.finditer(text))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    return LINK.findall(re.sub(r"`[^`\n]*`", "", FENCE.sub("", text)))


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"^#{{1,{level}}}\s", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def table_names(text: str) -> list[str]:
    """The backticked names in the first column of the Markdown tables in ``text``."""
    names = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            first = line.strip("|").split("|")[0]
            names += re.findall(r"`([^`]+)`", first)
    return names


def squash(text: str) -> str:
    """Text without any whitespace: what is left when wrapping is set aside."""
    return re.sub(r"\s+", "", text)


# --- the documented matrices (also used by tests/test_example.py) -----------------------------

COUNTS = re.compile(r"^\d+ cells?: .*$")


@dataclasses.dataclass
class DocumentedRun:
    command: str  # the block's "$ ..." line, without the "$ "
    world_sizes: list[int]
    rows: dict[tuple[str, str], dict[int, str]]  # (case, variant) -> world size -> status
    counts: str  # the "N cells: ..." line, "" where the block shows none
    text: str


def documented_runs(text: str) -> list[DocumentedRun]:
    """Every fenced block of ``text`` that shows a command and the matrix or counts line it printed."""
    runs = []
    for block in fenced_blocks(text):
        lines = block.splitlines()
        command = next((line[2:] for line in lines if line.startswith("$ ")), "")
        counts = next((line for line in lines if COUNTS.match(line)), "")
        if not command or not counts:
            continue
        world_sizes: list[int] = []
        rows: dict[tuple[str, str], dict[int, str]] = {}
        header = next((i for i, line in enumerate(lines) if line.startswith("case ") and "ws=" in line), None)
        if header is not None:
            world_sizes = [int(w) for w in re.findall(r"ws=(\d+)", lines[header])]
            for line in lines[header + 1:]:
                if COUNTS.match(line):
                    break
                case, variant, *statuses = line.split()
                rows[(case, variant)] = dict(zip(world_sizes, statuses))
        runs.append(DocumentedRun(command, world_sizes, rows, counts, block))
    return runs


def documented_run(text: str, command: str) -> DocumentedRun:
    matches = [run for run in documented_runs(text) if run.command == command]
    assert len(matches) == 1, f"the guide shows {len(matches)} runs of {command!r}"
    return matches[0]


def counts_line(statuses: list[str]) -> str:
    """The line the harness prints under its matrix, for cells of these statuses."""
    from harness.records import STATUSES

    shown = [f"{statuses.count(s)} {s}" for s in STATUSES if statuses.count(s)]
    return f"{len(statuses)} {'cell' if len(statuses) == 1 else 'cells'}: " + (", ".join(shown) or "none")


# --- (a) links, (b) no private files, (c) the README's length ---------------------------------

@pytest.mark.parametrize("page", documentation(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_anchor_in_the_repo(page):
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: outside the project")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_no_page_points_at_files_users_do_not_have():
    found = []
    for path in [README, *text_files_under_docs(), ROOT / "reports" / "README.md", ROOT / "bench" / "README.md"]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {name}" for name in FORBIDDEN if name in line]
    assert not found, "\n".join(found)


def test_the_readme_reads_at_once():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference text into docs/"


def test_the_readme_keeps_the_two_commands_that_ci_runs():
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in ("pytest -n auto cases/", "pytest tests/"):
        line = f'pip install torch==2.13.0 && pip install -e ".[test,deepspeed]" && {command}\n'
        assert line in readme, line
        assert f"\n{command}\n" in ci


# --- (d) counts that drift ---------------------------------------------------------------------

def test_the_documented_fault_counts_are_the_registered_faults():
    from harness.selfcheck.faults import FAULTS

    found = []
    for page in documentation():
        text = prose(page.read_text(encoding="utf-8"))
        found += [(page.name, int(n)) for n in re.findall(r"(\d+)\s+(?:injected\s+)?sync\s+faults", text)]
        found += [(page.name, int(n)) for pair in re.findall(r"(\d+)/(\d+)\s+faults\s+caught", text) for n in pair]
    assert found, "no page says how many sync faults the self-check plants"
    assert all(n == len(FAULTS) for _, n in found), (found, len(FAULTS))


def test_each_documented_matrix_adds_up_to_its_counts_line():
    guide = GUIDE.read_text(encoding="utf-8")
    runs = [run for run in documented_runs(guide) if run.rows]
    assert len(runs) >= 2
    for run in runs:
        statuses = [s for by_ws in run.rows.values() for s in by_ws.values()]
        assert run.counts == counts_line(statuses), run.text


def test_the_guides_launch_prints_its_matrixs_world_size_2_column():
    guide = GUIDE.read_text(encoding="utf-8")
    full = documented_run(guide, "cd examples/my_project && pytest -n auto gradsync/")
    launch = documented_run(guide, "cd examples/my_project && torchrun --nproc-per-node 2 -m harness launch gradsync/")
    assert launch.counts == counts_line([by_ws[2] for by_ws in full.rows.values()])


# --- (e) the option help ----------------------------------------------------------------------

class _Group:
    def __init__(self, options: list[tuple[tuple[str, ...], dict[str, Any]]]) -> None:
        self.options = options

    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.options.append((names, kwargs))


class _Parser:
    """Stands in for pytest's parser: records what the plugin registers."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.groups: list[str] = []

    def getgroup(self, name: str, description: str = "") -> _Group:
        self.groups.append(description)
        return _Group(self.options)


def plugin_options() -> tuple[list[str], dict[str, tuple[str, str]]]:
    from harness.plugin import pytest_addoption

    parser = _Parser()
    pytest_addoption(parser)  # type: ignore[arg-type]
    return parser.groups, {names[0]: (kw.get("metavar", ""), kw.get("help", "")) for names, kw in parser.options}


def harness_helps() -> dict[str, str]:
    """``python -m harness [COMMAND] --help`` for the command line and each command, as printed."""
    from harness.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parser = build_parser()
        helps = {"": parser.format_help()}
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps.update({name: sub.format_help() for name, sub in commands.choices.items()})
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return helps


def generated(text: str, name: str) -> str:
    match = re.search(rf"<!-- generated: {re.escape(name)} -->\n(.*?)<!-- end generated -->", text, re.S)
    assert match, f"docs/options.md has no generated block {name!r}"
    return match.group(1)


def documented_pytest_options(block: str) -> tuple[str, dict[str, tuple[str, str]]]:
    lines = fenced_blocks(block)[0].splitlines()
    title = next(line for line in lines if line.endswith(":") and not line.startswith(" "))
    options: dict[str, list[str]] = {}
    current = None
    for line in lines[lines.index(title) + 1:]:
        match = re.match(r"^  (--[\w-]+)(?:=(\S+))?\s*(.*)$", line)
        if match:
            current = match.group(1)
            options[current] = [match.group(2) or "", match.group(3)]
        elif current and line.startswith("   "):
            options[current][1] += " " + line.strip()
    return title, {name: (metavar, text) for name, (metavar, text) in options.items()}


def _normal_help(text: str) -> str:
    return squash(text.replace("optional arguments:", "options:"))


def test_the_documented_pytest_options_are_the_plugins():
    text = OPTIONS.read_text(encoding="utf-8")
    groups, options = plugin_options()
    title, documented = documented_pytest_options(generated(text, "pytest --help"))
    assert title == f"{groups[0]}:"
    assert list(documented) == list(options), "run `python tests/test_docs.py` to regenerate docs/options.md"
    for name, (metavar, help_text) in options.items():
        assert documented[name][0] == metavar, name
        assert squash(documented[name][1]) == squash(help_text), f"{name}: run `python tests/test_docs.py`"
    # the table above the generated help names the same options
    table = [n for n in table_names(section(text, "## pytest's options")) if n.startswith("--")]
    assert table == list(options)


def test_the_documented_command_help_is_the_command_lines():
    block = generated(OPTIONS.read_text(encoding="utf-8"), "python -m harness --help")
    documented = {}
    for body in fenced_blocks(block):
        first, _, rest = body.partition("\n")
        match = re.fullmatch(r"\$ python -m harness(?: (\w+))? --help", first)
        assert match, first
        documented[match.group(1) or ""] = rest
    helps = harness_helps()
    assert list(documented) == list(helps), "run `python tests/test_docs.py` to regenerate docs/options.md"
    for name, help_text in helps.items():
        assert _normal_help(documented[name]) == _normal_help(help_text), \
            f"`python -m harness {name} --help` changed: run `python tests/test_docs.py`"


# --- (f) the report schema --------------------------------------------------------------------

def _string_keys(tree: ast.AST, function: str) -> set[str]:
    """The constant keys of the dict literals and subscript assignments in functions named ``function``."""
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Dict):
                    keys |= {k.value for k in inner.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                elif isinstance(inner, ast.Assign):
                    keys |= {t.slice.value for t in inner.targets if isinstance(t, ast.Subscript)
                             and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)}
    return keys


def environment_keys_in_code() -> set[str]:
    from harness.matrix.merge import MERGE_KEYS
    from harness.matrix.schema import UNAVAILABLE_CHECKS

    plugin = ast.parse((ROOT / "harness" / "plugin.py").read_text(encoding="utf-8"))
    launch = ast.parse((ROOT / "harness" / "launch" / "main.py").read_text(encoding="utf-8"))
    # HarnessState.environment (every run) and LaunchPlugin.environment (under a launcher) write the
    # environment; merge adds MERGE_KEYS; with_unavailable_checks adds UNAVAILABLE_CHECKS
    return _string_keys(plugin, "environment") | _string_keys(launch, "environment") | set(MERGE_KEYS) | {UNAVAILABLE_CHECKS}


def test_the_documented_environment_keys_are_those_the_code_writes():
    schema = SCHEMA.read_text(encoding="utf-8")
    documented = table_names(section(schema, "## `environment`"))
    assert sorted(documented) == sorted(environment_keys_in_code())
    launch = ast.parse((ROOT / "harness" / "launch" / "main.py").read_text(encoding="utf-8"))
    rank_keys = next({k.value for k in node.value.keys} for node in ast.walk(launch)
                     if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                     and any(isinstance(t, ast.Name) and t.id == "me" for t in node.targets))
    ranks_row = next(line for line in section(schema, "## `environment`").splitlines() if line.startswith("| `ranks`"))
    assert rank_keys <= set(re.findall(r"`(\w+)`", ranks_row)), rank_keys


def test_the_documented_fields_are_the_schemas():
    from harness.matrix.schema import Cell, Matrix
    from harness.records import Failure
    from harness.timeline import CHECKS, TimelineMark, TimelineStep

    schema = SCHEMA.read_text(encoding="utf-8")
    top = table_names(section(schema, "## The top level"))
    assert sorted(top) == sorted(Matrix([], []).to_dict()), top
    assert table_names(section(schema, "## A cell")) == [f.name for f in dataclasses.fields(Cell)]
    assert table_names(section(schema, "## A failure")) == [f.name for f in dataclasses.fields(Failure)]
    timeline = section(schema, "## A timeline")
    named = set(re.findall(r"`(\w+)`", timeline))
    fields = {f.name for cls in (TimelineStep, TimelineMark) for f in dataclasses.fields(cls)}
    assert fields | set(CHECKS) <= named, (fields | set(CHECKS)) - named


def test_the_documented_statuses_and_failure_kinds_are_the_records():
    from harness.records import STATUSES, FailureKind

    schema = SCHEMA.read_text(encoding="utf-8")
    assert table_names(section(schema, "## Statuses")) == list(STATUSES)
    assert sorted(table_names(section(schema, "## Failure kinds"))) == sorted(k.value for k in FailureKind)


def test_every_command_has_its_exit_statuses_documented():
    from harness.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    exits = section(SCHEMA.read_text(encoding="utf-8"), "## Exit statuses")
    for name in commands.choices:
        assert f"`python -m harness {name}`" in exits, name
    assert "`pytest cases/`" in exits



WRAPPER_SPEC_COLUMNS = ["wrapper", "family", "version or stage", "precisions", "bf16 also with", "compiled", "meshes",
                        "reduces every micro-batch", "wraps the module", "accumulates in", "bf16 forward"]


def wrapper_spec_rows() -> list[list[str]]:
    """docs/wrappers.md's "One spec a wrapper" table, as harness/wrappers/registry.py's SPECS make it."""
    from harness.wrappers.registry import SPECS

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    def forward(how: Any) -> str:
        if how is None:
            return "autocast"
        cast = ["parameters", *(["buffers"] if how.casts_buffers else []), *(["inputs"] if how.casts_inputs else [])]
        return f"casts {', '.join(cast)}" + ("; outputs bf16" if how.outputs_low else "")

    return [[f"`{s.name}`", s.family, str(s.fsdp_version or s.zero_stage or "-"), ", ".join(s.precisions),
             ", ".join(f"`{s.mixed_axis[0]}={v}`" for v in s.mixed_axis[1]) if s.mixed_axis else "-",
             yes(s.compiled), yes(s.meshes), yes(s.reduces_every_micro_batch), yes(s.wraps_module), s.accumulates_in,
             forward(s.sharded_forward)] for s in SPECS]


def test_the_documented_wrapper_specs_are_the_registrys():
    table = section((DOCS / "wrappers.md").read_text(encoding="utf-8"), "## One spec a wrapper")
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("|") and not re.match(r"^\|\s*-", line)]
    assert rows[0] == WRAPPER_SPEC_COLUMNS
    assert rows[1:] == wrapper_spec_rows()

# --- regenerating docs/options.md -------------------------------------------------------------

def _pytest_help_group() -> str:
    """The plugin's group of ``pytest --help``, as pytest prints it."""
    groups, _ = plugin_options()
    env = {**os.environ, "COLUMNS": HELP_COLUMNS}
    env.pop("PYTEST_ADDOPTS", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    start = lines.index(f"{groups[0]}:")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def regenerate(path: Path = OPTIONS) -> None:
    text = path.read_text(encoding="utf-8")
    pytest_block = f"```\n$ pytest --help\n...\n{_pytest_help_group()}\n```\n"
    harness_block = ""
    for name, help_text in harness_helps().items():
        command = f"python -m harness {name} --help" if name else "python -m harness --help"
        harness_block += f"### `{command[:-7]}`\n\n```\n$ {command}\n{help_text.rstrip()}\n```\n\n"
    for name, block in (("pytest --help", pytest_block), ("python -m harness --help", harness_block)):
        text = re.sub(rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end generated -->)",
                      lambda m: m.group(1) + block + m.group(2), text, flags=re.S)
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    regenerate()
    print(f"rewrote the generated blocks of {OPTIONS.relative_to(ROOT)}")
