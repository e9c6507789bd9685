"""N steps, stop, resume, N more steps == 2N uninterrupted steps, bitwise on CPU (fp32 and bf16 autocast).

The first half stops through ``stop_after_steps`` so both runs share the LR schedule of ``max_steps``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import read_metrics

from hybridnorm.train.checkpoint import list_checkpoints
from hybridnorm.train.trainer import train

N = 4


MOE = ("--model.moe={num_experts: 8, top_k: 2}", "--model.ffn_hidden_size=32", "--model.tie_embeddings=false")


@pytest.mark.parametrize(("precision", "extra"), [
    ("fp32", ()), ("bf16", ()), ("fp32", ("--grad_accum=2",)), ("bf16", MOE)], ids=["fp32", "bf16", "accum", "moe"])
def test_resume_is_bitwise_identical(make_cfg, tmp_path, precision, extra):
    common = (f"--precision={precision}", f"--max_steps={2 * N}", "--ckpt_interval=3", "--eval_interval=2", *extra)
    straight = train(make_cfg(tmp_path / "straight", *common))
    assert straight.step == 2 * N and not straight.interrupted

    first = train(make_cfg(tmp_path / "resumed", *common, f"--stop_after_steps={N}"))
    assert first.step == N and not first.interrupted
    # the stop saved a checkpoint at N (besides the periodic one at 3)
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step_000003", "step_000004"]
    second = train(make_cfg(tmp_path / "resumed", *common), resume=True)
    assert second.step == 2 * N

    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 2 * N + 1))
    keys = ["loss", "grad_norm", "lr", "tokens"] + (["aux_loss", "lb_loss", "z_loss"] if extra == MOE else [])
    for key in keys:
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert len({r["loss"] for r in a}) == 2 * N  # it really trained: the losses move
    assert [r["val_loss"] for r in read_metrics(tmp_path / "straight", "eval")] == \
        [r["val_loss"] for r in read_metrics(tmp_path / "resumed", "eval")]
    assert second.val_loss == straight.val_loss and second.train_loss == straight.train_loss

    for name in ("model.safetensors", "optimizer.safetensors"):
        wa = load_file(tmp_path / "straight" / "checkpoints" / "step_000008" / name)
        wb = load_file(tmp_path / "resumed" / "checkpoints" / "step_000008" / name)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{name}: {k}"


def test_resume_without_checkpoint_starts_fresh_and_finished_run_is_a_noop(make_cfg, tmp_path):
    cfg = make_cfg(tmp_path / "run", "--max_steps=2")
    assert train(cfg, resume=True).step == 2  # --resume on an empty folder: a fresh start
    again = train(cfg, resume=True)  # already at max_steps: nothing to do, nothing logged twice
    assert again.step == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_stop_after_steps_validation(make_cfg, tmp_path):
    from hybridnorm.errors import ConfigError

    with pytest.raises(ConfigError, match="stop_after_steps"):
        make_cfg(tmp_path, "--stop_after_steps=-1")


def test_purge_on_resume_drops_later_records_and_torn_lines_but_keeps_what_it_cannot_judge(tmp_path):
    """The log of a run resumed at step 3: records past 3 and a torn line go; a line that is JSON but no
    record with an integer step (not the trainer's own writing) stays for the readers to name, and the
    purge does not fail on it."""
    from hybridnorm.train.logger import _purge_after

    log = tmp_path / "metrics.jsonl"
    lines = ['{"kind": "train", "step": 2, "loss": 1.0}', '{"kind": "train", "step": 4, "loss": 1.0}',
             '{"kind": "train", "step": "x"}', "[1, 2]", '{"kind": "train", "step": true}',
             '{"kind": "meta", "time": 0.1}', '{"kind": "tra']
    log.write_text("\n".join(lines))  # the last line torn, no final newline
    _purge_after(log, 3)
    assert log.read_text().splitlines() == [lines[0], lines[2], lines[3], lines[4], lines[5]]


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_starting_over_sets_its_old_history_aside(make_cfg, tmp_path, resume):
    """A run killed before its first checkpoint leaves a metrics.jsonl and TensorBoard events and no
    checkpoint; trained again (with or without --resume) it starts at step 0 with one history in each: the
    old log is kept as metrics.stale.jsonl (then .2, ...), never appended to."""
    import shutil

    from torchrun_helpers import tensorboard_steps

    run = tmp_path / "run"
    cfg = make_cfg(run, "--max_steps=3")
    train(cfg)
    old = (run / "metrics.jsonl").read_text()
    for _ in range(2):
        shutil.rmtree(run / "checkpoints")  # as if killed before saving
        train(cfg, resume=resume)
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
        assert len(read_metrics(run, "meta")) == 1
        assert tensorboard_steps(run, "train/loss") == [1, 2, 3]
    assert (run / "metrics.stale.jsonl").read_text() == old
    assert (run / "metrics.stale.2.jsonl").is_file()
