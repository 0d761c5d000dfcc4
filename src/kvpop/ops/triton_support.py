"""Triton, where installed, and whether its kernels can run on a tensor's device: the one check the Triton paths
(`topk/kernel.py`, `dynamic/kernel.py`, `attention/block_mask_kernel.py`, `attention/decode_kernel.py`, `slots.py`)
share.

CPU installs have no Triton: each path then has its PyTorch form beside it. With `TRITON_INTERPRET=1` (set before
Triton compiles anything) the kernels run on the CPU under Triton's interpreter, which is how the tests check them
on machines without a GPU.
"""

from __future__ import annotations

import os

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def available(t: Tensor) -> bool:
    """Whether a Triton kernel can run on `t`'s device: Triton on CUDA, or Triton's interpreter on the CPU."""
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


__all__ = ["available", "tl", "triton"]
