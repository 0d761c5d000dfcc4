"""The stateful scorer of KVpop (`docs/method.md` Sec. 3): a per-head mLSTM memory with delayed readout.

Every token `t` is inserted into a matrix memory `C (d x d), n (d), m` (xLSTM's mLSTM: exponential
input gate, log-sigmoid forget gate, max-stabiliser `m`); token `t` is *read out* with the memory
after step `u = t + delay` using its own query `q~[t]`, and a small head turns the readout into the
score. One set of weights per KV head, all heads evaluated by einsum.

Three executions give the same scores (`tests/test_mlstm.py`; derivations in `README.md` beside this):

- `MLSTMScorer.forward`: whole sequences, differentiable, chunkwise (training) or quadratic (reference);
- `init_state` / `step` / `readout`: one token at a time (decoding), static shapes, no host sync;
- `scan`: a chunk of tokens from an existing state plus readouts at given in-chunk steps (prefill).

The pure functions below work on projected features in any float dtype; the module casts to float32.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# smallest normal float32: keeps the readout's denominator > 0 when `exp(-m)` underflows (m > 87)
_TINY = torch.finfo(torch.float32).tiny
MAX_AUTO_CHUNK = 512
"""Largest chunk `forward` picks by itself for long sequences (see its `chunk_size`)."""
AUTO_CHUNKS = 128
"""`forward` raises its chunk size so that a sequence has at most this many chunks (up to `MAX_AUTO_CHUNK`)."""


class MLSTMState(NamedTuple):
    """The stabilised memory of every (batch row, head); the true memory is `C * exp(m)`, `n * exp(m)`."""

    C: Tensor  # [B, H, d, d], float32, rows indexed by the key dim: readout is q~^T C
    n: Tensor  # [B, H, d]
    m: Tensor  # [B, H]


# --- the mLSTM on projected features ------------------------------------------------------------


def mlstm_step(state: MLSTMState, k: Tensor, v: Tensor, igate: Tensor, logf: Tensor) -> MLSTMState:
    """Insert one token: `m' = max(logf + m, i)`, `C' = e^(logf + m - m') C + e^(i - m') k v^T`.

    Args:
        k, v: [B, H, d] projected key (already scaled by 1/sqrt(d)) and value.
        igate, logf: [B, H] input-gate preactivation and log forget gate.
    """
    C, n, m = state
    m_new = torch.maximum(logf + m, igate).detach()
    fw = torch.exp(logf + m - m_new)
    iw = torch.exp(igate - m_new)
    C_new = fw[..., None, None] * C + iw[..., None, None] * (k[..., :, None] * v[..., None, :])
    n_new = fw[..., None] * n + iw[..., None] * k
    return MLSTMState(C_new, n_new, m_new)


def mlstm_readout(state: MLSTMState, q: Tensor) -> Tensor:
    """`h = q^T C / max(|q^T n|, exp(-m))` for R queries per head.

    Args:
        q: [B, H, R, d].
    Returns:
        [B, H, R, d].
    """
    C, n, m = state
    num = q @ C
    den = (q @ n[..., None]).squeeze(-1)
    return num / torch.maximum(den.abs(), torch.exp(-m)[..., None]).clamp_min(_TINY)[..., None]


def _decay_rows(logf: Tensor) -> Tensor:
    """Log decays inside a chunk: `[..., L] -> [..., L, L + 1]`.

    Row `u` (the memory after in-chunk step `u`): column 0 is `sum_{r <= u} logf_r` (the decay of the
    state the chunk started from), column `s + 1` is `sum_{s < r <= u} logf_r` (token `s`), `-inf`
    for `s > u`. Each entry is summed on its own segment, not as a difference of two long cumulative
    sums, so strong forget gates do not cost precision.
    """
    x = F.pad(logf, (1, 0))
    T = x.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=x.device)
    # seg[u, s] = sum_{s < r <= u} x_r
    seg = x[..., :, None].expand(*x.shape, T).masked_fill(~ones.tril(-1), 0.0).cumsum(-2)
    return seg.masked_fill(~ones.tril(), float("-inf"))[..., 1:, :]


def _log_weights(rows: Tensor, state_m: Tensor, igate: Tensor) -> Tensor:
    """Unstabilised log weights of [start state, token 0 .. L-1] for each row: [..., R, L + 1]."""
    return rows + torch.cat([state_m[..., None], igate], dim=-1)[..., None, :]


def mlstm_chunk_readout(state: MLSTMState, q: Tensor, rows: Tensor, igate: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Parallel form inside one chunk: readout of R queries, each with the memory after its own step.

    Args:
        state: memory before the chunk, leading dims `...` (`[B, H]` or `[B, H, NC]`).
        q: [..., R, d] readout queries.
        rows: [..., R, L + 1] the `_decay_rows` row of each query's readout step.
        igate: [..., L]; k, v: [..., L, d] the chunk's tokens.
    Returns:
        [..., R, d].
    """
    C, n, m = state
    logw = _log_weights(rows, m, igate)
    # the stabiliser cancels in h (numerator, denominator and floor all scale by e^-mx): no gradient needed
    mx = logw.amax(-1).detach()  # [..., R]
    w = torch.exp(logw - mx[..., None])
    w0 = w[..., 0]
    qk = (q @ k.transpose(-1, -2)) * w[..., 1:]  # [..., R, L]
    num = w0[..., None] * (q @ C) + qk @ v
    den = w0 * (q @ n[..., None]).squeeze(-1) + qk.sum(-1)
    return num / torch.maximum(den.abs(), torch.exp(-mx)).clamp_min(_TINY)[..., None]


def mlstm_chunk_update(state: MLSTMState, last_row: Tensor, igate: Tensor, k: Tensor, v: Tensor) -> MLSTMState:
    """The memory after a whole chunk (`last_row`: [..., L + 1], the chunk's last `_decay_rows` row)."""
    C, n, m = state
    logw = _log_weights(last_row[..., None, :], m, igate)[..., 0, :]  # [..., L + 1]
    m_new = logw.amax(-1).detach()
    w = torch.exp(logw - m_new[..., None])
    kw = k * w[..., 1:, None]
    C_new = w[..., 0, None, None] * C + kw.transpose(-1, -2) @ v
    n_new = w[..., 0, None] * n + kw.sum(-2)
    return MLSTMState(C_new, n_new, m_new)


def mlstm_chunk_states(state: MLSTMState, last_rows: Tensor, igate: Tensor, k: Tensor, v: Tensor) -> MLSTMState:
    """The memory after every chunk at once: the parallel form of `mlstm_chunk_update` in a loop over chunks.

    Each chunk's own contribution is summed first, stabilised by its own max `mu_c`; the memory after
    chunk c is then the start state and the chunks `j <= c`, each decayed by the forget gates of the
    chunks after it (`_decay_rows` over the chunks' total log decays, so each decay is summed on its
    own segment). A handful of kernels, where the loop took a dozen per chunk and left a GPU
    launch-bound. `m` is the sequential loop's (the max over the same log weights).

    Args:
        state: the memory before the first chunk, leading dims `[B, H]`.
        last_rows: [B, H, NC, L + 1] the last `_decay_rows` row of each chunk (column 0: the chunk's total).
        igate: [B, H, NC, L]; k, v: [B, H, NC, L, d].
    Returns:
        the memory after each chunk, leading dims `[B, H, NC]`.
    """
    C0, n0, m0 = state
    b = last_rows[..., 1:] + igate  # token s's log weight at its chunk's end
    mu = b.amax(-1).detach()  # [B, H, NC]; -inf for a chunk of padding steps only
    w = torch.exp(b - torch.where(torch.isfinite(mu), mu, 0.0)[..., None])
    kw = k * w[..., None]
    K = kw.transpose(-1, -2) @ v  # [B, H, NC, d, d]
    N = kw.sum(-2)  # [B, H, NC, d]
    # row c: [start state, chunk 0 .. NC-1] as they stand after chunk c (-inf for chunks after c)
    logw = _decay_rows(last_rows[..., 0]) + torch.cat([m0[..., None], mu], dim=-1)[..., None, :]
    m = logw.amax(-1).detach()  # [B, H, NC]
    W = torch.exp(logw - m[..., None])
    C = W[..., 0, None, None] * C0[:, :, None] + torch.einsum("bhcj,bhjxy->bhcxy", W[..., 1:], K)
    n = W[..., 0, None] * n0[:, :, None] + torch.einsum("bhcj,bhjx->bhcx", W[..., 1:], N)
    return MLSTMState(C, n, m)


def empty_state(batch: int, heads: int, d: int, device=None, dtype=torch.float32) -> MLSTMState:
    """The memory before any token: zeros, with `m = 0` (any finite m gives the same scores)."""
    return MLSTMState(
        torch.zeros(batch, heads, d, d, device=device, dtype=dtype),
        torch.zeros(batch, heads, d, device=device, dtype=dtype),
        torch.zeros(batch, heads, device=device, dtype=dtype),
    )


def _pad_steps(k: Tensor, v: Tensor, igate: Tensor, logf: Tensor, pad: int):
    """Append `pad` identity steps (no input: i = -inf; no forgetting: logf = 0)."""
    if pad == 0:
        return k, v, igate, logf
    return (F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)),
            F.pad(igate, (0, pad), value=float("-inf")), F.pad(logf, (0, pad)))


def mlstm_delayed_quadratic(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, logf: Tensor, delay: int) -> Tensor:
    """Reference: token t read out with the memory after step `min(t + delay, S - 1)`, one `S x (S + 1)` matrix.

    Args:
        q, k, v: [B, H, S, d]; igate, logf: [B, H, S]. The memory starts empty.
    Returns:
        h: [B, H, S, d].
    """
    B, H, S, d = q.shape
    step = (torch.arange(S, device=q.device) + delay).clamp(max=S - 1)
    rows = _decay_rows(logf)[..., step, :]
    return mlstm_chunk_readout(empty_state(B, H, d, q.device, q.dtype), q, rows, igate, k, v)


def mlstm_delayed_chunkwise(
    q: Tensor, k: Tensor, v: Tensor, igate: Tensor, logf: Tensor, delay: int, chunk_size: int,
    state: MLSTMState | None = None,
) -> tuple[Tensor, MLSTMState]:
    """Chunkwise form of `mlstm_delayed_quadratic`: `O(S L)` matrices, `S / L` states of `d x d`.

    The readout query of step `u` is `q[u - delay]` (queries shifted by `delay`), so every chunk reads
    out exactly L tokens; the last `min(delay, S)` tokens, whose step would pass `S - 1`, are read
    with the final memory.

    Returns:
        h: [B, H, S, d], and the memory after the last token.
    """
    B, H, S, d = q.shape
    state = state if state is not None else empty_state(B, H, d, q.device, q.dtype)
    if S == 0:
        return q.new_zeros(B, H, 0, d), state
    L = max(1, min(chunk_size, S))
    NC = -(-S // L)
    lead = min(delay, S)
    q_step = F.pad(q[:, :, : S - lead], (0, 0, lead, NC * L - S))
    k, v, igate, logf = _pad_steps(k, v, igate, logf, NC * L - S)
    q_step, k, v = (t.reshape(B, H, NC, L, d) for t in (q_step, k, v))
    igate, logf = igate.reshape(B, H, NC, L), logf.reshape(B, H, NC, L)
    rows = _decay_rows(logf)  # [B, H, NC, L, L + 1]

    # the memory each chunk starts from: the start state, then the memory after chunks 0 .. NC-2
    after = mlstm_chunk_states(state, rows[:, :, :, -1], igate, k, v)
    final = MLSTMState(*(t[:, :, -1] for t in after))
    start = MLSTMState(*(torch.cat([t0[:, :, None], t[:, :, :-1]], dim=2) for t0, t in zip(state, after)))
    # parallel over chunks: every step's readout
    h = mlstm_chunk_readout(start, q_step, rows, igate, k, v).reshape(B, H, NC * L, d)
    h_tail = mlstm_readout(final, q[:, :, S - lead :])
    return torch.cat([h[:, :, lead:S], h_tail], dim=2), final


def mlstm_scan(
    state: MLSTMState, k: Tensor, v: Tensor, igate: Tensor, logf: Tensor, q_r: Tensor, step_r: Tensor,
    chunk_size: int,
) -> tuple[Tensor, MLSTMState]:
    """Continue the memory over C tokens and read out R queries, each after its own in-chunk step.

    Every readout is evaluated against every sub-chunk of `chunk_size` steps and kept where its step
    falls (no data-dependent shapes): `O(R C d + (C / L) R d^2)` work, `O(R L)` memory.

    Args:
        k, v: [B, H, C, d]; igate, logf: [B, H, C].
        q_r: [B, H, R, d]; step_r: int64 [B, H, R] in [0, C - 1].
    Returns:
        h: [B, H, R, d], and the memory after the C tokens.
    """
    B, H, C, d = k.shape
    L = max(1, min(chunk_size, C))
    NC = -(-C // L)
    k, v, igate, logf = _pad_steps(k, v, igate, logf, NC * L - C)
    h = q_r.new_zeros(q_r.shape)
    for c in range(NC):
        sl = slice(c * L, (c + 1) * L)
        rows = _decay_rows(logf[:, :, sl])  # [B, H, L, L + 1]
        local = step_r - c * L
        inside = (local >= 0) & (local < L)
        idx = local.clamp(0, L - 1)[..., None].expand(-1, -1, -1, L + 1)
        h_c = mlstm_chunk_readout(state, q_r, rows.gather(2, idx), igate[:, :, sl], k[:, :, sl], v[:, :, sl])
        h = torch.where(inside[..., None], h_c, h)
        state = mlstm_chunk_update(state, rows[:, :, -1], igate[:, :, sl], k[:, :, sl], v[:, :, sl])
    return h, state


# --- the scorer ---------------------------------------------------------------------------------


def _float32(method):
    """Run a scorer method with autocast off: `docs/method.md` wants scores in float32, and bf16 einsums tie them."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.autocast(self.w_in.device.type, enabled=False):
            return method(self, *args, **kwargs)

    return run


class MLSTMScorer(nn.Module):
    """mLSTM memory per KV head over `x[t] = [k[t]; v[t]]` (detached, float32), read out `delay` steps later.

    Features per head: `q~, k~ / sqrt(d), v~` (each d), input gate `i~` (exponential), forget gate
    `logsigmoid(f~)`, all by one affine map of `x[t]`. Score: `head(h)`, a 1-hidden-layer SiLU MLP
    (`hidden > 0`) or a linear map (`hidden = 0`) from `h` to a scalar.
    """

    def __init__(
        self, num_heads: int, head_dim: int, d: int | None = None, hidden: int = 64, delay: int = 0,
        chunk_size: int = 64,
    ):
        super().__init__()
        d = head_dim if d is None else d
        for name, value, lo in (("num_heads", num_heads, 1), ("head_dim", head_dim, 1), ("d", d, 1),
                                ("hidden", hidden, 0), ("delay", delay, 0), ("chunk_size", chunk_size, 1)):
            if not isinstance(value, int) or value < lo:
                raise ValueError(f"{name}={value!r} must be an integer >= {lo}")
        self.num_heads, self.head_dim, self.d, self.hidden = num_heads, head_dim, d, hidden
        self.delay, self.chunk_size = delay, chunk_size
        # columns: q~ | k~ | v~ | i~ | f~
        self.w_in = nn.Parameter(torch.empty(num_heads, 2 * head_dim, 3 * d + 2))
        self.b_in = nn.Parameter(torch.zeros(num_heads, 3 * d + 2))
        if hidden > 0:
            self.w1 = nn.Parameter(torch.empty(num_heads, d, hidden))
            self.b1 = nn.Parameter(torch.zeros(num_heads, hidden))
        else:
            self.register_parameter("w1", None)
            self.register_parameter("b1", None)
        self.w2 = nn.Parameter(torch.empty(num_heads, hidden or d))
        self.b2 = nn.Parameter(torch.zeros(num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(2 * self.head_dim)
        nn.init.uniform_(self.w_in, -bound, bound)
        with torch.no_grad():
            self.b_in.zero_()
            # xLSTM's forget-gate bias: heads start with memories of ~20 to ~400 tokens
            self.b_in[:, -1] = torch.linspace(3.0, 6.0, self.num_heads)
        if self.w1 is not None:
            nn.init.uniform_(self.w1, -1 / math.sqrt(self.d), 1 / math.sqrt(self.d))
            nn.init.zeros_(self.b1)
        fan_in = self.hidden or self.d
        nn.init.uniform_(self.w2, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        nn.init.zeros_(self.b2)

    # --- pieces ---
    def _x(self, key: Tensor, value: Tensor) -> Tensor:
        return torch.cat([key.detach(), value.detach()], dim=-1).float()

    def features(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Projected features of N tokens.

        Args:
            key, value: [B, H, N, D] as cached; gradients are not taken through them.
        Returns:
            q, k, v: float32 [B, H, N, d] (k scaled by 1/sqrt(d)); igate, logf: float32 [B, H, N].
        """
        z = torch.einsum("bhnx,hxf->bhnf", self._x(key, value), self.w_in.float()) + self.b_in.float()[:, None]
        d = self.d
        q, k, v = z[..., :d], z[..., d : 2 * d] / math.sqrt(d), z[..., 2 * d : 3 * d]
        return q, k, v, z[..., 3 * d], F.logsigmoid(z[..., 3 * d + 1])

    def queries(self, key: Tensor, value: Tensor) -> Tensor:
        """Only `q~` of N tokens: float32 [B, H, N, d] (what a readout needs)."""
        w, b = self.w_in[..., : self.d].float(), self.b_in[:, : self.d].float()
        return torch.einsum("bhnx,hxf->bhnf", self._x(key, value), w) + b[:, None]

    def head(self, h: Tensor) -> Tensor:
        """Readouts [B, H, N, d] -> float32 scores [B, H, N]."""
        if self.w1 is not None:
            h = F.silu(torch.einsum("bhnd,hdf->bhnf", h, self.w1.float()) + self.b1.float()[:, None])
        return torch.einsum("bhnf,hf->bhn", h, self.w2.float()) + self.b2.float()[:, None]

    # --- whole sequences (training) ---
    @_float32
    def forward(
        self, key: Tensor, value: Tensor, *, valid: Tensor | None = None,
        backend: Literal["chunkwise", "quadratic"] = "chunkwise", chunk_size: int | None = None,
    ) -> Tensor:
        """Scores of a whole sequence, each token read out with the memory after `min(t + delay, S - 1)`.

        Args:
            key, value: [B, H, S, D] as cached (after k-norm and RoPE); gradients are not taken through them.
            valid: bool [B, S], False for padding: such steps leave the memory unchanged (left padding
                then gives every real token the score it has without the padding).
            backend: "chunkwise" (O(S L) memory) or "quadratic" (the S x S reference).
            chunk_size: L of the chunkwise form; default `self.chunk_size`, raised for long sequences to
                `S / AUTO_CHUNKS` (at most `MAX_AUTO_CHUNK`): the readouts cost `O(S L)` memory, the
                chunks' memories `O((S / L)^2)` weights and `S / L` matrices of `d x d`.
        Returns:
            float32 [B, H, S].
        """
        q, k, v, igate, logf = self.features(key, value)
        if valid is not None:
            igate, logf = _mask_padding(igate, logf, valid[:, None, :])
        if backend == "chunkwise":
            S = key.shape[-2]
            L = chunk_size or max(self.chunk_size, min(MAX_AUTO_CHUNK, -(-S // AUTO_CHUNKS)))
            h, _ = mlstm_delayed_chunkwise(q, k, v, igate, logf, self.delay, L)
        elif backend == "quadratic":
            h = mlstm_delayed_quadratic(q, k, v, igate, logf, self.delay)
        else:
            raise ValueError(f"backend={backend!r} must be 'chunkwise' or 'quadratic'")
        return self.head(h)

    # --- one token at a time (decoding) ---
    def init_state(self, batch: int, device=None) -> MLSTMState:
        """The empty memory: C [B, H, d, d], n [B, H, d], m [B, H], float32."""
        return empty_state(batch, self.num_heads, self.d, device)

    @_float32
    def step(
        self,
        state: MLSTMState,
        key_t: Tensor,  # [B, H, D]
        value_t: Tensor,  # [B, H, D]
        valid: Tensor | None = None,  # [B] bool, False: leave the row's memory unchanged (padding)
    ) -> MLSTMState:
        """Insert one token per row; returns the new memory (the old one is not modified)."""
        _, k, v, igate, logf = (t.squeeze(2) for t in self.features(key_t[:, :, None], value_t[:, :, None]))
        if valid is not None:
            igate, logf = _mask_padding(igate, logf, valid[:, None])
        return mlstm_step(state, k, v, igate, logf)

    @_float32
    def readout(self, state: MLSTMState, key_r: Tensor, value_r: Tensor) -> Tensor:
        """Score of one token per row (its own k/v `[B, H, D]`) with the current memory: float32 [B, H]."""
        return self.head(mlstm_readout(state, self.queries(key_r[:, :, None], value_r[:, :, None])))[..., 0]

    # --- a chunk from an existing memory (prefill) ---
    @_float32
    def scan(
        self,
        state: MLSTMState,
        key: Tensor,  # [B, H, C, D]
        value: Tensor,  # [B, H, C, D]
        readout_key: Tensor,  # [B, H, R, D]
        readout_value: Tensor,  # [B, H, R, D]
        readout_step: Tensor | None,  # int64 [B, H, R], in [0, C - 1]; None: R == C, token r after step r
        valid: Tensor | None = None,  # [B, C] bool, False: a padding step that leaves the memory unchanged
        chunk_size: int | None = None,
    ) -> tuple[MLSTMState, Tensor]:
        """Insert C tokens after `state`; score R tokens, token r with the memory after in-chunk step `readout_step[r]`.

        `readout_step=None` is the case of one readout per step (the cache's prefill: step `u` reads out
        token `u - delay`): it runs the chunkwise form, `O(C L d)` instead of `O(C^2 d)`.

        Returns:
            the memory after the C tokens, and float32 scores [B, H, R].
        """
        _, k, v, igate, logf = self.features(key, value)
        if valid is not None:
            igate, logf = _mask_padding(igate, logf, valid[:, None, :])
        q_r = self.queries(readout_key, readout_value)
        if readout_step is None:
            if q_r.shape[2] != k.shape[2]:
                raise ValueError(f"readout_step=None needs one readout per step: got {q_r.shape[2]} for {k.shape[2]} steps")
            h, state = mlstm_delayed_chunkwise(q_r, k, v, igate, logf, 0, chunk_size or self.chunk_size, state)
        else:
            h, state = mlstm_scan(state, k, v, igate, logf, q_r, readout_step, chunk_size or self.chunk_size)
        return state, self.head(h)

    # --- accounting ---
    def state_floats(self) -> int:
        """Floats of memory per (batch row, head): `d*d + d + 1`."""
        return self.d * self.d + self.d + 1

    def state_entries(self) -> int:
        """KV entries the memory costs per head, `ceil((d*d + d) / (2D))` (`docs/method.md` Sec. 3)."""
        return -(-(self.d * self.d + self.d) // (2 * self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, d={self.d}, hidden={self.hidden}, delay={self.delay}"


def _mask_padding(igate: Tensor, logf: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    # a padding step inserts nothing (i = -inf) and forgets nothing (logf = 0): the identity update
    return igate.masked_fill(~valid, float("-inf")), logf.masked_fill(~valid, 0.0)


__all__ = [
    "MLSTMScorer", "MLSTMState", "empty_state", "mlstm_chunk_readout", "mlstm_chunk_states", "mlstm_chunk_update",
    "mlstm_delayed_chunkwise", "mlstm_delayed_quadratic", "mlstm_readout", "mlstm_scan", "mlstm_step",
]
