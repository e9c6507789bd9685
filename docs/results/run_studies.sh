#!/usr/bin/env bash
# Reproduces the three CPU-scale studies of docs/results/README.md (about 15 minutes on 2 idle cores).
# Data: the embedded KJV corpus, BPE 8192. Every run is resumable: re-running skips finished runs.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-.}
# A small model shared by the studies: d=128, 4 heads (2 KV), SwiGLU 344, seq 128, batch 16, fp32.
COMMON=(--precision=fp32 --model.d_model=128 --model.n_heads=4 --model.n_kv_heads=2 --model.ffn_hidden_size=344
        --model.max_seq_len=128 --seq_len=128 --batch_size=16 --eval_interval=50 --eval_batches=8
        --ckpt_interval=1000 --keep_last=1 --diagnostics.every=10 --log_interval=10)

# (1) Gradient-norm profiles at initialization (step 1) and step 100 — the paper's Figure 2 — 12 layers.
hybridnorm compare --placements pre,post,hybridnorm,hybridnorm_star --max-steps 100 --out "$OUT/1_grad_profiles" \
  "${COMMON[@]}" --model.n_layers=12 --optim.lr=1e-3 --optim.warmup_steps=20

# (2) Deep and narrow (24 layers, d=64) at growing learning rates: where does each placement stop training?
hybridnorm sweep --placements pre,post,hybridnorm,hybridnorm_star --knob lr --values 1e-3,1e-2,5e-2 \
  --max-steps 100 --out "$OUT/2_deep_lr_sweep" "${COMMON[@]}" --model.n_layers=24 --model.d_model=64 \
  --batch_size=8 --optim.warmup_steps=10

# (3) HybridNorm and HybridNorm* vs Pre-Norm at equal tokens (150 steps × 2,048 tokens), 3 seeds, 6 layers.
hybridnorm compare --placements pre,hybridnorm,hybridnorm_star --seeds 0,1,2 --max-steps 150 \
  --out "$OUT/3_equal_tokens_3_seeds" "${COMMON[@]}" --model.n_layers=6 --optim.lr=3e-3 --optim.warmup_steps=20

# (2b) The same deep model without the safety nets: no gradient clipping, 2 warmup steps.
hybridnorm sweep --placements pre,post,hybridnorm,hybridnorm_star --knob lr --values 3e-3,1e-2,3e-2 \
  --max-steps 100 --out "$OUT/2b_deep_lr_sweep_no_clip" "${COMMON[@]}" --model.n_layers=24 --model.d_model=64 \
  --batch_size=8 --optim.warmup_steps=2 --optim.grad_clip=0
