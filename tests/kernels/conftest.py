"""Kernel tests: CPU tests run Triton in its interpreter, GPU tests (`@pytest.mark.gpu`) natively.

triton's own library functions (``tl.cdiv`` …) are built for one mode when triton is imported,
so the mode is fixed per session, here, before anything imports triton: the interpreter on a
machine without CUDA, unless TRITON_INTERPRET says otherwise. GPU runs:
``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``.
"""
from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"


@pytest.fixture(autouse=True)
def _triton_mode(request):
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if "gpu" in request.keywords and interpret:
        pytest.skip("GPU kernel tests need TRITON_INTERPRET=0 (this session interprets)")
    if "gpu" not in request.keywords and not interpret:
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 set before triton is imported")
