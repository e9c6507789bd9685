"""The fast kernels (hybridnorm.nn.kernels) against autograd and against their plain twins.

1. ``torch.autograd.gradcheck`` in float64 on every autograd Function, over its options: gains with and
   without grad and of both shapes, per-sequence RoPE tables, strided inputs, GQA, and every Q/K/V letter
   set the fused attention path takes. (The loss kernels have their own file, ``test_loss_kernels.py``.)
2. A model built with ``fast_kernels=True`` against the same weights with ``fast_kernels=False`` (the plain
   math): logits (with and without autograd) and every parameter's gradient, for every placement preset,
   every Table-6 name, an MoE model and the attention-norm variants the fused path must decline.

Tolerances of 2. Both paths compute the same function and differ only in rounding (a ``vector_norm`` pass
vs a mean of squares, one fused norm over all heads vs one per letter, in-place vs out-of-place RoPE), so
the difference is a small multiple of the dtype's epsilon, scaled by the size of the values. We compare
max|fast − plain| / max|plain| per tensor. Measured worst cases over all configurations here, with 4
randomized layers: float64 1e-14 (grads) and 2e-15 (logits), i.e. < 50 ulps (eps 2.2e-16); float32 7e-6
(grads) and 1e-6 (logits), i.e. < 60 ulps (eps 1.2e-7). The bounds below, 1e-12 (≈ 4500 ulps) and 5e-5
(≈ 400 ulps), leave ~100× and ~7× headroom for other BLAS/threading orders and are still far below any
real error: a misplaced gain, a missing norm or a wrong RoPE sign changes results by O(1e-2) or more.
"""

from __future__ import annotations

import oracle  # tests/oracle.py: randomize_ (tests/ is on sys.path via its conftest)
import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

import hybridnorm as hn
from hybridnorm.errors import ConfigError
from hybridnorm.nn import kernels
from hybridnorm.nn.attention import SDPA
from hybridnorm.nn.ffn import SwiGLU
from hybridnorm.nn.norms import RMSNorm
from hybridnorm.nn.rope import apply_rope

F64 = torch.float64
TOL = {torch.float64: 1e-12, torch.float32: 5e-5}


def _randn(*shape: int, seed: int = 0, grad: bool = True) -> torch.Tensor:
    t = torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


# -- 1. gradcheck of every autograd Function --------------------------------------------------------------

@pytest.mark.parametrize("gain_shape", [(6,), (4, 6)], ids=["gain_D", "gain_per_head"])
@pytest.mark.parametrize("gain_grad", [True, False], ids=["gain_grad", "gain_frozen"])
def test_gradcheck_rms_norm(gain_shape, gain_grad):
    x = _randn(2, 3, 4, 6)
    gain = (_randn(*gain_shape, seed=1, grad=False) + 1.5).requires_grad_(gain_grad)
    assert gradcheck(lambda x, g: kernels.RMSNormFn.apply(x, g, 1e-5), (x, gain))
    strided = _randn(2, 6, 4, 3, seed=2).transpose(1, 3)  # (2, 3, 4, 6), not contiguous
    assert gradcheck(lambda x, g: kernels.RMSNormFn.apply(x, g, 1e-5), (strided, gain))


@pytest.mark.parametrize("tables", ["shared", "per_sequence"])
def test_gradcheck_rope(tables):
    B, T, H, D = 2, 5, 3, 8
    lead = (T,) if tables == "shared" else (B, T)
    cos, sin = _randn(*lead, 1, D // 2, seed=1, grad=False), _randn(*lead, 1, D // 2, seed=2, grad=False)
    x = _randn(B, T, H, D)
    assert gradcheck(lambda x: kernels.RopeFn.apply(x, cos, sin), (x,))
    strided = _randn(B, H, T, D, seed=3).transpose(1, 2)  # (B, T, H, D) as attention hands it over
    assert gradcheck(lambda x: kernels.RopeFn.apply(x, cos, sin), (strided,))


def test_gradcheck_swiglu():
    assert gradcheck(kernels.SwiGLUFn.apply, (_randn(2, 3, 10),))
    assert gradcheck(kernels.SwiGLUFn.apply, (_randn(10, 3, seed=1).t(),))  # strided


LETTERS = ["", "Q", "K", "V", "QK", "KV", "QKV"]  # every letter set QKVPrep supports ("" = RoPE only)


@pytest.mark.parametrize("gain_grad", [True, False], ids=["gain_grad", "gain_frozen"])
@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("letters", LETTERS, ids=[s or "none" for s in LETTERS])
def test_gradcheck_qkv_prep(letters, H, Hkv, gain_grad):
    B, T, D = 2, 3, 4
    lo, hi = kernels.fused_qkv_range(letters, H, Hkv)
    qkv = _randn(B, T, H + 2 * Hkv, D)
    gain = (_randn(hi - lo, D, seed=1, grad=False) + 1.5).requires_grad_(gain_grad) if hi > lo else None
    cos, sin = _randn(T, 1, D // 2, seed=2, grad=False), _randn(T, 1, D // 2, seed=3, grad=False)

    def f(qkv, gain):
        return kernels.QKVPrep.apply(qkv, gain, cos, sin, H, Hkv, lo, hi, 1e-5)

    assert gradcheck(f, (qkv, gain))
    q, k, v = f(qkv, gain)
    assert (q.shape, k.shape, v.shape) == ((B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D))


def test_fused_qkv_range_declines_q_and_v_without_k():
    assert kernels.fused_qkv_range("QV", 4, 2) is None
    assert kernels.fused_qkv_range("QKV", 4, 2) == (0, 8)
    assert kernels.fused_qkv_range("K", 4, 2) == (4, 6)


# -- kernel vs plain twin, one op at a time (float64 tight, bf16 dtype handling) --------------------------

def _fwd_bwd(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out).mul_(0.5).add_(out.detach().float().sin().to(out.dtype)))
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_each_kernel_matches_its_plain_twin(dtype):
    # a few roundings apart (fused multiply-adds vs rounded products): a few ulps of the largest value
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 3e-2}[dtype]
    x, gain = _randn(2, 5, 3, 8).to(dtype), (_randn(8, seed=1) + 1.5).to(dtype)
    cos, sin = _randn(5, 4, seed=2, grad=False).float(), _randn(5, 4, seed=3, grad=False).float()
    plain_norm = RMSNorm(8, fast=False)
    pairs = {
        "rms_norm": (lambda x, g: kernels.rms_norm(x, g, 1e-5),
                     lambda x, g: functional_call(plain_norm, {"weight": g}, (x,)), (x, gain)),
        "rope": (lambda x: kernels.rope(x, cos, sin), lambda x: apply_rope(x, cos, sin), (x,)),
        "swiglu": (kernels.swiglu, _plain_swiglu, (x,)),
        "sdpa_in_fp32": (lambda q, k, v: kernels.sdpa_in_fp32(q, k, v, None, True),
                         lambda q, k, v: SDPA(fast=False)(q, k, v, None, True), _qkv(dtype)),
    }
    for name, (fast, plain, inputs) in pairs.items():
        out_f, grads_f = _fwd_bwd(fast, *inputs)
        out_p, grads_p = _fwd_bwd(plain, *inputs)
        assert out_f.dtype == out_p.dtype == dtype, name
        _assert_rel_close(out_f, out_p, tol, f"{name} output")
        for i, (a, b) in enumerate(zip(grads_f, grads_p, strict=True)):
            assert a.dtype == b.dtype == dtype
            _assert_rel_close(a, b, tol, f"{name} grad {i}")
        with torch.no_grad():  # the no-autograd branch: the Function's forward helper alone
            _assert_rel_close(fast(*inputs), out_p, tol, f"{name} no-grad output")


def _qkv(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q (2, 4, 6, 8) and GQA k, v (2, 2, 6, 8), scaled so the softmax is far from uniform."""
    return tuple((_randn(2, h, 6, 8, seed=s) * 2).to(dtype) for h, s in ((4, 4), (2, 5), (2, 6)))


def test_attention_upcasts_only_low_precision_cpu_at_small_head_dim(monkeypatch):
    calls = []
    real = kernels.sdpa_in_fp32
    monkeypatch.setattr(kernels, "sdpa_in_fp32", lambda *a: calls.append(a[0].dtype) or real(*a))
    q, k, v = _qkv(torch.bfloat16)
    SDPA(fast=True)(q, k, v, None, True)
    SDPA(fast=False)(q, k, v, None, True)  # the plain twin never does
    SDPA(fast=True)(q.float(), k.float(), v.float(), None, True)  # fp32: the kernel as it is
    wide = torch.zeros(1, 1, 2, kernels.UPCAST_ATTENTION_BELOW_HEAD_DIM, dtype=torch.bfloat16)
    SDPA(fast=True)(wide, wide, wide, None, True)  # head dim 64: bf16 kernel
    assert calls == [torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must not undo the upcast inside
        assert kernels.sdpa_in_fp32(q, k, v, None, True).dtype == torch.bfloat16


def test_bf16_model_with_upcast_attention_matches_plain():
    """A whole bf16 model (head dim 16, so the fp32 attention path runs) against the plain math: logits and
    gradients within a few bf16 roundings of the activations (tolerance 3e-2 of the largest value)."""
    fast, plain = _pair("hybridnorm", torch.float32)
    ids = torch.randint(0, fast.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = []
    for model in (fast, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        logits.float().square().mean().backward()
        out.append((logits.detach().float(), {n: p.grad for n, p in model.named_parameters()}))
    (lf, gf), (lp, gp) = out
    _assert_rel_close(lf, lp, 3e-2, "bf16 logits")
    for name, g in gp.items():
        _assert_rel_close(gf[name], g, 5e-2, f"bf16 grad of {name}")


def _plain_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    ffn = SwiGLU(1, gate_up.shape[-1] // 2, fast=False)
    ffn.w_in, ffn.w_out = torch.nn.Identity(), torch.nn.Identity()
    return ffn(gate_up)


# -- 2. the whole model: fast kernels vs the plain math -----------------------------------------------------

def _assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max|fast - plain| = {err:.3g}, max|plain| = {scale:.3g}"


def _pair(placement, dtype: torch.dtype, **overrides) -> tuple[hn.TransformerLM, hn.TransformerLM]:
    overrides.setdefault("n_layers", 4)
    fast_cfg = hn.ModelConfig.from_preset("tiny", placement=placement, **overrides)
    plain_cfg = hn.ModelConfig.from_preset("tiny", placement=placement, fast_kernels=False, **overrides)
    assert fast_cfg.fast_kernels and not plain_cfg.fast_kernels
    torch.manual_seed(0)
    fast = oracle.randomize_(hn.TransformerLM(fast_cfg), seed=0).to(dtype)  # gains away from 1 too
    plain = hn.TransformerLM(plain_cfg).to(dtype)
    plain.load_state_dict(fast.state_dict())
    return fast, plain


def _run(model: hn.TransformerLM, ids: torch.Tensor, cotangent: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits, aux = model(ids, return_aux=True)
    loss = (logits * cotangent).sum() + (aux["aux_loss"] if aux else 0)  # a generic vector-Jacobian product
    loss.backward()
    with torch.no_grad():
        no_grad_logits = model(ids)
    return logits.detach(), no_grad_logits, {n: p.grad for n, p in model.named_parameters()}


def check_fast_vs_plain(placement, dtype: torch.dtype, **overrides) -> None:
    fast, plain = _pair(placement, dtype, **overrides)
    cfg = fast.config
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    cot = torch.randn(2, 12, cfg.embedding_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits_f, nograd_f, grads_f = _run(fast, ids, cot)
    logits_p, nograd_p, grads_p = _run(plain, ids, cot)
    tol = TOL[dtype]
    assert logits_f.dtype == dtype
    _assert_rel_close(logits_f, logits_p, tol, "logits")
    _assert_rel_close(nograd_f, nograd_p, tol, "logits without autograd")
    _assert_rel_close(nograd_f, logits_f, tol, "fast logits with vs without autograd")
    assert grads_f.keys() == grads_p.keys()
    for name, g in grads_p.items():
        assert g is not None and grads_f[name] is not None, f"{name} got no gradient"
        _assert_rel_close(grads_f[name], g, tol, f"grad of {name}")


DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", hn.placements.names())
def test_fast_matches_plain_every_preset(name, dtype):
    check_fast_vs_plain(name, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", hn.placements.PAPER_NAMES)
def test_fast_matches_plain_every_table6_name(name, dtype):
    check_fast_vs_plain(name, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["pre", "hybridnorm", "hybridnorm_star"])
def test_fast_matches_plain_moe(name, dtype):
    check_fast_vs_plain(name, dtype, moe=dict(num_experts=4, top_k=2), ffn_hidden_size=32, tie_embeddings=False)


def _variant(scope: str, order: str) -> hn.placements.Placement:
    return hn.placements.get("hybridnorm").replace_blocks(qkv_norm_scope=scope, qkv_norm_order=order)


_YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 4, "attention_factor": 1.3}
VARIANTS = {  # what the fused Q/K/V path declines or must get right at its edges
    "QV-Post": ("QV-Post", {}),
    "full_scope": (_variant("full", "before_rope"), {}),
    "after_rope": (_variant("head", "after_rope"), {}),
    "full_after_rope": (_variant("full", "after_rope"), {}),
    "layernorm": ("hybridnorm", {"norm": "layer"}),
    "dyt": ("QKVC-Post", {"norm": "dyt"}),
    "mqa": ("hybridnorm", {"n_kv_heads": 1}),
    "mha": ("KV-Post", {"n_kv_heads": 4}),
    "decoupled_head_dim": ("hybridnorm_star", {"attn_head_dim": 12}),
    # stretched RoPE tables whose cos/sin are scaled past 1 (YaRN's attention_factor): a backward that assumed
    # c² + s² = 1 would be off by that factor squared
    "yarn_fused": ("hybridnorm_star", {"rope_scaling": _YARN}),
    "yarn_after_rope": (_variant("head", "after_rope"), {"rope_scaling": _YARN}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_matches_plain_attention_variants(variant, dtype):
    placement, overrides = VARIANTS[variant]
    check_fast_vs_plain(placement, dtype, **overrides)


def test_plain_differs_from_a_broken_kernel(monkeypatch):
    """The comparison can fail: a kernel with its RoPE sign flipped is caught at these tolerances."""
    broken = kernels.rope_into

    def flipped(x, cos, sin, out, inverse=False):
        return broken(x, cos, sin, out, inverse=not inverse)

    monkeypatch.setattr(kernels.attention, "rope_into", flipped)  # what QKVPrep calls
    with pytest.raises(AssertionError, match="logits"):
        check_fast_vs_plain("hybridnorm", torch.float64)


# -- the config field ---------------------------------------------------------------------------------------

def test_fast_kernels_field_validates_and_round_trips():
    cfg = hn.ModelConfig.from_preset("tiny", fast_kernels=False)
    assert hn.ModelConfig.from_dict(cfg.to_dict()).fast_kernels is False
    assert hn.ModelConfig.from_yaml(cfg.to_yaml()).fast_kernels is False
    assert hn.ModelConfig.from_json(cfg.to_json()).fast_kernels is False
    assert hn.ModelConfig().fast_kernels is True
    with pytest.raises(ConfigError, match="fast_kernels"):
        hn.ModelConfig(fast_kernels="yes")
    with pytest.raises(ConfigError, match="fast_kernels"):
        hn.ModelConfig.from_yaml("fast_kernels: 1\n")
    model = cfg.build()
    assert not model.blocks[0].attn.fast and not model.blocks[0].ffn.fast
    assert not any(m.fast for m in model.modules() if isinstance(m, RMSNorm))
