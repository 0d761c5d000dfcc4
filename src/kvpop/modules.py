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

    def __init__(self, cfg: KVpopConfig, num_layers: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layers = nn.ModuleList(make_policy(cfg, num_kv_heads, head_dim) for _ in range(num_layers))
        self.config = cfg
        self.previous_attn_implementation: str | None = None
        self.hooks: list = []
        self.base: dict | None = None
        """What identifies the base weights the model was retrofitted on (`kvpop.retrofit.base_identity`),
        kept through training and saved, so that a trained model is compared with its own base only."""

    @property
    def config(self) -> KVpopConfig:
        return self._config

    @config.setter
    def config(self, cfg: KVpopConfig) -> None:
        # the split each layer runs, made once per config (the attention hooks read it on every call)
        cfg.check_layers(len(self.layers))
        self._config = cfg
        self._layer_configs = [cfg.for_layer(i) for i in range(len(self.layers))]

    def layer_config(self, layer: int) -> KVpopConfig:
        """The config layer `layer` runs (its own top-k with per-layer budgets)."""
        return self._layer_configs[layer]


def kvpop_modules(model: nn.Module) -> KVpopModules:
    """The `KVpopModules` of a retrofitted model (a clear error otherwise)."""
    mods = getattr(model, "kvpop", None)
    if not isinstance(mods, KVpopModules):
        raise ValueError(f"{type(model).__name__} is not retrofitted: call kvpop.retrofit(model, cfg) first")
    return mods
