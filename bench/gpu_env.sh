# Sourced by the GPU scripts (bench/gpu_conformance.sh, bench/gpu_session.sh): install the carried
# wheels once into /tmp/site and export the environment the harness runs in.
#     WHEELS  folders of wheels (pip --no-index --target /tmp/site); docs/gpu.md says how to fetch
#     FA4     a folder with flash-attn-4's libs.tar.xz and wheels (.fa4y; docs/gpu.md)
# A script started by one that already sourced this (SWAFACTORY_GPU_ENV=1) installs nothing:
# parallel pip installs into one --target would overwrite each other.
if [ -z "${SWAFACTORY_GPU_ENV:-}" ]; then
    for d in ${WHEELS:-}; do
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl \
            || exit 2
    done
    if [ -n "${FA4:-}" ]; then
        tar xJf "$FA4/libs.tar.xz" -C /tmp/site && python3 -m pip install -q --no-index \
            --no-deps --no-compile --target /tmp/site --upgrade "$FA4"/*.whl || exit 2
    fi
    # pip --target skips .pth files: cutlass-dsl's package path is added by hand (flash-attn-4)
    if [ -n "${WHEELS:-}${FA4:-}" ]; then
        export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    # expandable segments: a dozen harness processes share one GPU, and each one's caching
    # allocator otherwise keeps its fragmented peak (serve runs at 1da1d66 ran out of memory)
    export TRITON_INTERPRET=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
        PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        SWAFACTORY_GPU_ENV=1
fi
