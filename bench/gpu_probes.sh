#!/usr/bin/env bash
# The GPU runs that the verify goal and the flash_attn bandwidth goal wait on, in
# stages that fit one 10-minute device call each (docs/gpu.md, "Probes for the open kernel lines").
#
# On the GPU host, from the repository root:
#     bench/gpu_probes.sh OUT STAGE...
# Stages:
#     verify   bench/probe_verify.py (Gemma 4 full-layer verify tile: random / sequential / L2
#              slots, q·kᵀ and k·qᵀ dense tiles) and one ncu pass over its kernels; Triton only,
#              no FlashInfer JIT
#     factory  FlashInfer's JIT warm-up for head dims 64 256 512, then bench_factory decode and
#              chain/tree verify at bs 8 and 64 on gemma4 and gpt_oss_20b, with --triton
#     fa4      bench/probe_fa4_decode.py (FA4's decode tile, GQA packing, splits; wall and device
#              time) and bench_pages for flash_attn and flashinfer at pages 1 and 128
#     graphs   FlashInfer's JIT warm-up for head dims 64 256 512, then bench/probe_graph_kernels.py:
#              the kernels of GPT-OSS-20b's bs-8 decode step captured and eager, and of Gemma 4's
#              bs-64 chain verify, with device µs per step (the graph-replay goal)
# Environment: WHEELS / FA4 as for bench/gpu_env.sh (.whl for verify and factory; .fa4y and a
# trimmed .whl for fa4 on a fresh machine), COMMIT (recorded in the tables), DEADLINE (seconds
# per stage, default 420).
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_probes.sh OUT STAGE...}
shift
[ $# -ge 1 ] || { echo "usage: bench/gpu_probes.sh OUT verify|factory|fa4|graphs ..." >&2; exit 2; }
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEADLINE=${DEADLINE:-420}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}${FA4:-}" ]; then mkdir -p /tmp/site; fi
# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
for stage in "$@"; do
    start=$(date +%s)
    case $stage in
    verify)
        timeout "$DEADLINE" python3 bench/probe_verify.py "$OUT" > "$OUT/probe_verify.txt" 2>&1
        echo "probe_verify: exit $?"
        grep -v '^dense\|^extend ' "$OUT/probe_verify.txt" | cut -c1-200
        timeout 150 ncu --clock-control none -k regex:'^(extend_stage1|dense|dense_t)$' \
            --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
            --section Occupancy --section SchedulerStats --section LaunchStats \
            python3 bench/probe_verify.py "$OUT" --ncu > "$OUT/ncu_verify.txt" 2>&1
        echo "ncu: exit $?" ;;
    factory)
        python3 tests/backends/flashinfer_warm.py 64 256 512 > "$OUT/warm.txt" 2>&1
        timeout "$DEADLINE" python3 bench/bench_factory.py --out "$OUT" --commit "$COMMIT" \
            --models gemma4,gpt_oss_20b --modes decode,verify_chain8,verify_tree8 --bs 8,64 \
            --triton --deadline $((DEADLINE - 60)) > "$OUT/factory.txt" 2>&1
        echo "bench_factory: exit $?"
        grep '^|' "$OUT/factory.txt" | cut -c1-200 ;;
    fa4)
        timeout "$DEADLINE" python3 bench/probe_fa4_decode.py "$OUT" > "$OUT/probe_fa4.txt" 2>&1
        echo "probe_fa4_decode: exit $?"
        cut -c1-240 "$OUT/probe_fa4.txt" | grep '^{'
        timeout "$DEADLINE" python3 bench/bench_factory.py --out "$OUT" --commit "$COMMIT" \
            --pages flash_attn,flashinfer --page-sizes 1,128 --models gpt_oss_20b --bs 64 \
            > "$OUT/pages.txt" 2>&1
        echo "bench_pages: exit $?"
        grep '^|' "$OUT/pages.txt" | cut -c1-240 ;;
    graphs)
        python3 tests/backends/flashinfer_warm.py 64 256 512 > "$OUT/warm.txt" 2>&1
        timeout "$DEADLINE" python3 bench/probe_graph_kernels.py "$OUT" gpt_oss_20b:decode:8 \
            gpt_oss_20b:decode:8:eager gemma4:verify_chain8:64:eager > "$OUT/graphs.txt" 2>&1
        echo "probe_graph_kernels: exit $?"
        cut -c1-160 "$OUT/graphs.txt" ;;
    *) echo "unknown stage $stage (verify, factory, fa4, graphs)" >&2; exit 2 ;;
    esac
    echo "stage $stage: $(( $(date +%s) - start )) s"
done
