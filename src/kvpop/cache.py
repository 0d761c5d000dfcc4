"""KVpopCache: a bounded KV cache of `sink + window + topk` slots per (layer, KV head) (`docs/method.md` Sec. 7).

Slot layout of every layer, the same for every head (so a decode step has static shapes):

    [0, s)            sinks: position p < s lives in slot p
    [s, s + w)        window ring: position p >= s lives in slot s + (p - s) % w
    [s + w, s + w + k) long-range top-k, with float32 static priorities

Each slot also stores its token's position (-1 = empty) and priority. Positions count each row's
real tokens (left padding is skipped), so every sequence's sinks are its own first tokens.

Two update paths, both equal to the rule (tests check them against the teacher-forced forward):
- decode (one new token): the token leaving the window replaces the weakest top-k slot if it beats
  it (or, for KVpop-cascade, one of two pools); O(slots) work, no host sync, no loop over heads (on CUDA
  one Triton launch per layer for the rule and the writes, `ops.slots.step_slots`, and two for the attention
  and a dynamic policy's priority update, `decode_step`);
- chunk (prefill, any length): the rule is evaluated over `slots + chunk` with `eviction_positions`,
  each query attends what the rule keeps for it, then the slots are rewritten with what is retained
  at the chunk's last token.

A stateful policy (the mLSTM scorer) also keeps its memory here, per layer (`state`, batch first).
Its priorities are read out `delay <= window` steps after insertion: at position `p` the memory takes
token `p` and then reads out token `p - delay`, which is still in the window (or is token `p` itself).
The evidence scorer keeps its per-window-slot sums in `state` too (`cache_evidence.py`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop import cache_evidence
from kvpop.modules import kvpop_modules
from kvpop.ops.attention import decode_attention, decode_attention_scored, sparse_attention
from kvpop.ops.dynamic import CASCADES, candidate_index, dynamic_walk, eviction_from_steps
from kvpop.ops.dynamic.chunked import chunk_round, decide_from_sums, round_evidence
from kvpop.ops.dynamic.reference import write_slot
from kvpop.ops.slots import step_slots, write_slots
from kvpop.ops.topk import NEVER, eviction_positions
from kvpop.policy import LayerPolicy


def cache_kwargs(model, cache: Cache) -> dict:
    """`{name: cache}` for a forward or `generate` call: transformers >= 5.2x renamed `past_key_values=` to `cache=`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class KVpopLayerCache(CacheLayerMixin):
    """One layer's slots. `keys`/`values`: [B, Hkv, slots, D]; `pos`: int64 and `pri`: float32 [B, Hkv, slots]."""

    # static shapes, in-place updates and a tensor length: `generate` compiles the decode step as it does
    # for `StaticCache` (on CUDA), and `kvpop.decode.Decoder` captures it
    is_compileable = True
    is_sliding = False

    def __init__(self, sink: int, window: int, topk: int, dynamic_prefill: str = "walk"):
        super().__init__()
        self.sink, self.window, self.topk = sink, window, topk
        # how a dynamic policy (TOVA, H2O) takes a chunk: "walk" (its decisions, then one attention) or
        # "replay" (the decode step token by token: the reference, and the path before the walk)
        self.dynamic_prefill = dynamic_prefill
        self.slots = sink + window + topk
        self.pos: Tensor | None = None
        self.pri: Tensor | None = None
        # KVpop-TOVA and KVpop-cascade only: the slots' static priors [B, Hkv, slots]
        self.prior: Tensor | None = None
        self.seen: Tensor | None = None  # [B] real tokens so far, per row
        self.state: tuple[Tensor, ...] | None = None  # a stateful policy's memory, batch first (made on first use)
        # tokens given to the model so far, padding included (what generate counts): an int64 scalar tensor
        # updated in place, so a compiled step neither specialises on it nor recompiles as it grows
        self.length: Tensor | None = None
        # True until the first token is inserted: a chunk into empty slots attends its own tokens only
        self.fresh = True
        # the compiled `decode_step` this layer decodes with (`KVpopCache.fuse`), or None: eager
        self.fused = None

    # --- transformers' Cache protocol ---
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor, with_prior: bool = False) -> None:
        B, H, _, D = key_states.shape
        kw = dict(device=key_states.device)
        # one slot more than the budget: a scratch slot that a masked write of the decode step targets
        # instead of reading the old value back (a gather and a where per buffer saved, every layer
        # and token); `keys`, `values`, `pos`, `pri` (and `prior`) are views without it
        n = self.slots + 1
        self.buffers = (
            torch.zeros(B, H, n, D, dtype=key_states.dtype, **kw),
            torch.zeros(B, H, n, value_states.shape[-1], dtype=value_states.dtype, **kw),
            torch.full((B, H, n), -1, dtype=torch.long, **kw),
            torch.full((B, H, n), float("-inf"), dtype=torch.float32, **kw),
        )
        if with_prior:
            # KVpop-TOVA (score "prior"), KVpop-cascade (`ops.dynamic.CASCADES`): each slot's static prior, moved
            # with its token like its priority
            self.buffers += (torch.full((B, H, n), float("-inf"), dtype=torch.float32, **kw),)
        self._views()
        self.seen = torch.zeros(B, dtype=torch.long, **kw)
        self._length(key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        if not torch.compiler.is_compiling():
            # fixed addresses: a compiled step with CUDA graphs updates these in place instead of copying them
            for t in self.static_tensors():
                torch._dynamo.mark_static_address(t)

    def _length(self, device) -> Tensor:
        if self.length is None:
            self.length = torch.zeros((), dtype=torch.long, device=device)
        return self.length

    def _slots_of(self, i: int) -> Tensor | None:
        """Buffer `i` without its scratch slot, sliced from the buffer itself (the decode step's reads); None for a
        prior buffer (4) the policy does not keep.

        In a compiled step the buffers are then its only inputs among the cache's tensors. A view attribute (`keys`,
        `pos`, ...) read there would be a second graph input aliasing its mutated buffer: AOT autograd merges such
        inputs into a synthetic base, and inductor's CUDA graphs skipped the stateful and cascade policies' steps
        ("mutated inputs", tests/test_decode.py)."""
        return self.buffers[i][:, :, : self.slots] if i < len(self.buffers) else None

    def _views(self) -> None:
        self.keys, self.values, self.pos, self.pri, self.prior = (self._slots_of(i) for i in range(5))

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # the real work needs priorities and padding, which only the attention call has: see `attend`
        self._length(key_states.device).add_(key_states.shape[-2])
        return key_states, value_states

    def get_seq_length(self) -> Tensor | int:
        """Tokens given so far (padding included): an int64 scalar tensor, as `StaticCache` returns in transformers 5.2x."""
        return 0 if self.length is None else self.length

    @property
    def processed(self) -> int:
        """`get_seq_length()` as a Python int (a host sync)."""
        return 0 if self.length is None else int(self.length)

    @processed.setter
    def processed(self, value: int) -> None:
        self.fresh = self.fresh and value == 0
        if self.length is None:
            self.length = torch.tensor(value, dtype=torch.long, device=self.seen.device if self.seen is not None else None)
        else:
            self.length.fill_(value)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # `update` hands the attention only the new tokens (the slots are the cache's business): kv length = q,
        # static while decoding
        q = query_length if isinstance(query_length, int) else query_length.shape[-1]
        return q, 0

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
            if self.prior is not None:
                self.prior.fill_(float("-inf"))
            self.seen.zero_()
        self.state = None
        self.fresh = True
        if self.length is not None:
            self.length.zero_()

    def _map_rows(self, fn) -> None:
        """Apply `fn` to every per-row buffer (batch dim 0), the stateful policy's memory included."""
        if self.is_initialized:
            self.buffers = tuple(fn(b) for b in self.buffers)
            self._views()
            self.seen = fn(self.seen)
        if self.state is not None:
            self.state = type(self.state)(*(fn(t) for t in self.state))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_rows(lambda t: t[indices])

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
        rope: tuple[Tensor, Tensor] | None = None,  # (cos, sin) [B, C, D] of the new tokens
        softcap: float | None = None,
    ) -> Tensor:
        """Insert a chunk of `C` new tokens and return their attention output [B, Hq, C, D].

        `softcap`: the model's logit soft-capping `c * tanh(l / c)` (Gemma 2), in the attention and in what a
        dynamic policy ranks by; None: none."""
        if policy.teacher_forced_only:
            raise ValueError(f"the {type(policy).__name__} ranks tokens by future attention: it cannot decode")
        if policy.chunk > 1:
            raise ValueError(f"decision_chunk={policy.chunk}: this layer's cache decides after every token; a "
                             "KVpopCache built for the retrofitted model holds the chunked rule's layers")
        if not self.is_initialized:
            self.lazy_initialization(key, value, with_prior=policy.score in ("prior", *CASCADES))
        position = self.seen[:, None] + torch.cumsum(valid.long(), dim=-1) - 1  # [B, C]
        B, H, C, _ = key.shape
        if policy.stateful or policy.evidence:
            if self.state is None:
                self.state = policy.init_state(B, key.device)
            # priorities are read out `delay` steps after insertion (`_advance_*`, `cache_evidence`); until
            # then a placeholder
            priority = torch.full((B, H, C), float("-inf"), dtype=torch.float32, device=key.device)
        else:
            priority = policy.priority(policy.scorer_key(key, rope), value, position.clamp(min=0)).detach()  # [B, Hkv, C]
        if C == 1:
            out = self._decode(query, key, value, position[:, 0], valid[:, 0], priority[..., 0], scale, policy, rope,
                               softcap)
        elif policy.dynamic and self.dynamic_prefill == "replay":
            outs = [
                self._decode(query[:, :, j : j + 1], key[:, :, j : j + 1], value[:, :, j : j + 1],
                             position[:, j], valid[:, j], priority[..., j], scale, policy,
                             None if rope is None else tuple(r[:, j : j + 1] for r in rope), softcap)
                for j in range(C)
            ]
            out = torch.cat(outs, dim=2)
        elif policy.dynamic:
            out = self._dynamic_chunk(query, key, value, position, valid, priority, scale, policy, softcap)
        else:
            out = self._chunk(query, key, value, position, valid, priority, scale, policy, rope, softcap)
        # in place, like every per-step update here: a captured CUDA graph keeps the buffers' addresses
        self.seen.add_(valid.sum(-1))
        self.fresh = False
        return out

    def _decode(self, query, key, value, p: Tensor, real: Tensor, pri_new: Tensor, scale: float,
                policy: LayerPolicy, rope: tuple[Tensor, Tensor] | None = None, softcap: float | None = None) -> Tensor:
        """One token per row (`p`: [B] its position): Sec. 7's step with static shapes (`decode_step`)."""
        if policy.stateful:
            # before the leaving token is compared: with delay == window it is the one read out now
            pri_new = self._advance_decode(key, value, p, real, pri_new, policy)
        if policy.evidence:
            cache_evidence.decode_readout(self, p, real, policy)
        step = self.fused or decode_step
        # a dynamic policy's priorities are updated inside the step, by its score (`ops.dynamic.score_update`, as the
        # prefill walks apply it)
        out = step(self.buffers, query, key, value, p, real, pri_new, self.sink, self.window, self.topk, scale,
                   policy.score if policy.dynamic else None, policy.pool, policy.tova_first, policy.decay, softcap)
        if policy.evidence:
            cache_evidence.decode_accumulate(self, query, key, p, real, scale, policy, rope)
        return out

    def _advance_decode(self, key, value, p: Tensor, real: Tensor, pri_new: Tensor, policy: LayerPolicy) -> Tensor:
        """Stateful policies, one step: insert token `p` into the memory, read out token `p - delay`.

        Token `p - delay` is the new token itself (delay 0) or sits in its window ring slot (`1 <= delay
        <= window`). At delay == window it is the token leaving the window, whose slot the new token is
        about to take: it is read here, before that write. Padding steps change nothing.

        Returns:
            the new token's priority [B, H] (its readout at delay 0, else the placeholder `pri_new`).
        """
        s, w, d = self.sink, self.window, policy.delay
        B, H, _, D = self.keys.shape
        x = p - d  # [B] the position read out
        rslot = (s + (x - s).clamp(min=0) % w)[:, None, None].expand(B, H, 1)
        if d == 0:
            rk, rv = key, value
        else:
            keys, values = self._slots_of(0), self._slots_of(1)
            rk = keys.gather(2, rslot[..., None].expand(-1, -1, -1, D))
            rv = values.gather(2, rslot[..., None].expand(-1, -1, -1, values.shape[-1]))
        state, pri = policy.advance(self.state, key, value, real[:, None], rk, rv, x.clamp(min=0)[:, None])
        self._store_state(state)
        pri = pri.detach()  # [B, H, 1]
        if d == 0:
            return pri[..., 0]
        # sinks are never ranked, and nothing is read out before the first token (then: the scratch slot)
        due = (real & (x >= s))[:, None, None]
        write_slot(self.buffers[3], torch.where(due, rslot, self.slots), pri)
        return pri_new

    def _advance_chunk(self, key, value, position: Tensor, valid: Tensor, cand_k: Tensor, cand_v: Tensor,
                       cand_pri: Tensor, policy: LayerPolicy) -> Tensor:
        """Stateful policies, a chunk: insert its tokens into the memory; after step `u`, read out token `u - delay`.

        Returns:
            `cand_pri` ([B, H, slots + C]) with the priorities of every token read out in this chunk.
        """
        s, w, d, n_slots = self.sink, self.window, policy.delay, self.slots
        B, H, C, D = key.shape
        x = position - d  # [B, C] the position read out after each step
        # token x is a chunk token, or an older one still in its window ring slot (x >= seen - delay >= seen - window)
        seen = self.seen[:, None]
        in_chunk = torch.searchsorted(torch.cumsum(valid.long(), dim=-1), (x - seen + 1).clamp(min=1)).clamp(max=C - 1)
        src = torch.where(x >= seen, n_slots + in_chunk, s + (x - s).clamp(min=0) % w)[:, None].expand(B, H, C)
        rk = cand_k.gather(2, src[..., None].expand(-1, -1, -1, D))
        rv = cand_v.gather(2, src[..., None].expand(-1, -1, -1, cand_v.shape[-1]))
        state, pri = policy.advance(self.state, key, value, valid, rk, rv, x.clamp(min=0))
        self._store_state(state)
        # every token is read out at one step only; steps with nothing due write to a scratch column
        due = (valid & (x >= s))[:, None].expand(B, H, C)
        dst = torch.where(due, src, cand_pri.shape[-1])
        scratch = cand_pri.new_empty(B, H, 1)
        return torch.cat([cand_pri, scratch], dim=2).scatter_(2, dst, pri.detach())[..., :-1]

    def _store_state(self, state: tuple[Tensor, ...]) -> None:
        """Keep the policy's new memory: copied into the existing buffers (in place), else adopted."""
        if self.state is None or any(old.shape != new.shape for old, new in zip(self.state, state)):
            self.state = type(state)(*(t.detach() for t in state))
            return
        for old, new in zip(self.state, state):
            old.copy_(new.detach())

    def static_tensors(self) -> list[Tensor]:
        """Every tensor a decode step updates in place (slots, counters, the policy's memory)."""
        if not self.is_initialized:
            return []
        return [*self.buffers, self.seen, self.length, *(self.state or ())]

    def _dynamic_chunk(self, query, key, value, position: Tensor, valid: Tensor, priority: Tensor, scale: float,
                       policy: LayerPolicy, softcap: float | None = None) -> Tensor:
        """A dynamic policy's chunk: the decode step's decisions (`ops.dynamic.dynamic_walk`), then one attention.

        The walk decides which token each step evicts (and leaves the slots exactly as token-by-token
        decoding would); a token once evicted never returns, so those decisions are eviction
        positions, and the chunk attends its slots and tokens under the rule's mask, as `_chunk` does.
        """
        s, w = self.sink, self.window
        B, H, C, D = key.shape
        evicted, pos, pri, prior = dynamic_walk(query, key, self.keys, self.pos, self.pri, position, valid, priority,
                                                s, w, self.topk, scale, policy.score, slot_prior=self.prior,
                                                pool=policy.pool, decay=policy.decay, softcap=softcap)
        new_pos = torch.where(valid, position, -1)[:, None, :].expand(B, H, C)
        cand_pos = torch.cat([self.pos, new_pos], dim=2)  # [B, H, slots + C]
        cand_k = torch.cat([self.keys, key.to(self.keys.dtype)], dim=2)
        cand_v = torch.cat([self.values, value.to(self.values.dtype)], dim=2)
        evict = eviction_from_steps(evicted, position, cand_pos)
        out = self._chunk_attention(query, key, value, cand_k, cand_v, position, valid, cand_pos, cand_pos >= 0, evict,
                                    scale, softcap)
        # the slots the walk left, filled from the candidates (empty slots stay zero)
        src = candidate_index(pos, cand_pos)[..., None]
        held = (pos >= 0)[..., None]
        self.keys.copy_(torch.where(held, cand_k.gather(2, src.expand(-1, -1, -1, D)), 0.0))
        self.values.copy_(torch.where(held, cand_v.gather(2, src.expand(-1, -1, -1, cand_v.shape[-1])), 0.0))
        self.pos.copy_(pos)
        self.pri.copy_(pri)
        if prior is not None:
            self.prior.copy_(prior)
        return out

    def _chunk_attention(self, query, key, value, cand_k, cand_v, position, valid, cand_pos, cand_valid, evict,
                         scale: float, softcap: float | None = None) -> Tensor:
        """A chunk's attention over its candidates (the slots, then its tokens) under their eviction positions.

        Into a fresh cache the slots are all empty: the chunk attends its own tokens, whose positions every
        head shares (FlexAttention on CUDA rather than a dense `[chunk, slots + chunk]` mask); their eviction
        positions are the last `chunk` columns, whether the candidates held the empty slots or not.
        """
        s, w = self.sink, self.window
        if self.fresh:
            out, _ = sparse_attention(query, key, value, position, valid, position, valid, evict[..., -key.shape[2]:],
                                      s, w, scale, softcap=softcap)
        else:
            out, _ = sparse_attention(query, cand_k, cand_v, position, valid, cand_pos, cand_valid, evict, s, w, scale,
                                      softcap=softcap)
        return out

    def _chunk(self, query, key, value, position: Tensor, valid: Tensor, priority: Tensor, scale: float,
               policy: LayerPolicy, rope: tuple[Tensor, Tensor] | None = None, softcap: float | None = None) -> Tensor:
        """Any number of tokens: the rule over `slots + chunk`, then the slots rewritten (`ops.slots`)."""
        s, w = self.sink, self.window
        B, H, C, _ = key.shape
        new_pos = torch.where(valid, position, -1)[:, None, :].expand(B, H, C)
        # into a fresh cache the slots are all empty and the rule over the chunk alone gives the same answers,
        # unless the policy's memory reads the candidates by slot (stateful, evidence)
        alone = self.fresh and not (policy.stateful or policy.evidence)
        if alone:
            cand_pos, cand_pri = new_pos, priority
            cand_k, cand_v = key.to(self.keys.dtype), value.to(self.values.dtype)
        else:
            cand_pos = torch.cat([self.pos, new_pos], dim=2)  # [B, H, slots + C]
            cand_pri = torch.cat([self.pri, priority], dim=2)
            cand_k = torch.cat([self.keys, key.to(self.keys.dtype)], dim=2)
            cand_v = torch.cat([self.values, value.to(self.values.dtype)], dim=2)
        cand_valid = cand_pos >= 0
        if policy.stateful:
            # tokens whose readout is not due yet (t + delay > last) keep the placeholder -inf. It cannot
            # sway a decision of this chunk: a token acts on the others only once eligible (at query
            # t + window), the queries here end at `last` < t + delay <= t + window, and an eviction
            # caused by it would come at `t + window > last`. It is read out before it becomes eligible.
            cand_pri = self._advance_chunk(key, value, position, valid, cand_k, cand_v, cand_pri, policy)
        if policy.evidence:
            # the same argument: a token is read out by the query at which it becomes eligible
            cand_pri = cache_evidence.chunk_readout(self, query, key, value, position, valid, cand_pri, scale, policy,
                                                    rope)
        # a fresh chunk's candidates are its tokens, in position order: the kernel needs no sort on CUDA
        evict = eviction_positions(cand_pri, cand_pos, cand_valid, s, w, self.topk, ordered=alone)
        out = self._chunk_attention(query, key, value, cand_k, cand_v, position, valid, cand_pos, cand_valid, evict,
                                    scale, softcap)

        # what the rule retains after the chunk's last real token goes back into the slot layout
        last = self.seen + valid.sum(-1) - 1  # [B]
        write_slots((self.keys, self.values, self.pos, self.pri), (cand_k, cand_v, cand_pos, cand_pri), evict, last,
                    s, w)
        return out


def decode_step(
    buffers: tuple[Tensor, ...],
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, H, 1, D]
    value: Tensor,  # [B, H, 1, D]
    p: Tensor,  # [B] position of the new token (-1: a padding step)
    real: Tensor,  # [B] bool
    pri_new: Tensor,  # [B, H] its static priority
    sink: int,
    window: int,
    topk: int,
    scale: float,
    score: str | None = None,
    pool: int | None = None,
    tova_first: bool = False,
    decay: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """One decode step on a layer's slot buffers (keys, values, pos, pri, and the prior of KVpop-TOVA and the
    cascades; each with a scratch slot last).

    The token leaving the window (position `p - window`) replaces the weakest top-k slot if it beats it;
    the new token takes its sink or window-ring slot (`ops.slots.step_slots`); then the query attends the occupied
    slots, and a dynamic policy (`score`, one of `ops.dynamic.SCORES`) rewrites every occupied slot's priority from
    the step's probabilities (`ops.attention.decode_attention_scored`). On CUDA that is three launches per layer for
    every rule: the slot kernel, the split attention, and its combine with the priority update. A function of
    tensors, ints and strings only, so that `torch.compile` traces it once for every layer (`fused_decode_step`).
    Masked writes go to the scratch slot instead of reading the old value back.

    KVpop-cascade (`pool` an int, score "cascade"): the last `pool` long-range slots are ranked by `pri`, the
    others by the static priority in the prior buffer; the leaving token meets the static pool first and
    whichever loses meets the `pri` pool (`ops.dynamic.reference.static_first_step`). None: one pool ranked by
    `pri`. With `tova_first` (the layer-wide cascades, scores "cascade_mean" and "cascade_sum") the leaving token
    meets the `pri` pool first, and whichever loses meets the static pool (`ops.dynamic.reference.tova_first_step`).
    `decay`: score "cascade_sum"'s weight of the accumulated score (`ops.dynamic.score_update`). `softcap`: the
    model's logit soft-capping, None for none (the split kernels take none: the reference attention then).

    Returns:
        the attention output [B, Hq, 1, D].
    """
    slots = buffers[0].shape[2] - 1
    keys, values = (b[:, :, :slots] for b in buffers[:2])
    static = topk - (topk if pool is None else pool)  # KVpop-cascade: the long-range slots ranked by the prior
    step_slots(buffers, key, value, p, real, pri_new, sink, window, topk, static, tova_first)
    if score is None:
        # the positions as the occupancy: the CUDA kernel compares them itself (one launch less per layer)
        return decode_attention(query, keys, values, buffers[2][:, :, :slots], scale, softcap)
    # the priorities' buffer whole (its scratch slot unused): a compiled step updates its own input in place
    prior = buffers[4] if len(buffers) > 4 else None
    return decode_attention_scored(query, keys, values, buffers[2], buffers[3], prior, real, scale, score, decay,
                                   softcap)


_FUSED: dict[str, object] = {}


def fused_decode_step(backend: str = "inductor"):
    """`decode_step` compiled once per backend, shared by every layer and cache (`KVpopCache.fuse`).

    A decode step is ~70 small kernels per layer beyond the dense model's (counted on the CPU with a
    dispatch mode); compiled, they fuse into a few, which matters once Python is gone: a captured
    CUDA graph still launches every kernel. One small function compiles in seconds, where the
    whole 36-layer model step took inductor more than 150 s.
    """
    if backend not in _FUSED:
        _FUSED[backend] = torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backend)
    return _FUSED[backend]


class ChunkedLayerCache(KVpopLayerCache):
    """One full-attention layer's cache under the chunked rule (`KVpopConfig.decision_chunk`, `ops/dynamic/chunked.py`).

    `topk` long-range slots, then a ring of `chunk` slots that the chunk's tokens take in step order (padding steps
    included, as empty slots), and the chunk's queries: the cache holds at most `topk + chunk` tokens. While a chunk
    is read nothing is evicted, and each query attends the occupied slots up to itself; after the chunk's last
    step the decision (`decide_from_sums`) keeps `topk` of the long-range slots and the ring's tokens and empties the
    ring. H2O's chunked rule (`protect`) carries each slot's accumulated score where the others carry its static
    prior, and adds the chunk's attention to it at each decision. The decision reads the same tensors in the same
    order as the teacher-forced execution (`chunked_eviction_positions`: the slots, then the chunk), so both make the
    same decisions bit for bit, however the tokens arrive (a prompt at once, in pieces, or one per step).

    Steps are counted on the host (`filled`): a compiled step would specialise on the count, so `model.generate`
    decodes this layer eagerly. `kvpop.decode.Decoder` compiles it all the same (`KVpopCache.steps_on_device`): while
    it decodes, the ring's next slot is a device tensor (`ring_at`) that the step advances in place, and the host,
    which knows that every step adds one token, runs each decision between two steps (`step_done`)."""

    is_compileable = False

    def __init__(self, topk: int, chunk: int, pool: int | None, protect: int | None = None):
        super().__init__(0, 1, topk)
        self.chunk, self.pool_size, self.protect = chunk, pool, protect
        self.filled = 0  # steps of the current chunk so far
        self.queries: Tensor | None = None
        # a whole chunk's round as a captured CUDA graph (`_whole_chunk`): None until the first one, False where
        # capture failed; `use_graphs = False` runs every round eagerly (the reference the CUDA tests compare with)
        self.graph = None
        self.use_graphs = True
        # the memory pool the graphs of one cache's layers share: a list holding its handle and the first graph
        # captured into it (`_capture`), once made
        self.graph_pool: list | None = None
        # steps counted on the device (`count_on_device`): the ring's next slot, int64 [1], which a one-token step
        # writes and advances in place, so that a compiled step never reads `filled`; the scale and soft-capping of
        # the layer's attention, kept from its last eager call, for the decisions the host runs between steps
        self.on_device = False
        self.ring_at: Tensor | None = None
        self.attention_args: tuple[float, float | None] | None = None

    @classmethod
    def for_config(cls, cfg) -> ChunkedLayerCache:
        """The layer cache of a chunked `KVpopConfig` (`decision_chunk > 1`), laid out by its `chunk_layout`."""
        slots, pool, protect = cfg.chunk_layout
        return cls(slots, cfg.decision_chunk, pool, protect)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor, with_prior: bool = False) -> None:
        B, H, _, D = key_states.shape
        n, kw = self.topk + self.chunk, dict(device=key_states.device)
        # the long-range slots [0, topk), then the ring; no scratch slot (no masked per-step write here)
        self.buffers = (
            torch.zeros(B, H, n, D, dtype=key_states.dtype, **kw),
            torch.zeros(B, H, n, value_states.shape[-1], dtype=value_states.dtype, **kw),
            torch.full((B, H, n), -1, dtype=torch.long, **kw),
            # the static prior of each slot (H2O's chunked rule: its accumulated score)
            torch.full((B, H, n), float("-inf"), dtype=torch.float32, **kw),
        )
        self.slots = n
        self._views()
        self.graph = None
        self.seen = torch.zeros(B, dtype=torch.long, **kw)
        self.ring_at = torch.full((1,), self.filled, dtype=torch.long, **kw)
        self._length(key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values, self.pos, self.prior = self.buffers
        # no score buffer: the decision scores from the kept queries. `pri` names the prior for what reads it
        # (`reset`, which fills both with -inf)
        self.pri = self.prior

    def reset(self) -> None:
        super().reset()
        self.filled = 0
        if self.ring_at is not None:
            self.ring_at.zero_()

    def _map_rows(self, fn) -> None:
        super()._map_rows(fn)
        if self.queries is not None:
            self.queries = fn(self.queries)
        self.graph = None  # new buffers: a captured round would read the old ones

    def static_tensors(self) -> list[Tensor]:
        if not self.is_initialized:
            return []
        return [*self.buffers, self.seen, self.length, self.ring_at,
                *(() if self.queries is None else (self.queries,))]

    def attend(self, query, key, value, valid, policy, scale, rope=None, softcap=None) -> Tensor:
        if policy.chunk != self.chunk:
            raise ValueError(f"this layer's cache decides every {self.chunk} steps, its policy every {policy.chunk}")
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        B, H, C, D = key.shape
        if self.queries is None:
            self.queries = query.new_zeros(B, query.shape[1], self.chunk, query.shape[-1])
        position = self.seen[:, None] + torch.cumsum(valid.long(), dim=-1) - 1  # [B, C]
        priority = policy.priority(policy.scorer_key(key, rope), value, position.clamp(min=0)).detach()
        self.attention_args = (scale, softcap)  # what the host's decisions between compiled steps attend with
        if self.on_device:
            if C != 1:
                raise ValueError(f"while its steps are counted on the device this layer takes one token per call, "
                                 f"got {C}: prefill before `KVpopCache.steps_on_device`")
            return self._step_on_device(query, key, value, valid, position, priority, scale, softcap)
        K, outs, i = self.topk, [], 0
        while i < C:
            n = min(self.chunk - self.filled, C - i)
            seg = slice(i, i + n)
            ring = slice(K + self.filled, K + self.filled + n)
            self.keys[:, :, ring] = key[:, :, seg]
            self.values[:, :, ring] = value[:, :, seg]
            self.pos[:, :, ring] = torch.where(valid[:, seg], position[:, seg], -1)[:, None].expand(B, H, n)
            self.prior[:, :, ring] = priority[:, :, seg].float()
            self.queries[:, :, self.filled : self.filled + n] = query[:, :, seg]
            if n == self.chunk:
                # a whole chunk at once: its queries see exactly what its decision reads, so one set of weights
                # gives both the output and the decision
                outs.append(self._whole_chunk(scale, softcap))
                i += n
                continue
            if n == 1:
                # one query: every occupied slot (the ring's later slots are still empty), the decode attention
                out = decode_attention(query[:, :, seg], self.keys, self.values, self.pos, scale, softcap)
            else:
                # the segment's queries over the occupied slots, causally by position (the ring's later tokens too)
                never = torch.full_like(self.pos, NEVER)
                out, _ = sparse_attention(query[:, :, seg], self.keys, self.values, position[:, seg], valid[:, seg],
                                          self.pos, self.pos >= 0, never, 0, 1, scale, topk=self.slots - 1,
                                          softcap=softcap)
            outs.append(out)
            self.filled += n
            i += n
            if self.filled == self.chunk:
                self._decide(scale, softcap)
        self.seen.add_(valid.sum(-1))
        self.fresh = False
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _step_on_device(self, query, key, value, valid, position, priority, scale, softcap) -> Tensor:
        """One token into the ring's slot `ring_at` (what `attend` writes at `filled`), its attention over the occupied
        slots, `ring_at` advanced: no host value read, so a compiled step serves every step of a chunk. The decision
        after the chunk's last step is the host's (`step_done`)."""
        B, H = key.shape[:2]
        slot = self.ring_at + self.topk
        self.keys.index_copy_(2, slot, key)
        self.values.index_copy_(2, slot, value)
        self.pos.index_copy_(2, slot, torch.where(valid, position, -1)[:, None].expand(B, H, 1))
        self.prior.index_copy_(2, slot, priority.float())
        self.queries.index_copy_(2, self.ring_at, query)
        self.ring_at.add_(1)
        self.seen.add_(valid.sum(-1))
        return decode_attention(query, self.keys, self.values, self.pos, scale, softcap)

    def count_on_device(self, on: bool) -> None:
        """Count this layer's steps on the device (`_step_on_device`, one token per call, each followed by
        `step_done`) or, `on=False`, on the host again."""
        if on and self.ring_at is not None:
            self.ring_at.fill_(self.filled)
        self.on_device = on

    def step_done(self) -> None:
        """The host's side of a step counted on the device: the step counted, and after a chunk's last step its
        decision (`_decide`, from the kept queries), the ring emptied."""
        if not self.on_device:
            raise RuntimeError("step_done counts a step taken on the device: call count_on_device(True) first")
        self.filled += 1
        if self.filled == self.chunk:
            if self.attention_args is None:
                raise RuntimeError("a decision needs the layer's attention scale, kept from an eager call: prefill "
                                   "the prompt before decoding with steps counted on the device")
            self._decide(*self.attention_args)
            self.ring_at.zero_()

    def _whole_chunk(self, scale: float, softcap: float | None) -> Tensor:
        """A chunk that arrived whole (written into the ring, its queries kept): its round (`_round`), on CUDA as one
        captured graph. A round is about a hundred small kernels on tensors of fixed shapes and addresses (the
        cache's own buffers), so their launches from the host, not their work, would set a GPU prefill's time."""
        if self._graphs_apply():
            if self.graph is None or self.graph[2] != (scale, softcap):
                self.graph = self._capture(scale, softcap)
            if self.graph:
                self.graph[0].replay()
                return self.graph[1].clone()  # the graph's output buffer is rewritten by its next replay
        return self._round(scale, softcap)

    def _graphs_apply(self) -> bool:
        return (self.use_graphs and self.graph is not False and self.keys.is_cuda and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())

    def _round_decision(self, scale: float, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
        """A whole chunk's output, the candidates its decision keeps and their carried values, from one
        `round_evidence` (the same floats as `chunk_round` on the same tensors); the cache untouched."""
        K = self.topk
        held, chunk_valid = self.pos[:, :, :K] >= 0, self.pos[:, 0, K:] >= 0
        out, sums = round_evidence(self.queries, self.keys, self.values, held, chunk_valid, scale, softcap)
        keep, _, carried = decide_from_sums(sums, self.pos, self.prior, K, self._pool, self.protect)
        return out, keep, carried

    def _round(self, scale: float, softcap: float | None) -> Tensor:
        """A whole chunk's round: its output, then its decision applied."""
        out, keep, carried = self._round_decision(scale, softcap)
        self._keep(keep, carried)
        return out

    def _capture(self, scale: float, softcap: float | None):
        """`_round` captured as a CUDA graph: (graph, its output buffer, the constants it was captured with), or
        False where capture fails (the rounds then run eagerly, the same kernels). Capturing runs nothing: the
        caller replays it for this round. The graphs of a cache's layers share one memory pool (they never run
        at once), so the round's intermediates are held once, not once per layer."""
        dev = self.keys.device
        try:
            # warm-up outside the capture, on a side stream, the cache untouched: the libraries' handles and
            # workspaces are made here, not inside the graph
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._round_decision(scale, softcap)
            torch.cuda.current_stream(dev).wait_stream(side)
            if self.graph_pool is not None and not self.graph_pool:
                self.graph_pool.append(torch.cuda.graph_pool_handle())
            shared = self.graph_pool[0] if self.graph_pool else None
            graph = torch.cuda.CUDAGraph()
            # capture on the side stream directly: `torch.cuda.graph` would also synchronise, collect garbage and
            # empty the allocator's cache, tens of milliseconds per layer and prompt
            with torch.cuda.stream(side):
                graph.capture_begin(pool=shared)
                try:
                    out = self._round(scale, softcap)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(dev).wait_stream(side)
            if self.graph_pool is not None and len(self.graph_pool) == 1:
                # the allocator frees a pool with the last graph captured into it, and a later capture into the
                # same handle then fails: the first graph stays with the handle, so the pool lives as long as the
                # cache does, whichever layer drops its own graph (a reordered batch, a reset)
                self.graph_pool.append(graph)
            return graph, out, (scale, softcap)
        except RuntimeError as err:
            warnings.warn(f"kvpop: the chunked rule's round could not be captured as a CUDA graph ({err}); "
                          "its rounds run eagerly", RuntimeWarning, stacklevel=2)
            return False

    @property
    def _pool(self) -> int:
        return self.topk if self.pool_size is None else self.pool_size

    def _decide(self, scale: float, softcap: float | None) -> None:
        """The decision after a chunk that arrived in pieces, from its kept queries (`chunk_round`)."""
        keep, _, carried = chunk_round(self.queries, self.keys, self.pos, self.prior, self.topk, self._pool, scale,
                                       softcap, self.protect)
        self._keep(keep, carried)

    def _keep(self, keep: Tensor, carried: Tensor) -> None:
        """Apply a decision: `topk` of the slots and the ring stay, with their carried values; the ring empties."""
        K = self.topk
        D, Dv = self.keys.shape[-1], self.values.shape[-1]
        self.keys[:, :, :K] = self.keys.gather(2, keep[..., None].expand(-1, -1, -1, D))
        self.values[:, :, :K] = self.values.gather(2, keep[..., None].expand(-1, -1, -1, Dv))
        self.pos[:, :, :K] = self.pos.gather(2, keep)
        self.prior[:, :, :K] = carried.gather(2, keep)
        self.pos[:, :, K:] = -1
        self.prior[:, :, K:] = float("-inf")
        self.filled = 0


class KVpopCache(Cache):
    """The bounded cache for a model prepared by `kvpop.retrofit`; pass it as `cache=` (`past_key_values=` on 5.17).

    Memory is `layers x Hkv x (sink + window + topk)` key/value slots whatever the generation length; a hybrid
    model's sliding-window layers hold their window `W` each (`kvpop.layer_kinds`).
    `dynamic_prefill`: how TOVA / H2O take a prompt: "walk" (`ops.dynamic`, the default) or "replay"
    (the decode step token by token; the same slots, slower: the reference).
    """

    def __init__(self, model=None, *, config=None, dynamic_prefill: str = "walk"):
        if config is None:
            if model is None:
                raise ValueError("KVpopCache needs the retrofitted model (or config=KVpopConfig and num_layers)")
            config = kvpop_modules(model).config
        if config.match_mlp_memory:
            raise ValueError("KVpopCache needs a resolved config (its effective topk): pass the retrofitted model, "
                             "or config=cfg.resolve(head_dim)")
        if dynamic_prefill not in ("walk", "replay"):
            raise ValueError(f"dynamic_prefill={dynamic_prefill!r} must be 'walk' or 'replay'")
        self.config = config
        if isinstance(model, int):
            config.check_layers(model)
            layers = [config.for_layer(i) for i in range(model)]
        else:
            # a hybrid model's sliding-window layers keep their window (`KVpopModules.layer_configs`)
            layers = kvpop_modules(model).layer_configs(config)
        super().__init__(layers=[
            ChunkedLayerCache.for_config(c) if c.decision_chunk > 1
            else KVpopLayerCache(c.sink, c.window, c.topk, dynamic_prefill) for c in layers])
        # the chunked rule's layers, listed once: `step_done` visits them after every compiled step
        self._chunked = [layer for layer in self.layers if isinstance(layer, ChunkedLayerCache)]
        pool: list = []  # the chunked layers' graphs share one memory pool (`ChunkedLayerCache._capture`)
        for layer in self._chunked:
            layer.graph_pool = pool

    @property
    def is_compileable(self) -> bool:
        # the chunked rule counts its steps on the host: `generate` then decodes eagerly (`Decoder` compiles it,
        # counting them on the device: `steps_on_device`)
        return all(layer.is_compileable for layer in self.layers)

    @contextlib.contextmanager
    def steps_on_device(self) -> Iterator[None]:
        """Decode the chunked rule's layers with their steps counted on the device, one token per call, each call
        followed by `step_done()`: what lets `kvpop.decode.Decoder` compile or capture their step. The prompt goes
        in before (its rounds are the host's); a cache without chunked layers is unchanged."""
        for layer in self._chunked:
            layer.count_on_device(True)
        try:
            yield
        finally:
            for layer in self._chunked:
                layer.count_on_device(False)

    def step_done(self) -> None:
        """After each step inside `steps_on_device`: the chunked layers count it, and decide after a chunk's last."""
        for layer in self._chunked:
            if layer.on_device:
                layer.step_done()

    def fuse(self, backend: str | None = "inductor") -> None:
        """Decode every layer with `decode_step` compiled (`fused_decode_step`); `None` goes back to eager.

        The first decode step compiles (seconds); prefill chunks are not affected.
        """
        step = None if backend is None else fused_decode_step(backend)
        for layer in self.layers:
            layer.fused = step

    @contextlib.contextmanager
    def static_length(self) -> Iterator[None]:
        """Kept for callers of earlier versions: the length is a tensor now, so a compiled step sees no changing int."""
        yield

    def slots_used(self) -> list[Tensor]:
        """Per layer (sliding-window layers included), the number of occupied slots per (batch row, KV head): int64
        [B, Hkv]."""
        return [(layer.pos >= 0).sum(-1) for layer in self.layers if layer.is_initialized]
