"""kvpop: a fixed-size KV cache with a learned eviction policy (KVpop) for Hugging Face causal LMs.

    cfg = kvpop.KVpopConfig(sink=4, window=256, topk=1788)
    model = kvpop.retrofit(hf_model, cfg)
    out = model.generate(**inputs, past_key_values=kvpop.KVpopCache(model))

Most names are imported on first use, so `kvpop --help` does not wait for transformers. The
functions of `kvpop.retrofit` are bound eagerly: a lazy `retrofit` would be replaced by the
submodule of the same name the first time anything imports `kvpop.retrofit`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvpop.config import KVpopConfig
from kvpop.retrofit import detach, load, retrofit, save

_EXPORTS = {
    "KVpopCache": "kvpop.cache",
    "eviction_times": "kvpop.policy",
    "future_attention_target": "kvpop.ops.target",
    "retention_mask": "kvpop.policy",
}

__all__ = [
    "KVpopCache",
    "KVpopConfig",
    "detach",
    "eviction_times",
    "future_attention_target",
    "load",
    "retention_mask",
    "retrofit",
    "save",
]

if TYPE_CHECKING:
    from kvpop.cache import KVpopCache
    from kvpop.ops.target import future_attention_target
    from kvpop.policy import eviction_times, retention_mask


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpop' has no attribute {name!r}")
