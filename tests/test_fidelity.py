"""Long-generation fidelity (`kvpop.eval.fidelity`): the metrics on hand-made cases, scoring, the store, the CLI.

Generation itself (fast path against the reference loop) is tested in test_generation.py.
"""

import json
import math

import pytest
import torch

import kvpop
from kvpop.cli import main
from kvpop.eval.evaluate import training_free
from kvpop.eval.fidelity import (
    Generation,
    dense_scores,
    onpolicy_agreement,
    repeated_ngrams,
    run_fidelity,
    summarise,
)
from kvpop.models import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random-llama")


# --- the metrics, by hand --------------------------------------------------------------------------


def test_onpolicy_agreement_counts_the_steps_past_the_budget():
    # prompt of 3 tokens, budget 5: token i is predicted at position 2 + i, so steps 3, 4, 5 count
    tokens = [7, 8, 9, 10, 11, 12]
    argmax = [7, 0, 0, 10, 0, 12]
    assert onpolicy_agreement(tokens, argmax, prompt_len=3, budget=5) == (2, 3)
    # a budget the prompt already passed counts every step; one never reached counts none
    assert onpolicy_agreement(tokens, argmax, prompt_len=3, budget=0) == (3, 6)
    assert onpolicy_agreement(tokens, argmax, prompt_len=3, budget=2) == (3, 6)
    assert onpolicy_agreement(tokens, argmax, prompt_len=3, budget=9) == (0, 0)
    with pytest.raises(ValueError, match="6 tokens and 5"):
        onpolicy_agreement(tokens, argmax[:5], 3, 5)


def test_repeated_ngrams_by_hand():
    # 4-grams: 1234 2341 3412 4123 1234 2341 -> the last two occurred earlier
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 6)
    assert repeated_ngrams([5, 5, 5, 5, 5, 5]) == (2, 3)
    assert repeated_ngrams([1, 2, 3]) == (0, 0)
    assert repeated_ngrams([1, 2, 1, 2], n=2) == (1, 3)


def _gen(tokens, logp, argmax, prompt_len, correct=False, seconds=1.0):
    return Generation("p", 4, 0, "greedy", None, prompt_len, tokens, "", seconds, logp, argmax, correct)


def test_summarise_pools_tokens_and_reports_the_spread():
    # generation a: prompt 2, budget 4 -> steps i >= 3 count; b: prompt 5 -> every step counts
    a = _gen([1, 2, 3, 1, 2, 3], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], [1, 2, 3, 0, 2, 3], 2, correct=True)
    b = _gen([4, 4, 4, 4, 4], [-1.0] * 5, [4, 0, 0, 0, 0], 5, seconds=3.0)
    row = summarise([a, b], "p", 4, "greedy")
    assert row.generations == 2 and row.tokens == 5.5
    assert row.nll == pytest.approx((2.1 + 5.0) / 11)
    # past the budget: a's steps 3, 4, 5 and all of b's
    assert row.nll_past_budget == pytest.approx((0.4 + 0.5 + 0.6 + 5.0) / 8)
    assert row.counted_steps == 8
    assert row.agreement == pytest.approx((2 + 1) / 8)
    # the spread of the per-generation means: a 2/3, b 1/5
    per = [2 / 3, 1 / 5]
    assert row.agreement_se == pytest.approx(abs(per[0] - per[1]) / 2)
    assert row.nll_se == pytest.approx(abs(2.1 / 6 - 1.0) / 2)
    # 4-grams: a 123 1 -> (1231, 2312, 3123): none repeated; b: (4444) x 2, one repeated
    assert row.repetition == pytest.approx(1 / 5)
    assert row.pass_at_1 == 0.5 and row.seconds_per_generation == 2.0
    single = summarise([b], "p", 4, "greedy")
    assert math.isnan(single.nll_se) and single.agreement == pytest.approx(0.2)


# --- scoring on a tiny model ------------------------------------------------------------------


@torch.no_grad()
def test_dense_scores_are_the_full_forward(tiny):
    model, _ = tiny
    prompt, tokens = [5, 6, 7, 8], [9, 10, 11]
    logp, top = dense_scores(model, prompt, tokens)
    full = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    want = torch.stack([full[3 + i, t] for i, t in enumerate(tokens)])
    assert torch.allclose(logp, want, atol=1e-5)
    assert top.tolist() == full[3:6].argmax(-1).tolist()
    retro = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(16, policy="streaming_llm"))
    try:
        with pytest.raises(ValueError, match="base model"):
            dense_scores(retro, prompt, tokens)
    finally:
        kvpop.detach(retro)


def test_run_fidelity_rows(tiny):
    model, tok = tiny
    problems = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "What is 2 + 3?", "answer": "5"}]
    entries = [training_free(p, 24) for p in ("streaming_llm", "tova")]
    rows, gens = run_fidelity(model, tok, entries, problems, 20, samples=1, ignore_eos=True, batch=2)
    assert [(r.policy, r.mode) for r in rows] == [(p, m) for m in ("greedy", "sampled")
                                                  for p in ("dense", "streaming_llm", "tova")]
    assert len(gens) == 3 * 2 * 2 and all(len(g.tokens) == 20 for g in gens)
    dense_greedy = rows[0]
    # the dense model's own greedy text is its argmax at every step
    assert dense_greedy.agreement == 1.0 and dense_greedy.counted_steps > 0
    for r in rows:
        assert r.nll > 0 and 0 <= r.agreement <= 1 and 0 <= r.repetition <= 1
        assert r.pass_at_1 == 0.0  # a random model answers nothing
    assert rows[2].variant == "paper" and rows[2].sink == 0
    with pytest.raises(ValueError, match="cannot generate"):
        run_fidelity(model, tok, [training_free("oracle", 24)], problems, 4)


def test_eval_generate_writes_fidelity(tmp_path, capsys):
    out = tmp_path / "fid"
    args = ["eval", "--model", "tiny-random-qwen3", "--generate", "6", "--problems", "1", "--samples", "1",
            "--budgets", "32", "--policies", "streaming_llm,h2o_windowed,oracle", "--out", str(out)]
    assert main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {(r["policy"], r["mode"]) for r in last["rows"]} == {
        (p, m) for p in ("dense", "streaming_llm", "h2o_windowed") for m in ("greedy", "sampled")}
    saved = json.loads((out / "fidelity.json").read_text())
    assert len(saved["generations"]) == 6 and "--generate 6" in saved["command"]
    assert (out / "fidelity.png").stat().st_size > 5000 and "NLL" in (out / "fidelity.txt").read_text()
    assert saved["args"]["gen_batch"] == 1  # the CPU's default
    assert main(["eval", "--model", "tiny-random-qwen3", "--generate", "4", "--data", "x.txt", "--out", str(out), "--force"]) == 1
    assert "--data champ" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny-random-qwen3", "--generate", "4", "--gen-batch", "0", "--out", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert "--gen-batch 0" in err and "Traceback" not in err
    # more problems than champ's held-out split holds: refused with the count, not silently fewer rows
    assert main(["eval", "--model", "tiny-random-qwen3", "--generate", "4", "--problems", "1000", "--out", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert "--problems 1000" in err and "held-out split has" in err and "Traceback" not in err


def test_a_store_keeps_generations_for_a_rerun(tiny, tmp_path, monkeypatch):
    from kvpop.eval import fidelity

    model, tok = tiny
    problems = [{"problem": "What is 1 + 1?", "answer": "2"}]
    entries = [training_free("h2o", 24)]
    store = tmp_path / "gens.jsonl"
    rows, _ = run_fidelity(model, tok, entries, problems, 8, store=store, tag="m", ignore_eos=True)
    assert len(store.read_text().splitlines()) == 2  # dense and h2o, greedy
    calls = []
    real = fidelity.generate_batch
    monkeypatch.setattr(fidelity, "generate_batch", lambda m, prompts, *a, **k: calls.extend(prompts)
                        or real(m, prompts, *a, **k))
    again, _ = run_fidelity(model, tok, entries, problems, 8, store=store, tag="m", ignore_eos=True)
    assert calls == [] and [r.as_dict() | {"seconds_per_generation": 0} for r in again] == [
        r.as_dict() | {"seconds_per_generation": 0} for r in rows]
    # new work only: a sample per problem, another policy; another model tag shares nothing
    run_fidelity(model, tok, [*entries, training_free("tova", 24)], problems, 8, samples=1, store=store, tag="m",
                 ignore_eos=True)
    assert len(calls) == 2 + 2  # dense and h2o sampled; tova greedy and sampled
    run_fidelity(model, tok, entries, problems, 8, store=store, tag="other", ignore_eos=True)
    assert len(calls) == 4 + 2


def test_a_store_reuses_greedy_texts_but_not_texts_of_another_sampler(tiny, tmp_path, monkeypatch):
    """Sampled keys name the sampler: a store written by the earlier CPU-generator sampling (keys without it)
    gives back its greedy texts, which argmax decoding reproduces, and none of its sampled ones."""
    from kvpop.eval import fidelity
    from kvpop.sampling import SAMPLER

    model, tok = tiny
    problems = [{"problem": "What is 1 + 1?", "answer": "2"}]
    entries = [training_free("tova", 24)]
    store = tmp_path / "gens.jsonl"
    run_fidelity(model, tok, entries, problems, 8, samples=1, store=store, tag="m", ignore_eos=True)
    records = [json.loads(line) for line in store.read_text().splitlines()]
    assert {r["mode"] for r in records} == {"greedy", "sampled"}
    for r in records:
        assert (json.loads(r["key"])[-1] == SAMPLER) == (r["mode"] == "sampled")
    # the store as the earlier sampler wrote it: the same keys without the sampler's name
    old = [{**r, "key": json.dumps(json.loads(r["key"])[:-1])} if r["mode"] == "sampled" else r for r in records]
    store.write_text("".join(json.dumps(r) + "\n" for r in old))
    calls = []
    real = fidelity.generate_batch
    monkeypatch.setattr(fidelity, "generate_batch", lambda m, prompts, *a, **k: calls.append(k["temperature"])
                        or real(m, prompts, *a, **k))
    run_fidelity(model, tok, entries, problems, 8, samples=1, store=store, tag="m", ignore_eos=True)
    assert calls == [0.7, 0.7]  # dense and tova sampled again; both greedy texts reused


def test_bench_score_generations_scores_a_store_as_eval_does(tmp_path, capsys):
    # bench/score_generations.py: a store made on one machine, scored on another, gives eval's own rows
    import importlib.util
    import sys
    from pathlib import Path

    out = tmp_path / "fid"
    assert main(["eval", "--model", "tiny-random-qwen3", "--generate", "40", "--problems", "2", "--samples", "0",
                 "--budgets", "16", "--policies", "streaming_llm,tova", "--ignore-eos", "--out", str(out)]) == 0
    want = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    path = Path(__file__).resolve().parents[1] / "bench" / "score_generations.py"
    spec = importlib.util.spec_from_file_location("score_generations", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    assert script.main([str(out / "generations.jsonl"), "--budget", "16", "--model", "tiny-random-qwen3",
                        "--problems", "2", "--out", str(tmp_path / "scored")]) == 0
    got = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert set(got) == set(want) == {"dense", "streaming_llm", "tova"}
    for name, row in want.items():
        assert got[name]["nll"] == pytest.approx(row["nll"], rel=1e-6)
        assert got[name]["agreement"] == pytest.approx(row["agreement"], rel=1e-9)
    assert (tmp_path / "scored" / "fidelity.png").exists()


def test_champ_prompt_of_a_base_model_without_a_chat_template(tiny):
    from kvpop.eval.fidelity import BOXED_HINT, champ_prompt

    _, tok = tiny
    chat = champ_prompt(tok, "What is 2 + 2?")
    assert "<|im_start|>user" in tok.decode(chat)
    saved, tok.chat_template = tok.chat_template, None
    try:
        plain = tok.decode(champ_prompt(tok, "What is 2 + 2?"))
    finally:
        tok.chat_template = saved
    assert plain.endswith(f"Problem: What is 2 + 2?{BOXED_HINT}\n\nSolution:")
