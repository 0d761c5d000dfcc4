"""The attention function that `kvpop.retrofit` registers with transformers under the name "kvpop".

Every attention layer of a retrofitted model calls `kvpop_attention`. The retrofit's pre-hook on
each attention module passes in that layer's `LayerPolicy` and the cache of the call, so nothing
is looked up globally and nothing is stored on Hugging Face modules. The cases:

- a `KVpopCache`: the cache inserts the new tokens under the rule and attends (`cache.py`);
- no cache (or a fresh one of another kind, as a plain `model(ids)` creates): teacher-forced
  sparse attention over the whole sequence, every layer ranking its own keys/values;
- `kvpop_dense=True`: the original dense causal attention (the teacher), same numerics;
- a DMS policy in training mode, teacher-forced: DMS's soft eviction mask (`baselines/dms.py`);
- a sliding-window layer of a hybrid model (`layer_kinds.py`): its window, in every case above (the
  teacher's own attention is that window too); nothing is captured for training.

What the model's attention module passes along is honoured or refused, never dropped: `scaling` (Gemma's
`query_pre_attn_scalar`), `softcap` (Gemma 2's logit soft-capping `c * tanh(l / c)`, applied in every
execution, the training target's probabilities included), `sliding_window` (checked against the layer's
kind); learned sink logits (`s_aux`, gpt-oss) are refused.

Extra keyword arguments a caller may pass to the model forward (they flow down to here):
`kvpop_dense: bool`, `kvpop_capture: Capture` (receives one `LayerRecord` per full-attention layer, for training),
`kvpop_rope: (cos, sin)` (the layer's rotary embeddings, passed by the retrofit's hook: `scorer_keys="pre_rope"`),
`kvpop_priority: list[Tensor]` (static priorities per full-attention layer, in order, [B, Hkv, S], replacing the
policy's: the oracle),
`kvpop_backend: str` (`sparse_attention`'s backend for the teacher-forced rule; `kvpop train --attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvpop.ops.attention import sparse_attention
from kvpop.ops.dynamic import dynamic_eviction_positions
from kvpop.ops.dynamic.chunked import chunked_eviction_positions
from kvpop.ops.topk import NEVER, eviction_positions
from kvpop.timing import timed

ATTENTION_NAME = "kvpop"


@dataclass
class LayerRecord:
    """What one layer's teacher-forced forward exposes for training (`docs/method.md` Sec. 4-5)."""

    layer_idx: int
    query: Tensor  # [B, Hq, S, D]
    key: Tensor  # [B, Hkv, S, D]
    lse: Tensor | None  # float32 [B, Hq, S], the sparse attention's own log-normaliser (None: relaxed DMS)
    priority: Tensor  # float32 [B, Hkv, S], differentiable in the scorer
    position: Tensor  # int64 [B, S]
    valid: Tensor  # bool [B, S]
    scale: float  # the logit scale of this layer's attention
    log_gamma: Tensor  # float32 [Hkv], the layer's decay at this forward (detached)
    gate: Tensor | None = None  # float32 [B, Hkv, S], DMS in training: the eviction gate logits a_t (differentiable)
    softcap: float | None = None  # the logit soft-capping of this layer's attention (Gemma 2), None: none


class Capture:
    """Collects one `LayerRecord` per layer when passed as `kvpop_capture=` to the model forward.

    A plain object rather than a list on purpose: wrappers such as FSDP2 rebuild containers they find
    in forward kwargs (`tree_map`), which would silently drop what the layers append to a copy.
    """

    def __init__(self) -> None:
        self.records: list[LayerRecord] = []

    def append(self, record: LayerRecord) -> None:
        self.records.append(record)

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> LayerRecord:
        return self.records[i]


def padding_mask_passthrough(*args, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """Mask factory registered for "kvpop": hand through the 2D padding mask of the new tokens, [B, q].

    The rule builds its own per-layer, per-head masks; it only needs to know which tokens are real.
    Only the last `q` columns matter (`_padding`), and keeping just those gives the compiled decode step
    a mask of one static shape instead of one that grows every token. transformers 5.2x passes
    `q_length`, 5.17 `cache_position` (of length q).
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    q = kwargs.get("q_length")
    if q is None and isinstance(kwargs.get("cache_position"), Tensor):
        q = kwargs["cache_position"].shape[0]
    if q is None or q == attention_mask.shape[-1]:
        return attention_mask
    # a copy, not a view: a view's row stride is the growing mask's length, on which `generate`'s compiled
    # step recompiles, then takes it as a symbolic stride (on CUDA: a new CUDA graph recorded per step).
    # 5.24's `generate` copies it only when it is not contiguous, and a [1, q] view still is
    return attention_mask[:, -q:].clone(memory_format=torch.contiguous_format)


def _padding(attention_mask: Tensor | None, batch: int, length: int, device) -> Tensor:
    """Bool [B, length]: which of the newest `length` tokens are real."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"kvpop attention takes a 2D padding mask [batch, tokens]; got shape {tuple(attention_mask.shape)}. "
            "Custom 4D masks are not supported: the retention rule makes its own masks."
        )
    return attention_mask[:, -length:].to(device=device, dtype=torch.bool)


def kvpop_attention(
    module: nn.Module,
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface: returns (output [B, Q, Hq, D], no weights)."""
    from kvpop.cache import KVpopCache

    policy = kwargs.get("kvpop_layer")
    if policy is None:
        raise RuntimeError("kvpop attention called without its layer policy: use kvpop.retrofit(model, cfg)")
    cfg = kwargs["kvpop_config"]
    softcap = _check_call(module, policy, cfg, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if torch.is_autocast_enabled(query.device.type):
        # As SDPA does under autocast: in a float32 model under bf16 autocast, RoPE's float32 cos/sin promote q and
        # k back to float32 while v stays bf16. Mixed, the CPU kernels refuse them and on CUDA the attention and
        # the future-attention target (39 % of a SmolLM2 distillation step on an H100, docs/training.md) would run in float32.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    B, _, Q, _ = query.shape
    if Q == 0:
        raise ValueError("empty input: the model got 0 tokens")
    cache = kwargs.get("kvpop_cache")
    if isinstance(cache, KVpopCache):
        valid = _padding(attention_mask, B, Q, query.device)
        out = cache.layers[module.layer_idx].attend(query, key, value, valid, policy, scale, kwargs.get("kvpop_rope"),
                                                    softcap)
        return out.transpose(1, 2), None
    if key.shape[-2] != Q:
        raise ValueError(
            f"a kvpop model got a {type(cache).__name__} holding {key.shape[-2] - Q} past tokens; decoding needs the "
            "bounded cache: pass cache=kvpop.KVpopCache(model) (past_key_values= on transformers 5.17)"
        )

    valid = _padding(attention_mask, B, Q, query.device)
    position = torch.cumsum(valid.long(), dim=-1) - 1  # [B, S]
    backend = kwargs.get("kvpop_backend", "auto")
    if policy.sliding:
        # the rule with no sinks and no long-range slots: each token leaves at `t + window`, as in the model
        # itself (also with kvpop_dense: the teacher attends this window too); nothing to capture
        evict = (position + cfg.window)[:, None].expand(key.shape[:3]).contiguous()
        out, _ = sparse_attention(query, key, value, position, valid, position, valid, evict, 0, cfg.window, scale,
                                  backend=backend, topk=0, softcap=softcap)
        return out.transpose(1, 2), None
    if policy.dynamic and not kwargs.get("kvpop_dense", False):
        # TOVA / H2O: the decode step's decisions over the sequence (a walk), then one sparse attention
        priority = policy.priority(policy.scorer_key(key, kwargs.get("kvpop_rope")), value, position.clamp(min=0)).detach()
        sink, window, topk = cfg.sink, cfg.window, cfg.topk
        with timed("kvpop.dynamic_walk"):
            if policy.chunk > 1:
                # the chunked rule: one decision per chunk of steps; a query sees up to topk + chunk tokens
                slots, pool, protect = cfg.chunk_layout
                evict = chunked_eviction_positions(query, key, position, valid, priority, slots, pool, policy.chunk,
                                                   scale, softcap, protect)
                # its evictions say everything: no window beyond the query's own token (the ring's tokens go at
                # the decision like any other)
                sink, window, topk = 0, 1, slots + policy.chunk - 1
            else:
                evict = dynamic_eviction_positions(query, key, position, valid, priority, cfg.sink, cfg.window, cfg.topk,
                                                   scale, policy.score, pool=policy.pool, decay=policy.decay,
                                                   softcap=softcap)
        out, _ = sparse_attention(query, key, value, position, valid, position, valid, evict, sink, window,
                                  scale, backend=backend, topk=topk, softcap=softcap)
        return out.transpose(1, 2), None
    capture = kwargs.get("kvpop_capture")
    if cfg.policy == "dms" and policy.training and not kwargs.get("kvpop_dense", False):
        # DMS learns its gates through a soft eviction mask (an additive bias), not the boolean rule
        from kvpop.baselines.dms import relaxed_attention

        logits, alpha, priority = policy.relaxed(key, value)
        # no lse: DMS trains by the KL and its compression loss, never by the future-attention target
        out, lse = relaxed_attention(query, key, value, position, valid, alpha, cfg.sink, cfg.window, scale,
                                     softcap=softcap)
        if capture is not None:
            capture.append(LayerRecord(module.layer_idx, query, key, lse, priority, position, valid, scale,
                                       policy.log_gamma.detach(), gate=logits, softcap=softcap))
        return out.transpose(1, 2), None
    override = kwargs.get("kvpop_priority")
    if kwargs.get("kvpop_dense", False):
        evict = torch.full(key.shape[:3], NEVER, dtype=torch.long, device=key.device)
        priority = None
        sink, window, topk = Q, Q, None  # everything is a sink: causal attention over real tokens
    else:
        with timed("kvpop.scorer"):
            rope = kwargs.get("kvpop_rope")
            if override is not None:
                # one per full-attention layer, in order (a hybrid model's sliding layers have none)
                priority = override[kwargs["kvpop_policy_layer"]]
            elif policy.evidence:
                # scored when leaving the window, from the attention its window's queries gave it
                priority = policy.attention_priority(query, key, value, position, valid, scale, rope)
            else:
                priority = policy.priority(policy.scorer_key(key, rope), value, position)
        with timed("kvpop.rule"):
            evict = eviction_positions(priority.detach(), position[:, None], valid[:, None], cfg.sink, cfg.window,
                                       cfg.topk, ordered=True)
        sink, window, topk = cfg.sink, cfg.window, cfg.topk
    with timed("kvpop.sparse_attention"):
        out, lse = sparse_attention(
            query, key, value, position, valid, position, valid, evict, sink, window, scale,
            return_lse=capture is not None, backend=backend, topk=topk, softcap=softcap,
        )
    if capture is not None:
        capture.append(LayerRecord(module.layer_idx, query, key, lse, priority, position, valid, scale,
                                   policy.log_gamma.detach(), softcap=softcap))
    return out.transpose(1, 2), None


def _check_call(module: nn.Module, policy, cfg, kwargs: dict) -> float | None:
    """What the model's attention module passed beyond q, k, v that changes the attention: the soft-capping to
    apply (None: none), after refusing what the rule's attention cannot run. Python values only (no host sync)."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("this model's attention adds learned sink logits (s_aux, as gpt-oss does), which kvpop's "
                         "attention does not compute")
    passed = kwargs.get("sliding_window")
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    # a layer runs as full attention where the model attends no window, or one no position reaches past
    if policy.sliding:
        agrees = passed == cfg.window
    else:
        agrees = passed is None or (limit is not None and passed >= limit)
    if not agrees:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} was retrofitted as "
                         f"{f'a sliding window of {cfg.window}' if policy.sliding else 'full attention'}, but the model "
                         f"attends it with sliding_window={passed}")
    softcap = kwargs.get("softcap")
    if softcap is not None and policy.evidence:
        raise ValueError(f"the evidence scorer does not take logit soft-capping (this model caps its attention "
                         f"logits at {softcap}); use scorer 'mlp' or 'mlstm'")
    return None if softcap is None else float(softcap)


def register() -> None:
    """Make "kvpop" a valid `attn_implementation` (idempotent; called by `retrofit`, not at import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvpop_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_mask_passthrough)
