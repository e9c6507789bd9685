"""``train --resume`` continues the run's model with the run's tokenizer (``hybridnorm.train.resume_guard``):
a command that asks for another architecture or another tokenizer is refused with one error before the
run folder is touched; a change that keeps the model (more steps, another learning rate, the plain kernels)
is allowed and logged as an event."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_helpers import as_older_checkpoint
from train_helpers import read_metrics

from hybridnorm.data.tokenizer import train_bpe
from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint import list_checkpoints
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.trainer import train


@pytest.fixture
def run(make_cfg, tmp_path) -> Path:
    """A run of 2 steps with its checkpoint (tiny model, byte tokenizer)."""
    out = tmp_path / "run"
    train(make_cfg(out, "--max_steps=2", "--ckpt_interval=2"), quiet=True)
    return out


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (run / "config.yaml", run / "tokenizer.json", run / "metrics.jsonl")}


def test_same_command_resumes_without_a_change_event(make_cfg, run):
    train(make_cfg(run, "--max_steps=2", "--ckpt_interval=2"), resume=True, quiet=True)
    assert not [e for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume"]


def test_a_change_that_keeps_the_model_is_allowed_and_logged(make_cfg, run):
    result = train(make_cfg(run, "--max_steps=3", "--optim.lr=1e-3", "--model.fast_kernels=false",
                            "--ckpt_interval=1", "--stop_after_steps=5"),  # run control: not reported
                   resume=True, quiet=True)
    assert result.step == 3
    (event,) = [e for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume"]
    assert event["step"] == 2 and event["fields"] == ["max_steps", "model.fast_kernels", "optim.lr"]
    saved = TrainConfig.load(run / "config.yaml")
    assert saved.optim.lr == 1e-3 and saved.max_steps == 3  # config.yaml says what the run now trains with


def test_a_long_context_stage_may_change_ropes_frequencies_and_is_logged(make_cfg, run):
    """The recipe of a long-context stage: resume with a longer context and stretched RoPE (YaRN here, or a
    larger rope_theta). No parameter changes; the function does, on purpose: allowed, logged, recorded, and
    the resumed model computes with the new tables."""
    result = train(make_cfg(run, "--max_steps=3", "--model.max_seq_len=256", "--model.rope_theta=20000",
                            "--model.rope_scaling.type=yarn", "--model.rope_scaling.factor=2",
                            "--model.rope_scaling.original_max_seq_len=128"), resume=True, quiet=True)
    assert result.step == 3
    (event,) = [e for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume"]
    fields = event["fields"]  # the section appears field by field (it was absent: null)
    assert {"max_steps", "model.max_seq_len", "model.rope_theta", "model.rope_scaling.type",
            "model.rope_scaling.factor"} <= set(fields)
    assert all(f in ("max_steps", "model.max_seq_len", "model.rope_theta") or f.startswith("model.rope_scaling.")
               for f in fields)
    saved = TrainConfig.load(run / "config.yaml").model
    assert (saved.rope_theta, saved.rope_scaling.type, saved.rope_scaling.factor) == (20000.0, "yarn", 2.0)
    model = saved.build()
    assert model.rope_cos.shape[0] == 256 and model.rope_cos.abs().max() > 1.0  # YaRN scales cos by its factor


@pytest.mark.parametrize(("override", "fields"), [
    ("--model.placement=post", "model.placement: 'hybridnorm_star' -> 'post'"),  # same parameter shapes
    ("--model.norm_eps=0.001", "model.norm_eps: 1e-05 -> 0.001"),
    ("--model.n_kv_heads=4", "model.n_kv_heads"),
])
def test_another_architecture_is_refused_before_anything_is_written(make_cfg, run, override, fields):
    before = _files(run)
    with pytest.raises(ConfigError, match=rf"cannot resume .*as a different model \({fields}") as e:
        train(make_cfg(run, "--max_steps=3", override), resume=True, quiet=True)
    assert str(run / "checkpoints" / "step_000002" / "config.yaml") in str(e.value)  # what the weights were
    assert _files(run) == before and [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000002"]


def test_another_tokenizer_is_refused(make_cfg, run, tmp_path):
    other = train_bpe(["in the beginning was the word " * 20, "and the word was with god " * 20], vocab_size=300)
    other.save(tmp_path)
    before = _files(run)
    with pytest.raises(ConfigError, match=r"another tokenizer: .*differs from the run's .*tokenizer\.json"):
        train(make_cfg(run, "--max_steps=3", f"--data.tokenizer={tmp_path / 'tokenizer.json'}"),
              resume=True, quiet=True)
    assert _files(run) == before


def _as_older_checkpoint(run: Path) -> None:
    as_older_checkpoint(list_checkpoints(run / "checkpoints")[-1])


def test_the_checkpoints_own_config_is_the_record_a_hand_edit_of_the_runs_cannot_move(make_cfg, run):
    """norm_eps changes no parameter: a run config.yaml edited to another one, resumed with it, would load
    the weights into another function. The checkpoint's own copy says what they were trained as."""
    cfg_file = run / "config.yaml"
    cfg_file.write_text(cfg_file.read_text(encoding="utf-8").replace("norm_eps: 1.0e-05", "norm_eps: 0.001"),
                        encoding="utf-8")
    assert TrainConfig.load(cfg_file).model.norm_eps == 0.001
    with pytest.raises(ConfigError, match=r"as a different model \(model.norm_eps: 1e-05 -> 0.001; recorded in "
                                          r".*step_000002/config.yaml"):
        train(make_cfg(run, "--max_steps=3", "--model.norm_eps=0.001"), resume=True, quiet=True)
    _as_older_checkpoint(run)  # without the copy, the run folder's (edited) file is all there is to go by
    assert train(make_cfg(run, "--max_steps=3", "--model.norm_eps=0.001"), resume=True, quiet=True).step == 3


@pytest.mark.parametrize("older", [False, True])
def test_a_damaged_tokenizer_file_is_named(make_cfg, run, older):
    if older:
        _as_older_checkpoint(run)
    tok = run / "checkpoints" / "step_000002" / "tokenizer.json" if not older else run / "tokenizer.json"
    tok.write_bytes(b"\xff{not a tokenizer")
    before = _files(run)
    if older:
        with pytest.raises(ConfigError, match=r"cannot read tokenizer file .*run/tokenizer\.json"):
            train(make_cfg(run, "--max_steps=3"), resume=True, quiet=True)
    else:  # a damaged copy fails the checkpoint's hashes: no checkpoint to resume, named, set aside
        with pytest.raises(ConfigError, match=r"step_000002/tokenizer\.json is (truncated or )?corrupt"):
            train(make_cfg(run, "--max_steps=3"), resume=True, quiet=True)
    assert _files(run) == before
