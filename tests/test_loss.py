"""Tests of the boundary loss (`kvpop.train.loss`, `docs/method.md` Sec. 5).

Run: `python -m pytest tests/test_loss.py -q`.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from kvpop.policy import retention_mask, static_priority
from kvpop.train.loss import (
    BoundaryPairs,
    balance_weights,
    boundary_labels,
    boundary_loss,
    pair_weights,
    teacher_priority,
)

ATOL = 1e-6
RTOL = 1e-5

# the hand-made case: S = 10, sink 1, window 2, topk 2, so pairs exist for q >= 5.
#   q=5: t_new=3 (3) vs E(4)={1,2}       top-2 {1:5, 2:1}          t_bnd=2 (1): keep, Delta 2
#   q=6: t_new=4 (3) vs E(5)={1,2,3}     top-2 {1:5, 3:3}          t_bnd=3 (3): tie -> newer keeps, Delta 0
#   q=7: t_new=5 (0) vs E(6)={1..4}      top-2 {1:5, 4:3 (beats 3)} t_bnd=4 (3): drop, Delta 3
#   q=8: t_new=6 (7) vs E(7)={1..5}      top-2 {1:5, 4:3}          t_bnd=4 (3): keep, Delta 4
#   q=9: t_new=7 (2) vs E(8)={1..6}      top-2 {6:7, 1:5}          t_bnd=1 (5): drop, Delta 3
HAND_PI = [9.0, 5.0, 1.0, 3.0, 3.0, 0.0, 7.0, 2.0, 8.0, 4.0]
HAND_RULE = dict(sink=1, window=2, topk=2)
HAND_T_NEW = [0, 0, 0, 0, 0, 3, 4, 5, 6, 7]
HAND_T_BND = [0, 0, 0, 0, 0, 2, 3, 4, 4, 1]
HAND_Y = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, -1.0, 1.0, -1.0]
HAND_MARGIN = [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 3.0, 4.0, 3.0]
HAND_VALID = [False] * 5 + [True] * 5


def _hand_pairs() -> BoundaryPairs:
    return boundary_labels(torch.tensor(HAND_PI).view(1, 1, 10), **HAND_RULE)


def _brute_force(pi: torch.Tensor, sink: int, window: int, topk: int):
    """t_bnd by sorting E(q - 1) per query, y read off the dense reference mask."""
    B, H, S = pi.shape
    mask = retention_mask(pi, sink, window, topk)
    t_bnd = torch.full((B, H, S), -1, dtype=torch.long)
    y = torch.zeros(B, H, S)
    for b in range(B):
        for h in range(H):
            for q in range(sink + window + topk, S):
                if topk == 0:
                    continue
                older = sorted(range(sink, q - window), key=lambda t: (pi[b, h, t].item(), t), reverse=True)
                t_bnd[b, h, q] = older[topk - 1]
                y[b, h, q] = 1.0 if mask[b, h, q, q - window] else -1.0
    return t_bnd, y


def test_hand_case_exact():
    pairs = _hand_pairs()
    assert torch.equal(pairs.t_new, torch.tensor(HAND_T_NEW).view(1, 1, 10))
    assert torch.equal(pairs.t_bnd, torch.tensor(HAND_T_BND).view(1, 1, 10))
    assert torch.equal(pairs.y, torch.tensor(HAND_Y).view(1, 1, 10))
    assert torch.equal(pairs.margin, torch.tensor(HAND_MARGIN).view(1, 1, 10))
    assert torch.equal(pairs.valid, torch.tensor(HAND_VALID).view(1, 1, 10))
    assert pairs.y.dtype == torch.float32 and pairs.t_new.dtype == torch.long


def test_heads_and_batch_are_independent():
    hand = torch.tensor(HAND_PI)
    other = torch.randn(10, generator=torch.Generator().manual_seed(3))
    pi = torch.stack([torch.stack([hand, other]), torch.stack([other, hand])])  # [2, 2, 10]
    pairs = boundary_labels(pi, **HAND_RULE)
    alone = _hand_pairs()
    for b, h in ((0, 0), (1, 1)):
        for field in BoundaryPairs._fields:
            assert torch.equal(getattr(pairs, field)[b, h], getattr(alone, field)[0, 0]), field


def test_all_ties_keep_the_newer_token():
    S, sink, window, topk = 12, 2, 3, 3
    pairs = boundary_labels(torch.zeros(2, 2, S), sink, window, topk)
    q = torch.arange(S)
    live = q >= sink + window + topk
    # with all priorities equal the top-k of E(q-1) is its k newest tokens; the weakest is the oldest
    assert torch.equal(pairs.valid, live.expand(2, 2, S))
    assert torch.equal(pairs.t_bnd[..., live], (q - window - topk)[live].expand(2, 2, -1))
    assert torch.equal(pairs.y[..., live], torch.ones(2, 2, int(live.sum())))
    assert torch.equal(pairs.margin, torch.zeros(2, 2, S))
    # zero margins weigh nothing
    loss, _ = boundary_loss(torch.randn(2, 2, S), pairs)
    assert loss.item() == 0.0


RANDOM_RULES = [
    # (S, sink, window, topk)
    (10, 1, 2, 2),
    (17, 0, 1, 3),
    (23, 3, 1, 1),
    (30, 0, 4, 5),
    (31, 2, 5, 0),
    (12, 4, 3, 7),
    (9, 2, 2, 6),  # s + w + k > S: no pairs
    (40, 1, 1, 12),
    (1, 0, 1, 1),
]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("rule", RANDOM_RULES)
def test_matches_dense_reference(rule, ties):
    S, sink, window, topk = rule
    g = torch.Generator().manual_seed(hash(rule) % 2**31 + ties)
    for _ in range(3):
        if ties:
            pi = torch.randint(0, 3, (2, 3, S), generator=g).float()
        else:
            pi = torch.randn(2, 3, S, generator=g)
        pairs = boundary_labels(pi, sink, window, topk)
        t_bnd_ref, y_ref = _brute_force(pi, sink, window, topk)
        valid_ref = t_bnd_ref >= 0
        assert torch.equal(pairs.valid, valid_ref)
        assert torch.equal(torch.where(valid_ref, pairs.t_bnd, -1), t_bnd_ref)
        assert torch.equal(pairs.y, y_ref)
        q = torch.arange(S)
        assert torch.equal(pairs.t_new, torch.where(valid_ref, q - window, 0))
        gap = pi.gather(-1, pairs.t_new) - pi.gather(-1, pairs.t_bnd)
        assert torch.equal(pairs.margin, torch.where(valid_ref, y_ref * gap, 0.0))
        assert (pairs.margin >= 0).all()
        if topk == 0:
            assert not pairs.valid.any()


COMPILED_RULES = [
    # (S, sink, window, top-ks): the top-ks of one (S, sink, window) share a graph (a tensor in it); among them
    # 0 and those with S <= sink + window + topk (no pairs)
    (63, 2, 5, (0, 1, 4, 30, 55, 56, 80)),
    (500, 0, 1, (1, 17, 498, 499, 600)),
    (6, 4, 2, (1, 3)),
    (3, 4, 1, (0, 2)),  # S <= sink: nothing ranked, nothing compiled
]


def _assert_same_pairs(got: BoundaryPairs, want: BoundaryPairs, what: str) -> None:
    for field in BoundaryPairs._fields:
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {field} {a.dtype} {tuple(a.shape)}"
        # floats bit for bit (-0.0 is not 0.0 here)
        if a.is_floating_point():
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), f"{what}: {field} differs at {int((a != b).sum())} of {a.numel()}"


@pytest.mark.parametrize("backend, rule", [
    *[("aot_eager", rule) for rule in COMPILED_RULES],
    # a C++ compile per graph, tens of seconds on two cores
    pytest.param("inductor", COMPILED_RULES[0], marks=pytest.mark.slow),
])
def test_compiled_labels_are_the_eager_bits(backend, rule):
    from torch._dynamo.utils import counters

    S, sink, window, topks = rule
    # drawn queries come in expanded (all taken) or dense: a graph each; one for inductor
    fractions = (1.0, 0.5) if backend == "aot_eager" else (1.0,)
    g = torch.Generator().manual_seed(S)
    torch._dynamo.reset()
    counters.clear()
    for topk in topks:
        for ties in (True, False):
            pi = torch.randint(0, 3, (2, 3, S), generator=g).float() if ties else torch.randn(2, 3, S, generator=g)
            for fraction in fractions:
                got, want = (boundary_labels(pi, sink, window, topk, fraction, torch.Generator().manual_seed(topk),
                                             backend=b) for b in (backend, "eager"))
                _assert_same_pairs(got, want, f"{backend} S={S} sink={sink} window={window} topk={topk} "
                                              f"ties={ties} fraction={fraction}")
    # whatever the top-k: the graphs of the drawn queries' layouts, none where nothing is ranked
    assert counters["stats"]["unique_graphs"] == (0 if S <= sink else len(fractions))
    torch._dynamo.reset()


def test_a_failed_compile_warns_once_then_runs_eagerly(monkeypatch):
    from kvpop.train import loss as L

    calls = []

    def broken(backend):
        def fail(*args):
            calls.append(backend)
            raise RuntimeError("no C++ compiler")

        return fail

    # the CPU taken for a device that compiles under "auto", with a compile that fails
    monkeypatch.setattr(L, "COMPILE_ON", ("cpu",))
    monkeypatch.setattr(L, "_compiled_pair_fields", broken)
    monkeypatch.setattr(L, "_compile_failed", False)
    pi = torch.randint(0, 3, (2, 3, 40), generator=torch.Generator().manual_seed(0)).float()
    want = boundary_labels(pi, 2, 3, 5, backend="eager")
    with pytest.warns(UserWarning, match="compiled boundary labels failed"):
        _assert_same_pairs(boundary_labels(pi, 2, 3, 5), want, "the failed call")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same_pairs(boundary_labels(pi, 2, 3, 5), want, "the call after")
    assert calls == ["inductor"]
    # a backend asked for by name raises
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        boundary_labels(pi, 2, 3, 5, backend="inductor")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_labels_on_cuda_are_the_cpu_bits():
    # SmolLM2-135M's training shape at budget 1024 (3 KV heads, S 8192, sink 4, window 256, topk 764); a
    # per-layer budget's other top-k reuses the graph
    from kvpop.train import loss as L

    g = torch.Generator().manual_seed(0)
    for pi in (torch.randint(0, 40, (1, 3, 8192), generator=g).float(), torch.randn(2, 3, 8192, generator=g)):
        for topk in (764, 500):
            for fraction in (1.0, 0.5):
                want, got = (boundary_labels(x, 4, 256, topk, fraction, torch.Generator().manual_seed(topk))
                             for x in (pi, pi.cuda()))
                _assert_same_pairs(BoundaryPairs(*(t.cpu() for t in got)), want, f"topk={topk} fraction={fraction}")
    assert not L._compile_failed


def test_loss_matches_hand_formula():
    # three pairs, chosen with a query mask: q=5 (3 vs 2, keep, Delta 2), q=7 (5 vs 4, drop, Delta 3),
    # q=9 (7 vs 1, drop, Delta 3); rho = 1/3, so keeps weigh 1/(2/3) = 1.5 and drops 1/(4/3) = 0.75
    query_mask = torch.zeros(1, 10, dtype=torch.bool)
    query_mask[0, [5, 7, 9]] = True
    pairs = boundary_labels(torch.tensor(HAND_PI).view(1, 1, 10), **HAND_RULE, query_mask=query_mask)
    assert pairs.valid.sum().item() == 3
    pi_hat = torch.tensor([0.0, 0.3, 0.9, -0.2, 0.4, 1.0, -0.5, 0.1, 2.0, 3.0]).view(1, 1, 10)
    tau, delta = 0.5, 2.0

    def softplus(x):
        return math.log1p(math.exp(x))

    p = pi_hat[0, 0].tolist()
    terms = [
        math.tanh(2 / delta) * 1.5 * softplus(-(p[3] - p[2]) / tau),
        math.tanh(3 / delta) * 0.75 * softplus((p[5] - p[4]) / tau),
        math.tanh(3 / delta) * 0.75 * softplus((p[7] - p[1]) / tau),
    ]
    loss, stats = boundary_loss(pi_hat, pairs, tau=tau, margin_delta=delta)
    assert loss.dim() == 0
    assert math.isclose(loss.item(), sum(terms) / 3, rel_tol=RTOL), (loss.item(), sum(terms) / 3)

    # without weights: a plain mean of softplus
    plain = [softplus(-(p[3] - p[2]) / tau), softplus((p[5] - p[4]) / tau), softplus((p[7] - p[1]) / tau)]
    loss, _ = boundary_loss(pi_hat, pairs, tau=tau, margin_delta=0.0, balance=False)
    assert math.isclose(loss.item(), sum(plain) / 3, rel_tol=RTOL)

    # the student drops at q=5 (p3 -0.2 < p2 0.9: wrong), keeps at q=7 (p5 1.0 > p4 0.4: wrong),
    # drops at q=9 (p7 0.1 < p1 0.3: right)
    assert stats["pairs"].item() == 3
    assert math.isclose(stats["keep_rate"].item(), 1 / 3, rel_tol=RTOL)
    assert math.isclose(stats["accuracy"].item(), 1 / 3, rel_tol=RTOL)
    assert stats["keep_accuracy"].item() == 0.0
    assert stats["drop_accuracy"].item() == 0.5
    assert math.isclose(stats["margin"].item(), 8 / 3, rel_tol=RTOL)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_student_tie_counts_as_keep():
    pairs = _hand_pairs()
    _, stats = boundary_loss(torch.zeros(1, 1, 10), pairs)
    # all differences are 0: the student keeps everything, right on the 3 keeps, wrong on the 2 drops
    assert stats["keep_accuracy"].item() == 1.0
    assert stats["drop_accuracy"].item() == 0.0
    assert math.isclose(stats["accuracy"].item(), 3 / 5, rel_tol=RTOL)


def test_gradient_only_reaches_paired_tokens():
    pairs = _hand_pairs()
    pi_hat = torch.randn(1, 1, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss, _ = boundary_loss(pi_hat, pairs, margin_delta=0.0)
    loss.backward()
    grad = pi_hat.grad[0, 0]
    in_pairs = [1, 2, 3, 4, 5, 6, 7]
    assert (grad[[0, 8, 9]] == 0).all(), grad
    assert (grad[in_pairs] != 0).all(), grad
    # the weights and labels carry no graph back to the teacher
    pi_tgt = torch.tensor(HAND_PI).view(1, 1, 10).requires_grad_()
    teacher_pairs = boundary_labels(pi_tgt, **HAND_RULE)
    assert not teacher_pairs.margin.requires_grad and not teacher_pairs.y.requires_grad


def test_gradient_matches_softplus_derivative():
    pairs = _hand_pairs()
    pi_hat = torch.randn(1, 1, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pi_hat.requires_grad_()
    tau = 0.7
    loss, _ = boundary_loss(pi_hat, pairs, tau=tau, margin_delta=1.0, balance=True)
    loss.backward()
    # autograd through the float32 loss against a float64 hand form
    w = pair_weights(pairs, 1.0, True).double()
    d = pi_hat.detach().gather(-1, pairs.t_new) - pi_hat.detach().gather(-1, pairs.t_bnd)
    coef = -w * pairs.y.double() * torch.sigmoid(-pairs.y.double() * d / tau) / tau / pairs.valid.sum()
    ref = torch.zeros(1, 1, 10, dtype=torch.float64)
    ref.scatter_add_(-1, pairs.t_new, coef).scatter_add_(-1, pairs.t_bnd, -coef)
    err = (pi_hat.grad - ref).abs()
    assert torch.allclose(pi_hat.grad, ref, atol=ATOL), f"max err {err.max():.3g} mean {err.mean():.3g}"


def _pairs_from_labels(y: torch.Tensor) -> BoundaryPairs:
    """Pairs with the given labels (+1, -1, 0 = invalid) and unit margins."""
    valid = y != 0
    zeros = torch.zeros_like(y, dtype=torch.long)
    return BoundaryPairs(t_new=zeros, t_bnd=zeros, y=y.float(), margin=valid.float(), valid=valid)


def test_balance_weights_extremes():
    y = torch.tensor(
        [
            # b = 0: head 0 all drops, head 1 all keeps, head 2 one keep, head 3 nothing valid
            [[-1, -1, 0, -1], [1, 1, 1, 0], [1, -1, 0, 0], [0, 0, 0, 0]],
            [[-1, 0, 0, 0], [1, 1, 0, 0], [-1, -1, 0, 0], [0, 0, 0, 0]],
        ]
    )
    pairs = _pairs_from_labels(y)
    w = balance_weights(pairs, clip=(0.2, 5.0))
    assert torch.isfinite(w).all()
    keep, drop = y > 0, y < 0
    # rho = 0: drops weigh 1/2; rho = 1: keeps weigh 1/2
    assert torch.allclose(w[:, 0][drop[:, 0]], torch.tensor(0.5))
    assert torch.allclose(w[:, 1][keep[:, 1]], torch.tensor(0.5))
    # rho = 1/4, pooled over the batch: keeps 1/(2/4) = 2, drops 1/(2 * 3/4) = 2/3
    assert torch.allclose(w[:, 2][keep[:, 2]], torch.tensor(2.0))
    assert torch.allclose(w[:, 2][drop[:, 2]], torch.tensor(2 / 3))
    assert torch.equal(w[~pairs.valid], torch.zeros(int((~pairs.valid).sum())))
    # a tight clip: rho = 0 and 1 give c_min to the present class; rho = 1/4 clips the keep to c_max
    w = balance_weights(pairs, clip=(1.0, 1.5))
    assert torch.allclose(w[:, 0][drop[:, 0]], torch.tensor(1.0))
    assert torch.allclose(w[:, 1][keep[:, 1]], torch.tensor(1.0))
    assert torch.allclose(w[:, 2][keep[:, 2]], torch.tensor(1.5))
    assert torch.allclose(w[:, 2][drop[:, 2]], torch.tensor(1.0))
    loss, _ = boundary_loss(torch.randn(2, 4, 4), pairs)
    assert torch.isfinite(loss)


def test_balance_rare_class_is_clipped_to_c_max():
    y = torch.full((1, 1, 100), -1)
    y[0, 0, 0] = 1  # rho = 0.01: keep 1/(0.02) = 50 -> c_max
    w = balance_weights(_pairs_from_labels(y), clip=(0.2, 5.0))
    assert w[0, 0, 0].item() == 5.0
    assert torch.allclose(w[0, 0, 1:], torch.tensor(1 / (2 * 0.99)))


def test_query_fraction_count_and_determinism():
    S, sink, window, topk = 50, 2, 3, 5
    n_eligible = S - (sink + window + topk)  # 40
    pi = torch.randn(3, 4, S, generator=torch.Generator().manual_seed(0))

    def draw(seed, fraction=0.25):
        return boundary_labels(pi, sink, window, topk, fraction, generator=torch.Generator().manual_seed(seed))

    a, b, c = draw(7), draw(7), draw(8)
    for field in BoundaryPairs._fields:
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert not torch.equal(a.valid, c.valid)
    # 10 queries per sequence, the same ones for every head, all eligible
    assert torch.equal(a.valid.sum(-1), torch.full((3, 4), round(0.25 * n_eligible)))
    assert torch.equal(a.valid, a.valid[:, :1].expand_as(a.valid))
    assert not a.valid[..., : sink + window + topk].any()
    # sampled slots agree with the full set
    full = boundary_labels(pi, sink, window, topk)
    for field in ("t_bnd", "y", "margin"):
        assert torch.equal(getattr(a, field)[a.valid], getattr(full, field)[a.valid]), field
    # sequences draw different subsets
    assert not torch.equal(a.valid[0, 0], a.valid[1, 0])
    # a tiny fraction still draws one query per sequence
    assert torch.equal(draw(0, 1e-3).valid.sum(-1), torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError):
        draw(0, 0.0)


def test_query_sampling_draws_on_the_generators_device(monkeypatch):
    # the trainer's sampler is a CPU generator (checkpointed with the run) while the priorities may live
    # on a GPU, where `torch.rand(device="cuda", generator=cpu_generator)` raises: the numbers are drawn on
    # the generator's device and moved. Here a `torch.rand` that raises like CUDA's, and tensors on "meta"
    from kvpop.train import loss as L

    real_rand = torch.rand
    devices = []

    def strict_rand(*shape, generator=None, device=None, **kw):
        device = torch.device(device or "cpu")
        devices.append(device)
        if generator is not None and generator.device.type != device.type:
            raise RuntimeError(f"Expected a '{device.type}' device type for generator but found '{generator.device.type}'")
        return real_rand(*shape, generator=generator, device=device, **kw)

    monkeypatch.setattr(torch, "rand", strict_rand)
    eligible = torch.ones(2, 40, dtype=torch.bool, device="meta")
    out = L._sample_queries(eligible, 0.5, torch.Generator().manual_seed(0))
    assert out.device.type == "meta" and out.shape == (2, 40)
    assert devices == [torch.device("cpu")]
    # on one device nothing changed: the same draws as before (a resumed run repeats its queries)
    cpu = L._sample_queries(torch.ones(2, 40, dtype=torch.bool), 0.5, torch.Generator().manual_seed(0))
    keys = real_rand(2, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cpu, keys.argsort(-1).argsort(-1) < 20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_query_fraction_on_cuda_with_the_trainers_cpu_generator():
    pi = torch.randn(2, 3, 60, generator=torch.Generator().manual_seed(0))
    want = boundary_labels(pi, 2, 3, 5, 0.3, generator=torch.Generator().manual_seed(1))
    got = boundary_labels(pi.cuda(), 2, 3, 5, 0.3, generator=torch.Generator().manual_seed(1))
    for field in BoundaryPairs._fields:
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field


def test_margin_weight_makes_near_ties_count_little():
    # S=4, sink 0, window 1, topk 1: q=2 pits 1 against 0 (Delta 1e-3), q=3 pits 2 against 1 (Delta ~5)
    pi_tgt = torch.tensor([0.0, 1e-3, 5.0, 0.0]).view(1, 1, 4)
    pairs = boundary_labels(pi_tgt, 0, 1, 1)
    assert torch.equal(pairs.t_bnd[0, 0, 2:], torch.tensor([0, 1]))
    assert torch.equal(pairs.y[0, 0, 2:], torch.tensor([1.0, 1.0]))
    w = pair_weights(pairs, margin_delta=1.0, balance=False)
    assert w[0, 0, 2].item() < 1.1e-3 and w[0, 0, 3].item() > 0.999
    # the student is wrong by 1 on one pair and far right (no loss) on the other
    wrong_on_tie = torch.tensor([1.0, 0.0, 30.0, 0.0]).view(1, 1, 4)  # q=2 wrong by 1, q=3 right by 30
    wrong_on_clear = torch.tensor([0.0, 30.0, 29.0, 0.0]).view(1, 1, 4)  # q=2 right by 30, q=3 wrong by 1
    loss_tie, _ = boundary_loss(wrong_on_tie, pairs, balance=False)
    loss_clear, _ = boundary_loss(wrong_on_clear, pairs, balance=False)
    assert loss_tie.item() < 0.01 * loss_clear.item()
    # delta = 0 disables the weight: both cost the same
    loss_tie, _ = boundary_loss(wrong_on_tie, pairs, margin_delta=0.0, balance=False)
    loss_clear, _ = boundary_loss(wrong_on_clear, pairs, margin_delta=0.0, balance=False)
    assert math.isclose(loss_tie.item(), loss_clear.item(), rel_tol=RTOL)


def test_no_pairs_gives_zero_loss_with_a_graph():
    pairs = boundary_labels(torch.randn(2, 3, 20), sink=4, window=4, topk=0)
    pi_hat = torch.randn(2, 3, 20, requires_grad=True)
    loss, stats = boundary_loss(pi_hat, pairs)
    assert loss.item() == 0.0 and stats["pairs"].item() == 0
    # rates over no pairs are undefined
    assert torch.isnan(stats["keep_rate"]) and torch.isnan(stats["accuracy"])
    loss.backward()
    assert torch.equal(pi_hat.grad, torch.zeros_like(pi_hat))


def test_teacher_priority_detaches_gamma_and_target():
    B, H, S, n = 2, 3, 300, 128
    r = torch.randn(B, H, S, requires_grad=True)
    log_gamma = torch.log(torch.tensor([0.9, 0.5, 0.99])).requires_grad_()
    pi = teacher_priority(r, log_gamma, n)
    assert not pi.requires_grad and pi.dtype == torch.float32
    expected = static_priority(r.detach(), torch.arange(S).expand(B, S), log_gamma.detach(), n)
    assert torch.equal(pi, expected)
    # block 2 of head 1 is lifted by 2 * -log(0.5)
    assert math.isclose((pi - r)[0, 1, 260].item(), -2 * math.log(0.5), rel_tol=RTOL)


def test_softplus_form_is_the_logistic_loss():
    # softplus(-y d / tau) == -log sigmoid(y d / tau): the student is pushed to the teacher's side
    d = torch.linspace(-5, 5, 11)
    assert torch.allclose(F.softplus(-d), -F.logsigmoid(d), atol=ATOL)
