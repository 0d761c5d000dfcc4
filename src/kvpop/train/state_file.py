"""A training state as data: its structure in JSON, its tensors in safetensors, and nothing that can run.

    tree, tensors = encode({"step": 3, "optimizer": opt.state_dict(), "rng": {"numpy": np.random.get_state()}})
    # tree: JSON; tensors: {"optimizer.state.0.exp_avg": Tensor, ...}
    state = decode(tree, tensors, where)   # equal to the original, types included

What a checkpoint holds besides weights (an optimizer's state dict with its integer keys and tuple
betas, a scheduler's state, Python's, NumPy's and torch's RNG states) is nested dicts, lists,
tuples, numbers, strings, tensors and small NumPy arrays. `encode` writes each as JSON, with a
tagged object (`{"__kvpop__": ...}`) where JSON has no type of its own: a tensor (a reference to
its name in the safetensors file), a tuple, a dict whose keys are not all strings, a NumPy array
(its values listed), a float that is not finite. `decode` rebuilds exactly those types and no
others, so reading a state never imports or calls anything a file names; every float round-trips
exactly (JSON writes Python's shortest repr). Anything else refuses to be written, naming where it is.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from torch import Tensor

TAG = "__kvpop__"
NDARRAY_DTYPES = ("bool", "uint8", "uint32", "uint64", "int32", "int64", "float32", "float64")
"""NumPy dtypes a state may hold (NumPy's RNG state is uint32)."""
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class StateError(ValueError):
    """A state that cannot be written as data, or a file whose structure is not one `encode` writes."""


def encode(state: Any) -> tuple[Any, dict[str, Tensor]]:
    """`state` as (a JSON-able tree, its tensors by name); names are the keys' path joined by dots."""
    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, Tensor):
            if path in tensors:
                raise StateError(f"{path}: two tensors of the state would share this name")
            t = obj.detach().cpu().contiguous()
            # safetensors refuses tensors that share memory (tied weights): each is written on its own
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            if ptr is not None and ptr in storages:
                t = t.clone()
            elif ptr is not None:
                storages.add(ptr)
            tensors[path] = t
            return {TAG: "tensor", "name": path}
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {TAG: "float", "value": repr(obj)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.name not in NDARRAY_DTYPES:
                raise StateError(f"{path}: a NumPy array of {obj.dtype} (a state holds {', '.join(NDARRAY_DTYPES)})")
            return {TAG: "ndarray", "dtype": obj.dtype.name, "shape": list(obj.shape), "data": obj.ravel().tolist()}
        if isinstance(obj, np.generic):
            return walk(obj.item(), path)
        if isinstance(obj, tuple):
            return {TAG: "tuple", "items": [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in obj.items()}
            for k in obj:
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise StateError(f"{path}: a dict key of type {type(k).__name__} (keys are strings or numbers)")
            return {TAG: "dict", "items": [[walk(k, path), walk(v, f"{path}.{k}" if path else str(k))]
                                           for k, v in obj.items()]}
        raise StateError(f"{path or 'the state'}: a {type(obj).__name__} is not data a checkpoint holds (tensors, "
                         "numbers, strings, lists, tuples, dicts and NumPy arrays only)")

    return walk(state, ""), tensors


def decode(tree: Any, tensors: dict[str, Tensor], where: str) -> Any:
    """The state `encode` gave `tree` and `tensors` for; `where` names the file in errors (a `StateError`)."""

    def bad(why: str) -> StateError:
        return StateError(f"{where}: {why}; the file is damaged or not a kvpop checkpoint")

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            raise bad(f"a {type(node).__name__} in its structure")
        tag = node.get(TAG)
        if tag is None:
            return {k: walk(v) for k, v in node.items()}
        if tag == "tensor":
            name = node.get("name")
            if not isinstance(name, str) or name not in tensors:
                raise bad(f"it refers to a tensor {name!r} that its safetensors file does not hold")
            return tensors[name]
        if tag == "tuple" and isinstance(node.get("items"), list):
            return tuple(walk(v) for v in node["items"])
        if tag == "dict" and isinstance(node.get("items"), list):
            out = {}
            for pair in node["items"]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise bad("a dict entry that is not a [key, value] pair")
                key = walk(pair[0])
                if not (key is None or isinstance(key, (bool, int, float, str))):
                    raise bad(f"a dict key of type {type(key).__name__}")
                out[key] = walk(pair[1])
            return out
        if tag == "float" and node.get("value") in _FLOATS:
            return _FLOATS[node["value"]]
        if tag == "ndarray":
            return _ndarray(node, bad)
        raise bad(f"an entry tagged {str(tag)[:40]!r} that kvpop does not write")

    try:
        return walk(tree)
    except RecursionError:
        raise bad("its structure nests too deeply") from None


def _ndarray(node: dict[str, Any], bad) -> np.ndarray:
    dtype, shape, data = node.get("dtype"), node.get("shape"), node.get("data")
    if dtype not in NDARRAY_DTYPES:
        raise bad(f"a NumPy array of dtype {str(dtype)[:40]!r} (allowed: {', '.join(NDARRAY_DTYPES)})")
    if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise bad(f"a NumPy array of shape {str(shape)[:40]}")
    if not (isinstance(data, list) and len(data) == math.prod(shape)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) or dtype == "bool" for v in data)):
        raise bad(f"a NumPy array whose values do not fill its shape {shape}")
    try:
        return np.array(data, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError, TypeError) as err:
        raise bad(f"a NumPy array of {dtype} with values out of its range ({err})") from None
