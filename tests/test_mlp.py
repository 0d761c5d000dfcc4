"""The MLP scorer (KVpop-mlp): float32 scores, also under bf16 autocast."""

import torch

from kvpop.scorers import MLPScorer


def test_scores_are_float32_under_autocast():
    # under bf16 autocast the einsums ran in bf16: ~1 in 5 of 512 scores per head tied with another
    torch.manual_seed(0)
    s = MLPScorer(3, 64, 256)
    key, value = torch.randn(1, 3, 512, 64), torch.randn(1, 3, 512, 64)
    want = s(key, value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = s(key, value)
        got_bf16_inputs = s(key.bfloat16(), value.bfloat16())
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got_bf16_inputs, s(key.bfloat16(), value.bfloat16()))
    for h in range(3):
        assert got[0, h].unique().numel() == 512, f"head {h}: tied scores"
