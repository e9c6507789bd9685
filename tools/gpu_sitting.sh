#!/usr/bin/env bash
# One GPU sitting on a lent machine (device tool) that has torch + CUDA + transformers but no network and
# not every dependency: install the carried wheels (.whl/, made here by `make gpu-wheels`), put src/ on the
# path, and run benchmarks/gpu_check.py into $OUT. Extra arguments go to gpu_check.py (e.g. --resume
# after copying an earlier sitting's gpu_check.json into $OUT, or --only mfu). With `mfu` after the commit it
# runs benchmarks/gpu_mfu.py instead (the MFU climb), its rows kept in $OUT/mfu_rows.json as they come.
#   device run, carry [".whl"]:  bash tools/gpu_sitting.sh <commit> [gpu_check args]
#                                bash tools/gpu_sitting.sh <commit> mfu [gpu_mfu args, e.g. --profile $OUT/prof]
set -o pipefail
commit=${1:?usage: tools/gpu_sitting.sh COMMIT [mfu] [gpu_check.py or gpu_mfu.py args]}; shift
out=${OUT:-/tmp/gpu_check_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYBRIDNORM_COMMIT="$commit"
export HYBRIDNORM_CACHE=/tmp/hybridnorm_cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
if [ "${1:-}" = mfu ]; then
    shift
    python3 benchmarks/gpu_mfu.py --json "$out/mfu_rows.json" "$@" 2>&1 | tee "$out/console_mfu.txt"
else
    python3 benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/console.txt"
fi
