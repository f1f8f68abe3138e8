#!/bin/bash
# One GPU call for the triton backend's decode graphs: the decode kernel that writes the step's
# K/V (kernels/triton/decode.py, new_kv) in its GPU tests and a tile sweep on GPT-OSS geometry
# (probe_decode_tiles.py), the graph tests through backend=triton, then the factory's GPT-OSS
# decode step with --triton (graph replay against the floor, with the K/V written in the
# kernel and stored apart).
#     bench/gpu_triton_graphs.sh OUT COMMIT        (env: TILES, SPLITS for the sweep; PROBE=0)
set -u
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=$1; COMMIT=${2:-unknown}
python3 tests/backends/flashinfer_warm.py 64 > "$OUT/flashinfer-warm.log" 2>&1 &
WARM=$!
if [ "${PROBE:-1}" != 0 ]; then
    python3 bench/probe_decode_tiles.py --out "$OUT" ${TILES:+--tiles $TILES} \
        ${SPLITS:+--splits $SPLITS} 2>&1 | grep -v '^{' | tail -80
fi
python3 -m pytest -q -m gpu tests/kernels/test_decode_fused_write.py tests/kernels/test_triton_gpu.py \
    -k "fused or decode" -p no:cacheprovider 2>&1 | tail -3
wait $WARM
tail -1 "$OUT/flashinfer-warm.log"
python3 -m pytest -q -m gpu tests/backends/test_engine_graphs.py tests/backends/test_graphs.py \
    tests/backends/test_backends_vs_oracle.py -k "gpt_oss or writes_the_steps" \
    -p no:cacheprovider 2>&1 | tail -4
python3 bench/bench_factory.py --out "$OUT/factory" --commit "$COMMIT" --models gpt_oss_20b \
    --modes decode --bs 8,64 --triton --rounds 3 2>&1 | tail -6
