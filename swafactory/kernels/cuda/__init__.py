"""Kernels of our own in CUDA C++, for the tiles Triton's `tl` cannot lay out well (see each
.cu file's header). Chosen by `backend.kernels`, built with nvcc when the backend is built
(`prepare`) and cached; launched through the driver."""
from swafactory.kernels.cuda.decode import decode_d64, decode_d64_serves
from swafactory.kernels.cuda.launch import CudaKernel, cuda_kernels_available, nvcc_path
from swafactory.kernels.cuda.verify import dense_verify_d512, verify_d512_serves

__all__ = ["CudaKernel", "cuda_kernels_available", "nvcc_path", "dense_verify_d512",
           "verify_d512_serves", "decode_d64", "decode_d64_serves"]
