"""SIGTERM or Ctrl-C to a command that writes a folder (``export``, ``import``) while it writes: exit 130,
one ``interrupted:`` line that says nothing was written, no traceback, and nothing left behind — neither the
output folder nor the hidden half-written one beside it. Before, only ``train`` handled SIGTERM: an
``export`` killed by it left its ``.OUT.partial-*`` folder for good.

The command runs as ``python -m hybridnorm.cli`` would (``runpy``), from a wrapper that holds one function
inside the staged write until the test has sent its signal, so the signal provably lands mid-write."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bad_input_helpers import make_hf_and_run, snapshot

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

# argv: the marker prefix, "module:function" to hold (once), then the CLI's arguments
WRAPPER = textwrap.dedent('''
    import importlib, runpy, sys, time
    from pathlib import Path

    marker, target = sys.argv[1], sys.argv[2]
    module_name, name = target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def held(*args, **kwargs):
        Path(f"{marker}.held").write_text("held", encoding="utf-8")
        while not Path(f"{marker}.go").exists():
            time.sleep(0.01)
        return original(*args, **kwargs)

    setattr(module, name, held)
    sys.argv = ["hybridnorm", *sys.argv[3:]]
    runpy.run_module("hybridnorm.cli", run_name="__main__")
''')


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_hf_and_run(tmp_path_factory.mktemp("interrupt"))


@contextlib.contextmanager
def _held(tmp_path: Path, target: str, argv: list[str]) -> Iterator[subprocess.Popen]:
    """The command running with ``target`` held (it has reached it when this yields); killed on leaving if
    still running. Its output goes to ``tmp_path / "cmd.log"``; writing ``marker.go`` lets it go on."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER, encoding="utf-8")
    marker, log = tmp_path / "marker", tmp_path / "cmd.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(wrapper), str(marker), target, *argv],
                                stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{marker}.held").exists():
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the command never reached the held function"
            time.sleep(0.02)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _interrupted_while_held(tmp_path: Path, target: str, argv: list[str], sig: int) -> str:
    """Run the command with ``target`` held, send ``sig`` while it is held, let it go on; returns the
    output after checking exit 130 and no traceback."""
    with _held(tmp_path, target, argv) as proc:
        proc.send_signal(sig)
        time.sleep(0.2)  # the handler runs now; the default SIGTERM would end the process right here
        (tmp_path / "marker.go").write_text("", encoding="utf-8")
        rc = proc.wait(timeout=120)
    output = (tmp_path / "cmd.log").read_text(errors="replace")
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    return output


CASES = {  # command -> (function held inside its staged folder, argv given the HF folder, run and output)
    "export": ("hybridnorm.hf.export:hf_tokenizer",  # the weights are written by then; the tokenizer is next
               lambda hf, run, out: ["export", str(run), "--to", "hf", str(out)]),
    "import": ("hybridnorm.hf.export:save_checkpoint",  # tokenizer and config written; the checkpoint is next
               lambda hf, run, out: ["import", str(hf), "--out", str(out)]),
}


@pytest.mark.parametrize("command", sorted(CASES))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_write_leaves_nothing_and_says_so(folders, tmp_path, command, sig) -> None:
    hf, run = folders
    parent = tmp_path / "outputs"
    parent.mkdir()
    (parent / "mine.txt").write_text("a user's file beside the output", encoding="utf-8")
    before_inputs = {**{f"hf/{k}": v for k, v in snapshot(hf).items()},
                     **{f"run/{k}": v for k, v in snapshot(run).items()}}
    target, argv = CASES[command]
    output = _interrupted_while_held(tmp_path, target, argv(hf, run, parent / "out"), sig)

    lines = [ln for ln in output.splitlines() if ln.startswith("interrupted")]
    assert lines == ["interrupted: nothing was written (a partly written output is removed)"], output[-3000:]
    assert sorted(p.name for p in parent.iterdir()) == ["mine.txt"]  # no out/, no .out.partial-*
    after_inputs = {**{f"hf/{k}": v for k, v in snapshot(hf).items()},
                    **{f"run/{k}": v for k, v in snapshot(run).items()}}
    assert after_inputs == before_inputs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_command_starts_is_the_same_one_line(tmp_path, sig) -> None:
    """A signal before the command has read its options (held: building the parser): what torchrun sends a
    rank still starting when its peer has already failed. It was a KeyboardInterrupt traceback (seen under
    torchrun with 2 processes); now exit 130 and the one line, as later."""
    out = tmp_path / "out"
    output = _interrupted_while_held(tmp_path, "hybridnorm.cli_parser:build_parser",
                                     ["export", str(tmp_path / "no_run"), "--to", "hf", str(out)], sig)
    lines = [ln for ln in output.splitlines() if ln.startswith(("interrupted", "error"))]
    assert lines == ["interrupted: nothing was written (a partly written output is removed)"], output[-3000:]
    assert not out.exists()


def test_the_same_export_without_a_signal_writes_the_folder(folders, tmp_path) -> None:
    """The control: the held function, released without a signal, lets the export finish (so the test above
    fails for the signal, not for the wrapper)."""
    hf, run = folders
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER, encoding="utf-8")
    marker = tmp_path / "marker"
    Path(f"{marker}.go").write_text("", encoding="utf-8")  # released from the start
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(wrapper), str(marker), CASES["export"][0], *CASES["export"][1](
        hf, run, out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(f"{marker}.held").exists() and (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_a_writer_killed_outright_leaves_a_folder_the_next_write_clears(folders, tmp_path) -> None:
    """SIGKILL (or the OOM killer, a power cut) runs no cleanup: the hidden folder stays. The next export to
    the same name removes it, since its writer (named in it: host and pid) is gone, and leaves alone the
    folder of a writer still alive (this test's own pid) and one from another host."""
    import socket

    from hybridnorm.cli import main

    hf, run = folders
    parent = tmp_path / "outputs"
    parent.mkdir()
    out = parent / "out"
    with _held(tmp_path, CASES["export"][0], CASES["export"][1](hf, run, out)):
        pass  # held mid-write, then killed outright on leaving
    (killed,) = parent.iterdir()  # the killed writer's half folder, weights already in it
    assert killed.name.startswith(".out.partial-") and (killed / "config.json").exists()
    host = socket.gethostname().replace(".", "_")
    alive = parent / f".out.partial-{host}-{os.getpid()}-keep"
    elsewhere = parent / ".out.partial-another_host-1-keep"
    for kept in (alive, elsewhere):
        kept.mkdir()
        (kept / "x").write_text("someone's", encoding="utf-8")

    assert main(CASES["export"][1](hf, run, out)) == 0
    assert sorted(p.name for p in parent.iterdir()) == sorted(["out", alive.name, elsewhere.name])
    assert (out / "config.json").is_file() and (alive / "x").read_text(encoding="utf-8") == "someone's"
