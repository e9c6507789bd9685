"""A write that the OS refuses part-way (a full disk; here a file-size limit, which fails the same ``write``
calls with EFBIG and needs no root): ``export``, ``import`` and ``train`` end with one ``error:`` line naming
the folder asked for and the OS's reason, exit 2, no traceback, and nothing half-written left behind.

Before: ``export`` on a full disk printed safetensors' traceback (its I/O errors are a ``SafetensorError``,
not an ``OSError``), and ``import`` named its hidden staging folder and "earlier checkpoints" it never had.

The limit is set in the child process only (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so that the write
fails instead of the signal killing the process), below the size of the model's weights file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from bad_input_helpers import make_hf_and_run, snapshot
from train_helpers import tiny_overrides

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
resource = pytest.importorskip("resource", reason="file-size limits are POSIX")

LIMIT = 100_000  # bytes: every weights file here is larger (the tiny model's is ~360 KB), configs are smaller
WRAPPER = textwrap.dedent(f'''
    import resource, runpy, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))
    sys.argv = ["hybridnorm", *sys.argv[1:]]
    runpy.run_module("hybridnorm.cli", run_name="__main__")
''')


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_hf_and_run(tmp_path_factory.mktemp("full_disk"))


def _run_limited(tmp_path: Path, argv: list[str]) -> str:
    """The command under the limit; returns its one error line after checking exit 2 and no traceback."""
    wrapper = tmp_path / "limited.py"
    wrapper.write_text(WRAPPER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(wrapper), *argv], capture_output=True, text=True, timeout=300,
                          env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_full_disk_is_one_error_naming_the_folder_and_leaves_nothing(folders, tmp_path, command):
    hf, run = folders
    parent = tmp_path / "outputs"
    parent.mkdir()
    before = snapshot(hf) | {f"run/{k}": v for k, v in snapshot(run).items()}
    out = parent / "out"
    argv = (["export", str(run), "--to", "hf", str(out)] if command == "export"
            else ["import", str(hf), "--out", str(out)])
    line = _run_limited(tmp_path, argv)
    what = "export folder" if command == "export" else "run folder"
    assert line == f"error: {what} {out}: cannot write: File too large; nothing was left behind"
    assert list(parent.iterdir()) == []  # neither out/ nor the hidden folder it was written in
    assert snapshot(hf) | {f"run/{k}": v for k, v in snapshot(run).items()} == before


def test_a_full_disk_at_the_first_checkpoint_keeps_the_run_folder_clean(corpus, cache_dir, tmp_path):
    """train: the data cache is already written (the session's), the first checkpoint's weights exceed the
    limit. One line naming the checkpoint and the reason; no step_* folder and no temporary one."""
    out = tmp_path / "run"
    line = _run_limited(tmp_path, ["train", *tiny_overrides(corpus, cache_dir, out), "--max_steps=2"])
    assert "step_000002 failed: File too large" in line and str(out / "checkpoints") in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []
