"""Tests of the evaluation metrics (`kvpop.eval.metrics`, `DESIGN.md` "Metrics").

Run: `python -m pytest tests/test_metrics.py -q`.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from helpers import quiet, retrofitted, tiny_model
from kvpop.attention import Capture
from kvpop.eval.metrics import (
    RetentionRecall,
    TeacherForcedStats,
    counted_positions,
    extract_answer,
    is_correct,
    model_recall,
    oracle_priorities,
    pass_at_1,
    policy_priorities,
    recall_sums,
    retention_recall,
    teacher_forced_metrics,
)
from kvpop.policy import retention_mask
from kvpop.retrofit import kvpop_modules

REL = 1e-9  # float64 sums of the same float32 terms in another order
ORACLE_ATOL = 1e-4  # oracle priorities vs. a float64 dense recomputation (float32 model)


def _log(p: list[list[float]]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log().float()


# --- teacher-forced metrics ----------------------------------------------------------------------

# the hand-made case: V = 3, S = 4, start = 1, ids = [0, 1, 2, 0]; positions 1 and 2 count
#   pos 1 -> target 2: dense [.25 .25 .5] (right, nll log 2), model [.5 .25 .25] (wrong, nll log 4)
#   pos 2 -> target 0: dense [.5 .25 .25] (right, nll log 2), model [.5 .25 .25] (right, nll log 2)
#   KL(pos 1) = .25 log(.25/.5) + .5 log(.5/.25) = .25 log 2; KL(pos 2) = 0
# positions 0 and 3 hold logits that would change every number if they were counted
HAND_IDS = torch.tensor([[0, 1, 2, 0]])
HAND_DENSE = _log([[0.1, 0.1, 0.8], [0.25, 0.25, 0.5], [0.5, 0.25, 0.25], [0.8, 0.1, 0.1]])[None]
HAND_MODEL = _log([[0.8, 0.1, 0.1], [0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])[None]


def test_hand_made_logits():
    r = teacher_forced_metrics(HAND_DENSE, HAND_MODEL, HAND_IDS, start=1)
    assert r.positions == 2
    assert r.accuracy_dense == 1.0 and r.accuracy == 0.5 and r.rel_accuracy == 0.5
    assert r.ppl_dense == pytest.approx(2.0, rel=1e-6)
    assert r.ppl == pytest.approx(2**1.5, rel=1e-6)
    assert r.ppl_ratio == pytest.approx(2**0.5, rel=1e-6)
    assert r.top1_agreement == 0.5
    assert r.kl == pytest.approx(0.125 * math.log(2), rel=1e-6)


def test_identical_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 17, 13)
    ids = torch.randint(0, 13, (2, 17))
    r = teacher_forced_metrics(logits, logits.clone(), ids, start=3)
    assert r.positions == 2 * (17 - 1 - 3)
    assert r.rel_accuracy == 1.0 and r.ppl_ratio == 1.0 and r.top1_agreement == 1.0
    assert r.kl == 0.0
    assert r.ppl == r.ppl_dense


def test_counted_positions():
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert counted_positions(ids, 2)[0].tolist() == [False, False, True, True, False]
    # left padding: positions count from the first real token
    valid = torch.tensor([[True] * 5, [False, True, True, True, True]])
    assert counted_positions(ids, 2, valid)[1].tolist() == [False, False, False, True, False]
    assert not counted_positions(ids, 4).any()


def test_accumulates_sums_not_means():
    torch.manual_seed(1)
    dense, model = torch.randn(5, 23, 11), torch.randn(5, 23, 11)
    ids = torch.randint(0, 11, (5, 23))
    one = teacher_forced_metrics(dense, model, ids, start=6)
    stats = TeacherForcedStats(chunk=4)
    # batches of unequal size and length: a mean of batch means would differ
    stats.update(dense[:1], model[:1], ids[:1], start=6)
    stats.update(dense[1:, :20], model[1:, :20], ids[1:, :20], start=6)
    stats.update(dense[1:, 19:], model[1:, 19:], ids[1:, 19:], start=0)
    split = stats.result()
    assert split.positions == one.positions
    for name, value in one.as_dict().items():
        assert split.as_dict()[name] == pytest.approx(value, rel=REL), name


def test_padding_is_not_counted():
    torch.manual_seed(2)
    lengths, S, V = (20, 15), 20, 7
    dense, model = torch.randn(2, S, V), torch.randn(2, S, V)
    ids = torch.randint(0, V, (2, S))
    valid = torch.arange(S)[None, :] >= torch.tensor([S - n for n in lengths])[:, None]
    padded = teacher_forced_metrics(dense, model, ids, start=4, valid=valid)
    stats = TeacherForcedStats()
    for i, n in enumerate(lengths):
        stats.update(dense[i : i + 1, S - n :], model[i : i + 1, S - n :], ids[i : i + 1, S - n :], start=4)
    for name, value in stats.result().as_dict().items():
        assert padded.as_dict()[name] == pytest.approx(value, rel=REL), name


def test_nothing_counted_raises():
    stats = TeacherForcedStats()
    stats.update(HAND_DENSE, HAND_MODEL, HAND_IDS, start=3)
    with pytest.raises(ValueError, match="no position"):
        stats.result()


# --- retention recall ----------------------------------------------------------------------------


def recall_brute_force(teacher, model, sink, window, topk):
    """float64 [B, H]: mean over q >= s + w + k of |both retain| / k, from the dense masks."""
    S = teacher.shape[-1]
    q, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
    eligible = (t >= sink) & (t <= q - window)
    kept_t = retention_mask(teacher, sink, window, topk) & eligible
    kept_m = retention_mask(model, sink, window, topk) & eligible
    first = sink + window + topk
    # from `first` on, each rule keeps exactly k long-range tokens, so recall is |both| / k
    assert (kept_t.sum(-1)[..., first:] == topk).all() and (kept_m.sum(-1)[..., first:] == topk).all()
    return (kept_t & kept_m).sum(-1)[..., first:].double().mean(-1) / topk


def test_recall_identical_is_one():
    torch.manual_seed(3)
    pi = torch.randn(2, 3, 70)
    assert (retention_recall(pi, pi.clone(), 4, 8, 16) == 1.0).all()


# S = 6, sink 1, window 1, topk 2: queries q = 4, 5
#   teacher [0 5 4 3 2 1] keeps {1, 2} at q = 4 (E = {1,2,3}) and at q = 5 (E = {1..4})
#   model   [0 5 1 4 3 2] keeps {1, 3} at both: recall 1/2, 1/2 -> 0.5
#   newest  [0 1 2 3 4 5] keeps {2, 3} then {3, 4}: recall 1/2, 0 -> 0.25
@pytest.mark.parametrize(
    "model, expected", [([0.0, 5, 1, 4, 3, 2], 0.5), ([0.0, 1, 2, 3, 4, 5], 0.25), ([0.0, 5, 4, 3, 2, 1], 1.0)]
)
def test_recall_hand_made(model, expected):
    teacher = torch.tensor([0.0, 5, 4, 3, 2, 1])[None, None]
    sums, n = recall_sums(teacher, torch.tensor(model)[None, None], sink=1, window=1, topk=2)
    assert n == 2
    assert sums.item() / n == expected


@pytest.mark.parametrize("S, sink, window, topk", [(63, 4, 8, 16), (100, 0, 1, 1), (64, 2, 5, 7), (37, 3, 3, 20)])
@pytest.mark.parametrize("kind", ["random", "ties", "constant"])
def test_recall_matches_brute_force(S, sink, window, topk, kind):
    g = torch.Generator().manual_seed(S + topk)
    shape = (2, 3, S)
    if kind == "random":
        teacher, model = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    elif kind == "ties":
        teacher = torch.randint(0, 4, shape, generator=g).float()
        model = torch.randint(0, 3, shape, generator=g).float()
    else:
        teacher, model = torch.zeros(shape), torch.randn(shape, generator=g)
    sums, n = recall_sums(teacher, model, sink, window, topk)
    expected = recall_brute_force(teacher, model, sink, window, topk)
    err = (sums / n - expected).abs()
    assert err.max() <= 1e-12, f"max err {err.max():.3e}, mean err {err.mean():.3e}"


def test_recall_accumulator_and_short_sequences():
    g = torch.Generator().manual_seed(4)
    teacher = [torch.randn(5, 2, 50, generator=g) for _ in range(3)]
    model = [torch.randn(5, 2, 50, generator=g) for _ in range(3)]
    rule = dict(sink=2, window=5, topk=7)
    one = RetentionRecall(**rule)
    one.update(teacher, model)
    split = RetentionRecall(**rule)
    split.update([x[:2] for x in teacher], [x[:2] for x in model])
    split.update([x[2:] for x in teacher], [x[2:] for x in model])
    a, b = one.result(), split.result()
    assert a.queries == b.queries == 5 * (50 - 14)
    assert torch.allclose(a.per_head, b.per_head, rtol=REL, atol=0) and a.per_head.shape == (3, 2)
    for layer in range(3):
        assert torch.allclose(a.per_head[layer], retention_recall(teacher[layer], model[layer], **rule), rtol=REL)
    assert torch.allclose(a.per_layer, a.per_head.mean(-1))
    assert a.mean == pytest.approx(a.per_head.mean().item())
    # a sequence shorter than the budget has no query to count
    with pytest.raises(ValueError, match="no query"):
        retention_recall(teacher[0][..., :14], model[0][..., :14], **rule)
    with pytest.raises(ValueError, match="topk"):
        RetentionRecall(sink=2, window=5, topk=0)


# --- the oracle on a tiny retrofitted model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    with quiet():
        model = retrofitted("qwen3")
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    return model, ids


def oracle_brute_force(model, ids) -> list[torch.Tensor]:
    """The oracle of `docs/method.md` Sec. 4-5 from an explicit float64 dense softmax of each layer."""
    cfg = kvpop_modules(model).config
    records = Capture()
    with torch.no_grad(), quiet():
        model(input_ids=ids, kvpop_dense=True, kvpop_capture=records, use_cache=False)
    out = []
    for rec in records:
        q, k = rec.query.double(), rec.key.double()
        G = q.shape[1] // k.shape[1]
        S = q.shape[2]
        logits = rec.scale * q @ k.repeat_interleave(G, dim=1).transpose(-1, -2)  # [B, Hq, d, t]
        d, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
        p = logits.masked_fill(t > d, float("-inf")).softmax(-1)
        future = p.masked_fill(d < t + cfg.window, 0.0).sum(-2)  # [B, Hq, t]
        m = future / (S - cfg.window - torch.arange(S)).clamp(min=1)
        r = torch.log(cfg.target_eps + m).unflatten(1, (k.shape[1], G)).amax(2)
        steps = torch.div(torch.arange(S), cfg.decay_step, rounding_mode="floor")
        out.append((r - steps * rec.log_gamma.double()[:, None]).float())
    return out


def test_oracle_priorities(tiny):
    model, ids = tiny
    with quiet():
        oracle = oracle_priorities(model, ids)
        policy = policy_priorities(model, ids)
    cfg = kvpop_modules(model).config
    assert len(oracle) == len(policy) == model.config.num_hidden_layers
    for layer, (pi, ref) in enumerate(zip(oracle, oracle_brute_force(model, ids))):
        assert pi.shape == (1, 2, 40) and pi.dtype == torch.float32 and torch.isfinite(pi).all()
        err = (pi - ref).abs()
        assert err.max() <= ORACLE_ATOL, f"layer {layer}: max err {err.max():.3e}, mean err {err.mean():.3e}"
    rule = dict(sink=cfg.sink, window=cfg.window, topk=cfg.topk)
    recall = RetentionRecall(**rule)
    recall.update(oracle, oracle)
    assert recall.result().mean == 1.0
    recall = RetentionRecall(**rule)
    recall.update(oracle, policy)
    r = recall.result()
    assert ((r.per_head >= 0) & (r.per_head <= 1)).all() and r.per_layer.shape == (len(oracle),)


def test_model_recall_is_the_recall_of_kvpop_eval(tmp_path):
    # the recall curve's measurement (no logits) is the `recall` column of kvpop eval on the same sequences
    import copy

    import kvpop
    from kvpop.eval.evaluate import Evaluator, from_directory

    base = tiny_model("qwen3")
    saved = kvpop.save(kvpop.retrofit(copy.deepcopy(base), kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16)),
                       tmp_path / "trained")
    ids = torch.randint(3, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    # recall is of the static rule's ranking (a KVpop-mlp runs as the recommended cascade by default)
    evaluator = Evaluator(base, [from_directory(str(saved), rule="static")])
    with quiet():
        for row in ids:
            evaluator.add(row[None])
        got = model_recall(kvpop.load(saved, rule="static"), (row[None] for row in ids))
    (want,) = evaluator.rows(40)
    assert got.mean == pytest.approx(want["recall"], rel=REL) and 0 < got.mean < 1
    assert got.per_layer.tolist() == pytest.approx(want["recall_per_layer"], rel=REL)


# --- pass@1 with math-verify ---------------------------------------------------------------------

CHAMP_STYLE = "C(10, 5), or equivalently 252"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so the count is \\boxed{252}.", "252", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("Answer: 0.5", "1/2", True),
        ("The final answer is $\\dfrac{1}{2}$.", "1/2", True),
        ("\\boxed{253}", "252", False),
        ("\\boxed{0.51}", "1/2", False),
        ("\\boxed{252}", CHAMP_STYLE, True),
        ("\\boxed{\\binom{10}{5}}", CHAMP_STYLE, True),
        ("\\boxed{250}", CHAMP_STYLE, False),
        ("first \\boxed{1}, then correcting myself: \\boxed{252}", "252", True),
        ("first \\boxed{1}, then correcting myself: \\boxed{252}", "1", False),
        ("\\boxed{\\text{No}}", "No", True),
        ("Answer: no.", "No", True),
        ("\\boxed{Yes}", "No", False),
        ("Answer: 98", "98 values", True),
        ("Answer: 3", "3 is the only possible value", True),
        ("\\boxed{x^4+x^2+1}", "(x^2+x+1)(x^2-x+1)", True),
        ("\\boxed{2^{n-1}}", "2^(n-1)", True),
        ("\\boxed{81, 16}", "x=16 and x=81", True),
        ("\\boxed{16}", "x=16 and x=81", False),
        ("I could not solve it, though 252 came up.", "252", False),
        ("", "252", False),
    ],
)
def test_is_correct(completion, answer, expected):
    pytest.importorskip("math_verify")
    assert is_correct(completion, answer) is expected


def test_extract_answer():
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} and \\boxed{\\sqrt{2}}") == "\\sqrt{2}"
    assert extract_answer("1. step\n\nAnswer: 2^(n-1)\n") == "2^(n-1)"
    assert extract_answer("no final answer here") is None
    assert extract_answer("unclosed \\boxed{12") is None


def test_pass_at_1():
    pytest.importorskip("math_verify")
    samples = [["\\boxed{252}", "\\boxed{251}"], ["Answer: 1/2", "Answer: 0.5", "nothing", "\\boxed{2}"]]
    assert pass_at_1(samples, ["252", "\\frac{1}{2}"]) == pytest.approx((1 / 2 + 2 / 4) / 2)
    with pytest.raises(ValueError, match="no samples"):
        pass_at_1([[]], ["1"])


def test_is_correct_off_the_main_thread():
    # math-verify's timeouts use signal.alarm, which only the main thread may set
    pytest.importorskip("math_verify")
    result = []
    worker = threading.Thread(target=lambda: result.append(is_correct("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert result == [True]
