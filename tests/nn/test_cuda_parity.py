"""The model on a CUDA GPU (``pytest -m cuda``; every test here skips without one, CI has none).

Oracles, all independent of the CUDA path under test:
- every placement preset's fp32 logits and gradients on CUDA (TF32 off) against the same weights in
  float64 on the CPU. The bound is relative to the CPU's own fp32 error against float64: two fp32
  computations of one float64 result differ from it by reduction order alone, so CUDA may be at most 4×
  as far from float64 as the CPU is (plus a floor of 8 fp32 epsilons, for a CPU that happens to land on it);
- the fast kernels against their plain twins on CUDA in fp32, and under bf16 autocast against fp32 (no
  further from it than 4x the plain math's own bf16 error);
- MoE's ``grouped_mm`` dispatch against the per-expert loop on CUDA in bf16;
- KV-cached greedy generation against one full forward per new token, on the same GPU.
"""

from __future__ import annotations

import contextlib

import oracle
import pytest
import torch

import hybridnorm as hn

pytestmark = pytest.mark.cuda
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(placement: str, **overrides) -> hn.TransformerLM:
    overrides.setdefault("n_layers", 4)
    torch.manual_seed(0)
    cfg = hn.ModelConfig.from_preset("tiny", placement=placement, **overrides)
    return oracle.randomize_(hn.TransformerLM(cfg), seed=0)  # gains away from 1 too


def _logits_and_grads(model: hn.TransformerLM, ids: torch.Tensor, cot: torch.Tensor, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(ids.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        logits, aux = model(ids, return_aux=True)
        loss = (logits.float() * cot).sum() + (aux["aux_loss"] if aux else 0)  # a generic vector-Jacobian product
    loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    return logits.detach().double().cpu(), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _inputs(cfg: hn.ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    cot = torch.randn(2, 16, cfg.embedding_size, generator=torch.Generator().manual_seed(2))
    return ids, cot


@pytest.mark.parametrize("name", hn.placements.names())
def test_cuda_fp32_is_as_close_to_float64_as_the_cpu(name):
    model = _model(name)
    ids, cot = _inputs(model.config)
    ref_logits, ref_grads = _logits_and_grads(model.double(), ids, cot.double())
    cpu_logits, cpu_grads = _logits_and_grads(model.float(), ids, cot)
    cuda_logits, cuda_grads = _logits_and_grads(model.cuda(), ids.cuda(), cot.cuda())

    def bound(cpu_err: float) -> float:
        return 4 * max(cpu_err, 8 * EPS32)

    assert _rel(cuda_logits, ref_logits) <= bound(_rel(cpu_logits, ref_logits)), "logits"
    for n, g in ref_grads.items():
        assert _rel(cuda_grads[n], g) <= bound(_rel(cpu_grads[n], g)), f"grad of {n}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", hn.placements.PAPER_NAMES)
def test_fast_kernels_match_plain_on_cuda(name, bf16):
    fast = _model(name).cuda()
    plain = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=name, n_layers=4, fast_kernels=False))
    plain.load_state_dict(fast.state_dict())
    plain.cuda()
    ids, cot = (t.cuda() for t in _inputs(fast.config))
    lf, gf = _logits_and_grads(fast, ids, cot, bf16)
    lp, gp = _logits_and_grads(plain, ids, cot, bf16)
    if not bf16:  # fp32: reduction order through 4 layers and their backward, ~100 fp32 epsilons
        assert _rel(lf, lp) <= 1e-5, "logits"
        for n, g in gp.items():
            assert _rel(gf[n], g) <= 1e-5, f"grad of {n}"
        return
    # bf16: the fast kernels may be at most 4x as far from the fp32 result as the plain math under the same
    # autocast is (as above: two roundings of one value differ by luck; a floor of one bf16 epsilon, 2^-8,
    # where the plain math happens to land close). On the CPU the worst case here is 2.1x.
    l32, g32 = _logits_and_grads(plain, ids, cot, bf16=False)

    def bound(plain_err: float) -> float:
        return 4 * max(plain_err, 2.0**-8)

    assert _rel(lf, l32) <= bound(_rel(lp, l32)), "logits"
    for n, g in g32.items():
        assert _rel(gf[n], g) <= bound(_rel(gp[n], g)), f"grad of {n}"


def test_moe_grouped_mm_matches_the_expert_loop_on_cuda():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    model = _model("pre", moe={"num_experts": 4, "top_k": 2}, ffn_hidden_size=64, tie_embeddings=False).cuda()
    ids, cot = (t.cuda() for t in _inputs(model.config))
    results = {}
    for dispatch in ("grouped_mm", "loop"):
        for m in model.modules():
            if hasattr(m, "dispatch"):
                m.dispatch = dispatch
        results[dispatch] = _logits_and_grads(model, ids, cot, bf16=True)
    (lg, gg), (ll, gl) = results["grouped_mm"], results["loop"]
    assert _rel(lg, ll) <= 3e-2
    for n, g in gl.items():
        assert _rel(gg[n], g) <= 3e-2, f"grad of {n}"


@pytest.mark.parametrize("name", ["pre", "hybridnorm_star"])
def test_cached_greedy_generation_matches_a_full_forward_per_token_on_cuda(name):
    model = _model(name).cuda().eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        out = model.generate(prompt, 12, temperature=0)
        seq = prompt
        for _ in range(12):
            logits = model(seq)[:, -1].double()
            top2 = logits.topk(2).values[0]
            nxt = logits.argmax(-1, keepdim=True)
            if (top2[0] - top2[1]).item() < 1e-4 * top2.abs().max().item():  # a tie: either token is right
                break
            assert out[0, seq.shape[1]].item() == nxt.item(), f"token {seq.shape[1]}"
            seq = torch.cat([seq, nxt], dim=1)
    assert seq.shape[1] > prompt.shape[1]  # at least one token compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_and_loss_in_several_gpu_chunks_matches_the_plain_line(dtype, monkeypatch):
    from hybridnorm.nn import kernels

    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS_GPU", 7 * 1000)  # 7 rows a chunk, the last one short
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(45, 64, generator=g).to(dtype).cuda().requires_grad_()
    weight = (0.5 * torch.randn(1000, 64, generator=g)).to(dtype).cuda().requires_grad_()
    targets = torch.randint(0, 1000, (45,), generator=g).cuda()
    targets[1::4] = -100
    fast = kernels.linear_cross_entropy(hidden, weight, targets)
    fast_grads = torch.autograd.grad(fast, (hidden, weight))
    plain = hn.lm_loss(torch.nn.functional.linear(hidden, weight)[None], targets[None], fast=False)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 reduction order / a few bf16 roundings
    assert _rel(fast.double().cpu(), plain.double().cpu()) <= tol
    for a, b in zip(fast_grads, plain_grads, strict=True):
        assert _rel(a.double().cpu(), b.double().cpu()) <= tol


@pytest.mark.parametrize("name", ["pre", "hybridnorm_star"])
def test_550m_attention_runs_on_the_flash_kernel(name):
    """The 550M shapes (16 heads, 4 KV heads, head dim 96, GQA through ``enable_gqa``) in bf16 take SDPA's
    FlashAttention backend, forward and backward: with only that backend allowed, SDPA raises instead of
    falling back to the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = hn.ModelConfig.from_preset("550m", placement=name, n_layers=2, vocab_size=1024)
    model = hn.TransformerLM(cfg).cuda()
    ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0)).cuda()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
