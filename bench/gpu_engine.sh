#!/usr/bin/env bash
# Engine conditions on the GPU host: a host that runs ahead, production-size pools and graphs
# captured at start-up, long prefill chunks, and a production-size soak. Named suites, each
# bounded by `timeout`, so one that hangs leaves the others' results.
#
# From the repository root on the GPU host:
#     WHEELS=build/whlm bench/gpu_engine.sh OUT SUITE [SUITE ...]
# Suites:
#     repro     the run-ahead check on the checkout in OLD_TGZ (a `git archive` of an older
#               commit with tests/backends/run_ahead.py added): flashinfer decode twice, with
#               a never-reused FlashInfer staging buffer (--fresh-staging: the cause), verify
#     runahead  tests/backends/test_run_ahead_gpu.py (flashinfer and triton, 4 modes, guards
#               on and off) and the planning no-sync tests
#     graphs    the 1M-row start-up capture, fp8 scales after capture, graph tests
#     prefill   bench/bench_prefill.py (writes OUT/prefill/)
#     soak      bench/soak.py, 2000 steps (writes OUT/soak/)
#     generate  run=generate run.overlap=true, gemma4 and gpt_oss_20b x every spec, eager and
#               with graphs (bench/gpu_generate.sh; each job also runs without overlap)
# Writes OUT/SUITE.txt per suite (the last lines of its output) and OUT/SUITE.tgz of its files.
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_engine.sh OUT SUITE [SUITE ...]}
shift
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
T=(timeout --kill-after=10)
for suite in "$@"; do
    t0=$(date +%s)
    log=/tmp/engine_$suite
    mkdir -p "$log"
    case $suite in
    repro)
        mkdir -p /tmp/old && tar xzf "${OLD_TGZ:?OLD_TGZ: the older checkout}" -C /tmp/old
        for args in "--mode decode" "--mode decode" "--mode decode --fresh-staging" \
                    "--mode verify_chain" "--mode verify_chain --fresh-staging" \
                    "--mode decode --backend triton"; do
            ( cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old "${T[@]}" 120 python3 \
                tests/backends/run_ahead.py --backend flashinfer $args ) > "$log/o.txt" 2>&1
            rc=$?
            echo "old $args: rc=$rc $(grep -o '"mismatches": [0-9]*' "$log/o.txt") \
$(grep -m1 -o 'an illegal memory access[a-z ]*' "$log/o.txt")" | tee -a "$log/summary.txt"
            cp "$log/o.txt" "$log/old_$(echo "$args" | tr ' -' '__').txt"
        done ;;
    runahead)
        "${T[@]}" 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
            tests/backends/test_run_ahead_gpu.py tests/backends/test_planning_no_sync.py \
            tests/kvcache/test_books_no_sync_gpu.py tests/backends/test_misuse.py \
            > "$log/pytest.txt" 2>&1 ;;
    graphs)
        "${T[@]}" 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rA -s \
            tests/backends/test_graph_capture_1m_gpu.py tests/backends/test_graph_state_bounds.py \
            tests/backends/test_graphs.py tests/backends/test_engine_graphs.py \
            tests/backends/test_flashinfer_check.py tests/kernels/test_kernel_choice.py \
            > "$log/pytest.txt" 2>&1 ;;
    prefill)
        "${T[@]}" 240 python3 bench/bench_prefill.py --out "$log" > "$log/bench.txt" 2>&1 ;;
    soak)
        "${T[@]}" 300 python3 bench/soak.py --out "$log" --steps 2000 > "$log/soak.txt" 2>&1 ;;
    generate)
        LANES=flashinfer:0 WARM_DIMS="256 512 64" MODELS=gemma4,gpt_oss_20b DEADLINE=${GEN_EAGER:-230} \
            bench/gpu_generate.sh "$log/eager" run.overlap=true > "$log/eager.txt" 2>&1
        LANES=flashinfer:0 WARM=0 MODELS=gemma4,gpt_oss_20b DEADLINE=${GEN_GRAPHS:-150} \
            bench/gpu_generate.sh "$log/graphs" run.overlap=true backend.cuda_graph=true \
            > "$log/graphs.txt" 2>&1 ;;
    *) echo "unknown suite $suite" >&2; exit 2 ;;
    esac
    echo "== $suite: $(( $(date +%s) - t0 )) s" >> "$log/summary.txt"
    tail -n 40 "$log"/*.txt > "$OUT/$suite.txt" 2>/dev/null
    tar czf "$OUT/$suite.tgz" -C "$log" . 2>/dev/null
done
