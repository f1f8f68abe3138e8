#!/usr/bin/env bash
# The conformance set of one commit (smoke of every accepted combination, serve for flashinfer
# and triton; and the fp8 serve rows), in two device calls on one warm machine, each returning
# a single archive (the device tool brings back a few files only).
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
#                                   gemma4 (about 300 s; 4 × 24 GiB). With ISSUE17=1 also the
#                                   kernel-feature serve rows: flash_attn + flashinfer
#                                   per group, fp8 on flashinfer + triton (gemma4);
#                                   flash_attn page 128, flashinfer page 16, flex
#                                   (gpt_oss_20b, mistral_7b)
# Environment: DEADLINE (seconds the sweeps may run, default 420 for whl, 300 for fa4); TESTS=1
# (whl): the warm-up, then the hot path's GPU tests alone (TESTS_S seconds), then the sweeps.
# Nothing else runs beside the sweeps: at ad31922 GPU tests beside them left three serve runs
# unfinished at their deadline (bench/results/session-2026-12-04b-h200.md).
# Back here: tar xzf item5.tgz; python bench/gpu_rows.py add --commit C --call N item5/*/;
# python bench/gpu_rows.py render
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_item5.sh OUT whl|fa4}
PART=${2:?usage: bench/gpu_item5.sh OUT whl|fa4}
T0=$(date +%s)
R=$OUT/item5
mkdir -p "$R" /tmp/site
elapsed() { echo $(( $(date +%s) - T0 )); }
SPECS4=none,eagle3,frozen_kv_mtp,dflash
run_sweep() {  # NAME DEADLINE KNOB=VALUE...: one packed sweep, its log in R
    local name=$1 limit=$2
    shift 2
    env "$@" NAME="$name" PACK=1 DEADLINE="$limit" bench/gpu_conformance.sh "$R" matrix \
        > "$R/$name.txt" 2>&1
}
sweep() { run_sweep "$@" & }  # the same in the background
# after(NAME KNOB=VALUE...): a sweep for a chain, given what is left of the call's deadline D
after() {
    local name=$1 left=$((D - $(elapsed)))
    shift
    if [ "$left" -lt 40 ]; then echo "$name: not started, ${left} s left" > "$R/$name.txt"; return; fi
    run_sweep "$name" "$left" "$@"
}
case $PART in
whl)
    export WHEELS=${WHEELS:-.whl} SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    D=${DEADLINE:-420}
    if [ -n "${TESTS:-}" ]; then  # TESTS=1: warm-up, then the hot path's GPU tests, alone
        python3 tests/backends/flashinfer_warm.py 64 > "$R/warm.log" 2>&1
        echo "warm: $(elapsed) s"
        timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider \
            tests/backends/test_planning_no_sync.py tests/backends/test_engine_graphs.py \
            tests/backends/test_graphs.py tests/backends/test_gpu_vs_oracle.py -k \
            "not test_gpu_vs_oracle or (flashinfer and decode and not pages)" \
            > "$R/gpu_tests.log" 2>&1
        tail -3 "$R/gpu_tests.log"
        echo "tests: $(elapsed) s"
    fi
    sweep smoke_ttf $((D - $(elapsed))) BACKENDS=triton,torch,flex WORKLOAD=smoke JOBS=5
    sweep fp8_smoke $((D - $(elapsed))) BACKENDS=triton MODELS=gemma4 SPECS=$SPECS4 \
        WORKLOAD=smoke JOBS=2 EXTRA=backend.kv_dtype=fp8_e4m3
    if [ -z "${TESTS:-}" ]; then
        python3 tests/backends/flashinfer_warm.py 64 > "$R/warm.log" 2>&1
        echo "warm: $(elapsed) s"
    fi
    sweep serve_item5 $((D - $(elapsed))) BACKENDS=flashinfer,triton MODELS=gemma4,gpt_oss_20b \
        SPECS=$SPECS4 WORKLOAD=serve JOBS=5
    sweep smoke_fi $((D - $(elapsed))) BACKENDS=flashinfer WORKLOAD=smoke JOBS=3 ;;
fa4)
    export WHEELS=${WHEELS-build/w7} FA4=${FA4:-.fa4y}
    export SWAFACTORY_CACHE=${SWAFACTORY_CACHE:-$PWD/build/cubins}
    # shellcheck source=bench/gpu_env.sh
    . "$(dirname "$0")/gpu_env.sh" || exit 2
    D=${DEADLINE:-300}
    if [ -z "${ISSUE17:-}" ]; then
        sweep smoke_fa "$D" BACKENDS=flash_attn WORKLOAD=smoke JOBS=3
        sweep fp8_serve "$D" BACKENDS=triton MODELS=gemma4 SPECS=$SPECS4 WORKLOAD=serve JOBS=4 \
            EXTRA=backend.kv_dtype=fp8_e4m3
    else  # ISSUE17=1 (DEADLINE about 520): the kernel-feature serve rows too, in three chains
        # that keep at most four Gemma 4 jobs (about 24 GiB each) on the GPU; FlashInfer is the
        # one the whl part installed into /tmp/site on this machine
        P2=gpt_oss_20b,mistral_7b
        ( after smoke_fa BACKENDS=flash_attn WORKLOAD=smoke JOBS=3
          after fa_fi_gemma4 BACKENDS=flash_attn MODELS=gemma4 SPECS=none,eagle3 WORKLOAD=serve \
              JOBS=1 EXTRA=backend.groups.full=flashinfer ) &
        ( after fp8_serve BACKENDS=triton MODELS=gemma4 SPECS=$SPECS4 WORKLOAD=serve JOBS=4 \
              EXTRA=backend.kv_dtype=fp8_e4m3
          after fp8_fi_gemma4 BACKENDS=flashinfer MODELS=gemma4 SPECS=$SPECS4 WORKLOAD=serve \
              JOBS=3 EXTRA="backend.groups.full=triton backend.kv_dtype=fp8_e4m3" ) &
        ( after fa_p128 BACKENDS=flash_attn MODELS=$P2 SPECS=none,eagle3 WORKLOAD=serve JOBS=2 \
              EXTRA=backend.page_size=128
          after fi_p16 BACKENDS=flashinfer MODELS=$P2 SPECS=none,eagle3 WORKLOAD=serve JOBS=2 \
              EXTRA=backend.page_size=16
          after flex_serve BACKENDS=flex MODELS=$P2 SPECS=none,eagle3 WORKLOAD=serve JOBS=2 ) &
    fi ;;
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
