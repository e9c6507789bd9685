"""Which code made a run: the versions of hybridnorm, torch and Python, and the git commit of the hybridnorm
source when it is a git checkout.

The trainer writes this into the run's ``meta`` record so that a report comparing runs made weeks apart can
say whether the same code made them (a config records what was asked for, not the code that did it). The
commit is read with the local ``git`` program (no network); ``git_dirty`` says whether tracked files of the
package differ from that commit. Without git, or outside a checkout (a wheel install), both are None.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import hybridnorm


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):  # no git program, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.lru_cache(maxsize=4)
def code_versions(source: Path | None = None) -> dict[str, Any]:
    """{"hybridnorm", "torch", "python", "git_commit", "git_dirty"} for this process (computed once);
    the git fields describe ``source``, the folder of the hybridnorm package unless given."""
    package = source or Path(hybridnorm.__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], package)
    dirty = None
    if commit is not None:
        status = _git(["status", "--porcelain", "--untracked-files=no", "--", "."], package)
        dirty = None if status is None else bool(status)
    return {"hybridnorm": hybridnorm.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": commit, "git_dirty": dirty}


def describe(versions: dict[str, Any] | None) -> str:
    """One short line for a report: ``hybridnorm 0.1.0 @ 1a2b3c4d (modified), torch 2.13.0``; or ``not
    recorded`` for a run made before the trainer recorded it."""
    if not versions:
        return "not recorded"
    commit = versions.get("git_commit")
    at = f" @ {commit[:8]}" + (" (modified)" if versions.get("git_dirty") else "") if commit else ""
    return f"hybridnorm {versions.get('hybridnorm', '?')}{at}, torch {versions.get('torch', '?')}"
