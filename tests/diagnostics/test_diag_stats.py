"""Activation, attention and expert-load statistics against hand computations (naive loops, known
distributions, hand forward hooks)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.diagnostics import (
    Diagnostics,
    DiagnosticsConfig,
    activation_stats,
    attention_stats,
    expert_load_stats,
    token_cosine,
)


def _naive_attention(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """Max causal logit and mean entropy by plain Python loops over heads, queries and keys."""
    _, H, T, D = q.shape
    group = H // k.shape[1]
    max_logit, entropy_sum = -math.inf, 0.0
    for h in range(H):
        for i in range(T):
            logits = [sum(float(q[0, h, i, c]) * float(k[0, h // group, j, c]) for c in range(D)) / math.sqrt(D)
                      for j in range(i + 1)]
            max_logit = max(max_logit, *logits)
            m = max(logits)
            z = sum(math.exp(v - m) for v in logits)
            p = [math.exp(v - m) / z for v in logits]
            entropy_sum -= sum(pi * math.log(pi) for pi in p if pi > 0)
    return max_logit, entropy_sum / (H * T)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("max_elements", [1 << 22, 60, 1], ids=["one-block", "row-blocks", "row-by-row"])
def test_attention_stats_match_naive_loop(kv_heads, max_elements):
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(1, 4, 7, 8, generator=g) * 2
    k = torch.randn(1, kv_heads, 7, 8, generator=g) * 2
    got = attention_stats(q, k, max_elements=max_elements)
    want_max, want_entropy = _naive_attention(q, k)
    assert float(got["max_logit"]) == pytest.approx(want_max, rel=1e-5)
    assert float(got["entropy"]) == pytest.approx(want_entropy, rel=1e-5)


def test_attention_stats_reads_the_right_kv_head_under_gqa():
    # KV head 1 is large, KV head 0 tiny: with H=4, Hkv=2, query heads 2 and 3 read head 1
    q = torch.ones(1, 4, 3, 2)
    k = torch.stack([torch.full((3, 2), 0.01), torch.full((3, 2), 10.0)]).unsqueeze(0)
    assert float(attention_stats(q, k)["max_logit"]) == pytest.approx(20 / math.sqrt(2), rel=1e-6)
    uniform = attention_stats(torch.zeros(1, 2, 5, 4), torch.randn(1, 1, 5, 4))  # all logits 0: uniform rows
    assert float(uniform["entropy"]) == pytest.approx(sum(math.log(i + 1) for i in range(5)) / 5, rel=1e-6)


def test_kurtosis_of_known_distributions():
    g = torch.Generator().manual_seed(0)
    n = (4, 500, 500)
    normal = torch.randn(n, generator=g)
    uniform = torch.rand(n, generator=g)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample(n)
    assert float(activation_stats(normal)["kurtosis"]) == pytest.approx(0.0, abs=0.03)
    assert float(activation_stats(uniform * 5 + 3)["kurtosis"]) == pytest.approx(-1.2, abs=0.01)
    assert float(activation_stats(laplace)["kurtosis"]) == pytest.approx(3.0, abs=0.15)
    # a few massive activations make it explode
    spiky = normal.clone()
    spiky[0, 0, :3] = 200.0
    assert float(activation_stats(spiky)["kurtosis"]) > 50


def test_rms_max_abs_and_bf16_input():
    x = torch.tensor([[[3.0, -4.0], [0.0, 0.0]]])  # (1, 2, 2)
    s = activation_stats(x)
    assert float(s["rms"]) == pytest.approx(math.sqrt(25 / 4))
    assert float(s["max_abs"]) == 4.0
    xb = torch.randn(2, 8, 16).bfloat16()
    assert float(activation_stats(xb)["rms"]) == pytest.approx(float(xb.float().square().mean().sqrt()), rel=1e-6)


def _naive_cosine(seq: torch.Tensor) -> float:
    n = seq.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += float(torch.nn.functional.cosine_similarity(seq[i], seq[j], dim=0))
    return total / (n * (n - 1))


def test_token_cosine():
    token = torch.randn(1, 1, 32)
    assert float(token_cosine(token.expand(3, 50, 32) * 1.7)) == pytest.approx(1.0, abs=1e-6)  # identical tokens
    assert float(token_cosine(torch.eye(16).unsqueeze(0))) == pytest.approx(0.0, abs=1e-7)     # orthogonal tokens
    x = torch.randn(2, 20, 8)
    assert float(token_cosine(x)) == pytest.approx(_naive_cosine(x[0]), abs=1e-6)  # first sequence only
    long = torch.randn(1, 1000, 8)
    idx = torch.linspace(0, 999, 256).round().long()
    assert float(token_cosine(long)) == pytest.approx(_naive_cosine(long[0, idx]), abs=1e-6)  # 256 sampled


def test_expert_load_stats():
    s = expert_load_stats(torch.tensor([3, 1, 0, 4]))
    frac = [3 / 8, 1 / 8, 0.0, 4 / 8]
    mean = sum(frac) / 4
    cv = math.sqrt(sum((f - mean) ** 2 for f in frac) / 4) / mean
    assert (float(s["max"]), float(s["min"])) == (pytest.approx(0.5), 0.0)
    assert float(s["cv"]) == pytest.approx(cv, rel=1e-6)
    assert float(expert_load_stats(torch.tensor([5, 5, 5]))["cv"]) == 0.0


@pytest.mark.parametrize("placement", ["hybridnorm_star", "post", "pre"])
def test_collector_activation_stats_match_a_hand_hook(placement):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=3, placement=placement))
    outs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, out) -> None:  # returns None: the output is left alone
            outs.setdefault(i, out.detach().clone())
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(keep(i))
    diag = Diagnostics(model, DiagnosticsConfig(every=1))
    ids = torch.randint(0, 256, (2, 24))
    with diag.capture(1):
        model(ids)
        model(torch.randint(0, 256, (2, 24)))  # a second micro-batch: the first one is the sample
    m = diag.pop_metrics()
    for i, out in outs.items():
        assert m[f"act_rms/blocks.{i}"] == pytest.approx(float(out.square().mean().sqrt()), rel=1e-5)
        assert m[f"act_max_abs/blocks.{i}"] == pytest.approx(float(out.abs().max()), rel=1e-6)
        c = out.double() - out.double().mean()
        kurt = float(c.pow(4).mean() / c.square().mean() ** 2 - 3)
        assert m[f"act_kurtosis/blocks.{i}"] == pytest.approx(kurt, rel=1e-3, abs=1e-4)
        assert m[f"cos_sim/blocks.{i}"] == pytest.approx(_naive_cosine(out[0]), abs=1e-5)
    emb = model.embed(ids).detach()
    assert m["act_rms/embed"] == pytest.approx(float(emb.square().mean().sqrt()), rel=1e-5)


def _attention_run(fast: bool) -> tuple[TransformerLM, dict, dict[str, float]]:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=2, placement="hybridnorm_star",
                                                  fast_kernels=fast))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(i: int):
        def hook(module, args) -> None:  # registered before the collector's: sees the same q and k first
            seen.setdefault(i, (args[0][:1].detach().clone(), args[1][:1].detach().clone()))
        return hook

    for i, block in enumerate(model.blocks):
        block.attn.inner.register_forward_pre_hook(keep(i))
    diag = Diagnostics(model, DiagnosticsConfig(every=1))
    with diag.capture(1):
        model(torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0)))
    return model, seen, diag.pop_metrics()


def test_collector_attention_metrics_from_the_sdpa_inputs():
    runs = {fast: _attention_run(fast) for fast in (True, False)}
    for model, seen, m in runs.values():
        cfg = model.config
        assert sorted(seen) == [0, 1]
        for i, (q, k) in seen.items():
            assert q.shape == (1, cfg.n_heads, 10, cfg.head_dim) and k.shape == (1, cfg.kv_heads, 10, cfg.head_dim)
            want_max, want_entropy = _naive_attention(q, k)
            assert m[f"attn_max_logit/blocks.{i}"] == pytest.approx(want_max, rel=1e-5)
            assert m[f"attn_entropy/blocks.{i}"] == pytest.approx(want_entropy, rel=1e-5)
        assert sum(len(b.attn.inner._forward_pre_hooks) for b in model.blocks) == 2  # only the test's own
    # the fast kernels (fused Q/K/V norm + RoPE) and the plain math give the same q and k
    for i in (0, 1):
        for a, b in zip(runs[True][1][i], runs[False][1][i], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
