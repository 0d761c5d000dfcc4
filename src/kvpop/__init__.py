"""kvpop: a fixed-size KV cache with a learned eviction policy (KVpop) for Hugging Face causal LMs."""

from kvpop.config import KVpopConfig
from kvpop.policy import eviction_times, retention_mask

__all__ = ["KVpopConfig", "eviction_times", "retention_mask"]
