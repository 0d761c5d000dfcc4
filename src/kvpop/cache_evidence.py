"""The evidence scorer's part of the bounded cache (`docs/method.md` Sec. 8): window accumulators and readouts.

Per layer the cache keeps, for each window ring slot, the sum, max and latest of the window-normalised
attention its token received so far (`EvidenceState.acc`, and the key before RoPE for
`scorer_keys="pre_rope"`). A token is read out when it leaves the window, before it is compared with
the weakest long-range slot, exactly like the mLSTM's readout at `delay == window`:

- decode (one token): `decode_readout` scores the leaving token from its slot, then (after the shared
  decode step) `decode_accumulate` adds the step's window probabilities (`window_probs`) to the ring;
  the new token's slot starts from zero. Static shapes, no host sync, no loop over heads.
- chunk (prefill): `chunk_readout` runs the op of the training path (`window_evidence`) over the
  ring's tokens and the chunk's, adds the ring's earlier sums, scores every token due in the chunk
  and leaves the ring's sums as a decode would have.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.dynamic.reference import write_slot
from kvpop.ops.evidence import window_evidence, window_probs
from kvpop.policy import EvidencePolicy, EvidenceState


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """`x[b, h, index[b, r], ...]` for x [B, H, N, ...] and index [B, R]."""
    B, H, R = x.shape[0], x.shape[1], index.shape[1]
    idx = index.view(B, 1, R, *(1,) * (x.dim() - 3)).expand(B, H, R, *x.shape[3:])
    return x.gather(2, idx)


def decode_readout(layer, p: Tensor, real: Tensor, policy: EvidencePolicy) -> None:
    """Score the token leaving the window at this step (position `p - w`) and write its slot's priority.

    Its window's queries `p - w .. p - 1` are all in the ring slot's accumulators by now. Sinks are
    never ranked, and a padding step reads nothing (the write goes to the scratch slot).
    """
    s, w = layer.sink, layer.window
    state: EvidenceState = layer.state
    x = p - w  # [B]
    j = ((x - s).clamp(min=0) % w)[:, None]  # [B, 1] its ring index
    # slot views sliced from the buffers: a compiled step's only cache inputs (`KVpopLayerCache._slots_of`)
    keys, values = layer._slots_of(0), layer._slots_of(1)
    key = _gather(state.key, j) if policy.pre_rope else _gather(keys, s + j)
    pri = policy.readout(key, _gather(values, s + j), _gather(state.acc, j), x.clamp(min=0)[:, None])
    due = (real & (x >= s))[:, None, None]
    slot = (s + j)[:, None].expand(-1, pri.shape[1], -1)
    write_slot(layer.buffers[3], torch.where(due, slot, layer.slots), pri.detach())


def decode_accumulate(layer, query: Tensor, key: Tensor, p: Tensor, real: Tensor, scale: float,
                      policy: EvidencePolicy, rope: tuple[Tensor, Tensor] | None) -> None:
    """After the step's write: add query `p`'s window-normalised attention to every ring slot's sums.

    Args:
        query: [B, Hq, 1, D]; key: [B, H, 1, D] the new token's (for its key before RoPE).
        p: [B] the new token's position; real: [B] False for a padding step (nothing changes).
    """
    s, w = layer.sink, layer.window
    n = s + w
    state: EvidenceState = layer.state
    keys, pos = layer._slots_of(0), layer._slots_of(2)  # from the buffers, as in `decode_readout`
    probs = window_probs(query, keys[:, :, :n], pos[:, :, :n] >= 0, scale)[..., s:]  # [B, H, G, w]
    probs = probs.transpose(-1, -2)  # [B, H, w, G]
    j = (p - s).clamp(min=0) % w
    # the new token's slot starts afresh (it held the token that just left)
    fresh = ((torch.arange(w, device=p.device) == j[:, None]) & (p >= s)[:, None])[:, None, :, None]  # [B, 1, w, 1]
    acc = state.acc
    total = torch.where(fresh, 0.0, acc[..., 0, :]) + probs
    peak = torch.maximum(torch.where(fresh, 0.0, acc[..., 1, :]), probs)
    acc.copy_(torch.where(real[:, None, None, None, None], torch.stack([total, peak, probs], dim=3), acc))
    if policy.pre_rope:
        write = fresh & real[:, None, None, None]
        state.key.copy_(torch.where(write, policy.scorer_key(key, rope), state.key))


def chunk_readout(layer, query: Tensor, key: Tensor, value: Tensor, position: Tensor, valid: Tensor,
                  cand_pri: Tensor, scale: float, policy: EvidencePolicy,
                  rope: tuple[Tensor, Tensor] | None) -> Tensor:
    """A chunk: the evidence its queries give the ring's and its own tokens; the priorities of those due.

    Local entries (the layout `window_evidence` wants, consecutive positions): entry `i < w` is
    position `seen - w + i` from its ring slot, entry `w + j` the chunk's `j`-th real token
    (position `seen + j`). Entry `i` is read out at query `seen + i`: it is due in this chunk when
    `i < n` (the chunk's real tokens), whichever part it lives in.

    Args:
        query [B, Hq, C, D], key/value [B, H, C, D], position/valid [B, C] of the chunk.
        cand_pri: [B, H, slots + C], the candidates' priorities (slots, then the chunk's tokens).
    Returns:
        `cand_pri` with the priorities of every token read out in this chunk.
    """
    s, w, n_slots = layer.sink, layer.window, layer.slots
    state: EvidenceState = layer.state
    B, H, C, D = key.shape
    dev = key.device
    seen = layer.seen[:, None]  # [B, 1]
    n = valid.sum(-1, keepdim=True)  # [B, 1]
    ar_w, ar_c = torch.arange(w, device=dev), torch.arange(C, device=dev)

    ring_pos = seen - w + ar_w  # [B, w]
    ring_j = (ring_pos - s).clamp(min=0) % w
    # the chunk's real tokens in position order (padding to a dump column)
    dest = torch.where(valid, position - seen, C)  # [B, C]

    def compact(x: Tensor) -> Tensor:
        idx = dest[:, None, :, None].expand(B, x.shape[1], C, x.shape[-1])
        return x.new_zeros(B, x.shape[1], C + 1, x.shape[-1]).scatter_(2, idx, x)[:, :, :C]

    c_key, c_real, c_pos = compact(key), ar_c < n, seen + ar_c
    local_key = torch.cat([_gather(layer.keys, s + ring_j), c_key.to(layer.keys.dtype)], dim=2)
    key_valid = torch.cat([ring_pos >= s, c_real & (c_pos >= s)], dim=1)
    # the sinks: in their slots once seen, else still in this chunk
    u = torch.arange(s, device=dev).expand(B, s)
    from_chunk = _gather(c_key, (u - seen).clamp(0, C - 1)).to(layer.keys.dtype)
    sink_key = torch.where((u < seen)[:, None, :, None], layer.keys[:, :, :s], from_chunk)
    sink_pos = torch.where(u < seen + n, u, -1)
    stats, reached = window_evidence(compact(query), local_key, key_valid, c_real, c_pos, sink_key, sink_pos,
                                     w, scale)
    # the ring's tokens: add what their window's earlier queries gave them
    old = _gather(state.acc, ring_j)  # [B, H, w, 3, G]
    new = stats[:, :, :w]
    ring = torch.stack([old[..., 0, :] + new[..., 0, :], torch.maximum(old[..., 1, :], new[..., 1, :]),
                        torch.where(reached[:, None, :w, None], new[..., 2, :], old[..., 2, :])], dim=3)
    total = torch.cat([ring, stats[:, :, w:]], dim=2)  # [B, H, w + C, 3, G]

    if policy.pre_rope:
        s_key = torch.cat([_gather(state.key, ring_j), compact(policy.scorer_key(key, rope))], dim=2)
    else:
        s_key = local_key
    s_value = torch.cat([_gather(layer.values, s + ring_j), compact(value).to(layer.values.dtype)], dim=2)
    local_pos = seen - w + torch.arange(w + C, device=dev)  # [B, w + C]
    pri = policy.readout(s_key, s_value, total, local_pos.clamp(min=0)).detach()  # [B, H, w + C]

    # each due entry's candidate column: its ring slot, or the chunk token's own column
    orig = torch.zeros(B, C + 1, dtype=torch.long, device=dev).scatter_(1, dest, ar_c.expand(B, C))[:, :C]
    column = torch.cat([s + ring_j, n_slots + orig], dim=1)
    due = key_valid & (torch.arange(w + C, device=dev) < n)
    column = torch.where(due, column, cand_pri.shape[-1])[:, None].expand(B, H, w + C)
    cand_pri = torch.cat([cand_pri, cand_pri.new_empty(B, H, 1)], dim=2).scatter_(2, column, pri)[..., :-1]

    # the ring after the chunk: slot j holds position P = last - ((last - s - j) mod w), entry P - seen + w
    last = seen + n - 1
    entry = (last - ((last - s - ar_w) % w) - seen + w).clamp(0, w + C - 1)  # [B, w]
    state.acc.copy_(_gather(total, entry))
    if policy.pre_rope:
        state.key.copy_(_gather(s_key, entry))
    return cand_pri
