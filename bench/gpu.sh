#!/usr/bin/env bash
# The GPU host's one entry: named suites of benchmarks, GPU tests and harness sweeps.
#
# From the repository root on the GPU host:
#     bench/gpu.sh OUT SUITE [SUITE ...]      each suite bounded by `timeout` (DEADLINE s)
#     . bench/gpu.sh                          sourced: install WHEELS / FA4 and export the
#                                             environment only (then run anything by hand)
# Suites (each writes OUT/SUITE.txt, the last lines of its logs, and OUT/SUITE.tgz, its files;
# OUT/machine.txt names the GPU, the commit and the packages once per call):
#   conformance  = tests matrix faults
#   tests        FlashInfer's JIT warm-up, then every GPU test (tests/backends, tests/kernels)
#   hotpath      the hot path's GPU tests alone: no host sync in planning, engine-style
#                capture, FlashInfer decode re-planning against the oracle, fused key lists
#   matrix       the harness sweep BACKENDS x SPECS x MODELS on WORKLOAD, JOBS at a time
#                (NAME: its folder; EXTRA: more overrides). Record its rows back here with
#                bench/gpu_rows.py add --commit C DIR, then bench/gpu_rows.py render
#   missing      every serve sweep the conformance record lacks for BACKENDS
#                (bench/gpu_rows.py missing), one per backend and model, in parallel
#   faults       each planted fault on a flashinfer smoke run; every one must exit 1
#   generate     run=generate over MODELS x SPECS, one lane per LANES backend, eager and
#                through CUDA graphs, DEADLINE s a pass (bench/bench_generate.py run; render
#                its rows back here)
#   factory      bench/bench_factory.py: decode, chain and tree verify, bs 8 and 64, --triton
#                and --auto (backend=auto tuned on this GPU, its first tuning's seconds)
#   longctx      bench/bench_factory.py: Gemma 4 decode at 32K and 128K context, bs 16 and 64
#   prefill      bench/bench_prefill.py          fp8    bench/bench_fp8.py (gemma4, bs 64)
#   pages        bench/bench_pages.py (gpt_oss_20b, bs 64; flash_attn needs FA4)
#   guards       bench/bench_guards.py           soak   bench/soak.py, 2000 steps
#   acceptance   bench/bench_generate.py acceptance: distilled drafts on a pretrained target, the
#                seed faults 2 and 3 with the guards off beside their clean twins (ACC_MODELS,
#                default gpt_oss_20b, x triton, flashinfer x dflash, eagle, frozen_kv_mtp); MODELS=1
#   tp           the tensor-parallel sweep on two GPUs, tp 1 then 2, one harness process per
#                GPU (PHASE=tp1|tp2|all; WORK keeps the sweeps between calls: a later call
#                skips what has a result.json, RESUME=0 none; MIN_LEFT; DRY=1 plans only).
#                Back here: tar xzf tp.tgz -C /tmp/tp && python bench/tp_scaling.py /tmp/tp/*
#   core         the serving core on the GPU: planning without a host sync over every CUDA
#                backend, the overlap loop at zero syncs (flashinfer, triton, every spec),
#                engine graphs, run=generate under the attention oracle, and a graph replayed
#                for another mode (bench/probes/graph_routes.py: DFlash block 16, clean and
#                faults=graph_key_without_mode, eager against graphs)
#   runahead     a host two forwards ahead, bit-identical to the serial run, and no-sync tests
#   graphs       the 1M-row start-up capture, fp8 scales after capture, the graph tests (a
#                replay runs the eager step's kernels: tests/backends/test_graph_kernels_gpu.py)
#   repro        the run-ahead check on OLD_TGZ (`git archive` of an older commit with
#                tests/backends/run_ahead.py added), with and without a fresh FlashInfer staging
#   tiles        kernel tiles: the CUDA/Triton decode tile sweep (bench/probes/decode_tiles.py)
#                and the head_dim-512 verify tile sweep (bench/probes/verify_cuda.py), their tests
#   kernels      the kernels a captured step replays (bench/probes/graph_kernels.py)
#   host         where host time goes and what waits for the GPU (bench/probes/host_gpu.py,
#                sync_wait.py, sync_sites.py)
#   evidence     the GPU evidence at one commit, part by part (PARTS, a comma list; default
#                core,generate,faults,speed), within one call's CALL_S (570): a part that
#                finished at this commit on this machine (build/evidence/COMMIT/PART.done) is
#                skipped, so the next call on a warm machine resumes; a part that does not fit
#                the time left waits for the next call. One OUT/evidence.tgz, one
#                OUT/evidence.txt. Parts:
#                  core      the `core` suite; with OLD_TGZ (`git archive` of an older commit)
#                            also its graph-route probe there (bench/probes/graph_routes.py)
#                  generate  run=generate x gemma4, gpt_oss_20b x every spec, graphs at start-up
#                            and overlap on: checked (the oracle on), then timed (warm, the
#                            oracle off; tokens/s with overlap and without)
#                  faults    every fault x flashinfer, triton, guards on; the engine-path
#                            faults with them off (FAULTS_GUARDED, FAULTS_UNGUARDED)
#                  speed     the `factory` suite, then `longctx` in what is left
#                  seeds     each seed preset (+experiment=seed1..seed4) on flashinfer and
#                            triton, guards off, as its users ran it: seed 2's collapse over
#                            time (each job's report.png beside its clean twin), seed 3's
#                            crash past the use threshold, seed 1's out-of-bounds tree read
#                  matrix    bench/fault_matrix.py: every fault x flashinfer, triton x guards
#                            on / off, on its launch line (the fault-matrix record's GPU half)
#                  drafts    Gemma 4's acceptance rows at the shipped pool sizing (no
#                            --swa-as-full; the wired target recipe trains first, then each
#                            family's seed fault: DFlash's split pool under swa_pool_missed with
#                            pages in order, EAGLE-3's tree under skip_spec_translation,
#                            frozen_kv_mtp under pool_cached_at_init), then the accept-length-
#                            against-context bench at 1K-32K (bench/bench_context.py)
# Environment:
#   WHEELS, FA4  folders of wheels to install into /tmp/site (offline hosts; docs/gpu.md);
#                unset on a host that has /tmp/site from an earlier call: that one is used
#   DEADLINE     seconds each suite may run (defaults per suite, 240-540)
#   COMMIT       the commit the records name (default: git rev-parse, else unknown)
#   MODELS / BACKENDS / SPECS / WORKLOAD / JOBS   narrow a sweep (matrix, missing, tp, generate)
#   LANES        generate: backend:gpu words (default flashinfer:0); GRAPHS: "false true"
#   OVERRIDES    generate: more overrides for every job (e.g. run.overlap=true)
#   ROUNDS       factory: interleaved factory/raw rounds (default 5)
#   ACC_MODELS / ACC_FAMILIES   acceptance: its models (comma list; gemma4's target, lag 1032,
#                pretrains at 2.1 s a step: it does not fit a call) and the families beside the
#                pool fault (default dflash,eagle); trained targets and drafts are cached in
#                SWAFACTORY_CACHE_DIR between calls
SITE_PATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages  # pip --target skips .pth files:
# cutlass-dsl's package path (flash-attn-4) is added by hand

gpu_env() {  # install the carried wheels once into /tmp/site; export what the harness runs in
    # a script started from one that already did this (SWAFACTORY_GPU_ENV=1) installs nothing:
    # parallel pip installs into one --target would overwrite each other
    [ -z "${SWAFACTORY_GPU_ENV:-}" ] || return 0
    local d
    for d in ${WHEELS:-}; do
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl \
            || return 2
    done
    if [ -n "${FA4:-}" ]; then
        tar xJf "$FA4/libs.tar.xz" -C /tmp/site && python3 -m pip install -q --no-index \
            --no-deps --no-compile --target /tmp/site --upgrade "$FA4"/*.whl || return 2
    fi
    if [ -n "${WHEELS:-}${FA4:-}" ] || [ -d /tmp/site ]; then
        export PYTHONPATH=$SITE_PATH:$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    # expandable segments: a dozen harness processes share one GPU, and each one's caching
    # allocator otherwise keeps its fragmented peak (serve runs ran out of memory without it)
    # run=generate checks its attention rows (graph replays included) against the fp32 oracle
    export SWAFACTORY_ORACLE=${SWAFACTORY_ORACLE:-true}
    export TRITON_INTERPRET=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
        PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        SWAFACTORY_GPU_ENV=1 PYTHONUNBUFFERED=1
}
if (return 0 2>/dev/null); then gpu_env; return; fi  # sourced: the environment only

set -uo pipefail
case ${1:-} in
-*|"")  # an option is never an OUT folder: print the header above, make nothing
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
    case ${1:-} in -h|--help) exit 0 ;; "") exit 2 ;; *) echo "unknown option: $1" >&2; exit 2 ;; esac ;;
esac
OUT=$1
shift
[ $# -ge 1 ] || { echo "usage: bench/gpu.sh OUT SUITE [SUITE ...] (--help lists them)" >&2; exit 2; }
# NVLink multicast off in every process started from here (NCCL, symmetric memory, NVSHMEM)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SPECS4=none,eagle3,frozen_kv_mtp,dflash
mkdir -p "$OUT"
gpu_env || exit 2

limit() { timeout --kill-after=10 "${DEADLINE:-$1}" "${@:2}"; }  # SECONDS CMD...: DEADLINE wins
warm() { python3 tests/backends/flashinfer_warm.py "$@" >> "$D/warm.txt" 2>&1; }  # HEAD_DIM... [KIND...]
bench() { limit "$@" --out "$D" > "$D/bench.txt" 2>&1; }  # SECONDS python3 SCRIPT ARGS...
gpu_tests() { limit "$1" python3 -m pytest -m gpu -q -p no:cacheprovider -rA "${@:2}"; }

suite_tests() {
    warm
    gpu_tests 480 tests/backends tests/kernels > "$D/pytest.txt" 2>&1
}
suite_hotpath() {
    warm 64
    gpu_tests 150 tests/backends/test_planning_no_sync.py tests/backends/test_engine_graphs.py \
        tests/backends/test_graphs.py tests/backends/test_gpu_vs_oracle.py -k \
        "not test_gpu_vs_oracle or (flashinfer and decode and not pages)" > "$D/pytest.txt" 2>&1
}
suite_matrix() {  # the harness's own multirun; its jobs in D/NAME, one folder each
    if ! python3 -c "import hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
        echo "matrix: hydra-joblib-launcher is not installed; carry its wheels (docs/gpu.md)" \
            | tee "$D/matrix.txt" >&2
        return 2
    fi
    local name=${NAME:-matrix}
    # shellcheck disable=SC2086  # EXTRA is a list of overrides
    limit 540 python3 -m swafactory -m backend="${BACKENDS:-flashinfer,flash_attn,flex,triton,torch}" \
        spec="${SPECS:-none,eagle,eagle3,nextn,frozen_kv_mtp,dflash}" \
        model="${MODELS:-gemma4,gpt_oss_20b,mistral_7b}" workload="${WORKLOAD:-serve}" \
        ${EXTRA:-} hydra/launcher=joblib hydra.launcher.n_jobs="${JOBS:-6}" \
        hydra.sweep.dir="$D/$name" > "$D/$name.txt" 2>&1
    local rc=$?
    head -3 "$D/$name/matrix.md" 2>/dev/null
    return $rc
}
suite_missing() {  # one matrix per (backend, model) the record lacks, in parallel
    local line name pids=() want=${BACKENDS:-flashinfer,triton}
    python3 bench/gpu_rows.py missing --workload serve \
        | grep -E "^BACKENDS=(${want//,/|}) " > "$D/plan.txt"
    warm 256 512 64 128 &
    local warm_pid=$!
    while read -r line; do
        [ -n "$line" ] || continue
        name=serve_$(echo "$line" | sed -E 's/BACKENDS=([^ ]+) MODELS=([^ ]+).*/\1_\2/')
        # shellcheck disable=SC2086  # the plan line is a list of KEY=VALUE knobs
        ( case $line in *flashinfer*) wait "$warm_pid" 2>/dev/null ;; esac
          export $line NAME=$name JOBS=${JOBS:-2}; suite_matrix ) &
        pids+=($!)
    done < "$D/plan.txt"
    [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
    wait
}
# The fault runs, fault:spec[:model[:overrides]] (model default gemma4: sinks need gpt_oss_20b,
# fp8 on flashinfer needs gemma4's D = 512 layers on triton). Guards on: the conformance harness
# (its typed-space checks are always on; faults=none is the graph faults' clean twin, a batch
# that shrinks inside its bucket of 4). Guards off: run=generate with run.guards=false at a
# geometry FlashInfer serves, the faults that act on the engine's path, each caught by its
# symptom (tests/engine/test_generate.py); drafts that accept where the symptom is the accept
# length or the draft's rows against the clean twin's.
SHRINK=workload.max_running_requests=4,workload.num_requests=6
PRETRAINED=run.target_weights=pretrained,spec.draft_weights=distilled
BLOCK16=spec.block_size=16,spec.num_draft_tokens=16  # DFlash's two modes in one graph bucket
FAULTS_GUARDED=(skip_spec_translation:eagle3 allocator_pool_for_own_pool_draft:dflash
    swa_pool_missed:dflash:gpt_oss_20b:spec.draft_pool_split=true
    pool_cached_at_init:frozen_kv_mtp window_off_by_one:none no_swa_eviction:none
    no_draft_headroom:eagle leak_rejected_draft_slots:eagle plan_without_window:none
    sink_dropped:none:gpt_oss_20b tree_mask_not_rebased:eagle3 premature_free_on_reject:eagle
    paged_free_stale_mapping:none:gemma4:backend.page_size=16
    fp8_descale_dropped:none:gemma4:backend.kv_dtype=fp8_e4m3,backend.groups.full=triton
    graph_pad_stale_swa_loc:none:gpt_oss_20b:backend.cuda_graph=true,$SHRINK
    graph_key_without_mode:dflash:gpt_oss_20b:run=generate,backend.cuda_graph=true,$BLOCK16
    block_window_one_left_bound:dflash:gpt_oss_20b:spec.draft_window=16
    draft_planned_with_group0:eagle3:gpt_oss_20b:spec.draft_window=16,spec.draft_kv_retention=window
    windowed_draft_admitted_as_full:eagle3:gpt_oss_20b:spec.draft_window=16,spec.draft_kv_retention=window
    swa_metadata_missing_in_spec_modes:eagle:gpt_oss_20b window_gather_from_zero:eagle:gpt_oss_20b
    verify_rows_share_write_loc:eagle:gpt_oss_20b verify_as_decode:eagle:gpt_oss_20b
    lookahead_not_retained:eagle:gpt_oss_20b
    frozen_draft_fp8_unscaled:frozen_kv_mtp:gemma4:backend.kv_dtype=fp8_e4m3,backend.groups.full=triton
    graph_draft_extend_untranslated:eagle3:gpt_oss_20b:run=generate,spec.draft_weights=random,spec.draft_window=16,spec.draft_kv_retention=window,backend.cuda_graph=true
    none:none:gpt_oss_20b:backend.cuda_graph=true,$SHRINK)
FAULTS_UNGUARDED=(skip_spec_translation:eagle3:gpt_oss_20b
    pool_cached_at_init:frozen_kv_mtp:gpt_oss_20b
    allocator_pool_for_own_pool_draft:dflash:gpt_oss_20b:$PRETRAINED
    swa_pool_missed:dflash:gpt_oss_20b:spec.draft_pool_split=true,$PRETRAINED
    plan_without_window:none:gpt_oss_20b tree_mask_not_rebased:eagle3:gpt_oss_20b
    sink_dropped:none:gpt_oss_20b
    graph_key_without_mode:dflash:gpt_oss_20b:backend.cuda_graph=true,$BLOCK16,$PRETRAINED
    swa_metadata_missing_in_spec_modes:eagle:gpt_oss_20b window_gather_from_zero:eagle:gpt_oss_20b
    verify_rows_share_write_loc:eagle:gpt_oss_20b verify_as_decode:eagle:gpt_oss_20b
    lookahead_not_retained:eagle:gpt_oss_20b
    graph_draft_extend_untranslated:eagle3:gpt_oss_20b:spec.draft_weights=random,spec.draft_window=16,spec.draft_kv_retention=window,backend.cuda_graph=true
    none:dflash:gpt_oss_20b:backend.cuda_graph=true,$BLOCK16,$PRETRAINED)
fault_lane() {  # FIXED ENTRY...: each entry with the FIXED overrides (comma list) in $D/FAULT;
    # a line per run in $D/faults.txt; fails where a fault is refused (exit 2), is not caught
    # (exit 0) or never acts (exit 3), or the clean twin fails
    local fixed=$1 pair fault spec model extra bad=0 want
    shift
    : > "$D/faults.txt"
    for pair in "$@"; do
        IFS=: read -r fault spec model extra <<< "$pair"
        while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-6}" ]; do wait -n; done
        # shellcheck disable=SC2086  # extra, fixed: overrides, one word each
        ( limit 300 python3 -m swafactory backend="${FAULT_BACKEND:-flashinfer}" \
              model="${model:-gemma4}" workload=smoke faults="$fault" spec="$spec" \
              ${extra//,/ } ${fixed//,/ } \
              hydra.run.dir="$D/$fault" > "$D/$fault.log" 2>&1
          echo "fault $fault (spec $spec): exit $?" ) >> "$D/faults.txt" &
    done
    wait
    while read -r _ fault _ _ _ rc; do
        want=1; [ "$fault" = none ] && want=0
        [ "$rc" = "$want" ] || { echo "fault $fault: exit $rc, wanted $want" >&2; bad=1; }
    done < "$D/faults.txt"
    return $bad
}
suite_faults() { fault_lane "${FAULT_EXTRA:-}" "${FAULTS_GUARDED[@]}"; }
suite_generate() {  # one lane per backend (one process, jobs one after another) per pass
    local g lane b gpu left t0 dir
    warm 256 512 64 128
    for g in ${GRAPHS:-false true}; do
        t0=$(date +%s) dir=$D/graphs_$g
        mkdir -p "$dir"
        for lane in ${LANES:-flashinfer:0}; do
            b=${lane%%:*} gpu=${lane#*:}
            left=$(( ${DEADLINE:-200} - ($(date +%s) - t0) ))
            # shellcheck disable=SC2086  # OVERRIDES: one override a word
            ( CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $((left + 60)) python3 bench/bench_generate.py \
                  run --backend "$b" --rows "$dir/rows_$b.jsonl" --reports "$dir/reports_$b" \
                  --deadline "$left" ${MODELS:+--models "$MODELS"} ${SPECS:+--specs "$SPECS"} \
                  "backend.cuda_graph=$g" ${OVERRIDES:-} > "$dir/lane_$b.txt" 2>&1
              echo "lane $b exit $? at $(( $(date +%s) - t0 )) s" >> "$dir/lane_$b.txt" ) &
        done
        wait
        find "$dir" -name '*.png' -delete
    done
}
suite_factory() {
    warm 64 256 512 decode short mask  # no FA3 prefill (the long pole of the warm-up)
    bench 420 python3 bench/bench_factory.py --models gemma4,gpt_oss_20b \
        --modes decode,verify_chain8,verify_tree8 --bs 8,64 --triton --auto \
        --rounds "${ROUNDS:-5}" --deadline $(( ${DEADLINE:-420} - 60 )) --commit "$COMMIT"
}
suite_longctx() {  # Gemma 4 decode where the SWA layers' share of the bytes falls
    warm 256 512 decode
    bench 420 python3 bench/bench_factory.py --models gemma4 --modes decode --bs 16,64 \
        --ctx 32768,131072 --rounds "${ROUNDS:-3}" --deadline $(( ${DEADLINE:-420} - 60 )) \
        --commit "$COMMIT"
}
suite_prefill() { bench 240 python3 bench/bench_prefill.py; }
suite_fp8() {
    warm 256 512
    bench 300 python3 bench/bench_fp8.py --models gemma4 --bs 64 \
        --backends flashinfer,triton,flashinfer+triton --commit "$COMMIT"
}
suite_pages() {
    warm 64
    local fa=""
    python3 -c "import flash_attn.cute" > /dev/null 2>&1 && fa=,flash_attn  # only with FA4 carried
    bench 300 python3 bench/bench_pages.py --models gpt_oss_20b --bs 64 --backends "flashinfer$fa" \
        --commit "$COMMIT"
}
suite_guards() { warm 64 256 512 decode; bench 300 python3 bench/bench_guards.py --commit "$COMMIT"; }
suite_acceptance() {  # SWA pools the full ones' size (the draft's own pool's): a pool fault's
    # slots then stay in bounds and show as sglang's users saw them, an accept-length collapse
    # (past a smaller draft pool they index out of bounds: a device-side assert). Each family
    # beside the seed fault that acts on its draft (and its clean row): triton's rows first,
    # training the target and drafts while FlashInfer's warm-up (every kind: 64-token chunks
    # load FA3's causal prefill) compiles at low priority, then flashinfer's on the cached
    # models. GPT-OSS-20b: 12 rows in 489 s on an H200, warm-up included (acceptance-h200.md)
    local m b w ACC_MODELS=${ACC_MODELS:-gpt_oss_20b}
    ( nice -n 19 python3 tests/backends/flashinfer_warm.py 64 256 512 > "$D/warm.txt" 2>&1 ) &
    w=$!
    for b in triton flashinfer; do
        [ "$b" = flashinfer ] && wait "$w"
        # shellcheck disable=SC2086  # a comma list, one model a word
        for m in ${ACC_MODELS//,/ }; do
            limit 540 python3 bench/bench_generate.py acceptance --out "$D/${m}_${b}_pool" \
                --models "$m" --backends "$b" --families "${ACC_FAMILIES:-dflash,eagle}" \
                --faults allocator_pool_for_own_pool_draft --swa-as-full --commit "$COMMIT" \
                > "$D/${m}_${b}_pool.txt" 2>&1
            limit 300 python3 bench/bench_generate.py acceptance --out "$D/${m}_${b}_init" \
                --models "$m" --backends "$b" --families frozen_kv_mtp \
                --faults pool_cached_at_init --swa-as-full --commit "$COMMIT" \
                > "$D/${m}_${b}_init.txt" 2>&1
        done
    done
}
suite_soak() { limit 300 python3 bench/soak.py --out "$D" --steps 2000 > "$D/soak.txt" 2>&1; }
suite_core() {
    warm 64 256 512
    gpu_tests 300 tests/backends/test_planning_no_sync.py tests/engine/test_overlap_gpu.py \
        tests/backends/test_engine_graphs.py tests/engine/test_generate_oracle.py \
        > "$D/pytest.txt" 2>&1
    bench 420 python3 bench/probes/graph_routes.py --commit "$COMMIT"
}
suite_runahead() {
    gpu_tests 300 tests/backends/test_run_ahead_gpu.py tests/backends/test_planning_no_sync.py \
        tests/kvcache/test_books_no_sync_gpu.py tests/backends/test_misuse.py \
        > "$D/pytest.txt" 2>&1
}
suite_graphs() {
    gpu_tests 240 -s tests/backends/test_graph_capture_1m_gpu.py \
        tests/backends/test_graph_state_bounds.py tests/backends/test_graphs.py \
        tests/backends/test_engine_graphs.py tests/backends/test_graph_kernels_gpu.py \
        tests/backends/test_flashinfer_check.py tests/kernels/test_kernel_choice.py \
        > "$D/pytest.txt" 2>&1
}
suite_repro() {  # the older checkout's run-ahead check: FlashInfer's pinned plan workspace
    local args rc
    mkdir -p /tmp/old && tar xzf "${OLD_TGZ:?OLD_TGZ: the older checkout}" -C /tmp/old
    for args in "--mode decode" "--mode decode" "--mode decode --fresh-staging" \
                "--mode verify_chain" "--mode verify_chain --fresh-staging" \
                "--mode decode --backend triton"; do
        # shellcheck disable=SC2086  # args: options, one a word
        ( cd /tmp/old && PYTHONPATH=$SITE_PATH:/tmp/old limit 120 python3 \
            tests/backends/run_ahead.py --backend flashinfer $args ) > "$D/o.txt" 2>&1
        rc=$?
        echo "old $args: rc=$rc $(grep -o '"mismatches": [0-9]*' "$D/o.txt") \
$(grep -m1 -o 'an illegal memory access[a-z ]*' "$D/o.txt")" >> "$D/summary.txt"
        mv "$D/o.txt" "$D/old_$(echo "$args" | tr ' -' '__').txt"
    done
}
suite_tiles() {  # the CUDA kernels' tests, then each tile sweep (cubins: SWAFACTORY_CACHE)
    warm 64 256 512 &
    gpu_tests 240 -x tests/kernels/test_cuda_decode_gpu.py tests/kernels/test_decode_fused_write.py \
        tests/kernels/test_cuda_decode_fp8_gpu.py tests/kernels/test_cuda_verify_gpu.py \
        > "$D/pytest.txt" 2>&1
    limit 240 python3 bench/probes/decode_tiles.py --out "$D" --tiles 128x4x2 \
        --splits 0,2,4,8 --cuda 64x2,64x3,128x2 > "$D/decode_tiles.txt" 2>&1
    limit 240 python3 bench/probes/verify_cuda.py --out "$D" > "$D/verify_cuda.txt" 2>&1
    wait
}
suite_kernels() {
    warm 64 256 512
    limit 420 python3 bench/probes/graph_kernels.py "$D" gpt_oss_20b:decode:8 \
        gpt_oss_20b:decode:8:eager gemma4:verify_chain8:64 gemma4:verify_chain8:64:eager \
        gpt_oss_20b:verify_chain8:64:backend=triton \
        gpt_oss_20b:verify_chain8:64:backend=triton:eager > "$D/graph_kernels.txt" 2>&1
}
suite_host() {
    warm 64 256 512
    limit 240 python3 bench/probes/host_gpu.py "$D" > "$D/host_gpu.txt" 2>&1
    limit 180 python3 bench/probes/sync_wait.py "$D" > "$D/sync_wait.txt" 2>&1
    limit 180 python3 bench/probes/sync_sites.py "$D/sync_sites.json" backend=flashinfer \
        model=gemma4 spec=eagle3 workload=smoke > "$D/sync_sites.txt" 2>&1
}

# The evidence parts: each writes into $D/PART; estimates (s) decide what fits the call
declare -A EVIDENCE_S=([core]=420 [generate]=420 [faults]=300 [speed]=420 [seeds]=300
                       [drafts]=540 [matrix]=540)
evidence_core() {  # the `core` suite's tests beside its probe (and the older commit's first)
    local old=/tmp/old_tree pid
    warm 64 256 512
    gpu_tests 300 tests/backends/test_planning_no_sync.py tests/engine/test_overlap_gpu.py \
        tests/backends/test_engine_graphs.py tests/engine/test_generate_oracle.py \
        > "$D/pytest.txt" 2>&1 &
    pid=$!
    if [ -n "${OLD_TGZ:-}" ]; then  # the older commit first: its run trains the cached models
        rm -rf "$old" && mkdir -p "$old/bench/probes" && tar xzf "$OLD_TGZ" -C "$old" \
            && cp bench/probes/graph_routes.py "$old/bench/probes/"
        ( cd "$old" && PYTHONPATH=$SITE_PATH:$old limit 280 python3 bench/probes/graph_routes.py \
            --out "$D/old" --variant clean= --commit "${OLD_COMMIT:-older}" ) > "$D/old.txt" 2>&1
    fi
    limit $(( CALL_S - $(elapsed_call) - 15 )) python3 bench/probes/graph_routes.py --out "$D" \
        --commit "$COMMIT" > "$D/routes.txt" 2>&1
    local r=$?
    wait "$pid" || return $?
    return $r
}
evidence_generate() {  # checked, then timed: both passes run overlap (and its twin without)
    # checked: graphs captured at start-up, overlap on, the attention oracle on; every job is
    # lossless and its overlap twin equal. timed: the same jobs again on warm kernel caches with
    # the oracle off (its readbacks are host syncs): tokens/s with overlap and without
    local o base=$D
    for o in checked:true timed:false; do
        D=$base/${o%%:*}
        mkdir -p "$D"
        SWAFACTORY_ORACLE=${o#*:} GRAPHS=true LANES=${LANES:-flashinfer:0} DEADLINE=190 \
            OVERRIDES="run.overlap=true ${OVERRIDES:-}" suite_generate
    done
    D=$base
}
evidence_faults() {  # each backend x guards on (FAULTS_GUARDED) and off (FAULTS_UNGUARDED)
    local b base=$D rc=0
    for b in flashinfer triton; do
        ( D=$base/${b}_guards_true; mkdir -p "$D"; FAULT_BACKEND=$b JOBS=3 suite_faults ) &
        ( D=$base/${b}_guards_false; mkdir -p "$D"
          FAULT_BACKEND=$b JOBS=3 fault_lane run=generate,run.guards=false \
              "${FAULTS_UNGUARDED[@]}" ) &
    done
    for b in $(jobs -p); do wait "$b" || rc=1; done
    return $rc
}
evidence_seeds() {  # the presets' own lengths and pool sizing; only the backend and device change
    local b p rc=0
    for b in flashinfer triton; do
        for p in seed1_eagle3_untranslated_tables seed2_dflash_swa_pool_missed \
                 seed3_frozen_kv_cached_pool seed4_dflash_own_pool_translated; do
            limit 120 python3 -m swafactory "+experiment=$p" "backend=$b" workload.device=cuda \
                "hydra.sweep.dir=$D/${b}_$p" > "$D/${b}_$p.txt" 2>&1
            # the sweep exits 1 for its failed fault row: its matrix.md is the verdict
            [ -s "$D/${b}_$p/matrix.md" ] || rc=1
        done
    done
    return $rc
}
evidence_matrix() {  # the fault matrix's GPU half, in what is left of the call
    warm 64 256 512
    limit $(( CALL_S - $(elapsed_call) - 20 )) python3 bench/fault_matrix.py \
        --backends flashinfer,triton --device cuda --out "$D" --commit "$COMMIT" \
        > "$D/matrix.txt" 2>&1
}
evidence_drafts() {  # Gemma 4 at its real geometry (the wired target recipe), then long contexts
    local f row fault extra
    for row in "dflash:swa_pool_missed:spec.draft_pool_split=true,workload.page_order=in_order" \
               "eagle3:skip_spec_translation:" "frozen_kv_mtp:pool_cached_at_init:"; do
        IFS=: read -r f fault extra <<< "$row"
        # shellcheck disable=SC2046  # one --override per comma-separated entry
        limit 240 python3 bench/bench_generate.py acceptance --out "$D/gemma4_$f" \
            --models gemma4 --backends flashinfer --families "$f" --faults "$fault" \
            --commit "$COMMIT" $(for o in ${extra//,/ }; do echo --override "$o"; done) \
            > "$D/gemma4_$f.txt" 2>&1
    done
    local left=$(( CALL_S - $(elapsed_call) - 20 ))
    [ "$left" -ge 120 ] || { echo "context: $left s left, not run" | tee "$D/context.txt"; return 0; }
    limit "$left" python3 bench/bench_context.py --device cuda --models gpt_oss_20b \
        --backend flashinfer --contexts 1024,2048,4096,8192,16384,32768 \
        --draft-windows lag+8,1024,4096 --commit "$COMMIT" --out "$D" > "$D/context.txt" 2>&1
}
evidence_speed() {
    suite_factory || return $?
    local left=$(( CALL_S - $(elapsed_call) - 20 ))
    if [ "$left" -ge 150 ]; then DEADLINE=$left suite_longctx
    else echo "longctx: $left s left, not run" | tee "$D/longctx.txt"; fi
}
elapsed_call() { echo $(( $(date +%s) - CALL_T0 )); }
suite_evidence() {
    local p rc=0 base=$D marks=build/evidence/$COMMIT
    mkdir -p "$marks"
    local parts
    parts=$(echo "${PARTS:-core,generate,faults,speed}" | tr , ' ')
    for p in $parts; do
        declare -F "evidence_$p" > /dev/null || { echo "unknown evidence part $p" >&2; return 2; }
    done
    for p in $parts; do
        if [ -e "$marks/$p.done" ]; then
            echo "evidence $p: done at $COMMIT on this machine earlier, skipped" | tee -a "$base/summary.txt"
            continue
        fi
        if [ $(( CALL_S - $(elapsed_call) )) -lt "${EVIDENCE_S[$p]}" ]; then
            echo "evidence $p: needs ${EVIDENCE_S[$p]} s, $(( CALL_S - $(elapsed_call) )) s left: the next call" \
                | tee -a "$base/summary.txt"
            continue
        fi
        D=$base/$p
        mkdir -p "$D"
        local t0
        t0=$(date +%s)
        "evidence_$p"
        local r=$?
        D=$base
        [ "$r" = 0 ] && touch "$marks/$p.done" || rc=$r
        echo "evidence $p: exit $r, $(( $(date +%s) - t0 )) s" | tee -a "$base/summary.txt"
    done
    return $rc
}

# The tensor-parallel sweep: no GPU ever runs two harness processes at once (a process's CUDA
# event times include other processes' kernels when they time-slice one GPU): tp=1 in two lanes
# pinned to GPU 0 and 1, each one job at a time (Hydra's basic launcher is serial); then tp=2,
# one job at a time on both. FlashInfer's JIT warm-up runs in the background; its jobs wait.
suite_tp() {
    local T0 R PHASE=${PHASE:-all} DEADLINE=${DEADLINE:-540} MIN_LEFT=${MIN_LEFT:-30}
    local WORK=${WORK:-/tmp/tp_scaling/$COMMIT} v pair b m s p tp lane i l
    T0=$(date +%s)
    R=$WORK/$(date -u +%Y%m%dT%H%M%SZ)_$PHASE
    case $PHASE in tp1|tp2|all) ;; *) echo "PHASE=$PHASE: use tp1, tp2 or all" >&2; return 2 ;; esac
    for v in DEADLINE MIN_LEFT; do
        [[ ${!v} =~ ^[0-9]+$ ]] || { echo "$v=${!v}: give whole seconds" >&2; return 2; }
    done
    local -a specs models given backends plan=()
    IFS=, read -ra specs <<< "${SPECS:-$SPECS4}"
    IFS=, read -ra models <<< "${MODELS:-gemma4,gpt_oss_20b}"
    IFS=, read -ra given <<< "${BACKENDS:-flashinfer,triton}"
    for pair in "${given[@]/#/backend:}" "${specs[@]/#/spec:}" "${models[@]/#/model:}"; do
        [ -f "conf/${pair%%:*}/${pair#*:}.yaml" ] || {
            echo "${pair%%:*} '${pair#*:}' has no conf/${pair%%:*}/${pair#*:}.yaml; choose from:" \
                 "$(cd "conf/${pair%%:*}" 2>/dev/null && ls -- *.yaml | sed 's/\.yaml$//' | xargs)" >&2
            return 2; }
    done
    # flashinfer last: its jobs wait for the warm-up, the others fill that time
    for b in "${given[@]}"; do [ "$b" = flashinfer ] || backends+=("$b"); done
    for b in "${given[@]}"; do [ "$b" = flashinfer ] && backends+=("$b"); done
    local NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=2  # no nvidia-smi (a dry run here): plan for two
    local DONE="" skipped=0
    if [ "${RESUME:-1}" = 1 ] && [ -d "$WORK" ]; then  # "tp backend spec model" with a result
        DONE=$(python3 - "$WORK" <<'EOF'
import json, pathlib, sys
for p in pathlib.Path(sys.argv[1]).rglob("result.json"):
    try:
        r = json.loads(p.read_text())
        tp = next((o.split("=", 1)[1] for o in r["overrides"] if o.startswith("parallel.tp=")), "1")
        print(tp, r["backend"], r["spec"], r["model"])
    except (ValueError, KeyError, OSError):
        pass  # unreadable: run the combination again
EOF
)
    fi
    is_done() { grep -qxF "$1 $2 $3 $4" <<< "$DONE"; }
    # the plan: "tp lane backend model specs" lines, each one Hydra multirun. tp=1 lanes: a
    # snake over (model, spec, backend) gives both lanes the same jobs of every model and
    # backend, so both GPUs finish at about the same time
    if [ "$PHASE" != tp2 ]; then
        local -A lane_specs=()
        i=0
        for m in "${models[@]}"; do for s in "${specs[@]}"; do for b in "${backends[@]}"; do
            case $(( i % 4 )) in 0|3) l=0 ;; *) l=1 ;; esac
            i=$((i + 1))
            if is_done 1 "$b" "$s" "$m"; then skipped=$((skipped + 1)); continue; fi
            lane_specs[$l.$b.$m]+=${lane_specs[$l.$b.$m]:+,}$s
        done; done; done
        for l in 0 1; do for b in "${backends[@]}"; do for m in "${models[@]}"; do
            [ -n "${lane_specs[$l.$b.$m]:-}" ] && plan+=("1 $l $b $m ${lane_specs[$l.$b.$m]}")
        done; done; done
    fi
    if [ "$PHASE" != tp1 ]; then
        local todo
        for b in "${backends[@]}"; do for m in "${models[@]}"; do
            todo=""
            for s in "${specs[@]}"; do
                if is_done 2 "$b" "$s" "$m"; then skipped=$((skipped + 1)); else todo+=${todo:+,}$s; fi
            done
            [ -n "$todo" ] && plan+=("2 - $b $m $todo")
        done; done
    fi
    sweep_name() { if [ "$2" = - ]; then echo "tp${1}_${3}_$4"; else echo "tp${1}_lane${2}_${3}_$4"; fi; }
    gpus_of() {  # tp=1 lane L on GPU L (both on GPU 0 on a one-GPU host); tp=2 on both
        if [ "$1" = 2 ]; then echo 0,1; elif [ "$NGPU" -ge 2 ]; then echo "$2"; else echo 0; fi
    }
    command_of() {  # tp lane backend model specs
        echo "CUDA_VISIBLE_DEVICES=$(gpus_of "$1" "$2") python3 -m swafactory -m backend=$3 spec=$5" \
             "model=$4 workload=serve parallel.tp=$1 hydra.sweep.dir=$R/$(sweep_name "$1" "$2" "$3" "$4")"
    }
    local dims=""  # the swept models' head dims (flashinfer_warm.py's arguments); "" = all
    for m in "${models[@]}"; do
        case $m in
        gemma4) dims+=" 256 512" ;;
        gpt_oss_20b|gpt_oss_120b) dims+=" 64" ;;
        mistral_7b) dims+=" 128" ;;
        *) dims=""; break ;;
        esac
    done
    dims=$(echo "$dims" | tr ' ' '\n' | sort -un | xargs)
    local warm_needed=0
    for p in "${plan[@]}"; do read -r _ _ b _ _ <<< "$p"; [ "$b" = flashinfer ] && warm_needed=1; done
    [ "${WARM:-1}" = 0 ] && warm_needed=0

    echo "tp: PHASE=$PHASE, commit $COMMIT, $NGPU GPU(s), deadline $DEADLINE s, work $R"
    echo "${#plan[@]} sweeps; $skipped combinations already have a result.json under $WORK"
    [ "$warm_needed" = 1 ] && echo "warm (background; flashinfer sweeps wait): CUDA_VISIBLE_DEVICES=0" \
        "python3 tests/backends/flashinfer_warm.py $dims"
    for p in "${plan[@]}"; do
        read -r tp lane b m s <<< "$p"
        echo "plan tp=$tp lane=$lane gpus=$(gpus_of "$tp" "$lane") backend=$b model=$m spec=$s"
        echo "    $(command_of "$tp" "$lane" "$b" "$m" "$s")"
    done
    if [ "$PHASE" != tp1 ] && [ "$NGPU" -lt 2 ]; then
        echo "tp=2 needs two GPUs; this host has $NGPU: the tp2 sweeps will be refused" >&2
    fi
    [ "${DRY:-0}" = 1 ] && return 0

    mkdir -p "$R"
    elapsed() { echo $(( $(date +%s) - T0 )); }
    left() { echo $(( DEADLINE - $(elapsed) )); }
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
        echo "cpus: $(nproc --all)"  # --all: nproc alone honours OMP_NUM_THREADS (gpu_env sets 2)
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

    local warm_pid=""
    if [ "$warm_needed" = 1 ]; then
        # shellcheck disable=SC2086  # the head dims are separate arguments
        ( log "start warm gpus=0"
          CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$(( $(left) > 1 ? $(left) : 1 ))" \
              python3 tests/backends/flashinfer_warm.py $dims > "$R/warm.txt" 2>&1
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
            run_lane 0 & local l0=$!
            run_lane 1 & local l1=$!
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
    [ -n "$warm_pid" ] && wait "$warm_pid"
    log "sweeps done"
    nvidia-smi > "$R/nvidia-smi-end.txt" 2>&1
    # every sweep so far under WORK (a later call's tarball holds the earlier calls' jobs too)
    tar czf "$OUT/tp.tgz" --exclude='*.png' -C "$(dirname "$WORK")" "$(basename "$WORK")"
    cat "$R/timeline.txt"
    local size
    size=$(stat -c %s "$OUT/tp.tgz")
    [ "$size" -le $((16 << 20)) ] || echo "WARNING: tp.tgz is $size bytes, over 16 MiB" >&2
}

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    echo "commit $COMMIT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'EOF'
import importlib.util, platform
print("python", platform.python_version())
for m in ("torch", "triton", "flashinfer", "flash_attn", "transformers", "hydra_plugins"):
    print(m, "ok" if importlib.util.find_spec(m) else "MISSING")
EOF
} > "$OUT/machine.txt" 2>&1
# shellcheck disable=SC2046  # conformance: three suites, one a word
set -- $(for s in "$@"; do [ "$s" = conformance ] && echo tests matrix faults || echo "$s"; done)
for suite in "$@"; do
    declare -F "suite_$suite" > /dev/null || { echo "unknown suite $suite (--help lists them)" >&2; exit 2; }
done
rc=0
CALL_T0=$(date +%s) CALL_S=${CALL_S:-570}
for suite in "$@"; do
    t0=$(date +%s)
    D=/tmp/gpu/$suite
    rm -rf "$D" && mkdir -p "$D"
    "suite_$suite"
    r=$?
    [ "$r" = 0 ] || rc=$r
    echo "== $suite: exit $r, $(( $(date +%s) - t0 )) s" | tee -a "$D/summary.txt"
    # shellcheck disable=SC2046  # the suite's logs, its folder and one level down
    tail -n 40 $(find "$D" -maxdepth 2 -name '*.txt' | sort) > "$OUT/$suite.txt" 2>/dev/null
    # tp packs its own WORK (the sweeps of every call); the others their folder
    [ "$suite" = tp ] || tar czf "$OUT/$suite.tgz" --exclude='*.png' -C "$D" . 2>/dev/null
done
exit "$rc"
