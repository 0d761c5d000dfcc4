"""DMS: hand-made gates with a known retained set, the Gumbel-sigmoid relaxation, the soft mask against
the hard rule, the compression loss by hand, the cache sizes it really uses, and a short training run
that reaches its compression target (`kvpop train --policy dms`, then `kvpop eval --trained`)."""

import json
import math
import random

import pytest
import torch

import kvpop
from helpers import assert_close, cache_kwargs, quiet, retrofitted
from kvpop.attention import Capture, LayerRecord
from kvpop.baselines import make_policy
from kvpop.baselines.dms import (
    EPS,
    cache_fraction,
    cache_sizes,
    compression_loss,
    gumbel_sigmoid,
    relaxed_attention,
    soft_eviction_bias,
    target_retention,
)
from kvpop.cache import KVpopLayerCache
from kvpop.cli import main
from kvpop.ops.topk import eviction_positions, mask_from_eviction

SOFT_ATOL = 1e-4  # soft mask with alpha in {0, 1} vs. the hard rule: an evicted key keeps a weight of EPS
NEG = float("-inf")


def _gates_from_key(policy, scale=10.0):
    """Hand-made gates: evict (a_t > 0) where key[..., 0] < 0, keep where it is > 0."""
    policy.gate_logits = lambda key, value: -scale * key[..., 0].float()
    return policy


def _held(layer, b=0, h=0):
    return sorted(p for p in layer.pos[b, h].tolist() if p >= 0)


def _feed(layer, policy, k, chunks):
    """Feed keys `k` [1, 1, S, D] through a layer cache in chunks (lengths)."""
    start = 0
    for n in chunks:
        sl = slice(start, start + n)
        q = torch.randn(1, 1, n, k.shape[-1])
        layer.attend(q, k[:, :, sl], k[:, :, sl], torch.ones(1, n, dtype=torch.bool), policy, 1.0)
        start += n


@pytest.mark.parametrize("topk", [20, 3])
@pytest.mark.parametrize("chunks", [[1] * 30, [11, 19], [30]], ids=["decode", "chunked", "prefill"])
def test_alternating_gates_keep_the_known_set(topk, chunks):
    # odd positions want to stay, even ones to go; sinks 0, 1 and the window 27..29 are always held
    sink, window, S = 2, 3, 30
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, policy="dms", scorer_hidden=4)
    policy = _gates_from_key(make_policy(cfg, num_kv_heads=1, head_dim=2))
    sign = torch.tensor([1.0 if t % 2 else -1.0 for t in range(S)])
    k = torch.stack([sign, torch.randn(S)], -1)[None, None]  # [1, 1, S, 2]
    layer = KVpopLayerCache(sink, window, topk)
    _feed(layer, policy, k, chunks)
    kept = [t for t in range(sink, S - window) if t % 2]
    # topk = 20 holds every kept token; topk = 3 overflows and evicts the oldest kept ones
    want = sorted([0, 1, *kept[-topk:], 27, 28, 29])
    assert _held(layer) == want
    # the dense reference of the rule says the same at the last query
    pri = policy.priority(k, k, torch.arange(S)[None])
    assert pri[0, 0].tolist() == [0.0 if t % 2 else NEG for t in range(S)]
    mask = kvpop.retention_mask(pri, sink, window, topk)
    assert mask[0, 0, -1].nonzero().flatten().tolist() == want
    # freed slots are reused: nothing is held that wanted to go, and the buffer never grows
    assert layer.keys.shape[2] == sink + window + topk


def test_evicted_tokens_leave_the_window_on_time_and_sinks_stay():
    # every token wants to go: only the sinks and the window are ever held, whatever topk
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=5, policy="dms", scorer_hidden=4)
    policy = _gates_from_key(make_policy(cfg, 1, 2))
    S = 17
    k = torch.stack([-torch.ones(S), torch.randn(S)], -1)[None, None]
    for n in range(7, S + 1):
        layer = KVpopLayerCache(2, 4, 5)
        _feed(layer, policy, k[:, :, :n], [1] * n)
        assert _held(layer) == [0, 1, *range(n - 4, n)]


def test_gumbel_sigmoid_shapes_and_temperature_limits():
    torch.manual_seed(0)
    x = torch.tensor([-3.0, -0.4, 0.0, 0.7, 2.5])
    for shape in [(5,), (2, 3, 5)]:
        assert gumbel_sigmoid(x.expand(shape), 0.5).shape == shape
    # no noise: sigmoid(x / tau); tau -> 0 gives the inference decision [x > 0], tau -> inf gives 1/2
    assert torch.allclose(gumbel_sigmoid(x, 0.5, noise=False), torch.sigmoid(x / 0.5))
    assert gumbel_sigmoid(x, 1e-4, noise=False).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert torch.allclose(gumbel_sigmoid(x, 1e4), torch.full((5,), 0.5), atol=1e-3)
    # with noise and tau -> 0 the samples are binary, and 1 with probability sigmoid(x)
    samples = gumbel_sigmoid(x.expand(200_000, 5), 1e-4)
    assert ((samples < 1e-6) | (samples > 1 - 1e-6)).float().mean() > 0.999
    assert torch.allclose(samples.mean(0), torch.sigmoid(x), atol=5e-3)
    # always inside [0, 1], differentiable
    logits = torch.randn(1000, requires_grad=True)
    alpha = gumbel_sigmoid(logits, 0.1)
    alpha.sum().backward()
    assert ((alpha >= 0) & (alpha <= 1)).all() and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("sink,window", [(0, 1), (2, 3), (4, 7)])
def test_soft_bias_with_binary_alpha_is_the_hard_mask(sink, window):
    torch.manual_seed(sink)
    B, H, S = 2, 3, 41
    alpha = (torch.rand(B, H, S) < 0.5).float()
    pos = torch.arange(S).expand(B, S)
    valid = torch.ones(B, S, dtype=torch.bool)
    bias = soft_eviction_bias(torch.log(1 - alpha + EPS), pos, valid, pos, valid, sink, window)
    # the hard rule with room for every kept token (topk >= S): alpha = 1 goes as it leaves the window
    pri = torch.where(alpha > 0, NEG, 0.0)
    evict = eviction_positions(pri, pos[:, None], valid[:, None], sink, window, topk=S)
    hard = mask_from_eviction(pos, valid, pos[:, None], valid[:, None], evict, sink, window)
    assert torch.equal(bias > math.log(EPS) / 2, hard)
    # kept keys are (nearly: log(1 + eps)) untouched, evicted ones get log(eps), the future -inf
    assert torch.equal(bias.abs() <= EPS, hard)
    past = pos[:, None, None, :] <= pos[:, None, :, None]
    assert torch.allclose(bias[~hard & past], torch.tensor(math.log(EPS)))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_relaxed_forward_with_binary_gates_equals_the_hard_forward(arch):
    # room for every kept token (topk >= S), so the hard rule drops exactly the alpha = 1 tokens
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=60, policy="dms", scorer_hidden=16)
    model = retrofitted(arch, cfg)
    for policy in model.kvpop.layers:
        mlp = policy.gate_logits
        # |a_t| far above the logistic noise: the relaxed alpha is exactly 0 or 1
        policy.gate_logits = lambda key, value, mlp=mlp: 1e4 * torch.sign(mlp(key, value))
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with quiet():
        with torch.no_grad():
            records = Capture()
            hard = model(ids, kvpop_capture=records).logits
            dropped = [(r.priority == NEG).float().mean().item() for r in records]
        model.train()
        soft = model(ids).logits
        model.eval()
    assert all(0.2 < d < 0.8 for d in dropped), dropped
    assert_close(soft, hard, SOFT_ATOL, f"{arch}: relaxed vs hard")
    soft.sum().backward()  # the soft path is differentiable through the model


def test_relaxed_attention_in_blocks_equals_one_block_forward_and_backward():
    # the checkpointed query blocks give the same outputs and gradients as one block, odd lengths included
    torch.manual_seed(0)
    B, Hkv, G, S, D = 2, 2, 2, 63, 8
    q, k, v = torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    logits = torch.randn(B, Hkv, S)
    pos = torch.arange(S).expand(B, S)
    valid = torch.ones(B, S, dtype=torch.bool)
    results = []
    for chunk in (S, 10):
        x = [t.clone().requires_grad_() for t in (q, k, v, logits)]
        out, lse = relaxed_attention(x[0], x[1], x[2], pos, valid, torch.sigmoid(x[3]), 2, 5, D**-0.5,
                                     return_lse=True, chunk=chunk)
        (out.square().sum() + lse.sum()).backward()
        results.append([out, lse, *(t.grad for t in x)])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dgate"), *results):
        assert_close(b, a, 1e-5, name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("frozen", [False, True])
def test_relaxed_attention_through_sdpa_equals_the_explicit_form(dtype, tol, device, frozen):
    # the CUDA path (the soft bias as SDPA's mask, GQA written out) against the explicit float32 form:
    # outputs and the gradients of q, k, v and the gates, with left padding and a ragged last block;
    # on CUDA, SDPA picks its memory-efficient kernel for a float mask (the one training uses).
    # `frozen`: only the gates need a gradient (`kvpop train --policy dms --freeze-base`), which torch 2.11's
    # kernel can refuse on CUDA ("LSE is not correctly aligned (strideH)")
    torch.manual_seed(1)
    B, Hkv, G, S, D = 2, 2, 3, 45, 8
    q, k, v = (torch.randn(B, Hkv * G, S, D, device=device), torch.randn(B, Hkv, S, D, device=device),
               torch.randn(B, Hkv, S, D, device=device))
    gate = 2 * torch.randn(B, Hkv, S, device=device)
    valid = torch.ones(B, S, dtype=torch.bool, device=device)
    valid[1, :7] = False  # row 1 left-padded by 7
    pos = (torch.cumsum(valid.long(), -1) - 1).clamp(min=0)
    results = []
    for backend in ("explicit", "sdpa"):
        x = [t.clone().to(dtype).requires_grad_(not frozen) for t in (q, k, v)] + [gate.clone().requires_grad_()]
        out, lse = relaxed_attention(x[0], x[1], x[2], pos, valid, torch.sigmoid(x[3]), 2, 5, D**-0.5,
                                     chunk=16, backend=backend)
        assert lse is None and out.dtype == dtype
        (out.float().square() * valid[:, None, :, None]).sum().backward()
        assert all(t.grad is None for t in x[:3]) == frozen
        results.append([out.float(), *(t.grad.float() for t in x if t.grad is not None)])
    names = ("out", "dgate") if frozen else ("out", "dq", "dk", "dv", "dgate")
    for name, a, b in zip(names, *results):
        assert torch.isfinite(b).all(), name
        assert_close(b, a, tol * max(1.0, a.abs().max().item()), f"{dtype} {name}")
    assert results[0][0][1, :, :7].abs().max() == 0 == results[1][0][1, :, :7].abs().max()  # padding queries


def test_relaxed_attention_backend_errors():
    x = torch.zeros(1, 2, 4, 8)
    pos, valid = torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="backend"):
        relaxed_attention(x, x, x, pos, valid, torch.zeros(1, 2, 4), 1, 1, 1.0, backend="flash")
    with pytest.raises(ValueError, match="no lse"):
        relaxed_attention(x, x, x, pos, valid, torch.zeros(1, 2, 4), 1, 1, 1.0, return_lse=True, backend="sdpa")


def _record(gate, sink, window):
    B, H, S = gate.shape
    pos = torch.arange(S).expand(B, S)
    return LayerRecord(0, None, None, None, torch.where(gate > 0, NEG, 0.0), pos, torch.ones(B, S, dtype=torch.bool),
                       1.0, torch.zeros(H), gate=gate)


def test_compression_loss_by_hand():
    # S = 8, sink 1, window 2: the tokens that leave the window are positions 1..5
    cfg = kvpop.KVpopConfig(sink=1, window=2, topk=2, policy="dms", dms_temperature=0.1, dms_loss_weight=2.0)
    assert target_retention(cfg, 8) == pytest.approx(2 / 5)  # topk / (S - sink - window)
    big = 50.0
    gate = torch.tensor([[[9.0, -big, -big, -big, -big, -big, 9.0, 9.0],  # head 0 keeps all of 1..5
                          [9.0, -big, big, -big, big, 0.0, 9.0, 9.0]]], requires_grad=True)  # keeps 1, 3 and half of 5
    loss, stats = compression_loss([_record(gate, 1, 2)], cfg, target=0.25)
    # R = (1.0, 2.5 / 5): loss = 2 * mean(|1 - 0.25|, |0.5 - 0.25|) = 1.0
    assert loss.item() == pytest.approx(1.0, abs=1e-6)
    assert stats["retention"].item() == pytest.approx(0.75, abs=1e-6)
    assert stats["retention_hard"].item() == pytest.approx((1.0 + 3 / 5) / 2)  # a_t <= 0 keeps token 5 too
    assert stats["target_retention"].item() == pytest.approx(0.25)
    loss.backward()
    # too much kept: the undecided gate is pushed towards "evict"; saturated gates and tokens that never
    # leave the window (0, 6, 7) get no gradient
    assert gate.grad[0, 1, 5] < 0
    assert gate.grad[0, :, [0, 6, 7]].abs().max() == 0
    # below the target the loss pulls the other way (two-sided)
    gate2 = torch.full((1, 1, 8), big, requires_grad=True)
    loss2, _ = compression_loss([_record(gate2, 1, 2)], cfg, target=0.25)
    assert loss2.item() == pytest.approx(2 * 0.25)


@pytest.mark.parametrize("sink,window,topk", [(2, 3, 4), (0, 1, 6), (4, 5, 0)])
def test_cache_sizes_count_what_the_rule_holds(sink, window, topk):
    torch.manual_seed(topk)
    B, H, S = 2, 3, 57
    pri = torch.randn(B, H, S)
    pri[torch.rand(B, H, S) < 0.4] = NEG
    evict = kvpop.eviction_times(pri, sink, window, topk)
    sizes = cache_sizes(evict, sink, window)
    want = kvpop.retention_mask(pri, sink, window, topk).sum(-1)
    assert torch.equal(sizes, want)
    budget = sink + window + topk
    assert sizes.max() <= budget
    total, count = cache_fraction(evict, sink, window, budget)
    assert count == B * H * (S - budget)
    assert total / count == pytest.approx(want[..., budget:].float().mean().item() / budget)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    path = tmp_path_factory.mktemp("dmsdata") / "notes.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(300)) for _ in range(40)))
    return path


TARGET_TOL = 0.05  # |retention - target| over the last steps of a 30-step run


def test_training_reaches_the_compression_target_and_eval_reports_the_cache_used(text_file, tmp_path, capsys):
    out = tmp_path / "dms"
    # budget 26 = sink 2 + window 8 + topk 16 at S = 128: target 16 / 118
    assert main(["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--policy", "dms",
                 "--budget", "26", "--sink", "2", "--window", "8", "--scorer-hidden", "32", "--seq-len", "128",
                 "--steps", "30", "--batch-size", "2", "--lr-scorer", "1e-2", "--max-tokens", str(128 * 16),
                 "--save-every", "0", "--out", str(out), "--no-progress"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    target = 16 / 118
    assert log[0]["target_retention"] == pytest.approx(target)
    saved = json.loads((out / "final" / "kvpop_config.json").read_text())
    assert saved["policy"] == "dms" and saved["dms_target_retention"] == pytest.approx(target)
    soft = sum(r["retention"] for r in log[-5:]) / 5
    hard = sum(r["retention_hard"] for r in log[-5:]) / 5
    with capsys.disabled():
        print(f"\nDMS: target retention {target:.3f}, reached {soft:.3f} (relaxed), {hard:.3f} (hard) over the "
              f"last 5 of 30 steps, from {log[0]['retention']:.3f} / {log[0]['retention_hard']:.3f}")
    assert abs(soft - target) < TARGET_TOL and abs(hard - target) < TARGET_TOL, (soft, hard)
    assert all(math.isfinite(r["loss_kl"]) for r in log)

    # evaluation: the average cache size DMS really used, in the rows and the printed table
    capsys.readouterr()
    assert main(["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all",
                 "--seq-len", "128", "--sequences", "2", "--policies", "none", "--trained", str(out / "final"),
                 "--out", str(tmp_path / "eval")]) == 0
    table = capsys.readouterr().out
    row = json.loads((tmp_path / "eval" / "results.json").read_text())["rows"][0]
    assert row["policy"] == "dms" and "cache" in table.splitlines()[0]
    fraction = row["avg_cache_fraction"]
    # sinks and window are always held (10 of 26); the buffer is never exceeded
    assert 10 / 26 <= fraction <= 1.0
    assert f"{fraction:.3f}" in table
    with capsys.disabled():
        print(f"\nDMS: avg_cache_fraction {fraction:.3f} of budget 26 (kvpop eval)\n{table}")

    # decoding with the bounded cache never holds more than the budget
    model = kvpop.load(out / "final")
    cache = kvpop.KVpopCache(model)
    with torch.no_grad(), quiet():
        model.generate(torch.randint(3, 250, (1, 40)), max_new_tokens=60, do_sample=False,
                       **cache_kwargs(cache))
    assert max(int(u.max()) for u in cache.slots_used()) <= 26


def test_relaxed_attention_soft_caps_the_logits_before_the_soft_mask():
    # Gemma 2: the gates' soft eviction bias is added to the capped logits, as the model's own mask is
    torch.manual_seed(2)
    B, Hkv, G, S, D, cap = 1, 1, 4, 30, 8, 1.0
    q, k, v = 3 * torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    alpha = torch.rand(B, Hkv, S)
    pos, valid = torch.arange(S)[None], torch.ones(B, S, dtype=torch.bool)
    out, lse = relaxed_attention(q, k, v, pos, valid, alpha, 2, 5, D**-0.5, return_lse=True, chunk=7, softcap=cap)
    logits = torch.tanh(q @ k.repeat_interleave(G, 1).transpose(-1, -2) * D**-0.5 / cap) * cap
    logits = logits + soft_eviction_bias(torch.log(1 - alpha + EPS), pos, valid, pos, valid, 2, 5)
    assert_close(out, torch.softmax(logits, -1) @ v.repeat_interleave(G, 1), 1e-5, "soft-capped relaxed attention")
    assert_close(lse, torch.logsumexp(logits, -1), 1e-5, "its lse")
    with pytest.raises(ValueError, match="backend='sdpa' takes no logit soft-capping"):
        relaxed_attention(q, k, v, pos, valid, alpha, 2, 5, D**-0.5, backend="sdpa", softcap=cap)
