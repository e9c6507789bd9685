"""precision="auto" (hybridnorm.train.precision) and the AdamW implementation the trainer picks."""

from __future__ import annotations

import pytest
import torch
import yaml
from train_helpers import read_metrics

import hybridnorm.train.precision as precision
from hybridnorm.config import ModelConfig
from hybridnorm.errors import ConfigError
from hybridnorm.train.optim import OptimConfig, build_optimizer, describe_optimizer, fused_supported
from hybridnorm.train.trainer import train

CPU = torch.device("cpu")


def _cpu_bf16(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


@pytest.mark.parametrize(("amx", "avx512_bf16", "d_model", "expected"), [
    (False, False, 512, "fp32"),   # emulated bf16: never
    (True, False, 512, "bf16"),
    (False, True, 256, "bf16"),    # the threshold itself
    (False, True, 255, "fp32"),
    (True, True, 64, "fp32"),      # the studies' width: fp32 even with AMX
])
def test_auto_on_cpu_follows_native_bf16_and_width(monkeypatch, amx, avx512_bf16, d_model, expected):
    _cpu_bf16(monkeypatch, amx, avx512_bf16)
    chosen, why = precision.choose_precision("auto", CPU, d_model)
    assert chosen == expected and why.startswith("auto: ")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("requested", ["fp32", "bf16"])
def test_an_explicit_precision_is_kept(monkeypatch, requested, native):
    _cpu_bf16(monkeypatch, False, native)
    chosen, why = precision.choose_precision(requested, CPU, 64)
    assert chosen == requested and why.startswith("as configured")
    # bf16 asked for where it is emulated: kept, and the log line says what it costs
    assert ("emulated" in why) == (requested == "bf16" and not native), why


def test_auto_on_gpus_and_others(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert precision.choose_precision("auto", torch.device("cuda:0"), 64)[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert precision.choose_precision("auto", torch.device("cuda:0"), 4096)[0] == "fp32"
    assert precision.choose_precision("auto", torch.device("mps"), 4096)[0] == "fp32"


def test_precision_field_names_its_choices():
    from hybridnorm.train.config import TrainConfig

    assert TrainConfig().precision == "auto"
    with pytest.raises(ConfigError, match=r"precision.*'auto'.*'fp32'.*'bf16'"):
        TrainConfig.from_dict({"precision": "fp16"})


def test_the_run_records_the_precision_it_chose(make_cfg, tmp_path, monkeypatch):
    _cpu_bf16(monkeypatch, True, True)  # native bf16, but the tiny model (d=64) is below the width rule
    cfg = make_cfg(tmp_path / "run", "--precision=auto", "--max_steps=2")
    train(cfg, quiet=True)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["precision"] == "fp32"  # what ran, so a resume elsewhere trains the same way
    assert read_metrics(tmp_path / "run", "meta")[0]["precision"] == "fp32"


# -- AdamW ------------------------------------------------------------------------------------------------

def test_fused_adamw_is_the_default_on_cpu_and_matches_foreach():
    """Same math: after 5 steps on the same gradients the fused and foreach parameters agree to fp32
    rounding (the two order their arithmetic differently), and a hand-written AdamW step agrees too."""
    torch.manual_seed(0)
    models = [ModelConfig.from_preset("tiny").build() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused, foreach = build_optimizer(models[0], cfg), build_optimizer(models[1], cfg, fused=False)
    assert fused_supported(models[0]) and describe_optimizer(fused) == "fused"
    assert describe_optimizer(foreach) == "foreach"
    ref = {n: p.detach().clone() for n, p in models[2].named_parameters()}
    decayed = {n for g in fused.param_groups if g["weight_decay"] for n, p in models[0].named_parameters()
               if any(p is q for q in g["params"])}
    m1 = {n: torch.zeros_like(p) for n, p in ref.items()}
    m2 = {n: torch.zeros_like(p) for n, p in ref.items()}
    b1, b2 = cfg.betas
    for t in range(1, 6):
        grads = {n: torch.randn_like(p) for n, p in ref.items()}
        for m, opt in ((models[0], fused), (models[1], foreach)):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
        for n, g in grads.items():  # AdamW (Loshchilov & Hutter), decoupled decay, bias-corrected
            ref[n] *= 1 - cfg.lr * (cfg.weight_decay if n in decayed else 0.0)
            m1[n] = b1 * m1[n] + (1 - b1) * g
            m2[n] = b2 * m2[n] + (1 - b2) * g * g
            denom = (m2[n] / (1 - b2**t)).sqrt() + cfg.eps
            ref[n] -= cfg.lr * (m1[n] / (1 - b1**t)) / denom
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(a, ref[n], rtol=1e-5, atol=1e-6, msg=n)
