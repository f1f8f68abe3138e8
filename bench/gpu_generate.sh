#!/usr/bin/env bash
# On the GPU host: `run=generate` over every model × spec, one lane per backend
# (bench/gpu_generate.py run: one process, jobs one after another), each lane pinned to a GPU.
#
# From the repository root on the GPU host:
#     WHEELS=.whl LANES="flashinfer:0 triton:1" bench/gpu_generate.sh "$OUT" [OVERRIDE ...]
#     FA4=.fa4y LANES="flash_attn:0" bench/gpu_generate.sh "$OUT"       # a warm host, next call
# Environment:
#     LANES     backend:gpu words (default "flashinfer:0 triton:0 flash_attn:0")
#     MODELS / SPECS   comma lists (default: every model and spec of bench/gpu_generate.py)
#     DEADLINE  seconds from the start until the lanes stop starting jobs (default 520)
#     WARM=0    skip FlashInfer's parallel JIT warm-up (tests/backends/flashinfer_warm.py)
#     WARM_DIMS head dims to warm up (default "256 512 64 128": every model's)
#     WHEELS, FA4   wheels to install (bench/gpu_env.sh); a warm host reuses /tmp/site
# Writes OUT/rows_BACKEND.jsonl, OUT/lane_BACKEND.log, OUT/host.txt, OUT/warm.txt and
# OUT/reports_TAG.tgz (every job's report.json and report.png). Back here:
#     python bench/gpu_generate.py render rows_*.jsonl --commit C --command "…"
set -uo pipefail
. "$(dirname "$0")/gpu_usage.sh" "$@"  # --help: the header above, nothing made
OUT=${1:?usage: bench/gpu_generate.sh OUT [OVERRIDE ...]}
shift
T0=$(date +%s)
LANES=${LANES:-flashinfer:0 triton:0 flash_attn:0}
DEADLINE=${DEADLINE:-520}
mkdir -p "$OUT"
if [ -z "${WHEELS:-}${FA4:-}" ] && [ -d /tmp/site ]; then  # a warm host: installed by a former call
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# shellcheck source=bench/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$OUT/host.txt" 2>&1

fi_gpu=""
for lane in $LANES; do [ "${lane%%:*}" = flashinfer ] && fi_gpu=${lane#*:}; done
rm -f /tmp/gen_warm.done
if [ -n "$fi_gpu" ] && [ "${WARM:-1}" != 0 ]; then
    ( CUDA_VISIBLE_DEVICES=$fi_gpu python3 tests/backends/flashinfer_warm.py ${WARM_DIMS:-256 512 64 128} \
        > "$OUT/warm.txt" 2>&1; echo "warm: $(( $(date +%s) - T0 )) s" >> "$OUT/warm.txt"
      touch /tmp/gen_warm.done ) &
else
    touch /tmp/gen_warm.done
fi
args=()
[ -n "${MODELS:-}" ] && args+=(--models "$MODELS")
[ -n "${SPECS:-}" ] && args+=(--specs "$SPECS")
for lane in $LANES; do
    b=${lane%%:*} gpu=${lane#*:}
    (
        if [ "$b" = flashinfer ]; then until [ -e /tmp/gen_warm.done ]; do sleep 2; done; fi
        left=$(( DEADLINE - ($(date +%s) - T0) ))
        CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $(( left + 60 )) python3 bench/gpu_generate.py run \
            --backend "$b" --rows "$OUT/rows_$b.jsonl" --reports "/tmp/gen_reports/$b" \
            --deadline "$left" "${args[@]}" "$@" > "$OUT/lane_$b.log" 2>&1
        echo "lane $b exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/lane_$b.log"
    ) &
done
wait
tag=$(echo "$LANES" | tr ' :' '__')
tar czf "$OUT/reports_$tag.tgz" -C /tmp/gen_reports . 2>/dev/null
echo "done in $(( $(date +%s) - T0 )) s"
tail -n 3 "$OUT"/lane_*.log
