"""The supported range: the lowest torch and accelerate the harness supports (docs/upgrade-checks.md,
"Supported versions"; pyproject.toml declares the same, and a test holds the two together).

Inside the range a cell that a release cannot run is ``skip`` or ``unsupported``, found by asking
the release (harness/wrappers/capabilities.py, harness/wrappers/probe.py); below it, a run with cells stops at start
with one line naming the range, never a matrix of harness errors. This is the one place where the
harness reads a version number to decide anything."""

from __future__ import annotations

import functools
import re
from importlib import metadata

# The lowest releases run here (README, "Supported versions"): torch 2.4 is the oldest the package
# registry serves for this Python; accelerate 0.19 the oldest release the catalogue was run against.
MINIMUM = {"torch": "2.4", "accelerate": "0.19"}


def _release(text: str) -> tuple[int, ...]:
    """``2.6.0+cu124`` -> (2, 6, 0); ``2.14.0a0`` -> (2, 14, 0): the release numbers, nothing after."""
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


@functools.lru_cache(maxsize=None)
def installed(package: str) -> str | None:
    """The installed release of ``package`` (read once a process: a declared defect asks per cell)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def below(package: str, release: str) -> bool:
    """Whether the installed ``package`` is a release before ``release`` (False when not installed)."""
    version = installed(package)
    return version is not None and _release(version) < _release(release)


def below_range(minimum: dict[str, str] | None = None) -> str | None:
    """One line naming the range and what is installed below it (or missing), or None inside it."""
    minimum = MINIMUM if minimum is None else minimum
    wrong = []
    for package, lowest in minimum.items():
        version = installed(package)
        if version is None:
            wrong.append(f"{package} is not installed")
        elif _release(version) < _release(lowest):
            wrong.append(f"{package} {version} is installed")
    if not wrong:
        return None
    declared = " and ".join(f"{package} >= {lowest}" for package, lowest in minimum.items())
    return (f"gradsync-harness supports {declared}; {', '.join(wrong)}: install a release in the range "
            "to run the gradient-sync matrix")
