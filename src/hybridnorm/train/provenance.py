"""Which code made a run, and on what hardware: the versions of hybridnorm, torch and Python, the git commit
of the hybridnorm source when it is a git checkout, and the device that ran the steps.

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

_CPUINFO = Path("/proc/cpuinfo")


def _git(args: list[str], cwd: Path) -> str | None:
    # --no-optional-locks: `git status` would otherwise refresh the index, taking .git/index.lock in the
    # user's checkout while they may be committing there (their `git commit` then fails on the lock)
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=False)
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


def _cpu_name() -> str | None:
    """The processor's model name (Linux: /proc/cpuinfo; elsewhere what ``platform`` knows, maybe nothing)."""
    try:
        for line in _CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def hardware(device: torch.device, processes: int = 1) -> dict[str, Any]:
    """{"device", "name", "processes", "threads"}: the kind of device the steps ran on (cpu / cuda / mps), its
    model name (a GPU's, or the CPU's), how many processes trained together, and the CPU threads of this
    one. Two runs with the same seed and config can differ in the last digits on other hardware: a report
    says which ran where."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"device": device.type, "name": name, "processes": processes, "threads": torch.get_num_threads()}


def describe_hardware(record: dict[str, Any] | None) -> str:
    """One short line for a report: ``cuda NVIDIA H100 80GB HBM3``, ``cpu AMD EPYC 9B14 (2 threads)``, with
    ``2 × `` in front when several processes trained together; ``not recorded`` for older runs."""
    if not record:
        return "not recorded"
    kind, name = record.get("device", "?"), record.get("name") or "unknown model"
    threads = f" ({record['threads']} threads)" if kind == "cpu" and record.get("threads") else ""
    times = f"{record['processes']} × " if (record.get("processes") or 1) > 1 else ""
    return f"{times}{kind} {name}{threads}"
