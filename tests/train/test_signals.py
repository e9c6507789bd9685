"""A second SIGTERM / SIGINT while a stopping trainer saves, or while it exits after the save, changes
nothing: the checkpoint is written whole and the process exits 130 without a traceback.

The trainer runs as ``python -m hybridnorm.cli train`` would (``runpy``), from a small wrapper that holds
one function at a chosen point until the test has sent its second signal: the signal provably lands
inside the save (or the exit), on every machine, without timing guesses. Nothing in the library knows
about the test."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

import pytest
from checkpoint_helpers import start_trainer, train_records, wait_for
from train_helpers import read_metrics, tiny_overrides

from hybridnorm.config import ModelConfig
from hybridnorm.train.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint
from hybridnorm.train.optim import OptimConfig, build_optimizer

# argv: marker file, where to hold ("save": the first safetensors write of a checkpoint; "exit": closing the
# metrics log, after the training loop and its signal handling are done), then the CLI's arguments
WRAPPER = textwrap.dedent('''
    import runpy, sys, time
    from pathlib import Path

    marker, where = Path(sys.argv[1]), sys.argv[2]

    def hold(original):
        def held(*args, **kwargs):
            if not marker.exists():
                marker.write_text("held", encoding="utf-8")
                while not marker.with_suffix(".go").exists():
                    time.sleep(0.01)
            return original(*args, **kwargs)
        return held

    if where == "save":
        import hybridnorm.train.checkpoint as module
        module.save_file = hold(module.save_file)
    else:
        import hybridnorm.train.logger as module
        module.MetricsLogger.close = hold(module.MetricsLogger.close)
    sys.argv = ["hybridnorm", *sys.argv[3:]]
    runpy.run_module("hybridnorm.cli", run_name="__main__")
''')


@pytest.mark.parametrize("where", ["save", "exit"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_during_the_stop_save_or_exit(corpus, cache_dir, tmp_path, sig, where):
    run, log, marker = tmp_path / "run", tmp_path / "train.log", tmp_path / "held"
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER, encoding="utf-8")
    # ckpt_interval=1000: the only save is the one the first signal asks for
    proc = start_trainer([*tiny_overrides(corpus, cache_dir, run), "--max_steps=100000"], log,
                         wrapper=[str(wrapper), str(marker), where])
    try:
        wait_for(proc, lambda: train_records(run) >= 2, log)
        proc.send_signal(sig)
        wait_for(proc, marker.exists, log)  # held inside the save (or the exit)
        if where == "save":
            assert list(run.glob("checkpoints/.tmp_step_*")) and not list_checkpoints(run / "checkpoints")
        proc.send_signal(sig)  # the second signal: delivered while the process is held
        time.sleep(0.2)  # let its handler run (a default handler would kill the process right here)
        marker.with_suffix(".go").write_text("", encoding="utf-8")
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer did not exit after the signals")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "already stopping" in output  # the second signal was seen, and ignored
    last = read_metrics(run)[-1]["step"]
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == [f"step_{last:06d}"]
    verify_checkpoint(ckpts[0])
    assert not list(run.glob("checkpoints/.tmp_*"))
    model = ModelConfig.from_preset("tiny", vocab_size=257).build()  # the run's model: byte vocab + end of text
    assert load_checkpoint(ckpts[0], model, build_optimizer(model, OptimConfig())).step == last
