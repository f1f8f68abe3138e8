#!/usr/bin/env bash
# The hot-path evidence at one commit, in one device call (carry .whl and build/cubins):
# FlashInfer warm-up, the GPU tests of the planning and graph paths (no host sync, engine-style
# capture, FlashInfer decode re-planning against the oracle, the fused key lists), then one
# whole `bench_factory.py` run. Returns OUT/hotpath.tgz (the device tool brings back few files).
#
#     bench/gpu_hotpath.sh OUT [ROUNDS]        (about 350 s; ROUNDS of bench_factory, default 5)
# Environment: TESTS_S (seconds for the GPU tests, default 150); BENCH_END (seconds from the
# start by which the bench stops starting cases, default 530); GENERATE=1: then `run=generate
# backend=flashinfer backend.cuda_graph=true` over gemma4 and gpt_oss_20b × every spec
# (bench/gpu_generate.sh, one lane; needs transformers among the wheels: carry MODELS=1's
# wheels, docs/gpu.md; BENCH_END defaults to 430 then).
# Back here: tar xzf hotpath.tgz (hotpath/tests.txt, hotpath/bench/factory-h200.{md,json,png},
# with GENERATE=1 hotpath/generate/rows_flashinfer.jsonl: bench/gpu_generate.py render)
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_hotpath.sh OUT [ROUNDS]}
ROUNDS=${2:-5}
T0=$(date +%s)
R=$OUT/hotpath
mkdir -p "$R" /tmp/site
export WHEELS=${WHEELS:-.whl} SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh" || exit 2
python3 tests/backends/flashinfer_warm.py 64 > "$R/warm.log" 2>&1
echo "warm: $(( $(date +%s) - T0 )) s"
timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -x \
    tests/backends/test_planning_no_sync.py tests/backends/test_engine_graphs.py \
    tests/backends/test_graphs.py "tests/backends/test_gpu_vs_oracle.py" -k \
    "not test_gpu_vs_oracle or (flashinfer and decode and not pages)" > "$R/tests.txt" 2>&1
tail -3 "$R/tests.txt"
echo "tests: $(( $(date +%s) - T0 )) s"
END=${BENCH_END:-$([ -n "${GENERATE:-}" ] && echo 430 || echo 530)}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 bench/bench_factory.py --out "$R/bench" --models gpt_oss_20b,gemma4 \
    --modes decode,verify_chain8,verify_tree8 --bs 8,64 --triton --rounds "$ROUNDS" \
    --commit "$COMMIT" --deadline $(( END - ($(date +%s) - T0) )) \
    > "$R/bench.txt" 2>&1
tail -30 "$R/bench.txt"
if [ -n "${GENERATE:-}" ]; then  # the engine of run=generate capturing its whole step
    echo "bench: $(( $(date +%s) - T0 )) s"
    LANES="flashinfer:0" WARM_DIMS="256 512 64" MODELS=gemma4,gpt_oss_20b \
        DEADLINE=$(( 560 - ($(date +%s) - T0) )) bench/gpu_generate.sh "$R/generate" \
        backend.cuda_graph=true > "$R/generate.txt" 2>&1
    tail -5 "$R/generate.txt"
fi
echo "done: $(( $(date +%s) - T0 )) s"
tar czf "$OUT/hotpath.tgz" -C "$OUT" hotpath && rm -rf "$R"
