"""The run folder as an environment: an ``--out_dir`` that cannot be a run folder is refused before any work;
one trainer per folder (a second one is refused, naming the holder; a killed holder frees it); a disk that
fills up during a save costs that save only — one ``error:`` line, exit 2, no temporary folder left, every
earlier checkpoint intact."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoint_helpers import model_and_optimizer, snapshot, start_trainer, train_records, wait_for, write_checkpoint
from safetensors import SafetensorError
from train_helpers import tiny_overrides

import hybridnorm.train.checkpoint.save as checkpoint
from hybridnorm import cli
from hybridnorm.train.checkpoint import CheckpointSaveError, latest_checkpoint, list_checkpoints, verify_checkpoint
from hybridnorm.train.checkpoint.lock import LOCK_NAME


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[None]:
    """A small tmpfs at ``where`` (root only): a real full or read-only file system, not a simulation."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN?)")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _train(corpus, cache, out, *extra) -> list[str]:
    return ["train", *tiny_overrides(corpus, cache, out), *extra]


# ---- --out_dir that cannot be a run folder: refused before data, model or anything else ----------------------

@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_out_dir_that_is_or_lies_under_a_file(corpus, cache_dir, tmp_path, capsys, kind):
    blocker = tmp_path / "results.txt"
    blocker.write_text("not a folder", encoding="utf-8")
    out = blocker if kind == "file" else blocker / "run"
    # a data source that does not exist: had any work started before the out_dir check, it would fail there
    rc = cli.main(_train(corpus, cache_dir, out, "--data.source=/nonexistent/corpus", "--max_steps=2"))
    line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert str(blocker) in line and "file" in line and "nonexistent" not in line
    assert blocker.read_text(encoding="utf-8") == "not a folder"


def test_read_only_out_dir(corpus, cache_dir, tmp_path, capsys):
    ro = tmp_path / "ro"
    with _tmpfs(ro, "size=1m,ro"):
        rc = cli.main(_train(corpus, cache_dir, ro / "run", "--data.source=/nonexistent/corpus", "--max_steps=2"))
        line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert str(ro) in line and "Read-only file system" in line and "nonexistent" not in line


# ---- one trainer per run folder ----------------------------------------------------------------------------

def test_second_trainer_on_the_same_folder_is_refused_naming_the_holder(corpus, cache_dir, tmp_path,
                                                                       no_peak_measure, capsys):
    run = tmp_path / "run"
    args = tiny_overrides(corpus, cache_dir, run)
    holder = start_trainer([*args, "--max_steps=100000"], tmp_path / "holder.log")
    try:
        wait_for(holder, lambda: train_records(run) >= 2, tmp_path / "holder.log")
        second_log = tmp_path / "second.log"
        second = start_trainer([*args, "--max_steps=100000", "--resume"], second_log)
        assert second.wait(timeout=120) == 2
        line = _error_line(second_log.read_text(errors="replace"))
        assert str(run) in line and f"pid {holder.pid}" in line and socket.gethostname() in line
        assert holder.poll() is None  # the holder was not disturbed
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the lock with the process: the folder can be resumed at once
    ckpt = latest_checkpoint(run / "checkpoints")
    start = int(ckpt.name.split("_")[1]) if ckpt else 0
    assert cli.main(["train", *args, "--resume", f"--max_steps={start + 1}"]) == 0
    assert not (run / LOCK_NAME).exists()  # released and removed by the process that finished


# ---- a full disk during a save -----------------------------------------------------------------------------

def test_disk_full_during_a_save_on_a_real_small_file_system(corpus, cache_dir, tmp_path, capsys, no_peak_measure):
    small = tmp_path / "small"
    # one checkpoint of the tiny model is ~1.1 MB: the first fits, the second cannot
    with _tmpfs(small, "size=1500k"):
        run = small / "run"
        rc = cli.main(_train(corpus, cache_dir, run, "--ckpt_interval=2", "--max_steps=50", "--keep_last=0"))
        err = capsys.readouterr().err
        line = _error_line(err)
        assert rc == 2
        assert "No space left on device" in line and str(run / "checkpoints" / "step_000004") in line
        assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000002"]
        verify_checkpoint(run / "checkpoints" / "step_000002")
        assert not list((run / "checkpoints").glob(".tmp_*"))
        assert not (run / LOCK_NAME).exists()


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_failed_save_removes_its_temporary_folder_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, failure):
    mo = model_and_optimizer()
    write_checkpoint(tmp_path, 2, model_opt=mo)
    before = snapshot(tmp_path)
    real, calls = checkpoint.save_file, []

    def full_disk(tensors, filename):  # the second file of the save: half a checkpoint is on disk
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            if failure == "oserror":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename)

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointSaveError, match=r"step_000004 failed: No space left on device \(writing "
                                                  r".*optimizer\.safetensors\)"):
        write_checkpoint(tmp_path, 4, keep_last=1, model_opt=mo)
    assert snapshot(tmp_path) == before  # the temporary folder is gone, nothing pruned, nothing else changed


def test_failed_save_in_a_run_is_one_error_line(corpus, cache_dir, tmp_path, capsys, monkeypatch, no_peak_measure):
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "_write_json", no_space)
    run = tmp_path / "run"
    rc = cli.main(_train(corpus, cache_dir, run, "--max_steps=3"))
    line = _error_line(capsys.readouterr().err)
    assert rc == 2 and "No space left on device" in line and str(run / "checkpoints") in line
    assert list_checkpoints(run / "checkpoints") == [] and not list((run / "checkpoints").glob(".tmp_*"))
