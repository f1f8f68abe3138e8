#!/bin/bash
# One GPU call for the CUDA cluster decode kernel (kernels/cuda/decode_d64.cu): its GPU tests
# and the decode tests it now serves, a per-layer probe against the Triton decode on GPT-OSS
# geometry (probe_decode_tiles.py --cuda), the graph tests through backend=triton, the
# no-sync planning test, then the factory's GPT-OSS decode step with --triton.
#     bench/gpu_cuda_decode.sh OUT COMMIT     (env: TILES, SPLITS for the probe, PROBE=0, FACTORY=0)
set -u
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=$1; COMMIT=${2:-unknown}
python3 tests/backends/flashinfer_warm.py 64 > "$OUT/flashinfer-warm.log" 2>&1 &
WARM=$!
python3 -m pytest -q -m gpu tests/kernels/test_cuda_decode_gpu.py tests/kernels/test_decode_fused_write.py \
    tests/kernels/test_cuda_decode_fp8_gpu.py \
    -p no:cacheprovider -x 2>&1 | tail -15
if [ "${PROBE:-1}" != 0 ]; then
    python3 bench/probe_decode_tiles.py --out "$OUT" --tiles 128x4x2 --splits "${SPLITS:-0,2,4,8}" \
        --cuda "${TILES:-64x2,64x3,128x2}" 2>&1 | grep -v '^{' | tail -40
fi
wait $WARM
tail -1 "$OUT/flashinfer-warm.log"
python3 -m pytest -q -m gpu tests/backends/test_engine_graphs.py tests/backends/test_graphs.py \
    tests/backends/test_backends_vs_oracle.py tests/backends/test_planning_no_sync.py \
    -k "gpt_oss or writes_the_steps or no_host_sync" -p no:cacheprovider 2>&1 | tail -6
if [ "${FACTORY:-1}" != 0 ]; then
    for T in ${FTILES:-64x3}; do  # the CUDA decode tile (SWAFACTORY_DECODE_TILE) per run
        SWAFACTORY_DECODE_TILE=$T python3 bench/bench_factory.py --out "$OUT/factory-$T" \
            --commit "$COMMIT" --models gpt_oss_20b --modes decode --bs 8,64 --triton --rounds 3 \
            2>&1 | tail -4
    done
fi
