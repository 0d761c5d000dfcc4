"""kvpop: a fixed-size KV cache with a learned eviction policy (KVpop) for Hugging Face causal LMs.

    cfg = kvpop.KVpopConfig(sink=4, window=256, topk=1788)
    model = kvpop.retrofit(hf_model, cfg)
    out = model.generate(**inputs, past_key_values=kvpop.KVpopCache(model))
"""

from kvpop.cache import KVpopCache
from kvpop.config import KVpopConfig
from kvpop.policy import eviction_times, retention_mask
from kvpop.retrofit import detach, load, retrofit, save

__all__ = [
    "KVpopCache",
    "KVpopConfig",
    "detach",
    "eviction_times",
    "load",
    "retention_mask",
    "retrofit",
    "save",
]
