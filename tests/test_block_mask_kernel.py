"""The Triton block-mask build (`ops/attention/block_mask_kernel.py`) against `sparse_block_mask`'s torch tables.

On a machine without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`), which
must be set before Triton compiles anything, so those checks run in a child process.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels are optional (pip install triton)")

CHECK = textwrap.dedent(
    """
    import torch
    from test_attention_flex import make_case
    from kvpop.ops.attention.block_mask import sparse_block_mask

    device = "cuda" if torch.cuda.is_available() else "cpu"
    TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    # (layout, B, Hq, Hkv, N, sink, window, topk, Q, block): GQA groups, padding, gaps, ragged edges,
    # a block size that is no power of two, ties, topk 0, a query chunk after a prefix
    CASES = [
        ("contiguous", 1, 4, 2, 1000, 4, 64, 96, None, 64, False),
        ("contiguous", 2, 6, 2, 257, 4, 16, 32, None, 32, True),
        ("contiguous", 1, 4, 4, 700, 4, 64, 128, 333, 64, False),
        ("contiguous", 1, 2, 1, 513, 0, 64, 0, None, 64, False),
        ("contiguous", 1, 3, 1, 300, 4, 512, 64, None, 48, True),
        ("padded", 2, 4, 2, 700, 4, 32, 48, None, 64, False),
        ("gaps", 2, 4, 2, 600, 2, 32, 48, 250, 32, True),
        ("contiguous", 1, 2, 2, 5, 1, 2, 1, None, 16, False),
    ]
    for layout, B, Hq, Hkv, N, sink, window, topk, Q, bs, ties in CASES:
        case = make_case(layout, B, Hq, Hkv, N, sink, window, topk, Q=Q, D=4, seed=N, ties=ties, device=device)
        want = sparse_block_mask(*case.block_args(), num_q_heads=Hq, block_size=bs, backend="torch")
        got = sparse_block_mask(*case.block_args(), num_q_heads=Hq, block_size=bs, backend="triton")
        # the whole tables, absent tails included: the same bytes the torch form hands FlexAttention
        for name in TABLES:
            a, b = getattr(want, name), getattr(got, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (layout, N, bs, name)
        assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
        # the mask_mod reads the kernel's folded inputs: the same predicate on a few points per head
        qi = torch.arange(case.q_pos.shape[-1], device=device)[:, None]
        ki = torch.arange(N, device=device)[None, :]
        for h in range(Hq):
            b = torch.zeros((), dtype=torch.long, device=device)
            hh = torch.tensor(h, device=device)
            assert torch.equal(want.mask_mod(b, hh, qi, ki), got.mask_mod(b, hh, qi, ki)), (layout, N, h)
    print("ok")
    """
)


def test_kernel_tables_equal_torch_tables():
    tests = str(Path(__file__).parent)
    if torch.cuda.is_available():
        sys.path.insert(0, tests)
        exec(compile(CHECK, "<block mask check>", "exec"), {})
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def test_backend_errors():
    from kvpop.ops.attention.block_mask import sparse_block_mask

    pos, ones = torch.arange(8)[None], torch.ones(1, 8, dtype=torch.bool)
    evict = torch.full((1, 1, 8), 10)
    with pytest.raises(ValueError, match="backend='bogus'"):
        sparse_block_mask(pos, ones, pos, ones, evict, 1, 2, 1, block_size=4, backend="bogus")
