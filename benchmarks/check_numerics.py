#!/usr/bin/env python
"""Check that the fast paths (fused Q/K/V norm + RoPE, RMSNorm / RoPE / SwiGLU autograd Functions) give
the same logits and gradients as plain-autograd reference code, within fp32 (bf16) rounding.

The reference is the straightforward formulation: ``F.rms_norm(x.float(), ...).to(x.dtype)``, RoPE by
chunk/cat, ``silu(gate) * up`` and the unfused attention path (``Attention.fused_qkv = False``). Both runs
use the same weights and inputs; printed is max|a - b| / max|b| for the logits and the worst parameter
gradient, next to fp32's and bf16's epsilon.

    python benchmarks/check_numerics.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import hybridnorm as hn
from hybridnorm.nn import attention, ffn, norms

P = hn.placements
PLACEMENTS = {
    "pre": "pre", "hybridnorm": "hybridnorm", "hybridnorm_star": "hybridnorm_star", "olmo2": "olmo2",
    "QKVC-Post": "QKVC-Post", "qk_norm": "qk_norm", "KV-Post": "KV-Post", "QV-Post": "QV-Post",
    "hybridnorm/full": P.get("hybridnorm").replace_blocks(qkv_norm_scope="full"),
    "hybridnorm/after_rope": P.get("hybridnorm").replace_blocks(qkv_norm_order="after_rope"),
    "hybridnorm/full+after": P.get("hybridnorm").replace_blocks(qkv_norm_scope="full",
                                                                  qkv_norm_order="after_rope"),
    "lns": "lns",
}


def _ref_rms(self: norms.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x.float(), (self.dim,), self.gain(), self.eps).to(x.dtype)


def _ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _ref_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    saved = (norms.RMSNorm.forward, attention.apply_rope, ffn.swiglu, attention.Attention.fused_qkv)
    norms.RMSNorm.forward = _ref_rms
    attention.apply_rope = _ref_rope
    ffn.swiglu = _ref_swiglu
    attention.Attention.fused_qkv = False
    try:
        yield
    finally:
        norms.RMSNorm.forward, attention.apply_rope, ffn.swiglu, attention.Attention.fused_qkv = saved


def run(model: hn.TransformerLM, ids: torch.Tensor, targets: torch.Tensor, dtype: str):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    with ctx:
        logits = model(ids)
        loss = hn.lm_loss(logits, targets)
    loss.backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    torch.manual_seed(0)
    print(f"{'placement':>24} {'dtype':>5} {'logits':>9} {'grads':>9}   (max rel. diff fast vs reference; "
          f"eps fp32 {torch.finfo(torch.float32).eps:.1e}, bf16 {torch.finfo(torch.bfloat16).eps:.1e})")
    for name, placement in PLACEMENTS.items():
        cfg = hn.ModelConfig(vocab_size=128, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2,
                             ffn_hidden_size=192, max_seq_len=64, placement=placement)
        model = hn.TransformerLM(cfg)
        with torch.no_grad():  # gains away from 1 so that they matter
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
        ids = torch.randint(0, 128, (2, 64))
        targets = torch.randint(0, 128, (2, 64))
        for dtype in ("fp32", "bf16"):
            fast_logits, fast_grads = run(model, ids, targets, dtype)
            with reference_paths():
                ref_logits, ref_grads = run(model, ids, targets, dtype)
            worst = max(rel(fast_grads[k], ref_grads[k]) for k in ref_grads)
            print(f"{name:>24} {dtype:>5} {rel(fast_logits, ref_logits):9.1e} {worst:9.1e}")


if __name__ == "__main__":
    main()
