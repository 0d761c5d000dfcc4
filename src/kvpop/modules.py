"""What `kvpop.retrofit` attaches to a model: one `LayerPolicy` per attention layer, and the config it runs.

Its own module, below `cache.py` and `retrofit.py`, so that the cache can find a model's policies
without importing the retrofit (imports flow one way: retrofit -> attention -> cache -> modules).
"""

from __future__ import annotations

from torch import nn

from kvpop.baselines import make_policy
from kvpop.config import KVpopConfig


class KVpopModules(nn.Module):
    """What KVpop adds to a model: one `LayerPolicy` (scorer and decay, or a baseline's) per attention layer.

    `config` is the resolved config the model runs (`KVpopConfig.resolve`: the effective `topk`).
    """

    def __init__(self, cfg: KVpopConfig, num_layers: int, num_kv_heads: int, head_dim: int, group: int = 1):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(make_policy(cfg, num_kv_heads, head_dim, group) for _ in range(num_layers))
        self.previous_attn_implementation: str | None = None
        self.hooks: list = []


def kvpop_modules(model: nn.Module) -> KVpopModules:
    """The `KVpopModules` of a retrofitted model (a clear error otherwise)."""
    mods = getattr(model, "kvpop", None)
    if not isinstance(mods, KVpopModules):
        raise ValueError(f"{type(model).__name__} is not retrofitted: call kvpop.retrofit(model, cfg) first")
    return mods
