#!/usr/bin/env bash
# Issue 16's item 5 (and issue 17's fp8 serve) at one commit, in two device calls on one warm
# machine, each returning a single archive (the device tool brings back a few files only).
#
# On the GPU host, from the repository root:
#     bench/gpu_item5.sh OUT whl    carry .whl and build/cubins: FlashInfer warm-up, then
#                                   smoke of flashinfer, triton, torch, flex; serve for
#                                   flashinfer and triton × gemma4, gpt_oss_20b × none, eagle3,
#                                   frozen_kv_mtp, dflash; fp8 KV smoke on triton × gemma4
#                                   (about 420 s)
#     bench/gpu_item5.sh OUT fa4    within 30 s of the first, carry .fa4y and build/w7 (not
#                                   the cubins: the carry limit; the first call's stay in
#                                   build/): flash_attn's smoke beside fp8 KV serve on triton ×
#                                   gemma4 (about 300 s; 4 × 24 GiB)
# Environment: DEADLINE (seconds the sweeps may run, default 420 for whl, 300 for fa4).
# Nothing else runs beside the sweeps: at ad31922 GPU tests beside them left three serve runs
# unfinished at their deadline (bench/results/session-2026-12-04b-h200.md).
# Back here: tar xzf item5.tgz; python bench/gpu_rows.py add --commit C --call N item5/*/;
# python bench/gpu_rows.py render
set -uo pipefail
OUT=${1:?usage: bench/gpu_item5.sh OUT whl|fa4}
PART=${2:?usage: bench/gpu_item5.sh OUT whl|fa4}
T0=$(date +%s)
R=$OUT/item5
mkdir -p "$R" /tmp/site
elapsed() { echo $(( $(date +%s) - T0 )); }
SPECS4=none,eagle3,frozen_kv_mtp,dflash
sweep() {  # NAME DEADLINE KNOB=VALUE...: one packed sweep in the background, its log in R
    local name=$1 limit=$2
    shift 2
    ( env "$@" NAME="$name" PACK=1 DEADLINE="$limit" bench/gpu_conformance.sh "$R" matrix \
        > "$R/$name.txt" 2>&1 ) &
}
case $PART in
whl)
    export WHEELS=${WHEELS:-.whl} SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    D=${DEADLINE:-420}
    sweep smoke_ttf "$D" BACKENDS=triton,torch,flex WORKLOAD=smoke JOBS=5
    sweep fp8_smoke "$D" BACKENDS=triton MODELS=gemma4 SPECS=$SPECS4 WORKLOAD=smoke JOBS=2 \
        EXTRA=backend.kv_dtype=fp8_e4m3
    python3 tests/backends/flashinfer_warm.py 64 > "$R/warm.log" 2>&1
    echo "warm: $(elapsed) s"
    sweep serve_item5 $((D - $(elapsed))) BACKENDS=flashinfer,triton MODELS=gemma4,gpt_oss_20b \
        SPECS=$SPECS4 WORKLOAD=serve JOBS=5
    sweep smoke_fi $((D - $(elapsed))) BACKENDS=flashinfer WORKLOAD=smoke JOBS=3 ;;
fa4)
    export WHEELS=${WHEELS-build/w7} FA4=${FA4:-.fa4y}
    export SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    D=${DEADLINE:-300}
    sweep smoke_fa "$D" BACKENDS=flash_attn WORKLOAD=smoke JOBS=3
    sweep fp8_serve "$D" BACKENDS=triton MODELS=gemma4 SPECS=$SPECS4 WORKLOAD=serve JOBS=4 \
        EXTRA=backend.kv_dtype=fp8_e4m3 ;;
*)
    echo "usage: bench/gpu_item5.sh OUT whl|fa4" >&2
    exit 2 ;;
esac
wait
for f in "$R"/*.txt; do  # one line per sweep: ok / refused / failed
    printf '%s: %s\n' "$(basename "$f" .txt)" "$(grep -h ' ok, ' "$f" | head -1)"
done
echo "sweeps done: $(elapsed) s"
# one file back: every sweep's tarball unpacked into item5/ and packed again with the logs
(cd "$R" && for t in *.tgz; do [ -e "$t" ] && tar xzf "$t" && rm "$t"; done)
tar czf "$OUT/item5.tgz" --exclude='*.png' -C "$OUT" item5 && rm -rf "$R"
ls -la "$OUT"
