#!/usr/bin/env bash
# Issue 16's hot-path evidence at one commit, in one device call (carry .whl and build/cubins):
# FlashInfer warm-up, the GPU tests of the planning and graph paths (no host sync, engine-style
# capture, FlashInfer decode re-planning against the oracle, the fused key lists), then one
# whole `bench_factory.py` run. Returns OUT/hotpath.tgz (the device tool brings back few files).
#
#     bench/gpu_hotpath.sh OUT [ROUNDS]        (about 520 s; ROUNDS of bench_factory, default 5)
# Back here: tar xzf hotpath.tgz (hotpath/tests.txt, hotpath/bench/factory-h200.{md,json,png})
set -uo pipefail
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
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 bench/bench_factory.py --out "$R/bench" --models gpt_oss_20b,gemma4 \
    --modes decode,verify_chain8,verify_tree8 --bs 8,64 --triton --rounds "$ROUNDS" \
    --commit "$COMMIT" --deadline $(( 530 - ($(date +%s) - T0) )) > "$R/bench.txt" 2>&1
tail -30 "$R/bench.txt"
echo "done: $(( $(date +%s) - T0 )) s"
tar czf "$OUT/hotpath.tgz" -C "$OUT" hotpath && rm -rf "$R"
