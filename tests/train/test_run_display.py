"""What a run shows besides its checkpoints: the console lines (paths printed as they are, a line per log interval
on a terminal that cannot redraw, no crash on a stdout that is not UTF-8) and TensorBoard's view of the run,
read with TensorBoard's own ``EventAccumulator`` and compared, scalar by scalar, with ``metrics.jsonl``."""

from __future__ import annotations

import io
import json
import math
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from train_helpers import tiny_overrides

from hybridnorm import cli
from hybridnorm.train.checkpoint import latest_checkpoint
from hybridnorm.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]


def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series TensorBoard shows for the run (its reader applies the purges of a restart)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def jsonl_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The same series from metrics.jsonl: ``<kind>/<key>`` for each finite number, as float32 as TB keeps it."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        for key, value in rec.items():
            if key not in ("kind", "step", "time") and isinstance(value, (int, float)) and math.isfinite(value):
                out.setdefault(f"{rec['kind']}/{key}", []).append((rec["step"], float(np.float32(value))))
    return out


def test_tensorboard_shows_one_history_after_a_run_starts_over(make_cfg, tmp_path):
    """A run killed before its first checkpoint starts over at step 0 and sets its old metrics.jsonl aside; its
    TensorBoard view must be that one history too. The old run's step-0 points (its meta record) stayed beside
    the new ones: two `meta/params` points at step 0, and a config changed between the two starts showed both."""
    run = tmp_path / "run"
    train(make_cfg(run, "--max_steps=2", "--model.d_model=48"))
    shutil.rmtree(run / "checkpoints")  # as if killed before its first save
    train(make_cfg(run, "--max_steps=3"))
    assert (run / "metrics.stale.jsonl").is_file()
    want, got = jsonl_scalars(run), tensorboard_scalars(run)
    assert got["meta/params"] == want["meta/params"] and len(want["meta/params"]) == 1
    assert got == want


def test_tensorboard_equals_the_log_after_a_resume_past_a_lost_tail(make_cfg, tmp_path):
    """A run resumed from an older checkpoint than its log's end (a kill after the save): each step once, the
    checkpoint step's own points kept, every value TensorBoard shows the log's."""
    run = tmp_path / "run"
    train(make_cfg(run, "--max_steps=4", "--ckpt_interval=2", "--eval_interval=2", "--diagnostics.every=2"))
    shutil.rmtree(run / "checkpoints" / "step_000004")  # the log runs to step 4, the newest checkpoint is step 2
    train(make_cfg(run, "--max_steps=5", "--ckpt_interval=2", "--eval_interval=2", "--diagnostics.every=2"),
          resume=True)
    want, got = jsonl_scalars(run), tensorboard_scalars(run)
    assert [s for s, _ in want["train/loss"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in want["meta/params"]] == [0, 2]
    assert got == want


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


def test_placements_on_a_stdout_that_is_not_utf8():
    """Python's C locale without its UTF-8 mode gives an ASCII stdout: the equations' subscripts raised
    UnicodeEncodeError, printed as an ``error:`` line after half the list. Now they come out escaped."""
    env = {**os.environ, "LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONPATH": str(ROOT / "src")}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run([sys.executable, "-m", "hybridnorm.cli", "placements"], env=env, capture_output=True,
                          timeout=300)
    assert done.returncode == 0 and b"error" not in done.stderr, done.stderr
    assert "X\\u2081 = N(Embed(tokens))" in done.stdout.decode("ascii")  # embed_norm's X₁


def test_gradprofile_progress_line_on_a_latin1_stdout(corpus, cache_dir, tmp_path, monkeypatch):
    """``hybridnorm gradprofile`` prints ``‖∇‖``: on a Latin-1 stdout that was a traceback after the first profile.
    The stdout that ``cli.main`` sets up writes it as escapes instead."""
    from hybridnorm.errors import escape_unencodable_output
    from hybridnorm.experiments import gradprofile

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1", errors="strict"))
    escape_unencodable_output()
    over = [f"--data.source={corpus}", "--data.tokenizer=bytes", f"--data.cache_dir={cache_dir}"]
    gradprofile.run(tmp_path / "p.json", ["tiny"], ["pre"], ["default"], [0], 2, 32, over)
    sys.stdout.flush()
    assert "last/first block \\u2016\\u2207\\u2016 " in raw.getvalue().decode("latin-1")
