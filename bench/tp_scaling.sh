#!/usr/bin/env bash
# The tensor-parallel scaling sweep on a 2-GPU host, with fair timing:
#     backend × spec × model × parallel.tp ∈ {1, 2}, workload=serve, as Hydra multiruns.
# A process's CUDA-event times include other processes' kernels when they time-slice one GPU, so
# no GPU ever runs two harness processes at once:
#   tp1  two lanes, pinned with CUDA_VISIBLE_DEVICES=0 and =1; each runs its half of the tp=1
#        combinations one job at a time (Hydra's basic launcher is serial);
#   tp2  afterwards, one tp=2 job at a time (each spawns two ranks, one per GPU).
# FlashInfer's kernels JIT-compile in the background (tests/backends/flashinfer_warm.py, the head
# dims of the models swept) while the triton jobs start; flashinfer jobs wait for it.
#
# On the GPU host, from the repository root:
#     WHEELS=.whl COMMIT=abc1234 PHASE=tp1 bench/tp_scaling.sh "$OUT"    # first call
#     COMMIT=abc1234 PHASE=tp2 bench/tp_scaling.sh "$OUT"                # second, same warm host
# Environment:
#     PHASE      tp1 | tp2 | all (default all; one device call rarely holds both)
#     DEADLINE   seconds from the start until running sweeps are stopped (default 540); what
#                finished is packed. A sweep is not started with under MIN_LEFT s (30) left.
#     BACKENDS / SPECS / MODELS   narrow the sweep (comma lists; defaults: the full sweep)
#     COMMIT     the commit checked out (git may not work on the host)
#     WORK       where the sweeps accumulate on the host (default /tmp/tp_scaling/COMMIT). A later
#                call skips every combination that already has a result.json there (RESUME=0: none)
#     WHEELS, FA4  wheels to install first (bench/gpu_env.sh); a warm host reuses /tmp/site
#     WARM=0     skip the FlashInfer warm-up (its JIT cache is on disk already)
#     DRY=1      print the plan and exit
# Writes OUT/tp_scaling.tgz: every sweep so far under WORK (result.json, report.json, matrix.md,
# logs; no png), this call's plan, commands, timeline, nvidia-smi output, host.txt and commit.
# Back here: tar xzf tp_scaling.tgz -C /tmp/tp && python bench/tp_scaling.py /tmp/tp/*
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
# NVLink multicast off in every process started from here (NCCL, symmetric memory, NVSHMEM)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${1:?usage: bench/tp_scaling.sh OUT   (PHASE=tp1|tp2|all, DEADLINE, BACKENDS, SPECS, MODELS, DRY=1)}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
PHASE=${PHASE:-all}
DEADLINE=${DEADLINE:-540}
MIN_LEFT=${MIN_LEFT:-30}
BACKENDS=${BACKENDS:-flashinfer,triton}
SPECS=${SPECS:-none,eagle3,frozen_kv_mtp,dflash}
MODELS=${MODELS:-gemma4,gpt_oss_20b}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
WORK=${WORK:-/tmp/tp_scaling/$COMMIT}
RUN=$(date -u +%Y%m%dT%H%M%SZ)_$PHASE
R=$WORK/$RUN

case $PHASE in tp1|tp2|all) ;; *) echo "PHASE=$PHASE: use tp1, tp2 or all" >&2; exit 2 ;; esac
for v in DEADLINE MIN_LEFT; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "$v=${!v}: give whole seconds" >&2; exit 2; }
done
IFS=, read -ra specs <<< "$SPECS"
IFS=, read -ra models <<< "$MODELS"
IFS=, read -ra given <<< "$BACKENDS"
for pair in "${given[@]/#/backend:}" "${specs[@]/#/spec:}" "${models[@]/#/model:}"; do
    [ -f "conf/${pair%%:*}/${pair#*:}.yaml" ] || {
        echo "${pair%%:*} '${pair#*:}' has no conf/${pair%%:*}/${pair#*:}.yaml; choose from:" \
             "$(cd "conf/${pair%%:*}" 2>/dev/null && ls -- *.yaml | sed 's/\.yaml$//' | xargs)" >&2
        exit 2; }
done
# flashinfer last: its jobs wait for the warm-up, the others fill that time
backends=()
for b in "${given[@]}"; do [ "$b" = flashinfer ] || backends+=("$b"); done
for b in "${given[@]}"; do [ "$b" = flashinfer ] && backends+=("$b"); done

NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=2  # no nvidia-smi (a dry run here): plan for two

# Combinations that already have a result.json under WORK: "tp backend spec model" lines
done_list() {
    [ "${RESUME:-1}" = 1 ] && [ -d "$WORK" ] || return 0
    python3 - "$WORK" <<'EOF'
import json, pathlib, sys
for p in pathlib.Path(sys.argv[1]).rglob("result.json"):
    try:
        r = json.loads(p.read_text())
        tp = next((o.split("=", 1)[1] for o in r["overrides"] if o.startswith("parallel.tp=")), "1")
        print(tp, r["backend"], r["spec"], r["model"])
    except (ValueError, KeyError, OSError):
        pass  # unreadable: run the combination again
EOF
}
DONE=$(done_list)
is_done() { grep -qxF "$1 $2 $3 $4" <<< "$DONE"; }

# The plan: "tp lane backend model specs" lines; each is one Hydra multirun (jobs run serially).
# tp=1 lanes: a snake over (model, spec, backend) gives each lane the same number of jobs of
# every model and backend, so both GPUs finish at about the same time.
plan=()
skipped=0
lane_of() { case $(( $1 % 4 )) in 0|3) echo 0 ;; *) echo 1 ;; esac; }
if [ "$PHASE" != tp2 ]; then
    declare -A lane_specs=()
    i=0
    for m in "${models[@]}"; do for s in "${specs[@]}"; do for b in "${backends[@]}"; do
        l=$(lane_of $i); i=$((i + 1))
        if is_done 1 "$b" "$s" "$m"; then skipped=$((skipped + 1)); continue; fi
        lane_specs[$l.$b.$m]+=${lane_specs[$l.$b.$m]:+,}$s
    done; done; done
    for l in 0 1; do for b in "${backends[@]}"; do for m in "${models[@]}"; do
        [ -n "${lane_specs[$l.$b.$m]:-}" ] && plan+=("1 $l $b $m ${lane_specs[$l.$b.$m]}")
    done; done; done
fi
if [ "$PHASE" != tp1 ]; then
    for b in "${backends[@]}"; do for m in "${models[@]}"; do
        todo=""
        for s in "${specs[@]}"; do
            if is_done 2 "$b" "$s" "$m"; then skipped=$((skipped + 1)); else todo+=${todo:+,}$s; fi
        done
        [ -n "$todo" ] && plan+=("2 - $b $m $todo")
    done; done
fi

sweep_name() {  # tp lane backend model → the sweep's folder under R
    if [ "$2" = - ]; then echo "tp${1}_${3}_$4"; else echo "tp${1}_lane${2}_${3}_$4"; fi
}
gpus_of() {  # tp=1 lane L runs on GPU L (both on GPU 0 when the host has one); tp=2 on both
    if [ "$1" = 2 ]; then echo 0,1; elif [ "$NGPU" -ge 2 ]; then echo "$2"; else echo 0; fi
}
command_of() {  # tp lane backend model specs
    echo "CUDA_VISIBLE_DEVICES=$(gpus_of "$1" "$2") python3 -m swafactory -m backend=$3 spec=$5" \
         "model=$4 workload=serve parallel.tp=$1 hydra.sweep.dir=$R/$(sweep_name "$1" "$2" "$3" "$4")"
}
warm_dims() {  # the head dims of the models swept (flashinfer_warm.py's arguments); "" = all
    local dims=""
    for m in "${models[@]}"; do
        case $m in
        gemma4) dims+=" 256 512" ;;
        gpt_oss_20b|gpt_oss_120b) dims+=" 64" ;;
        mistral_7b) dims+=" 128" ;;
        *) echo ""; return ;;
        esac
    done
    echo "$dims" | tr ' ' '\n' | sort -un | xargs
}
warm_needed=0
for p in "${plan[@]}"; do
    read -r _ _ b _ _ <<< "$p"; [ "$b" = flashinfer ] && warm_needed=1
done
[ "${WARM:-1}" = 0 ] && warm_needed=0

echo "tp_scaling: PHASE=$PHASE, commit $COMMIT, $NGPU GPU(s), deadline $DEADLINE s, work $R"
echo "${#plan[@]} sweeps; $skipped combinations already have a result.json under $WORK"
[ "$warm_needed" = 1 ] && echo "warm (background; flashinfer sweeps wait): CUDA_VISIBLE_DEVICES=0" \
    "python3 tests/backends/flashinfer_warm.py $(warm_dims)"
for p in "${plan[@]}"; do
    read -r tp lane b m s <<< "$p"
    echo "plan tp=$tp lane=$lane gpus=$(gpus_of "$tp" "$lane") backend=$b model=$m spec=$s"
    echo "    $(command_of "$tp" "$lane" "$b" "$m" "$s")"
done
if [ "$PHASE" != tp1 ] && [ "$NGPU" -lt 2 ]; then
    echo "tp=2 needs two GPUs; this host has $NGPU: the tp2 sweeps will be refused" >&2
fi
[ "${DRY:-0}" = 1 ] && exit 0

mkdir -p "$R" "$OUT"
if [ -z "${WHEELS:-}${FA4:-}" ] && [ -d /tmp/site ]; then  # a warm host: installed by a former call
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
log() { echo "+$(elapsed) s $*" >> "$R/timeline.txt"; }
log "start phase $PHASE, deadline $DEADLINE s"
printf '%s\n' "${plan[@]}" > "$R/plan.txt"
for p in "${plan[@]}"; do read -r tp lane b m s <<< "$p"; command_of "$tp" "$lane" "$b" "$m" "$s"; done \
    > "$R/commands.txt"
echo "$COMMIT" > "$R/commit.txt"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $COMMIT"
    echo "phase: $PHASE"
    echo "gpus: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | paste -sd ';')"
    echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "cpus: $(nproc --all)"  # --all: nproc alone honours OMP_NUM_THREADS (gpu_env.sh sets 2)
    python3 - <<'EOF'
import importlib, platform
print("python:", platform.python_version())
for m in ("torch", "triton", "flashinfer"):
    try:
        mod = importlib.import_module(m)
        cuda = f" (CUDA {mod.version.cuda})" if m == "torch" else ""
        print(f"{m}: {mod.__version__}{cuda}")
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        print(f"{m}: MISSING ({type(e).__name__})")
EOF
} > "$R/host.txt" 2>&1
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
nvidia-smi topo -m > "$R/nvidia-smi-topo.txt" 2>&1

if [ "$warm_needed" = 1 ]; then
    # shellcheck disable=SC2046  # the head dims are separate arguments
    ( log "start warm gpus=0"
      CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$(( $(left) > 1 ? $(left) : 1 ))" \
          python3 tests/backends/flashinfer_warm.py $(warm_dims) > "$R/warm.txt" 2>&1
      log "end warm gpus=0 exit $?"; touch "$R/warm.done" ) &
    warm_pid=$!
else
    touch "$R/warm.done"
fi

run_sweep() {  # tp lane backend model specs: one multirun, stopped at the deadline
    local tp=$1 lane=$2 b=$3 m=$4 s=$5 name gpus rc budget
    name=$(sweep_name "$tp" "$lane" "$b" "$m")
    gpus=$(gpus_of "$tp" "$lane")
    if [ "$tp" = 2 ] && [ "$NGPU" -lt 2 ]; then log "skip $name: one GPU"; return; fi
    if [ "$b" = flashinfer ]; then
        until [ -e "$R/warm.done" ] || [ "$(left)" -lt "$MIN_LEFT" ]; do sleep 2; done
    fi
    budget=$(left)  # timeout 0 would mean no limit: never reached below MIN_LEFT
    if [ "$budget" -lt "$MIN_LEFT" ]; then log "skip $name: $budget s left"; return; fi
    log "start $name gpus=$gpus specs=$s"
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$budget" python3 -m swafactory -m backend="$b" \
        spec="$s" model="$m" workload=serve parallel.tp="$tp" hydra.sweep.dir="$R/$name" \
        > "$R/$name.log" 2>&1
    rc=$?
    log "end $name gpus=$gpus exit $rc$([ $rc = 124 ] && echo ' (deadline)')"
}
run_lane() {  # every planned sweep of one tp=1 lane, one after another
    local p tp lane b m s
    for p in "${plan[@]}"; do
        read -r tp lane b m s <<< "$p"
        [ "$tp" = 1 ] && [ "$lane" = "$1" ] && run_sweep "$tp" "$lane" "$b" "$m" "$s"
    done
}

if [ "$PHASE" != tp2 ]; then
    if [ "$NGPU" -ge 2 ]; then
        run_lane 0 & l0=$!
        run_lane 1 & l1=$!
        wait "$l0" "$l1"
    else
        run_lane 0; run_lane 1  # one GPU: the lanes take turns
    fi
fi
if [ "$PHASE" != tp1 ]; then  # after both lanes: each tp=2 job holds both GPUs
    for p in "${plan[@]}"; do
        read -r tp lane b m s <<< "$p"
        [ "$tp" = 2 ] && run_sweep "$tp" "$lane" "$b" "$m" "$s"
    done
fi
[ -n "${warm_pid:-}" ] && wait "$warm_pid"
log "sweeps done"
nvidia-smi > "$R/nvidia-smi-end.txt" 2>&1
tar czf "$OUT/tp_scaling.tgz" --exclude='*.png' -C "$(dirname "$WORK")" "$(basename "$WORK")"
cat "$R/timeline.txt"
ls -la "$OUT"
size=$(stat -c %s "$OUT/tp_scaling.tgz")
[ "$size" -le $((16 << 20)) ] || echo "WARNING: tp_scaling.tgz is $size bytes, over 16 MiB" >&2
