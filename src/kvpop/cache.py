"""KVpopCache: a bounded KV cache of `sink + window + topk` slots per (layer, KV head) (`KVPOP.md` Sec. 7).

Slot layout of every layer, the same for every head (so a decode step has static shapes):

    [0, s)            sinks: position p < s lives in slot p
    [s, s + w)        window ring: position p >= s lives in slot s + (p - s) % w
    [s + w, s + w + k) long-range top-k, with float32 static priorities

Each slot also stores its token's position (-1 = empty) and priority. Positions count each row's
real tokens (left padding is skipped), so every sequence's sinks are its own first tokens.

Two update paths, both equal to the rule (tests check them against the teacher-forced forward):
- decode (one new token): the token leaving the window replaces the weakest top-k slot if it beats
  it; O(slots) work, no host sync, no loop over heads;
- chunk (prefill, any length): the rule is evaluated over `slots + chunk` with `eviction_positions`,
  each query attends what the rule keeps for it, then the slots are rewritten with what is retained
  at the chunk's last token.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop.ops.attention import attention_with_probs, masked_attention
from kvpop.ops.topk import eviction_positions, mask_from_eviction
from kvpop.policy import LayerPolicy


def cache_kwargs(model, cache: Cache) -> dict:
    """`{name: cache}` for a forward or `generate` call: transformers >= 5.2x renamed `past_key_values=` to `cache=`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class KVpopLayerCache(CacheLayerMixin):
    """One layer's slots. `keys`/`values`: [B, Hkv, slots, D]; `pos`: int64 and `pri`: float32 [B, Hkv, slots]."""

    is_compileable = False
    is_sliding = False

    def __init__(self, sink: int, window: int, topk: int):
        super().__init__()
        self.sink, self.window, self.topk = sink, window, topk
        self.slots = sink + window + topk
        self.pos: Tensor | None = None
        self.pri: Tensor | None = None
        self.seen: Tensor | None = None  # [B] real tokens so far, per row
        self.processed = 0  # tokens given to the model so far, padding included (what generate counts)

    # --- transformers' Cache protocol ---
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, D = key_states.shape
        kw = dict(device=key_states.device)
        self.keys = torch.zeros(B, H, self.slots, D, dtype=key_states.dtype, **kw)
        self.values = torch.zeros(B, H, self.slots, value_states.shape[-1], dtype=value_states.dtype, **kw)
        self.pos = torch.full((B, H, self.slots), -1, dtype=torch.long, **kw)
        self.pri = torch.full((B, H, self.slots), float("-inf"), dtype=torch.float32, **kw)
        self.seen = torch.zeros(B, dtype=torch.long, **kw)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # the real work needs priorities and padding, which only the attention call has: see `attend`
        self.processed += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.processed

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else query_length.shape[-1]
        return self.processed + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.pos.fill_(-1)
            self.pri.fill_(float("-inf"))
            self.seen.zero_()
        self.processed = 0

    def reorder_cache(self, beam_idx: Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "pri", "seen"):
                setattr(self, name, getattr(self, name).index_select(0, beam_idx.to(self.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "pri", "seen"):
                setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "pri", "seen"):
                setattr(self, name, getattr(self, name)[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a KVpopCache cannot be cropped: evicted tokens are gone")

    # --- KVpop ---
    def attend(
        self,
        query: Tensor,  # [B, Hq, C, D]
        key: Tensor,  # [B, Hkv, C, D]
        value: Tensor,  # [B, Hkv, C, D]
        valid: Tensor,  # [B, C] bool, False for padding
        policy: LayerPolicy,
        scale: float,
    ) -> Tensor:
        """Insert a chunk of `C` new tokens and return their attention output [B, Hq, C, D]."""
        if policy.teacher_forced_only:
            raise ValueError(f"the {type(policy).__name__} ranks tokens by future attention: it cannot decode")
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        position = self.seen[:, None] + torch.cumsum(valid.long(), dim=-1) - 1  # [B, C]
        priority = policy.priority(key, value, position.clamp(min=0)).detach()  # [B, Hkv, C]
        C = key.shape[-2]
        if C == 1 or policy.dynamic:
            # dynamic policies re-rank after every token, so even a prefill runs their step semantics
            outs = [
                self._decode(query[:, :, j : j + 1], key[:, :, j : j + 1], value[:, :, j : j + 1],
                             position[:, j], valid[:, j], priority[..., j], scale, policy)
                for j in range(C)
            ]
            out = torch.cat(outs, dim=2)
        else:
            out = self._chunk(query, key, value, position, valid, priority, scale)
        self.seen = self.seen + valid.sum(-1)
        return out

    def _decode(self, query, key, value, p: Tensor, real: Tensor, pri_new: Tensor, scale: float,
                policy: LayerPolicy) -> Tensor:
        """One token per row (`p`: [B] its position): Sec. 7's step with static shapes."""
        s, w, k = self.sink, self.window, self.topk
        B, H, _, D = self.keys.shape
        # a padding step (p = -1) writes nothing; any in-range slot will do for its index
        slot = torch.where(p < s, p.clamp(min=0), s + (p - s).clamp(min=0) % w)  # [B]
        idx = slot[:, None, None].expand(B, H, 1)
        if k > 0:
            # the token leaving the window (position p - w) becomes eligible: keep it if it beats the weakest top-k slot
            leave_pos, leave_pri = self.pos.gather(2, idx), self.pri.gather(2, idx)
            leaving = (real & (p >= s + w))[:, None, None]
            top_pos, top_pri = self.pos[..., s + w :], self.pri[..., s + w :]
            weakest_pri = top_pri.amin(-1, keepdim=True)
            # among equal weakest priorities the older token is weaker; empty slots (-inf, -1) go first
            oldest = torch.where(top_pri == weakest_pri, top_pos, torch.iinfo(torch.long).max)
            widx = oldest.argmin(-1, keepdim=True)  # [B, H, 1]
            weakest_pos = top_pos.gather(2, widx)
            beats = (leave_pri > weakest_pri) | ((leave_pri == weakest_pri) & (leave_pos > weakest_pos))
            promote = leaving & beats
            dst = widx + s + w
            self._move(idx, dst, promote)
        new = real[:, None, None].expand(B, H, 1)
        self._write(idx, new, key, value, p[:, None, None].expand(B, H, 1), pri_new[..., None])
        occupied = self.pos >= 0
        if not policy.dynamic:
            out, _ = masked_attention(query, self.keys, self.values, occupied[:, :, None, :], scale)
            return out
        out, probs = attention_with_probs(query, self.keys, self.values, occupied, scale)
        self.pri = torch.where(real[:, None, None], policy.update(self.pri, probs, occupied), self.pri)
        return out

    def _move(self, src: Tensor, dst: Tensor, where: Tensor) -> None:
        """Copy slot `src` to slot `dst` ([B, H, 1] indices) where `where` holds."""
        for name in ("keys", "values", "pos", "pri"):
            buf = getattr(self, name)
            if buf.dim() == 4:
                s4, d4 = (i[..., None].expand(-1, -1, -1, buf.shape[-1]) for i in (src, dst))
                buf.scatter_(2, d4, torch.where(where[..., None], buf.gather(2, s4), buf.gather(2, d4)))
            else:
                buf.scatter_(2, dst, torch.where(where, buf.gather(2, src), buf.gather(2, dst)))

    def _write(self, idx: Tensor, where: Tensor, key: Tensor, value: Tensor, pos: Tensor, pri: Tensor) -> None:
        """Write one new token per (b, h) into slot `idx` ([B, H, 1]) where `where` holds."""
        for buf, new in ((self.keys, key), (self.values, value), (self.pos, pos), (self.pri, pri)):
            if buf.dim() == 4:
                i4 = idx[..., None].expand(-1, -1, -1, buf.shape[-1])
                buf.scatter_(2, i4, torch.where(where[..., None], new.to(buf.dtype), buf.gather(2, i4)))
            else:
                buf.scatter_(2, idx, torch.where(where, new.to(buf.dtype), buf.gather(2, idx)))

    def _chunk(self, query, key, value, position: Tensor, valid: Tensor, priority: Tensor, scale: float) -> Tensor:
        """Any number of tokens: the rule over `slots + chunk`, then the slots rewritten."""
        s, w, n_slots = self.sink, self.window, self.slots
        B, H, C, _ = key.shape
        new_pos = torch.where(valid, position, -1)[:, None, :].expand(B, H, C)
        cand_pos = torch.cat([self.pos, new_pos], dim=2)  # [B, H, slots + C]
        cand_valid = cand_pos >= 0
        cand_pri = torch.cat([self.pri, priority], dim=2)
        cand_k = torch.cat([self.keys, key.to(self.keys.dtype)], dim=2)
        cand_v = torch.cat([self.values, value.to(self.values.dtype)], dim=2)
        evict = eviction_positions(cand_pri, cand_pos, cand_valid, s, w, self.topk)
        mask = mask_from_eviction(position, valid, cand_pos, cand_valid, evict, s, w)  # [B, H, C, slots + C]
        out, _ = masked_attention(query, cand_k, cand_v, mask, scale)

        # what the rule retains after the chunk's last real token goes back into the slot layout
        last = (self.seen + valid.sum(-1) - 1)[:, None, None]  # [B, 1, 1]
        sink_kept = cand_valid & (cand_pos < s)
        in_window = cand_valid & (cand_pos >= s) & (cand_pos > last - w)
        top_kept = cand_valid & (cand_pos >= s) & (cand_pos <= last - w) & (last < evict)
        top_slot = s + w + torch.cumsum(top_kept.long(), dim=-1) - 1
        dest = torch.where(
            sink_kept,
            cand_pos,
            torch.where(in_window, s + (cand_pos - s) % w, torch.where(top_kept, top_slot, n_slots)),
        )
        # slot `n_slots` is a scratch column for everything dropped
        for name, cand, fill in (("keys", cand_k, 0.0), ("values", cand_v, 0.0), ("pos", cand_pos, -1),
                                 ("pri", cand_pri, float("-inf"))):
            buf = getattr(self, name)
            shape = (*buf.shape[:2], n_slots + 1, *buf.shape[3:])
            d = dest if buf.dim() == 3 else dest[..., None].expand(-1, -1, -1, buf.shape[-1])
            fresh = torch.full(shape, fill, dtype=buf.dtype, device=buf.device).scatter_(2, d, cand)
            buf.copy_(fresh[:, :, :n_slots])
        return out


class KVpopCache(Cache):
    """The bounded cache for a model prepared by `kvpop.retrofit`; pass it as `past_key_values=`.

    Memory is `layers x Hkv x (sink + window + topk)` key/value slots whatever the generation length.
    """

    def __init__(self, model=None, *, config=None):
        from kvpop.retrofit import kvpop_modules

        if config is None:
            if model is None:
                raise ValueError("KVpopCache needs the retrofitted model (or config=KVpopConfig and num_layers)")
            mods = kvpop_modules(model)
            config, num_layers = mods.config, len(mods.layers)
        else:
            num_layers = model if isinstance(model, int) else len(kvpop_modules(model).layers)
        self.config = config
        super().__init__(layers=[KVpopLayerCache(config.sink, config.window, config.topk) for _ in range(num_layers)])

    @property
    def is_compileable(self) -> bool:
        return False

    def slots_used(self) -> list[Tensor]:
        """Per layer, the number of occupied slots per (batch row, KV head): int64 [B, Hkv]."""
        return [(layer.pos >= 0).sum(-1) for layer in self.layers if layer.is_initialized]
