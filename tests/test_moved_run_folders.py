"""Run folders and data caches as researchers move and share them: a run moved (or copied to another machine)
where its ``data.source`` and its trainer's ``data.cache_dir`` are not, evaluated with ``hybridnorm eval``;
a data cache on a read-only file system, read by ``train`` and ``eval``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_helpers import tiny_overrides

from hybridnorm import cli
from hybridnorm.data.tokenizer import file_lock
from hybridnorm.errors import ConfigError


def _eval(capsys, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main(["eval", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, (captured.out + captured.err).strip().splitlines()


def _loss(lines: list[str]) -> str:
    (found,) = [m.group(1) for line in lines if (m := re.search(r"val loss (\S+), perplexity", line))]
    return found


def test_eval_of_a_moved_run_whose_corpus_is_gone_reads_it_from_the_cache(corpus, tmp_path, capsys, monkeypatch,
                                                                          no_peak_measure):
    src, cache = Path(shutil.copytree(corpus, tmp_path / "data")), tmp_path / "trainer-cache"
    assert cli.main(["train", *tiny_overrides(src, cache, tmp_path / "run"), "--max_steps=2"]) == 0
    rc, lines = _eval(capsys, str(tmp_path / "run"))
    assert rc == 0
    before = _loss(lines)

    moved = tmp_path / "elsewhere" / "moved"
    shutil.move(tmp_path / "run", moved)
    src.rename(tmp_path / "data-now")  # the recorded absolute data.source is stale
    rc, lines = _eval(capsys, str(moved))
    assert rc == 0 and _loss(lines) == before  # the same validation tokens, from the cache
    (note,) = [line for line in lines if line.startswith("note:")]
    assert f"data.source={src}" in note and str(cache) in note

    # on another machine: neither the trainer's cache path nor the data is there; the machine's cache is used
    shutil.rmtree(cache)
    monkeypatch.setenv("HYBRIDNORM_CACHE", str(tmp_path / "machine-cache"))
    rc, lines = _eval(capsys, str(moved))
    (line,) = lines
    assert rc == 2 and line.startswith("error: ") and f"data.source={src}" in line and "--data" in line
    assert not cache.exists()  # the recorded cache path is not recreated
    rc, lines = _eval(capsys, str(moved), "--data", str(tmp_path / "data-now"))
    assert rc == 0 and _loss(lines) == before and not cache.exists()
    assert (tmp_path / "machine-cache").is_dir()
    rc, lines = _eval(capsys, str(moved))  # prepared there by --data: the run's corpus is found by content
    assert rc == 0 and _loss(lines) == before

    # a checkpoint from before data_sha256 was recorded: no cached copy can be found by content, and the error
    # says so (it said "the data cache holds no prepared copy", though one is there)
    (state,) = moved.glob("checkpoints/step_*/state.json")
    body = json.loads(state.read_text())
    del body["extra"]["data_sha256"]
    state.write_text(json.dumps(body))
    manifest = json.loads((state.parent / "manifest.json").read_text())  # its record of state.json, rewritten too
    manifest["state.json"] = {"bytes": state.stat().st_size, "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
    (state.parent / "manifest.json").write_text(json.dumps(manifest))
    rc, lines = _eval(capsys, str(moved))
    (line,) = lines
    assert rc == 2 and "records no data sha256" in line and "holds no prepared copy" not in line and "--data" in line


@contextlib.contextmanager
def _read_only_copy(folder: Path, where: Path) -> Iterator[Path]:
    """``folder`` copied onto a small tmpfs at ``where``, remounted read-only (root only): a real read-only
    file system, where root too is refused."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN?)")
    try:
        shutil.copytree(folder, where / folder.name)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where / folder.name
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_data_cache_is_read_by_train_and_eval(corpus, tmp_path, capsys, no_peak_measure):
    cache = tmp_path / "cache"
    assert cli.main(["train", *tiny_overrides(corpus, cache, tmp_path / "run"), "--max_steps=1"]) == 0
    rc, lines = _eval(capsys, str(tmp_path / "run"))  # reads the trainer's entry: the cache holds no other
    assert rc == 0
    before = _loss(lines)
    with _read_only_copy(cache, tmp_path / "ro") as ro:
        assert cli.main(["train", *tiny_overrides(corpus, ro, tmp_path / "r1"), "--max_steps=1"]) == 0
        rc, lines = _eval(capsys, str(tmp_path / "r1"))  # r1's data.cache_dir is the read-only one
        assert rc == 0 and _loss(lines) == before  # the same run, trained and scored on the same tokens

    (entry,) = [p.parent for p in cache.glob("*-bytes/meta.json")]
    (entry / "meta.json").unlink()  # a preparation killed before its last file: nothing there is ready
    with _read_only_copy(cache, tmp_path / "ro2") as ro:
        capsys.readouterr()
        assert cli.main(["train", *tiny_overrides(corpus, ro, tmp_path / "r2"), "--max_steps=1"]) == 2
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if line.startswith("error:")]
        assert "Traceback" not in err and str(ro / entry.name) in line and "read-only" in line
    assert not (tmp_path / "r2").exists()


def test_a_lock_file_another_user_made_unreadable_is_no_way_around_the_lock():
    """A shared cache entry (a folder every user may write) whose ``.lock`` another user made with umask 077: a
    process that could not open it went on without any lock, and could build the entry while its maker held
    the lock and built it too. One error naming the file now; a folder it cannot write stays read as it is."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    with tempfile.TemporaryDirectory() as shared:  # in the system's temp folder: pytest's is root's alone
        folder = Path(shared) / "entry"
        folder.mkdir()
        folder.parent.chmod(0o755)
        folder.chmod(0o777)
        (folder / ".lock").touch(mode=0o600)  # root's: unreadable by nobody
        assert _nobody_takes_the_lock(folder) == 0
        folder.chmod(0o755)  # nobody cannot write there: reads it as it is, unlocked (it builds nothing)
        assert _nobody_takes_the_lock(folder) == 1


def _nobody_takes_the_lock(folder: Path) -> int:
    """What user nobody's file_lock on ``folder`` does while root holds it: 0 refused naming the lock file, 1
    went on, 2 another error."""
    with file_lock(folder):  # root building the entry
        pid = os.fork()
        if pid == 0:  # nobody, in the same shared cache
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                with file_lock(folder):
                    code = 1  # went on while root holds the lock
            except ConfigError as e:
                code = 0 if str(folder / ".lock") in str(e) and "two processes" in str(e) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
