"""The nightly CI: .github/workflows/nightly.yml passes actionlint, has its four jobs, and its merge job
diffs against the last successful night without failing a first night; the multi-node batch script
and bench/gpu_smoke.sh parse, and behave as they say with stand-ins for SLURM, torch and the GPUs.

No YAML parser: the workflow is read as text, and a step's script is cut out by its indentation and
run by bash as GitHub's `shell: bash` runs it (bash -e -o pipefail)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness.matrix.schema import Cell, Matrix

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "nightly.yml"
SBATCH = ROOT / ".ci" / "nightly-multinode.sbatch"
SMOKE = ROOT / "bench" / "gpu_smoke.sh"
JOBS = ("cpu", "gpu", "multinode", "merge")


def workflow() -> str:
    return WORKFLOW.read_text(encoding="utf-8")


def find_actionlint() -> str:
    """The actionlint executable: on PATH, or beside this interpreter (a venv not activated)."""
    beside = Path(sys.executable).parent / "actionlint"
    found = shutil.which("actionlint") or (str(beside) if os.access(beside, os.X_OK) else None)
    if found is None:
        pytest.fail("actionlint not found on PATH or beside this python: it is a test dependency "
                    "(pip install -e \".[test]\" installs it)", pytrace=False)
    return found


def jobs_block(text: str) -> dict[str, str]:
    """The text of each top-level job, by its id."""
    lines = text.splitlines()
    start = lines.index("jobs:")
    jobs: dict[str, list[str]] = {}
    current = None
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        match = re.fullmatch(r"  ([A-Za-z0-9_-]+):\s*", line)
        if match:
            current = match.group(1)
            jobs[current] = []
        elif current is not None:
            jobs[current].append(line)
    return {name: "\n".join(body) for name, body in jobs.items()}


def step_script(job: str, step_name: str) -> str:
    """The `run: |` script of the step named step_name in job, dedented."""
    lines = jobs_block(workflow())[job].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"- name: {step_name}")
    step_indent = len(lines[start]) - len(lines[start].lstrip())
    run_at = next(i for i in range(start + 1, len(lines))
                  if lines[i].strip() == "run: |" and len(lines[i]) - len(lines[i].lstrip()) == step_indent + 2)
    body_indent = step_indent + 4
    body = []
    for line in lines[run_at + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) < body_indent:
            break
        body.append(line[body_indent:])
    return "\n".join(body).rstrip() + "\n"


def run_bash_step(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = cwd / "step.sh"
    path.write_text(script, encoding="utf-8")
    full = {**os.environ, **env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(path)], check=False, cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=120)


def write_matrix(path: Path, world_size: int, status: str = "pass", device: str = "cuda") -> Path:
    cells = [Cell("fused_loss", "fp32", world_size, status, f"{status} at ws={world_size}", checks=4, grad_checks=2),
             Cell("accumulate", "steps=2-fp32", world_size, "pass", "ok", checks=8, grad_checks=4)]
    environment = {"python": "3.11.7", "torch": "2.13.0", "accelerate": "1.15.0",
                   "backend": "nccl" if device == "cuda" else "gloo", "device": device,
                   "world_sizes": [world_size], "seed": 1234}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(Matrix(environment=environment, cells=cells, created="2026-01-01T00:00:00").to_dict()))
    return path


# --- the workflow as a whole -------------------------------------------------------------------------

def test_actionlint_finds_nothing():
    result = subprocess.run([find_actionlint(), "-no-color", str(WORKFLOW.relative_to(ROOT))], check=False,
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_four_jobs_and_the_nights_artifacts():
    jobs = jobs_block(workflow())
    assert set(JOBS) <= set(jobs)
    assert "needs: [cpu, gpu, multinode]" in jobs["merge"] and "if: always()" in jobs["merge"]
    assert "pytest -n auto cases/ --world-sizes 1,2,4 --backend gloo --report-dir reports/cpu" in jobs["cpu"]
    cpu = jobs["cpu"]
    assert cpu.index("pip install torch==2.13.0") < cpu.index('pip install -e ".[test,deepspeed]"')
    assert "fail-fast: false" in jobs["gpu"]
    assert "--standalone --nproc-per-node" in jobs["gpu"]
    assert '-m harness launch --backend nccl --report-dir "$REPORT_DIR"' in jobs["gpu"]
    assert "sbatch --wait" in jobs["multinode"] and ".ci/nightly-multinode.sbatch" in jobs["multinode"]
    for job, artifact in (("cpu", "matrix-cpu"), ("gpu", "matrix-gpu-${{ matrix.gpus }}"),
                          ("multinode", "matrix-multinode"), ("merge", "matrix-nightly")):
        assert f"name: {artifact}" in jobs[job], job
        assert '>> "$GITHUB_STEP_SUMMARY"' in jobs[job], job
    assert len(re.findall(r"uses: actions/upload-artifact@v4\n\s+if: always\(\)", workflow())) == 4


def test_every_input_falls_back_to_its_own_default():
    """A scheduled run has no inputs: each `inputs.x || default` must repeat the input's default."""
    text = workflow()
    dispatch = text[text.index("workflow_dispatch:"):text.index("\npermissions:")]
    inputs = dict(re.findall(r"\n      ([a-z_]+):\n(?:        .*\n)*?        default: (.+)", dispatch))
    assert set(inputs) == {"gpu_runner_labels", "gpu_counts", "slurm_runner_labels", "nodes", "gpus_per_node",
                           "meshes"}
    for name, default in inputs.items():
        value = default.strip().strip("'\"")
        literal = value if value.isdigit() else f"'{value}'"
        uses = re.findall(rf"inputs\.{name} \|\| ([^ )}}]+)", text)
        assert uses, f"inputs.{name} is never used with a fallback"
        assert set(uses) == {literal}, f"inputs.{name}: fallbacks {uses}, default {literal}"
        if name != "meshes":  # a word for --meshes; the lists and numbers are JSON (fromJSON reads them)
            json.loads(value)


def test_merge_diffs_against_the_last_successful_night():
    merge = jobs_block(workflow())["merge"]
    assert "gh run list" in merge and "--workflow nightly.yml --status success" in merge
    assert '--branch "$BRANCH"' in merge and "BRANCH: ${{ github.ref_name }}" in merge
    assert "--limit 1 --json databaseId" in merge and "GH_TOKEN: ${{ github.token }}" in merge
    assert merge.count("run-id: ${{ steps.previous.outputs.run_id }}") == 2
    assert merge.count("github-token: ${{ github.token }}") == 2
    assert "python -m harness merge" in merge and "python -m harness diff" in merge
    assert re.search(r"^permissions:\n(  .*\n)*  actions: read", workflow(), re.MULTILINE)


# --- the merge job's scripts, run ----------------------------------------------------------------------

def test_merge_step_merges_the_gpu_and_multinode_matrices_only(tmp_path):
    for count in (1, 2):
        write_matrix(tmp_path / f"night/matrix-gpu-{count}/matrix.json", count)
    write_matrix(tmp_path / "night/matrix-multinode/matrix.json", 16)
    write_matrix(tmp_path / "night/matrix-cpu/matrix.json", 2, device="cpu")  # would collide with gpu-2
    summary = tmp_path / "summary.md"
    result = run_bash_step(step_script("merge", "Merge the GPU and multi-node matrices"), tmp_path,
                           {"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.returncode == 0, result.stderr
    merged = json.loads((tmp_path / "reports/nightly/matrix.json").read_text())
    assert sorted({c["world_size"] for c in merged["cells"]}) == [1, 2, 16]
    assert summary.read_text().strip()


def test_merge_step_with_no_gpu_matrix_says_so(tmp_path):
    summary = tmp_path / "summary.md"
    result = run_bash_step(step_script("merge", "Merge the GPU and multi-node matrices"), tmp_path,
                           {"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.returncode == 0, result.stderr
    assert "nothing to merge" in summary.read_text()


def diff_night(tmp_path: Path, previous_run: str, *, last_night: str | None, tonight: str = "pass"):
    """Run the diff step with tonight's matrices (one failing fused_loss when tonight="fail") and,
    unless last_night is None, last night's."""
    write_matrix(tmp_path / "reports/nightly/matrix.json", 2, tonight)
    write_matrix(tmp_path / "night/matrix-cpu/matrix.json", 2, tonight, device="cpu")
    if last_night is not None:
        write_matrix(tmp_path / "previous/nightly/matrix.json", 2, last_night)
        write_matrix(tmp_path / "previous/cpu/matrix.json", 2, last_night, device="cpu")
    summary = tmp_path / "summary.md"
    result = run_bash_step(step_script("merge", "Diff against the last successful night"), tmp_path,
                           {"GITHUB_STEP_SUMMARY": str(summary), "PREVIOUS_RUN": previous_run})
    return result, summary.read_text() if summary.exists() else ""


def test_a_first_night_does_not_fail(tmp_path):
    result, summary = diff_night(tmp_path, "", last_night=None, tonight="fail")
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary.count("nothing to compare") == 2


def test_an_unchanged_night_passes_and_its_diff_is_in_the_summary(tmp_path):
    result, summary = diff_night(tmp_path, "4242", last_night="pass")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "## GPU and multi-node" in summary and "## CPU" in summary
    assert (tmp_path / "reports/nightly/diff.md").read_text() in summary
    assert (tmp_path / "reports/nightly/diff-cpu.md").read_text() in summary


def test_a_regression_against_last_night_fails(tmp_path):
    result, summary = diff_night(tmp_path, "4242", last_night="pass", tonight="fail")
    assert result.returncode == 1
    assert "::error::GPU and multi-node: regression against run 4242" in result.stdout
    assert "::error::CPU: regression against run 4242" in result.stdout
    assert "fused_loss" in summary


def test_last_nights_artifacts_gone_is_a_warning(tmp_path):
    result, summary = diff_night(tmp_path, "4242", last_night=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "::warning::" in result.stdout and "not compared" in summary


# --- the batch script -------------------------------------------------------------------------------

def test_sbatch_script_is_referenced_and_parses():
    assert SBATCH.is_file()
    assert ".ci/nightly-multinode.sbatch" in workflow()
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for directive in ("nodes", "ntasks-per-node", "gpus-per-node", "time"):
        assert re.search(rf"^#SBATCH --{directive}=\S+$", text, re.MULTILINE), directive
    # sbatch reads #SBATCH lines only before the first command
    first_command = next(i for i, line in enumerate(text.splitlines())
                         if line.strip() and not line.startswith("#"))
    last_directive = max(i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert last_directive < first_command
    assert "visible from rank 0's node" in text


def fake_bin(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_script_rendezvous_and_status(tmp_path):
    """Under stand-ins for scontrol and srun: the first host is MASTER_ADDR, the report dir is the first
    argument, and srun's status is the script's."""
    fake_bin(tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "gpu-a07\\ngpu-a08\\n"\n')
    fake_bin(tmp_path, "srun", 'echo "srun MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT $*"\nexit 3\n')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "gpu-a[07-08]", "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "16",
           "SLURM_SUBMIT_DIR": str(tmp_path), "PYTHON": "python3"}
    env.pop("MASTER_PORT", None)
    result = subprocess.run(["bash", str(SBATCH), str(tmp_path / "out")], check=False, env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 3, result.stderr
    port = 20000 + 123456 % 20000
    assert (f"srun MASTER_ADDR=gpu-a07 MASTER_PORT={port} python3 -m harness launch --backend nccl "
            f"--report-dir {tmp_path / 'out'}") in result.stdout
    assert (tmp_path / "out").is_dir()


# --- bench/gpu_smoke.sh -----------------------------------------------------------------------------

def test_gpu_smoke_parses_and_is_executable():
    subprocess.run(["bash", "-n", str(SMOKE)], check=True)
    assert os.access(SMOKE, os.X_OK)
    assert SMOKE.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in SMOKE.read_text()


# A stand-in for python on a box with GPUS GPUs: it logs each call; a launch writes its report dir's
# matrix.json (and fails at world size FAIL_WS), so do pytest and merge.
FAKE_PYTHON = r"""
echo "$*" >> "$CALLS"
if [ "$1" = "-" ]; then cat >/dev/null; echo "torch (stand-in)" >&2; echo "$GPUS"; exit 0; fi
out=""; ws=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --report-dir|--out) out="$2"; shift ;;
    --nproc-per-node) ws="$2"; shift ;;
  esac
  shift
done
if [ -n "$out" ]; then mkdir -p "$out"; echo '{}' > "$out/matrix.json"; echo '|' > "$out/matrix.md"; fi
if [ -n "$ws" ] && [ "$ws" = "${FAIL_WS:-}" ]; then exit 1; fi
exit 0
"""


def run_smoke(tmp_path: Path, gpus: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake_bin(tmp_path, "python", FAKE_PYTHON)
    calls = tmp_path / "calls.log"
    full = {k: v for k, v in os.environ.items() if k != "CASE_TIMEOUT"}
    full.update(PYTHON=str(tmp_path / "bin" / "python"), GPUS=str(gpus), CALLS=str(calls),
                PATH=f"/usr/bin{os.pathsep}/bin", **env)
    result = subprocess.run(["bash", str(SMOKE), str(tmp_path / "out")], check=False, env=full,
                            capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_gpu_smoke_without_a_gpu_says_so_in_one_line(tmp_path):
    result, calls = run_smoke(tmp_path, 0)
    assert result.returncode == 2
    messages = [line for line in result.stderr.splitlines() if line.startswith("gpu_smoke:")]
    assert len(messages) == 1 and messages[0].startswith("gpu_smoke: no GPU found"), result.stderr
    assert calls == ["-"]


def test_gpu_smoke_without_torch_says_so(tmp_path):
    fake_bin(tmp_path, "broken-python", "exit 1\n")
    env = {**os.environ, "PYTHON": str(tmp_path / "bin" / "broken-python")}
    result = subprocess.run(["bash", str(SMOKE), str(tmp_path / "out")], check=False, capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "cannot import torch" in result.stderr


def test_gpu_smoke_runs_every_power_of_two_then_pools_merge_and_diff(tmp_path):
    result, calls = run_smoke(tmp_path, 6, FAIL_WS="2", CASE_TIMEOUT="45")
    out = tmp_path / "out"
    launches = [c for c in calls if "-m torch.distributed.run" in c]
    every = "--wrappers ddp,fsdp2,fsdp1,deepspeed-z1,deepspeed-z2,deepspeed-z3"  # every wrapper, every variant
    assert launches == [f"-m torch.distributed.run --standalone --nproc-per-node {n} -m harness launch "
                        f"--backend nccl --report-dir {out}/launch-ws{n} {every} --case-timeout 45" for n in (1, 2, 4)]
    assert (f"-m pytest cases/ -p no:cacheprovider --backend nccl --report-dir {out}/pools {every} "
            "--case-timeout 45") in calls
    merged = [f"{out}/launch-ws{n}/matrix.json" for n in (1, 2, 4)]
    assert f"-m harness merge {' '.join(merged)} --out {out}/launches" in calls
    assert (f"-m harness diff {out}/launches/matrix.json {out}/pools/matrix.json "
            f"--output {out}/launch-vs-pools.txt") in calls
    # a failed launch does not stop the rest, and the status says which
    assert result.returncode == 1
    assert "torchrun launch at world size 2 (exit 1)" in result.stderr
    assert f"{out}/pools/matrix.md" in result.stdout


def test_gpu_smoke_all_passing_exits_zero(tmp_path):
    result, calls = run_smoke(tmp_path, 1)
    assert result.returncode == 0, result.stderr
    assert sum("-m torch.distributed.run" in c for c in calls) == 1
    assert not any("--case-timeout" in c for c in calls)
    assert "every step passed on 1 GPU(s)" in result.stdout
