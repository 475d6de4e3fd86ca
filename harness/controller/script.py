"""What a ``python -m harness watch SCRIPT`` run asked for (harness/launch/watch_command.py), as the controller
reads it: the matrix names the script, and the command that reruns one of its cells."""

from __future__ import annotations

import shlex
from typing import Any

from harness.decorator import ALL_PRECISIONS
from harness.messages import watched

SCRIPT_CELLS = ("script", "cells.py")  # harness/rank/script/cells.py, under harness/rank: the cells' case file


def rerun_command(*, world_size: int, variant: str, report_dir: str, case_timeout_s: float) -> str:
    """The command that runs one cell of the running ``watch`` again, its reports in ``report_dir``."""
    asked = watched() or {}
    parts = ["python", "-m", "harness", "watch", str(asked.get("path")),
             "--world-sizes", str(world_size)]
    if variant in ALL_PRECISIONS:
        parts += ["--precision", variant]
    if asked.get("loss"):
        parts += ["--loss", str(asked["loss"])]
    if asked.get("num_steps"):
        parts += ["--num-steps", str(asked["num_steps"])]
    if asked.get("contract"):
        parts += ["--contract", str(asked["contract"])]
    if asked.get("tiny_model"):
        parts += ["--tiny-model"]
    parts += ["--report-dir", report_dir, "--case-timeout", f"{case_timeout_s:g}"]
    if asked.get("argv"):
        parts += ["--", *asked["argv"]]
    return shlex.join(parts)


def script_environment(asked: dict[str, Any]) -> dict[str, Any]:
    """What ``python -m harness watch`` ran, for the matrix: the script, its arguments, the options of the
    specification, and the launcher's ACCELERATE_* settings the script ran under (not ignored, as they
    are for a case)."""
    shown = {key: asked.get(key) for key in ("path", "argv", "loss", "num_steps", "contract", "tiny_model")}
    return {**shown, "accelerate_settings": sorted(asked.get("accelerate_settings") or {})}
