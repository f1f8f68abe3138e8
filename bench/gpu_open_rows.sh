#!/usr/bin/env bash
# The GPU rows still missing after the bf87f57 runs (bench/results/session-2026-12-04e-h200.md),
# at one commit, in two device calls on one warm machine, each returning one archive.
#
# On the GPU host, from the repository root:
#     bench/gpu_open_rows.sh OUT whl   carry MODELS=1's wheels (build/whlm, docs/gpu.md) and
#                                      build/cubins: the hot path's gemma4 × standalone through
#                                      `run=generate backend=flashinfer`, eager then with graphs
#                                      (report.json names each rejected draft's logit gaps);
#                                      the fp8 KV smoke and serve on gpt_oss_20b ×
#                                      flashinfer, triton × none, eagle3, frozen_kv_mtp, dflash;
#                                      then, alone on the GPU, the fp8 decode bench (Gemma 4,
#                                      bs 64) and FlashInfer's page sizes (GPT-OSS, bs 64)
#                                      (about 450 s)
#     bench/gpu_open_rows.sh OUT fa4   within 30 s, carry .fa4y and build/w7: flash_attn's page
#                                      sizes 1 and 128 (GPT-OSS, bs 64) (about 90 s)
# Environment: COMMIT (the commit the bench files name; the host may have no .git), WHEELS.
# Back here: tar xzf open_rows.tgz; python bench/gpu_rows.py add --commit C --call N
# open_rows/fp8_gptoss_*/; open_rows/gen_{false,true}/rows_flashinfer.jsonl are generate rows.
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_open_rows.sh OUT whl|fa4}
PART=${2:?usage: bench/gpu_open_rows.sh OUT whl|fa4}
T0=$(date +%s)
R=$OUT/open_rows
mkdir -p "$R" /tmp/site
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
elapsed() { echo $(( $(date +%s) - T0 )); }
sweep() {  # NAME KNOB=VALUE...: one packed serve/smoke sweep, its log in R
    local name=$1
    shift
    env "$@" NAME="$name" PACK=1 DEADLINE=300 bench/gpu_conformance.sh "$R" matrix \
        > "$R/$name.txt" 2>&1
}
bench() {  # NAME ARGS...: one bench_factory.py run at bs 64, nothing else on the GPU
    local name=$1
    shift
    python3 bench/bench_factory.py --out "$R/$name" --bs 64 --ctx 8192 \
        --commit "$COMMIT" "$@" > "$R/$name.txt" 2>&1
    tail -8 "$R/$name.txt"
    echo "$name: $(elapsed) s"
}
case $PART in
whl)
    export WHEELS=${WHEELS:-build/whlm} SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    python3 tests/backends/flashinfer_warm.py 256 512 64 > "$R/warm.log" 2>&1
    echo "warm: $(elapsed) s"
    for g in false true; do  # the same jobs eager and through graphs, at one commit
        LANES=flashinfer:0 WARM=0 MODELS=gemma4 SPECS=standalone,eagle DEADLINE=150 \
            bench/gpu_generate.sh "$R/gen_$g" "backend.cuda_graph=$g" > "$R/gen_$g.txt" 2>&1
        tail -3 "$R/gen_$g/lane_flashinfer.log"
    done
    echo "generate: $(elapsed) s"
    sweep fp8_gptoss_serve BACKENDS=flashinfer,triton MODELS=gpt_oss_20b \
        SPECS=none,eagle3,frozen_kv_mtp,dflash WORKLOAD=serve JOBS=8 EXTRA=backend.kv_dtype=fp8_e4m3 &
    sweep fp8_gptoss_smoke BACKENDS=flashinfer,triton MODELS=gpt_oss_20b \
        SPECS=none,eagle3,frozen_kv_mtp,dflash WORKLOAD=smoke JOBS=4 EXTRA=backend.kv_dtype=fp8_e4m3 &
    wait
    grep -h " ok, " "$R"/fp8_gptoss_*.txt
    echo "sweeps: $(elapsed) s"
    bench fp8 --models gemma4 --fp8 flashinfer,triton
    bench pages_fi --models gpt_oss_20b --pages flashinfer --page-sizes 1,16,128 ;;
fa4)
    export WHEELS=${WHEELS-build/w7} FA4=${FA4:-.fa4y}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    bench pages_fa --models gpt_oss_20b --pages flash_attn --page-sizes 1,128 ;;
*)
    echo "usage: bench/gpu_open_rows.sh OUT whl|fa4" >&2
    exit 2 ;;
esac
(cd "$R" && for t in *.tgz; do [ -e "$t" ] && tar xzf "$t" && rm "$t"; done)
tar czf "$OUT/open_rows.tgz" --exclude='*.png' -C "$OUT" open_rows && rm -rf "$R"
ls -la "$OUT"
