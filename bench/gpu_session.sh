#!/usr/bin/env bash
# One device call of the serve matrix: every serve combination of the named backends that the
# record (bench/results/gpu-conformance-rows.jsonl) does not yet have ok, in parallel sweeps that
# respect the host's memory, stopped in time to pack the results into $OUT/session.tgz.
#
# On the GPU host, from the repository root:
#     bench/gpu_session.sh BACKEND...
# Environment:
#     WHEELS, FA4  wheels to install first (bench/gpu_env.sh): .whl, and .fa4y for flash-attn-4
#     WARM=1     compile FlashInfer's kernel variants first (about 170 s on a fresh machine); the
#                other backends' sweeps start meanwhile, flashinfer's once it is done.
#                WARM="256 512": only those head dims' variants (Gemma 4's)
#     SYNC=1     also count each backend's synchronizing calls on a gemma4 smoke run
#                (bench/sync_sites.py → session/sync_BACKEND.txt)
#     DEADLINE   seconds from the start until the sweeps are stopped (default 500)
#     JOBS       parallel jobs per (backend, model) sweep (default 2; Gemma 4: GEMMA_JOBS, 2).
#                Memory decides: at 4ab4ad3+ (2026-11-29) a flashinfer Gemma 4 serve run peaked at
#                28-29 GiB, Mistral 13.5, GPT-OSS 2; the torch backend (fp32 KV) on Gemma 4 held
#                45 GiB at its first step (report.json's peak_device_bytes says what each took)
#     JOBS_<backend>_<model>  one sweep's own count (JOBS_torch_gemma4=1)
#     SKIP       sweeps to leave out, as <backend>_<model> words (SKIP="flash_attn_mistral_7b")
#     DRY=1      print the sweeps and exit
# Back here: tar xzf session.tgz; python bench/gpu_rows.py add --commit C --call N session/*/
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
[ $# -ge 1 ] || { echo "usage: bench/gpu_session.sh BACKEND..." >&2; exit 2; }
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
R=$OUT/session
mkdir -p "$R"
elapsed() { echo $(( $(date +%s) - T0 )); }

# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # once: the sweeps below inherit it

pattern=$(printf '%s|' "$@")
sweep_name() { echo "$1" | sed -E 's/BACKENDS=([^ ]+) MODELS=([^ ]+).*/\1_\2/'; }
python3 bench/gpu_rows.py missing --workload serve | grep -E "^BACKENDS=(${pattern%|}) " \
    | while read -r line; do
        case " ${SKIP:-} " in *" $(sweep_name "$line") "*) ;; *) echo "$line" ;; esac
    done > "$R/plan.txt"
echo "$(wc -l < "$R/plan.txt") sweeps:"; cat "$R/plan.txt"
[ "${DRY:-0}" = 1 ] && exit 0

# FlashInfer's kernels compile in the background; only flashinfer's jobs wait for them
if [ "${WARM:-0}" != 0 ]; then
    # shellcheck disable=SC2046  # WARM=1: every variant; else the head dims to warm
    ( python3 tests/backends/flashinfer_warm.py $([ "$WARM" = 1 ] || echo "$WARM") > "$R/warm.txt" 2>&1
      echo "warm: $(elapsed) s"; touch "$R/warm.done" ) &
else
    touch "$R/warm.done"
fi
wait_warm() {  # a flashinfer job waits for the warm
    case $1 in *flashinfer*) until [ -e "$R/warm.done" ]; do sleep 2; done ;; esac
}
pids=()
if [ "${SYNC:-0}" = 1 ]; then  # where each backend's run waits for the GPU (bench/sync_sites.py)
    for b in "$@"; do
        ( wait_warm "$b"; python3 bench/sync_sites.py "$R/sync_$b.json" backend="$b" \
            model=gemma4 spec=eagle3 workload=smoke > "$R/sync_$b.txt" 2>&1 ) &
        pids+=($!)
    done
fi
while read -r line; do
    [ -n "$line" ] || continue
    name=serve_$(sweep_name "$line")
    jobs=${JOBS:-2}
    case $line in *MODELS=gemma4*) jobs=${GEMMA_JOBS:-2} ;; esac
    var=JOBS_${name#serve_}  # e.g. JOBS_triton_gemma4=3: one sweep's own count
    jobs=${!var:-$jobs}
    # shellcheck disable=SC2086  # the plan line is a list of KEY=VALUE knobs
    ( wait_warm "$line"
      env $line NAME="$name" JOBS="$jobs" DEADLINE="$(( ${DEADLINE:-500} - $(elapsed) ))" \
          bench/gpu_conformance.sh "$R" matrix > "$R/$name.txt" 2>&1 ) &
    pids+=($!)
done < "$R/plan.txt"
[ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
echo "sweeps done: $(elapsed) s"
tar czf "$OUT/session.tgz" --exclude='*.png' -C "$OUT" session && rm -rf "$R"
ls -la "$OUT"
