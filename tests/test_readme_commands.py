"""Every runnable ``hybridnorm train`` / ``torchrun`` command of README.md, verbatim and in order, in one
scratch folder: a documented command cannot hang or fail unnoticed. Runnable means CPU-sized
(``--size tiny``) with no placeholder (``...``, ``[optional]``, ``HOST``); the others are synopses or
GPU-sized, and are listed by the skip test below so a reader sees what is not run. Each command must exit
0 within its bound (a hang is a failure, not a stuck suite)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from train_helpers import run_bounded

import hybridnorm

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDERS = ("...", "[", "]", "HOST", "|")


def _commands() -> list[str]:
    """Each command line of the README's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            command = line.split(" # ")[0].split("  #")[0].strip()
            if command.startswith(("hybridnorm train", "torchrun ")):
                out.append(command)
    return out


def _runnable(command: str) -> bool:
    return "--size tiny" in command and not any(p in command for p in PLACEHOLDERS)


def test_the_readme_has_runnable_multi_process_commands():
    runnable = [c for c in _commands() if _runnable(c)]
    assert sum(c.startswith("torchrun") for c in runnable) >= 2 and any("--resume" in c for c in runnable)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_every_runnable_readme_command_runs_verbatim(tmp_path):
    # the code under test, also from the scratch folder (a relative PYTHONPATH would not reach it there)
    src = str(Path(hybridnorm.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDNORM_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    for command in filter(_runnable, _commands()):
        words = shlex.split(command)
        if words[0] == "hybridnorm":  # this checkout's package, whichever `hybridnorm` script is on PATH
            words = [sys.executable, "-m", "hybridnorm.cli", *words[1:]]
        proc = run_bounded(words, 300, cwd=tmp_path, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        assert "final: step" in proc.stdout, f"{command}\n{proc.stdout[-2000:]}"


def test_what_is_not_run_is_a_synopsis_or_gpu_sized():
    for command in _commands():
        if not _runnable(command):
            assert any(p in command for p in PLACEHOLDERS) or "--size tiny" not in command, command
