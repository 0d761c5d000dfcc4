"""The mLSTM scorer: whole-sequence (chunkwise, quadratic), one-step and chunk-scan executions agree."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvpop.scorers import mlstm as M
from kvpop.scorers.mlstm import MLSTMScorer, MLSTMState

SCORE_RTOL = 1e-5  # float32 executions of the same scores (the bar)
SCORE_ATOL = 1e-5
FLOAT64_TOL = 1e-10  # the same executions in float64, on ill-conditioned inputs
GRAD_RTOL = 1e-4  # chunkwise vs quadratic gradients, relative to each parameter's largest entry

B, H, D = 2, 3, 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # thousands of tiny ops: a second thread only adds synchronisation (x5 slower on a busy machine)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _scorer(delay: int, seed: int = 0, gate: float = 20.0, hidden: int = 8, chunk_size: int = 16) -> MLSTMScorer:
    """A random scorer with large gate preactivations (|i~| up to ~100: exp(i~) overflows float32).

    q~ and k~ get a shared positive offset so that the readout's denominator `q~^T n` is a sum of
    mostly positive terms: where it cancels, float32 rounding is amplified by the cancellation in
    every execution order alike (README: precision), which is not what these tests measure.
    """
    torch.manual_seed(seed)
    s = MLSTMScorer(H, D, hidden=hidden, delay=delay, chunk_size=chunk_size)
    d = s.d
    with torch.no_grad():
        s.w_in[..., : 2 * d] *= 0.5
        s.b_in[:, : 2 * d] += 1.0
        s.w_in[..., 3 * d :] *= gate
        s.b_in[:, 3 * d :] = torch.randn(H, 2) * gate
    return s


def _inputs(S: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return 2 * torch.randn(B, H, S, D, generator=g), 2 * torch.randn(B, H, S, D, generator=g)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol=SCORE_RTOL, atol=SCORE_ATOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs()
    bad = err > atol + rtol * expected.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} entries off, max err {err.max().item():.3e}, mean err {err.mean().item():.3e}"
    )


def _recurrent_scores(s: MLSTMScorer, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Decoding semantics: token t is read out right after step t + delay, or after the last step."""
    S = key.shape[2]
    state = s.init_state(B)
    out = torch.full((B, H, S), float("nan"))
    for u in range(S):
        state = s.step(state, key[:, :, u], value[:, :, u])
        t = u - s.delay
        if t >= 0:
            out[:, :, t] = s.readout(state, key[:, :, t], value[:, :, t])
    for t in range(max(0, S - s.delay), S):
        out[:, :, t] = s.readout(state, key[:, :, t], value[:, :, t])
    return out


@pytest.mark.parametrize("S", [1, 7, 63, 200])
@pytest.mark.parametrize("delay", [0, 1, 5, 16])
def test_forward_matches_recurrent(S, delay):
    s = _scorer(delay, seed=S + delay)
    key, value = _inputs(S, seed=S + delay)
    expected = _recurrent_scores(s, key, value)
    with torch.no_grad():
        _assert_close(s(key, value), expected, f"chunkwise vs recurrent, S={S} delay={delay}")
        _assert_close(s(key, value, backend="quadratic"), expected, f"quadratic vs recurrent, S={S} delay={delay}")


def test_stabiliser_is_exercised():
    s = _scorer(delay=5)
    key, value = _inputs(200)
    with torch.no_grad():
        _, k, v, igate, logf = s.features(key, value)
        # without the max-stabiliser the memory would overflow float32
        assert torch.isinf(torch.exp(igate)).any()
        assert logf.min() < -50
        # and the stabiliser switches between the forget path and the input path
        m, took_input = torch.zeros(B, H), torch.zeros(B, H, dtype=torch.long)
        for u in range(200):
            took_input += (igate[:, :, u] > logf[:, :, u] + m).long()
            m = torch.maximum(logf[:, :, u] + m, igate[:, :, u])
        assert (took_input > 10).all() and (took_input < 190).all()
        _assert_close(s(key, value), _recurrent_scores(s, key, value), "large gates")


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("delay", [0, 3, 250])
def test_chunkwise_matches_quadratic(chunk_size, delay):
    S = 200  # divisible by none of the chunk sizes but 1
    s = _scorer(delay, seed=chunk_size)
    key, value = _inputs(S, seed=chunk_size)
    with torch.no_grad():
        ref = s(key, value, backend="quadratic")
        _assert_close(s(key, value, chunk_size=chunk_size), ref, f"chunk {chunk_size}, delay {delay}")


@pytest.mark.parametrize("padded_chunks", [0, 2])
def test_chunk_states_in_parallel_equal_the_sequential_loop(padded_chunks):
    # the memory after every chunk, all at once, against `mlstm_chunk_update` chunk by chunk, from a
    # non-empty start state with a large stabiliser; whole chunks of padding (i = -inf) included
    torch.manual_seed(padded_chunks)
    NC, L, d = 6, 5, 4
    k, v = torch.randn(B, H, NC, L, d), torch.randn(B, H, NC, L, d)
    igate = 30 * torch.randn(B, H, NC, L)
    logf = F.logsigmoid(3 * torch.randn(B, H, NC, L))
    if padded_chunks:
        igate[:, :, -padded_chunks:] = float("-inf")
        logf[:, :, -padded_chunks:] = 0.0
    start = MLSTMState(torch.randn(B, H, d, d), torch.randn(B, H, d), 40 * torch.randn(B, H))
    rows = M._decay_rows(logf)[..., -1, :]  # [B, H, NC, L + 1]
    want, state = [], start
    for c in range(NC):
        state = M.mlstm_chunk_update(state, rows[:, :, c], igate[:, :, c], k[:, :, c], v[:, :, c])
        want.append(state)
    got = M.mlstm_chunk_states(start, rows, igate, k, v)
    for i, what in enumerate("Cnm"):
        expected = torch.stack([w[i] for w in want], dim=2)
        _assert_close(got[i], expected, f"state {what}", atol=1e-5 * expected.abs().amax().item())
    # padding chunks leave gradients finite (no exp(-inf - -inf))
    k.requires_grad_()
    M.mlstm_chunk_states(start, rows, igate, k, v).C.sum().backward()
    assert torch.isfinite(k.grad).all()


def test_long_sequences_pick_a_larger_chunk_and_match_quadratic(monkeypatch):
    S = 3000  # ceil(S / 128) = 24 > the scorer's 16: the default path takes chunks of 24 steps
    s = _scorer(5, seed=3)
    key, value = _inputs(S, seed=3)
    seen = []
    real = M.mlstm_delayed_chunkwise
    monkeypatch.setattr(M, "mlstm_delayed_chunkwise", lambda *a: seen.append(a[6]) or real(*a))
    with torch.no_grad():
        got = s(key, value)
        ref = s(key, value, backend="quadratic")
    assert seen == [-(-S // M.AUTO_CHUNKS)]
    _assert_close(got, ref, "auto chunk")


def test_tokens_past_the_end_use_the_last_memory():
    S, delay = 30, 12
    s = _scorer(delay)
    key, value = _inputs(S)
    with torch.no_grad():
        scores = s(key, value)
        state = s.init_state(B)
        for u in range(S):
            state = s.step(state, key[:, :, u], value[:, :, u])
        last = torch.stack([s.readout(state, key[:, :, t], value[:, :, t]) for t in range(S)], dim=-1)
        _assert_close(scores[..., S - delay :], last[..., S - delay :], "tail tokens")
        # a delay longer than the sequence reads every token with the last memory
        s.delay = 1000
        _assert_close(s(key, value), last, "delay > S")


def _true_state(state: MLSTMState, m_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # compare memories in one stabiliser's frame: C e^(m - m_ref)
    scale = torch.exp(state.m - m_ref)
    return state.C * scale[..., None, None], state.n * scale[..., None]


@pytest.mark.parametrize("delay", [0, 5, 16])
def test_scan_from_mid_sequence_matches_forward(delay):
    S, p0, C = 150, 61, 53
    s = _scorer(delay, seed=delay)
    key, value = _inputs(S, seed=delay)
    with torch.no_grad():
        full = s(key, value)
        state = s.init_state(B)
        for u in range(p0):
            state = s.step(state, key[:, :, u], value[:, :, u])
        # the tokens read out during this chunk: t + delay in [p0, p0 + C)
        tokens = torch.arange(max(0, p0 - delay), p0 + C - delay)
        steps = (tokens + delay - p0).expand(B, H, -1)
        rk, rv = key[:, :, tokens], value[:, :, tokens]
        new, scores = s.scan(state, key[:, :, p0 : p0 + C], value[:, :, p0 : p0 + C], rk, rv, steps)
        _assert_close(scores, full[..., tokens], f"scan vs forward, delay={delay}")
        for u in range(p0, p0 + C):
            state = s.step(state, key[:, :, u], value[:, :, u])
        for a, b, what in zip(_true_state(new, state.m), state[:2], ("C", "n")):
            _assert_close(a, b, f"final state {what}", atol=1e-5 * b.abs().amax().item())


def test_scan_any_readout_steps_and_padding():
    C, R, p0 = 45, 20, 17
    s = _scorer(delay=0, seed=3, chunk_size=8)
    key, value = _inputs(p0 + C, seed=3)
    g = torch.Generator().manual_seed(7)
    steps = torch.randint(0, C, (B, H, R), generator=g)  # unsorted, repeated, different per (b, h)
    steps[..., 0] = C - 1
    rk, rv = 2 * torch.randn(B, H, R, D, generator=g), 2 * torch.randn(B, H, R, D, generator=g)
    valid = torch.rand(B, C, generator=g) > 0.3
    valid[0, :10] = False  # left padding
    with torch.no_grad():
        state = s.init_state(B)
        for u in range(p0):
            state = s.step(state, key[:, :, u], value[:, :, u])
        new, scores = s.scan(state, key[:, :, p0:], value[:, :, p0:], rk, rv, steps, valid=valid)
        expected = torch.full((B, H, R), float("nan"))
        for j in range(C):
            state = s.step(state, key[:, :, p0 + j], value[:, :, p0 + j], valid=valid[:, j])
            every = torch.stack([s.readout(state, rk[:, :, r], rv[:, :, r]) for r in range(R)], dim=-1)
            expected = torch.where(steps == j, every, expected)
        _assert_close(scores, expected, "scan readouts at any steps")
        for a, b, what in zip(_true_state(new, state.m), state[:2], ("C", "n")):
            _assert_close(a, b, f"final state {what}", atol=1e-5 * b.abs().amax().item())


@pytest.mark.parametrize("C", [1, 20, 45])
def test_scan_one_readout_per_step_matches_explicit_steps(C):
    # readout_step=None (what the cache's prefill uses): token r read out after step r, chunkwise
    p0 = 17
    s = _scorer(delay=0, seed=C, chunk_size=8)
    key, value = _inputs(p0 + C, seed=C)
    g = torch.Generator().manual_seed(C)
    rk, rv = 2 * torch.randn(B, H, C, D, generator=g), 2 * torch.randn(B, H, C, D, generator=g)
    valid = torch.rand(B, C, generator=g) > 0.3
    valid[0, : C // 3] = False
    with torch.no_grad():
        state = s.init_state(B)
        for u in range(p0):
            state = s.step(state, key[:, :, u], value[:, :, u])
        new, scores = s.scan(state, key[:, :, p0:], value[:, :, p0:], rk, rv, None, valid=valid)
        steps = torch.arange(C).expand(B, H, C)
        ref_new, ref = s.scan(state, key[:, :, p0:], value[:, :, p0:], rk, rv, steps, valid=valid)
    _assert_close(scores, ref, f"one readout per step, C={C}")
    for a, b, what in zip(_true_state(new, ref_new.m), ref_new[:2], ("C", "n")):
        _assert_close(a, b, f"final state {what}", atol=1e-5 * b.abs().amax().item())
    with pytest.raises(ValueError, match="one readout per step"):
        s.scan(state, key[:, :, p0:], value[:, :, p0:], torch.cat([rk, rk], 2), torch.cat([rv, rv], 2), None)


@pytest.mark.parametrize("delay", [0, 4])
def test_forward_skips_left_padding(delay):
    S, P = 40, 9
    s = _scorer(delay, seed=delay)
    key, value = _inputs(S, seed=delay)
    g = torch.Generator().manual_seed(5)
    pad_k, pad_v = torch.randn(B, H, P, D, generator=g), torch.randn(B, H, P, D, generator=g)
    valid = torch.ones(B, P + S, dtype=torch.bool)
    valid[:, :P] = False
    with torch.no_grad():
        want = s(key, value)
        got = s(torch.cat([pad_k, key], 2), torch.cat([pad_v, value], 2), valid=valid)
    _assert_close(got[..., P:], want, f"left padding, delay={delay}")


def test_padding_step_leaves_memory_unchanged():
    s = _scorer(delay=0)
    key, value = _inputs(5)
    with torch.no_grad():
        state = s.init_state(B)
        for u in range(4):
            state = s.step(state, key[:, :, u], value[:, :, u])
        same = s.step(state, key[:, :, 4], value[:, :, 4], valid=torch.zeros(B, dtype=torch.bool))
    for a, b in zip(same, state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("delay", [0, 5, 16])
def test_float64_executions_agree_on_any_inputs(delay):
    # mixed-sign q.k (the readout's denominator cancels) and large gates: exact algebra, checked in float64
    S, d, p0 = 120, 8, 50
    g = torch.Generator().manual_seed(delay)
    q, k, v = (torch.randn(B, H, S, d, generator=g, dtype=torch.float64) for _ in range(3))
    igate = 20 * torch.randn(B, H, S, generator=g, dtype=torch.float64)
    logf = torch.nn.functional.logsigmoid(20 * torch.randn(B, H, S, generator=g, dtype=torch.float64) + 2)
    ref = M.mlstm_delayed_quadratic(q, k, v, igate, logf, delay)
    chunk, _ = M.mlstm_delayed_chunkwise(q, k, v, igate, logf, delay, chunk_size=7)
    state = M.empty_state(B, H, d, dtype=torch.float64)
    rec = torch.full_like(ref, float("nan"))
    for u in range(S):
        if u == p0:
            mid = state
        state = M.mlstm_step(state, k[:, :, u], v[:, :, u], igate[:, :, u], logf[:, :, u])
        t = torch.arange(max(0, u - delay), S) if u == S - 1 else torch.arange(u - delay, u - delay + 1)
        if u >= delay or u == S - 1:
            rec[:, :, t] = M.mlstm_readout(state, q[:, :, t])
    # the tokens read out after step p0, each at its own step
    read_at = (torch.arange(S) + delay).clamp(max=S - 1)
    tokens = torch.arange(S)[read_at >= p0]
    steps = (read_at[tokens] - p0).expand(B, H, -1)
    scan, _ = M.mlstm_scan(mid, k[:, :, p0:], v[:, :, p0:], igate[:, :, p0:], logf[:, :, p0:], q[:, :, tokens],
                           steps, chunk_size=16)
    for got, want, what in ((chunk, ref, "chunkwise"), (rec, ref, "recurrent"), (scan, ref[:, :, tokens], "scan")):
        _assert_close(got, want, f"float64 {what}, delay={delay}", rtol=FLOAT64_TOL, atol=FLOAT64_TOL)


def test_gradients_reach_every_parameter_not_the_inputs():
    s = _scorer(delay=5, gate=1.0)
    key, value = _inputs(70)
    key.requires_grad_(True)
    value.requires_grad_(True)
    grads = {}
    for backend in ("chunkwise", "quadratic"):
        s.zero_grad()
        s(key, value, backend=backend, chunk_size=16).square().mean().backward()
        grads[backend] = {n: p.grad.clone() for n, p in s.named_parameters()}
    assert key.grad is None and value.grad is None
    for name, g in grads["chunkwise"].items():
        assert torch.isfinite(g).all() and g.abs().amax() > 0, f"no gradient for {name}"
        ref = grads["quadratic"][name]
        err = (g - ref).abs().amax() / ref.abs().amax()
        assert err <= GRAD_RTOL, f"{name}: chunkwise vs quadratic grad, relative max err {err:.3e}"


def test_linear_head_and_defaults():
    s = MLSTMScorer(2, 8, hidden=0, delay=3)
    assert s.w1 is None and s.w2.shape == (2, 8)
    key, value = _inputs(9)
    with torch.no_grad():
        out = s(key[:2, :2, :, :8], value[:2, :2, :, :8])
    assert out.shape == (2, 2, 9) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="delay"):
        MLSTMScorer(2, 8, delay=-1)


def test_state_accounting():
    s = MLSTMScorer(1, 64)
    assert s.state_floats() == 64 * 64 + 64 + 1
    assert s.state_entries() == math.ceil((64 * 64 + 64) / 128) == 33
    state = s.init_state(2)
    assert isinstance(state, M.MLSTMState)
    assert state.C.shape == (2, 1, 64, 64) and state.n.shape == (2, 1, 64) and state.m.shape == (2, 1)
    assert all(t.dtype == torch.float32 for t in state)


@pytest.mark.parametrize("delay", [0, 5])
def test_scores_are_float32_under_autocast(delay):
    # every execution: whole sequence, one step + readout, and scan
    s = _scorer(delay, seed=1, gate=1.0)
    key, value = _inputs(128, seed=1)
    with torch.no_grad():
        want = s(key, value)
        state = s.step(s.init_state(B), key[:, :, 0], value[:, :, 0])
        want_step = s.readout(state, key[:, :, 0], value[:, :, 0])
        _, want_scan = s.scan(s.init_state(B), key, value, key, value, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = s(key, value)
            state = s.step(s.init_state(B), key[:, :, 0], value[:, :, 0])
            got_step = s.readout(state, key[:, :, 0], value[:, :, 0])
            _, got_scan = s.scan(s.init_state(B), key, value, key, value, None)
    for g, w, what in ((got, want, "forward"), (got_step, want_step, "step"), (got_scan, want_scan, "scan")):
        assert g.dtype == torch.float32 and torch.equal(g, w), f"{what}: autocast changed the scores"
    assert all(got[b, h].unique().numel() == 128 for b in range(B) for h in range(H)), "tied scores"
