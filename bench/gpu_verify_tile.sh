#!/bin/bash
# One GPU call for the head-dim-512 CUDA verify tile: variant sweep (probe_verify_cuda.py), the
# GPU tests with the fastest correct variant, ncu on it, and the factory's Gemma 4 step with it
# and with the Triton tile (SWAFACTORY_CUDA_KERNELS=0), both from this call.
#     bench/gpu_verify_tile.sh OUT COMMIT        (env: CONFIGS, the variants to sweep)
# Cubins built ahead (SWAFACTORY_CACHE=build/cubins, carried) skip nvcc on the host.
set -u
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=$1; COMMIT=${2:-unknown}
export SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
python3 tests/backends/flashinfer_warm.py 256 512 > "$OUT/flashinfer-warm.log" 2>&1 &
WARM=$!
python3 bench/probe_verify_cuda.py --out "$OUT" --splits 1 --configs "${CONFIGS:-32x2}" 2>&1 | tail -16
best=$(python3 -c "
import json
rows = [r for r in json.load(open('$OUT/probe-verify-cuda.json'))['rows']
        if r.get('kind') == 'dense' and 'ms' in r and r['err'] < 5e-3]
print(min(rows, key=lambda r: r['ms'])['config'])")
echo "fastest correct variant: $best"
export SWAFACTORY_VERIFY_TILE=$best
python3 -m pytest -q -m gpu tests/kernels/test_cuda_verify_gpu.py -p no:cacheprovider 2>&1 | tail -3
timeout 120 ncu --clock-control none -k verify_d512 -c 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis python3 bench/probe_verify_cuda.py --out /tmp/ncu-probe \
    --only-dense --configs "$best" --splits 1 > "$OUT/ncu-$best.txt" 2>&1
echo "ncu: $?"
wait $WARM
python3 bench/bench_factory.py --out "$OUT/tile" --commit "$COMMIT" --models gemma4 \
    --modes decode,verify_chain8,verify_tree8 --bs 64 --rounds 3 2>&1 | tail -12
SWAFACTORY_CUDA_KERNELS=0 python3 bench/bench_factory.py --out "$OUT/triton-tile" \
    --commit "$COMMIT" --models gemma4 --modes decode,verify_chain8 --bs 64 --rounds 3 2>&1 \
    | tail -6
