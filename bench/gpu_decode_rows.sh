#!/bin/bash
# One GPU call for the whole-rows decode kernel (kernels/triton/decode_rows.py): its sweep on
# GPT-OSS geometry (probe_decode_rows.py), its GPU tests and the graph tests through
# backend=triton, then the factory's GPT-OSS decode step with --triton (graph replay against
# the floor, with decode_rows and with the per-head kernel).
#     bench/gpu_decode_rows.sh OUT COMMIT
set -u
OUT=$1; COMMIT=${2:-unknown}
python3 tests/backends/flashinfer_warm.py 64 > "$OUT/flashinfer-warm.log" 2>&1 &
WARM=$!
python3 bench/probe_decode_rows.py --out "$OUT" --tiles "${TILES:-32x8x3,16x8x3,32x4x3,64x8x2}" \
    --splits "${SPLITS:-0,4,16,33}" 2>&1 | tail -90
python3 -m pytest -q -m gpu tests/kernels/test_decode_rows.py -p no:cacheprovider 2>&1 | tail -3
wait $WARM
tail -3 "$OUT/flashinfer-warm.log"
python3 -m pytest -q -m gpu tests/backends/test_engine_graphs.py tests/backends/test_graphs.py \
    -k "gpt_oss" -p no:cacheprovider 2>&1 | tail -5
python3 bench/bench_factory.py --out "$OUT/factory" --commit "$COMMIT" --models gpt_oss_20b \
    --modes decode --bs 8,64 --triton --rounds 3 2>&1 | tail -24
