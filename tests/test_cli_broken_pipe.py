"""`hybridnorm placements | head -1`: a reader of stdout that goes away ends a command quietly, with the status a
shell shows for a Unix tool that SIGPIPE ended (141), as `git log | head` does; before 2026-12-02 it printed
`error: [Errno 32] Broken pipe` and exited 2, as for bad input. The reader is gone before the first write, so
every write meets the closed pipe (no race with how much the command prints)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["placements"], ["plan", "--size", "tiny", "--seq-len", "64"]])
def test_a_closed_stdout_ends_the_command_quietly_with_141(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-m", "hybridnorm.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""  # no error line, no "Exception ignored" from Python's exit


def test_the_same_command_with_its_reader_prints_and_exits_0() -> None:
    out = subprocess.run([sys.executable, "-m", "hybridnorm.cli", "placements"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "hybridnorm_star" in out.stdout and out.stderr == ""
