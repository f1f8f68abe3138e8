#!/usr/bin/env bash
# The GPU conformance run: backend tests, the serve matrix, and the faults on flashinfer.
#
# On a GPU host, from the repository root:
#     bench/gpu_conformance.sh OUT [STAGE...]      STAGE: tests matrix faults (default: all three)
# Environment:
#     WHEELS, FA4  wheels to install first into /tmp/site (offline hosts; bench/gpu_env.sh,
#              docs/gpu.md); unset = use the environment as it is.
#     JOBS     parallel harness processes sharing the GPU (default 6). Measured serve peaks
#              (06bb54c): Gemma 4 about 20 GiB (torch backend, fp32 KV: 38), Mistral 10-12
#              (torch: 23), GPT-OSS under 2; docs/gpu.md says what fit together.
#     MODELS / BACKENDS / SPECS / WORKLOAD   narrow the matrix (defaults: the full matrix, serve).
#     NAME     the matrix's folder under OUT (default matrix); EXTRA: more overrides for it.
#     DEADLINE seconds the matrix stage may run (default: no limit). Jobs still running then are
#              stopped; `bench/gpu_rows.py add` records them as unfinished. Leave time to pack OUT.
#     PACK=1   replace OUT/NAME by OUT/NAME.tgz once the matrix ends: the device tool brings back
#              a limited number of files (here: tar xzf NAME.tgz; gpu_rows.py add ... NAME/)
# Writes OUT/tests.txt, OUT/NAME/matrix.md (+ one folder per job), OUT/faults.txt (+ reports).
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_conformance.sh OUT [tests|matrix|faults]...}
shift
STAGES=${*:-tests matrix faults}
JOBS=${JOBS:-6}
BACKENDS=${BACKENDS:-flashinfer,flash_attn,flex,triton,torch}
SPECS=${SPECS:-none,eagle,eagle3,nextn,frozen_kv_mtp,dflash}
MODELS=${MODELS:-gemma4,gpt_oss_20b,mistral_7b}
WORKLOAD=${WORKLOAD:-serve}
NAME=${NAME:-matrix}
mkdir -p "$OUT"

# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
python3 - <<'EOF'
import importlib.util, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for m in ("flashinfer", "flash_attn.cute", "hydra", "pydantic"):
    print(m, "ok" if importlib.util.find_spec(m.split(".")[0]) else "MISSING")
EOF

for stage in $STAGES; do
    start=$(date +%s)
    case $stage in
    tests)
        python3 tests/backends/flashinfer_warm.py > "$OUT/warm.txt" 2>&1
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/backends tests/kernels \
            > "$OUT/tests.txt" 2>&1
        tail -3 "$OUT/tests.txt" ;;
    matrix)
        if ! python3 -c "import hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
            echo "matrix: hydra-joblib-launcher is not installed; carry its wheels" \
                "(../shared/gpu/wheels.sh DIR hydra-joblib-launcher joblib; docs/gpu.md)" >&2
            continue
        fi
        # shellcheck disable=SC2086  # EXTRA is a list of overrides
        ${DEADLINE:+timeout -k 10 "$DEADLINE"} python3 -m swafactory -m backend="$BACKENDS" spec="$SPECS" model="$MODELS" \
            workload="$WORKLOAD" ${EXTRA:-} hydra/launcher=joblib hydra.launcher.n_jobs="$JOBS" \
            hydra.sweep.dir="$OUT/$NAME" > "$OUT/$NAME.log" 2>&1
        head -3 "$OUT/$NAME/matrix.md"
        if [ -n "${PACK:-}" ]; then  # one file back instead of a folder per job (docs/gpu.md)
            tar czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "${OUT:?}/$NAME" \
                && echo "packed $OUT/$NAME.tgz"
        fi ;;
    faults)
        # each fault on the spec it belongs to (tests/harness/test_conformance.py: FAULTS), JOBS
        # at a time: each is a short smoke run, and every one must exit 1 with its report
        mkdir -p "$OUT/faults"
        # graphs: a batch that shrinks inside its bucket of 4 (faults=none is the clean twin). The
        # replay guard catches it on any model; without it the oracle needs gpt_oss_20b: one zeroed
        # key of gemma4's 1024-key window moves its outputs by less than bf16's error (at 2c17a0c)
        SHRINK=workload.max_running_requests=4,workload.num_requests=6
        # fault:spec[:model[:override]]; the model defaults to gemma4 (sinks need gpt_oss_20b,
        # fp8 on flashinfer needs gemma4's D = 512 layers on triton)
        for pair in skip_spec_translation:eagle3 allocator_pool_for_own_pool_draft:dflash \
                    pool_cached_at_init:frozen_kv_mtp window_off_by_one:none \
                    no_swa_eviction:none no_draft_headroom:eagle \
                    leak_rejected_draft_slots:eagle plan_without_window:none \
                    sink_dropped:none:gpt_oss_20b tree_mask_not_rebased:eagle3 \
                    premature_free_on_reject:eagle \
                    paged_free_stale_mapping:none:gemma4:backend.page_size=16 \
                    fp8_descale_dropped:none:gemma4:backend.kv_dtype=fp8_e4m3,backend.groups.full=triton \
                    graph_pad_stale_swa_loc:none:gpt_oss_20b:backend.cuda_graph=true,$SHRINK \
                    none:none:gpt_oss_20b:backend.cuda_graph=true,$SHRINK; do
            IFS=: read -r fault spec model extra <<< "$pair"
            while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
            ( python3 -m swafactory backend=flashinfer model="${model:-gemma4}" workload=smoke \
                faults="$fault" spec="$spec" ${extra//,/ } \
                hydra.run.dir="$OUT/faults/$fault" > "$OUT/faults/$fault.log" 2>&1
              echo "fault $fault (spec $spec): exit $?" ) &
        done > "$OUT/faults.txt"
        wait
        cat "$OUT/faults.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
    echo "stage $stage: $(( $(date +%s) - start )) s"
done
