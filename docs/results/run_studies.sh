#!/usr/bin/env bash
# Reproduces the studies of docs/results/README.md. Hours on 2 CPU cores (~5.5 min per 24-layer run);
# every grid resumes: re-running skips finished runs. Add --report-only to a command to rewrite its report
# from the runs finished so far, or --jobs N to train N runs side by side (on one H100, --jobs 16 trained 16
# 24-layer runs in ~4 minutes). STUDIES_OUT=DIR writes the studies there instead of beside this script.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${STUDIES_OUT:-.}  # not $OUT: a common variable name that some machines set
STUDIES=${STUDIES:-A B E}  # e.g. STUDIES=B to run only the depth study
# Shared: 24-layer d=64 models (4 heads, 2 KV, SwiGLU 344), batch 8 × 128 tokens, fp32, the kjv-bigval split
# (125k validation tokens, 100 batches = 102,400 scored), diagnostics every 100 steps for the verdicts.
COMMON=(--data.source=kjv-bigval --precision=fp32 --model.d_model=64 --model.n_heads=4 --model.n_kv_heads=2
        --model.ffn_hidden_size=344 --model.max_seq_len=128 --seq_len=128 --batch_size=8 --eval_interval=500
        --eval_batches=100 --ckpt_interval=250 --keep_last=1 --log_interval=20 --diagnostics.every=100)

# (A) placement × init × lr × seed, 1,000 steps (1.02M tokens), warmup 10%.
[[ " $STUDIES " != *" A "* ]] || hybridnorm sweep --placements pre,hybridnorm,hybridnorm_star,post_shifted --init normal,megatron \
  --axis lr=1e-2,1e-3,5e-3,2e-3 --seeds 0,1,2 --warmup-frac 0.1 --max-steps 1000 --baseline pre \
  --out "$OUT/A_lr_init_24_layers" "${COMMON[@]}" --model.n_layers=24 "$@"

# (B) depth at a standard lr with a long warmup, one init for all.
[[ " $STUDIES " != *" B "* ]] || hybridnorm sweep --placements pre,hybridnorm,hybridnorm_star,post_shifted --init megatron \
  --axis depth=12,24,48 --seeds 0,1,2 --warmup-frac 0.2 --max-steps 1000 --baseline pre \
  --out "$OUT/B_depth" "${COMMON[@]}" --optim.lr=1e-3 "$@"

# (E) ResiDual at depth against Pre-Norm: study B's settings, added after A-C.
[[ " $STUDIES " != *" E "* ]] || hybridnorm sweep --placements pre,resi_dual --init megatron \
  --axis depth=12,24,48 --seeds 0,1,2 --warmup-frac 0.2 --max-steps 1000 --baseline pre \
  --out "$OUT/E_resi_dual_depth" "${COMMON[@]}" --optim.lr=1e-3 "$@"

# The claim table of README.md, derived from both studies' runs.json (CI checks it is current).
python3 -m hybridnorm.experiments.claims "$OUT"
