"""What `kvpop.retrofit` attaches to a model: one `LayerPolicy` per attention layer, and the config it runs.

Its own module, below `cache.py` and `retrofit.py`, so that the cache can find a model's policies
without importing the retrofit (imports flow one way: retrofit -> attention -> cache -> modules).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from kvpop.baselines import SlidingWindowPolicy, make_policy
from kvpop.config import KVpopConfig
from kvpop.layer_kinds import check_layer_topk, window_config
from kvpop.policy import LayerPolicy


class KVpopModules(nn.Module):
    """What KVpop adds to a model: one `LayerPolicy` (scorer and decay, or a baseline's) per attention layer.

    `config` is the resolved config the model runs (`KVpopConfig.resolve`: the effective `topk`). In a hybrid
    model (`kvpop.layer_kinds`) it runs in the full-attention layers, the `policy_layers`; a sliding-window layer
    gets a `SlidingWindowPolicy` and runs `window_config(W)`. `layers[i]` is layer `i`'s policy either way, and
    `config.layer_topk` has one entry per policy layer.
    """

    def __init__(self, cfg: KVpopConfig, windows: int | Sequence[int | None], num_kv_heads: int, head_dim: int,
                 group: int = 1):
        super().__init__()
        self.windows: tuple[int | None, ...] = (None,) * windows if isinstance(windows, int) else tuple(windows)
        """Per layer: None (full attention, where the policy runs) or its sliding window."""
        self.policy_layers = tuple(i for i, w in enumerate(self.windows) if w is None)
        """The layers the policy runs in (the full-attention layers), in order."""
        self.layers = nn.ModuleList(
            make_policy(cfg, num_kv_heads, head_dim, group) if w is None
            else SlidingWindowPolicy(window_config(w), num_kv_heads, head_dim)
            for w in self.windows
        )
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
        self._layer_configs = self.layer_configs(cfg)
        self._config = cfg

    def layer_configs(self, cfg: KVpopConfig) -> list[KVpopConfig]:
        """What every layer runs under `cfg`: a policy layer its split (its own top-k with per-layer budgets), a
        sliding-window layer its window."""
        check_layer_topk(cfg, list(self.windows))
        return [window_config(w) if w is not None else cfg.for_layer(self.policy_layers.index(i))
                for i, w in enumerate(self.windows)]

    def layer_config(self, layer: int) -> KVpopConfig:
        """The config layer `layer` runs (its own top-k with per-layer budgets; its window if it slides)."""
        return self._layer_configs[layer]

    @property
    def policies(self) -> list[LayerPolicy]:
        """The policies of the full-attention layers (`policy_layers`), in order."""
        return [self.layers[i] for i in self.policy_layers]

    @property
    def hybrid(self) -> bool:
        """Whether some layers slide (their windows are kept as the model attends them)."""
        return len(self.policy_layers) < len(self.windows)


def kvpop_modules(model: nn.Module) -> KVpopModules:
    """The `KVpopModules` of a retrofitted model (a clear error otherwise)."""
    mods = getattr(model, "kvpop", None)
    if not isinstance(mods, KVpopModules):
        raise ValueError(f"{type(model).__name__} is not retrofitted: call kvpop.retrofit(model, cfg) first")
    return mods
