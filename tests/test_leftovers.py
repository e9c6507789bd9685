"""What a writer killed outright leaves (``hybridnorm.leftovers``): the next all-or-nothing write of the same
target removes the temporaries of writers that are gone, and nothing else. Checked on the cache writer
(``atomic_file``: tokenizers, token files, eval reports); the export/import folders are checked with a real
SIGKILL in test_cli_interrupt.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from hybridnorm import leftovers
from hybridnorm.data.tokenizer import atomic_write


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_write_clears_dead_writers_temporaries_and_nothing_else(tmp_path: Path) -> None:
    host = socket.gethostname().replace(".", "_")
    target = tmp_path / "tokens.bin"
    dead = _dead_pid()
    stale_file = tmp_path / f".tokens.bin.tmp-{host}-{dead}-abc.tmp"  # a killed tokenizer run's half file
    stale_dir = tmp_path / f".tokens.bin.tmp-{host}-{dead}-def"
    kept = {
        tmp_path / f".tokens.bin.tmp-{host}-{os.getpid()}-live.tmp": "a live writer's",
        tmp_path / f".tokens.bin.tmp-another_host-{dead}-x.tmp": "another host's: its pid means nothing here",
        tmp_path / f".other.bin.tmp-{host}-{dead}-y.tmp": "another target's",
        tmp_path / ".tokens.bin.abcdef.tmp": "a name of the old form (no writer in it)",
        tmp_path / "notes.txt": "a user's file",
    }
    stale_file.write_bytes(b"half")
    stale_dir.mkdir()
    (stale_dir / "x").write_bytes(b"half")
    for path, text in kept.items():
        path.write_text(text, encoding="utf-8")

    atomic_write(target, "whole")

    assert target.read_text(encoding="utf-8") == "whole"
    assert not stale_file.exists() and not stale_dir.exists()
    for path, text in kept.items():
        assert path.read_text(encoding="utf-8") == text, path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, *(p.name for p in kept)])


def test_temporaries_are_named_after_their_writer(tmp_path: Path) -> None:
    prefix = leftovers.temp_prefix("model.safetensors", "partial")
    assert prefix == f".model.safetensors.partial-{socket.gethostname().replace('.', '_')}-{os.getpid()}-"
    leftovers.clear_dead(tmp_path / "missing", "x", "tmp")  # a folder that is not there: nothing to do
