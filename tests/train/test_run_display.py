"""What a run shows besides its checkpoints: the console lines (paths printed as they are, a line per log interval
on a terminal that cannot redraw, no crash on a stdout that is not UTF-8) and TensorBoard's view of the run,
read with TensorBoard's own ``EventAccumulator`` and compared, scalar by scalar, with ``metrics.jsonl``."""

from __future__ import annotations

import os
import pty
import shutil
import sys
from pathlib import Path

from train_helpers import tiny_overrides

from hybridnorm import cli
from hybridnorm.train.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_paths_with_brackets_are_printed_as_they_are(corpus, cache_dir, tmp_path, capsys, no_peak_measure):
    """A data folder named ``docs[v2]`` was printed as ``docs`` (rich took ``[v2]`` for a style), and a run folder
    under ``x[/y]`` could not be resumed at all: rich raised MarkupError on the ``[/y]`` of the checkpoint path."""
    source = tmp_path / "docs[v2]"
    shutil.copytree(corpus, source)  # the same files under the same names: the cached tokens are reused
    run = tmp_path / "x[" / "y]"
    args = ["train", *tiny_overrides(source, cache_dir, run), "--ckpt_interval=1"]
    assert cli.main([*args, "--max_steps=1"]) == 0
    assert f"data: {source} (" in capsys.readouterr().err
    assert cli.main([*args, "--max_steps=2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resumed from {run / 'checkpoints' / 'step_000001'}" in err and "Traceback" not in err
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"


def _read_all(fd: int) -> bytes:
    """What the terminal holds now: read until nothing more comes for a moment (a pty hands it over in pieces)."""
    import select

    got = b""
    while select.select([fd], [], [], 0.5)[0]:
        got += os.read(fd, 1 << 16)
    return got


def test_a_dumb_terminal_gets_a_line_per_log_interval(tmp_path, monkeypatch):
    """On a terminal that cannot redraw (TERM=dumb) rich shows a live bar only once, when it stops: the steps
    before the last one were never on the screen. It gets the plain line per log interval, as a file does."""
    from hybridnorm.train.logger import MetricsLogger

    master, slave = pty.openpty()
    monkeypatch.setenv("TERM", "dumb")
    with open(slave, "w", encoding="utf-8", closefd=True) as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
        for step in (1, 2, 3):
            log.log(step, {"loss": 5.0 + step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.1})
        log.close()
        tty.flush()
        shown = _read_all(master).decode("utf-8", "replace")
    os.close(master)
    for step in (1, 2, 3):
        assert f"step {step}  loss {5.0 + step:.4f}" in shown, shown
    assert "\x1b" not in shown  # nothing a dumb terminal would print as garbage
