#!/usr/bin/env python
"""Print how far the fast kernels (``ModelConfig.fast_kernels=True``) are from the plain math (``False``)
in fp32 and under bf16 autocast: max|fast − plain| / max|plain| of the logits and of the worst parameter
gradient, next to fp32's and bf16's epsilon.

Correctness is owned by pytest (``tests/nn/test_kernels.py``: gradcheck of every kernel in float64 and fast
vs plain for every placement in float64/float32, with asserted tolerances). This script only prints, at a
larger size and in bf16, which the tests do not cover with a bound. Both models are built from configs that
differ only in ``fast_kernels`` and share the same weights; nothing is patched.

    python benchmarks/check_numerics.py
"""

from __future__ import annotations

import contextlib

import torch

import hybridnorm as hn

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
    print(f"{'placement':>24} {'dtype':>5} {'logits':>9} {'grads':>9}   (max rel. diff fast vs plain; "
          f"eps fp32 {torch.finfo(torch.float32).eps:.1e}, bf16 {torch.finfo(torch.bfloat16).eps:.1e})")
    for name, placement in PLACEMENTS.items():
        kw = dict(vocab_size=128, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_size=192,
                  max_seq_len=64, placement=placement)
        fast = hn.TransformerLM(hn.ModelConfig(**kw))
        plain = hn.TransformerLM(hn.ModelConfig(**kw, fast_kernels=False))
        with torch.no_grad():  # gains away from 1 so that they matter
            for p in fast.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
        plain.load_state_dict(fast.state_dict())
        ids = torch.randint(0, 128, (2, 64))
        targets = torch.randint(0, 128, (2, 64))
        for dtype in ("fp32", "bf16"):
            fast_logits, fast_grads = run(fast, ids, targets, dtype)
            ref_logits, ref_grads = run(plain, ids, targets, dtype)
            worst = max(rel(fast_grads[k], ref_grads[k]) for k in ref_grads)
            print(f"{name:>24} {dtype:>5} {rel(fast_logits, ref_logits):9.1e} {worst:9.1e}")


if __name__ == "__main__":
    main()
