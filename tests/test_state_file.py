"""`kvpop.train.state_file`: a training state written as JSON + safetensors comes back exactly, types included, and
reading one never builds anything but data.

    python -m pytest tests/test_state_file.py -q
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from helpers import assert_same_state
from kvpop.train.state_file import TAG, StateError, decode, encode


def _through_files(state):
    """`state` written as the two files a checkpoint part is, and read back."""
    tree, tensors = encode(state)
    return decode(json.loads(json.dumps(tree, allow_nan=False)), load(save(tensors)), "part.json")


def test_every_type_a_state_holds_comes_back_exactly():
    tied = torch.randn(4, 3)
    state = {
        "step": 7, "lr": 1e-3, "third": 1 / 3, "flags": [True, False, None], "name": "scorer",
        "nonfinite": [math.nan, math.inf, -math.inf],
        "by_id": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5)}, 17: {}},
        "mixed_keys": {1.5: "a", None: "b", "s": "c"},
        "betas": (0.9, 0.95), "nested": ((1, (2, [3])), []),
        "tensors": {"bf16": torch.randn(3).bfloat16(), "bytes": torch.arange(7, dtype=torch.uint8),
                    "long": torch.tensor([-(2**62), 2**62]), "empty": torch.zeros(0, 4), "scalar": torch.tensor(True)},
        "tied": {"embed": tied, "head": tied, "view": tied[1:3]},
        "numpy": ("MT19937", np.arange(624, dtype=np.uint32) * 6_000_000, 624, 0, 0.0),
        "grid": np.linspace(0, 1, 6).reshape(2, 3),
        "scalar_np": np.float64(2.5),
    }
    back = _through_files(state)
    assert back.pop("scalar_np") == 2.5
    assert_same_state(back, {k: v for k, v in state.items() if k != "scalar_np"})


def test_rng_optimizer_and_scheduler_restored_from_files_continue_bitwise():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW([{"params": params[:1], "name": "a"}, {"params": params[1:], "lr": 1e-2, "name": "b"}],
                            betas=(0.9, 0.95), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1 / (s + 1), lambda s: 1.0])

    def step():
        opt.zero_grad()
        (params[0].sum() ** 2 + (params[1] * torch.randn(4)).sum() + random.random() + np.random.rand()).backward()
        opt.step()
        sched.step()

    for _ in range(3):
        step()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    saved = _through_files({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "rng": rng})
    step()
    want = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, q in zip(params, saved["params"]):
            p.copy_(q)
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    np.random.set_state(saved["rng"]["numpy"])
    step()
    for p, q in zip(params, want):
        assert torch.equal(p, q)


@pytest.mark.parametrize("value,where", [
    ({"a": {"b": len}}, "a.b: a builtin_function_or_method"),
    ({"a": [object()]}, "a.0: a object"),
    ({"s": {1, 2}}, "s: a set"),
    ({"o": np.array([None, 1], dtype=object)}, "o: a NumPy array of object"),
    ({"k": {(1, 2): 3}}, "k: a dict key of type tuple"),
])
def test_what_is_not_data_refuses_to_be_written(value, where):
    with pytest.raises(StateError, match=f"^{where}"):
        encode(value)


@pytest.mark.parametrize("tree,says", [
    ({"x": {TAG: "pickle", "data": "gASV"}}, "an entry tagged 'pickle'"),
    ({"x": {TAG: "tensor", "name": "absent"}}, "a tensor 'absent' that its safetensors file does not hold"),
    ({"x": {TAG: "ndarray", "dtype": "object", "shape": [1], "data": [1]}}, "dtype 'object'"),
    ({"x": {TAG: "ndarray", "dtype": "uint32", "shape": [2], "data": [1]}}, "do not fill its shape"),
    ({"x": {TAG: "ndarray", "dtype": "uint32", "shape": [1], "data": [2**40]}}, "out of its range"),
    ({"x": {TAG: "dict", "items": [[1]]}}, "not a \\[key, value\\] pair"),
    ({"x": {TAG: "dict", "items": [[[1], 2]]}}, "a dict key of type list"),
    ({"x": {TAG: "float", "value": "1e999"}}, "tagged 'float'"),
])
def test_a_structure_kvpop_does_not_write_is_refused(tree, says):
    with pytest.raises(StateError, match=f"^part.json: .*{says}"):
        decode(tree, {}, "part.json")
