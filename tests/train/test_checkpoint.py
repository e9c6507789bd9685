"""Checkpoints: exact round trip, pruning, corruption detection with fallback, no pickle anywhere."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from checkpoint_helpers import model_and_optimizer

from hybridnorm.config import ModelConfig
from hybridnorm.nn.model import lm_loss
from hybridnorm.train.checkpoint import (
    CheckpointError,
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_weights,
    save_checkpoint,
    verify_checkpoint,
)
from hybridnorm.train.optim import OptimConfig, build_optimizer


def _model(vocab_size: int = 256, seed: int = 0):
    torch.manual_seed(seed)
    return ModelConfig.from_preset("tiny", vocab_size=vocab_size).build()


def _save(root, model, opt, step: int, keep_last: int = 10):
    return save_checkpoint(root, model, opt, TrainState(step=step, tokens=step * 64), keep_last)


def test_round_trip_model_optimizer_rng_and_state(tmp_path):
    model, opt = model_and_optimizer(2)
    torch.manual_seed(1234)
    state = TrainState(step=7, tokens=448, data={"epoch": 1, "step": 3}, extra={"note": "x"})
    path = save_checkpoint(tmp_path / "ckpt", model, opt, state)
    after_save = torch.rand(5)  # what the RNG gives right after the save

    model2 = _model(seed=99)
    opt2 = build_optimizer(model2, OptimConfig(lr=5.0, warmup_steps=0))
    torch.manual_seed(0)
    got = load_checkpoint(path, model2, opt2)

    assert got == state
    assert torch.equal(torch.rand(5), after_save)  # RNG restored
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd["state"].keys() == sd2["state"].keys() and len(sd["state"]) == len(list(model.parameters()))
    for idx, st in sd["state"].items():
        assert st.keys() == sd2["state"][idx].keys()
        for name, value in st.items():
            assert torch.equal(value, sd2["state"][idx][name]), (idx, name)
        assert float(sd2["state"][idx]["step"]) == 2.0  # Adam's step count
    for g, g2 in zip(sd["param_groups"], sd2["param_groups"], strict=True):
        assert g == g2  # lr, betas (a tuple again), weight decay, param ids

    # and the restored optimizer takes the same next step as the original
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    for m, o in ((model, opt), (model2, opt2)):
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
        o.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k


def test_only_safetensors_and_json_and_no_pickle_on_load(tmp_path, monkeypatch):
    model, opt = model_and_optimizer(1)
    path = _save(tmp_path, model, opt, 1)
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    assert not list(tmp_path.glob(".tmp_*"))

    def no_pickle(*a, **k):
        raise AssertionError("torch.load / pickle used")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr("pickle.load", no_pickle)
    monkeypatch.setattr("pickle.loads", no_pickle)
    load_checkpoint(path, _model(), build_optimizer(_model(), OptimConfig()))


def test_keep_last_prunes_oldest(tmp_path):
    model, opt = model_and_optimizer(1)
    for step in range(1, 6):
        _save(tmp_path, model, opt, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    _save(tmp_path, model, opt, 6, keep_last=0)  # 0: keep everything
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005", "step_000006"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_file_is_named_and_latest_falls_back(tmp_path, damage):
    model, opt = model_and_optimizer(1)
    good = _save(tmp_path, model, opt, 2)
    bad = _save(tmp_path, model, opt, 4)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) - 10
        f.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    else:
        f.unlink()
    expected = {"truncate": "truncated", "flip": "corrupt", "delete": "missing"}[damage]
    with pytest.raises(CheckpointError, match=expected) as exc:
        verify_checkpoint(bad)
    assert str(f) in str(exc.value)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_weights(bad, _model())
    with pytest.warns(UserWarning, match=r"skipping bad checkpoint.*model\.safetensors"):
        assert latest_checkpoint(tmp_path) == good
    verify_checkpoint(good)


def test_missing_manifest_means_incomplete(tmp_path):
    model, opt = model_and_optimizer(1)
    path = _save(tmp_path, model, opt, 3)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete.*manifest\.json"):
        verify_checkpoint(path)
    with pytest.warns(UserWarning):
        assert latest_checkpoint(tmp_path) is None
    (path / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        verify_checkpoint(path)


def test_stray_tmp_folder_is_ignored(tmp_path):
    model, opt = model_and_optimizer(1)
    good = _save(tmp_path, model, opt, 2)
    stray = tmp_path / f".tmp_step_000004_{os.getpid() + 1}"  # a save killed before its rename
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"half a file")
    (tmp_path / "step_000009.txt").write_text("not a checkpoint folder", encoding="utf-8")
    assert list_checkpoints(tmp_path) == [good]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to skip: no warning either
        assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "nonexistent") is None


def test_load_weights_into_other_vocab_names_the_shape_mismatch(tmp_path):
    model, opt = model_and_optimizer(1)
    path = _save(tmp_path, model, opt, 1)
    with pytest.raises(CheckpointError, match=r"embed\.weight has shape \(256, 64\).*\(300, 64\).*vocab") as exc:
        load_weights(path, _model(vocab_size=300))
    assert "model.safetensors" in str(exc.value)


def test_load_weights_into_other_architecture_names_the_keys(tmp_path):
    model, opt = model_and_optimizer(1)
    path = _save(tmp_path, model, opt, 1)
    other = ModelConfig.from_preset("tiny", n_layers=3).build()
    with pytest.raises(CheckpointError, match=r"does not fit this model: missing \['blocks\.2"):
        load_weights(path, other)


def test_manifest_records_sizes_and_hashes(tmp_path):
    model, opt = model_and_optimizer(1)
    path = _save(tmp_path, model, opt, 1)
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert set(manifest) == {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"}
    for name, entry in manifest.items():
        assert entry["bytes"] == (path / name).stat().st_size
        assert len(entry["sha256"]) == 64


def test_the_loaded_optimizer_keeps_its_own_settings_and_the_checkpoints_state(tmp_path):
    """A checkpoint of foreach AdamW (as an FSDP run on CPU writes) resumed where the step is deferred (host_sync
    'log', the CUDA default: fused AdamW gated by found_inf). torch's load_state_dict takes the saved groups
    whole, implementation flags included, so the next step ran foreach, which refuses found_inf
    (AssertionError), and other betas / eps / weight decay were not applied. Oracle: torch's own AdamW given
    the saved state with the new settings written into its groups by hand."""
    from hybridnorm.train.host_sync import PendingSteps

    model = _model()
    old = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), fused=False)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    old.step()
    path = save_checkpoint(tmp_path / "ckpt", model, old, TrainState(step=1, tokens=32))
    new_cfg = OptimConfig(lr=1e-2, warmup_steps=0, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.7)

    resumed, oracle = _model(seed=7), _model(seed=8)
    opt = build_optimizer(resumed, new_cfg, fused=True)
    PendingSteps(True).attach(opt, torch.device("cpu"))  # what the trainer does before loading
    load_checkpoint(path, resumed, opt)
    assert [(g["fused"], g["foreach"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [
        (True, None, (0.5, 0.6), 1e-3, 0.7), (True, None, (0.5, 0.6), 1e-3, 0.0)]

    oracle.load_state_dict(model.state_dict())
    decayed = [p for n, p in oracle.named_parameters() if n != "embed.weight"]  # the order build_optimizer keeps
    ref = torch.optim.AdamW([{"params": decayed}, {"params": [oracle.embed.weight]}], lr=1e-2, foreach=False)
    saved = old.state_dict()
    ref.load_state_dict(saved)
    for group, wd in zip(ref.param_groups, (0.7, 0.0), strict=True):
        group.update(betas=(0.5, 0.6), eps=1e-3, weight_decay=wd, foreach=False, fused=None)
    for m, o in ((resumed, opt), (oracle, ref)):
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
        o.step()
    for (name, a), b in zip(resumed.named_parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
