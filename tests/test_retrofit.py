"""retrofit / save / load, supported architectures, gradients and clear errors for bad input."""

from pathlib import Path

import pytest
import torch

import kvpop
from helpers import LOGIT_ATOL, assert_close, cache_kwargs, quiet, retrofitted, tiny_model
from kvpop.attention import Capture


def _ids(n=40, seed=0):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
@torch.no_grad()
def test_supported_architectures_decode_like_teacher_forcing(arch):
    model = retrofitted(arch)
    ids = _ids()
    with quiet():
        full = model(ids).logits
        dense = model(ids, kvpop_dense=True).logits
        cache = kvpop.KVpopCache(model)
        first = model(ids[:, :17], **cache_kwargs(cache)).logits
        rest = [model(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(17, 40)]
    assert_close(torch.cat([first, *rest], 1), full, LOGIT_ATOL, arch)
    # eviction really acts beyond the budget, and not before it
    budget = model.kvpop.config.budget
    assert_close(full[:, :budget], dense[:, :budget], LOGIT_ATOL, "within budget")
    assert (full[:, budget:] - dense[:, budget:]).abs().max() > 1e-3


@torch.no_grad()
def test_dense_mode_is_the_original_model():
    base = tiny_model("llama")
    ids = _ids()
    want = base(ids).logits
    model = kvpop.retrofit(base, kvpop.KVpopConfig(sink=2, window=4, topk=4, scorer_hidden=8))
    with quiet():
        assert_close(model(ids, kvpop_dense=True).logits, want, 1e-5, "kvpop_dense")
        kvpop.detach(model)
        assert_close(model(ids).logits, want, 1e-5, "after detach")
    assert not hasattr(model, "kvpop")


def test_save_load_round_trip_is_bitwise(tmp_path):
    model = retrofitted("qwen3")
    ids = _ids()
    with torch.no_grad(), quiet():
        want = model(ids).logits
        kvpop.save(model, tmp_path / "m")
        # the saved config (a KVpop-mlp runs as the recommended cascade by default)
        loaded = kvpop.load(tmp_path / "m", rule="static")
        got = loaded(ids).logits
    assert torch.equal(got, want)
    assert loaded.kvpop.config == model.kvpop.config
    assert {"config.json", "model.safetensors", "kvpop_config.json", "kvpop_scorers.safetensors"} <= {
        p.name for p in (tmp_path / "m").iterdir()
    }


def test_save_load_round_trip_of_the_mlstm_scorer_is_bitwise(tmp_path):
    import json

    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=16, scorer="mlstm", mlstm_hidden=8, delay=3, match_mlp_memory=True)
    model = retrofitted("qwen3", cfg)
    # head dim 16: the state costs ceil((16 * 16 + 16) / 32) = 9 entries, so 16 - 9 top-k slots
    assert model.kvpop.config.topk == 7 and model.kvpop.config.extra["match_mlp_memory"]["mlp_topk"] == 16
    ids = _ids()
    with torch.no_grad(), quiet():
        want = model(ids).logits
        cache = kvpop.KVpopCache(model)
        want_cached = torch.cat([model(ids[:, :20], **cache_kwargs(cache)).logits,
                                 *(model(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(20, 40))], 1)
        kvpop.save(model, tmp_path / "m")
        loaded = kvpop.load(tmp_path / "m")
        got = loaded(ids).logits
        cache = kvpop.KVpopCache(loaded)
        got_cached = torch.cat([loaded(ids[:, :20], **cache_kwargs(cache)).logits,
                                *(loaded(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(20, 40))], 1)
    assert torch.equal(got, want)
    # decoding is not bitwise across a reload, for the MLP scorer as well (the base weights' layout): within tolerance
    assert_close(got_cached, want_cached, LOGIT_ATOL, "cached after load")
    assert_close(got_cached, got, LOGIT_ATOL, "cached vs teacher-forced after load")
    assert loaded.kvpop.config == model.kvpop.config and loaded.kvpop.config.topk == 7
    assert json.loads((tmp_path / "m" / "kvpop_config.json").read_text())["topk"] == 7
    for (name, p), (_, q) in zip(model.kvpop.state_dict().items(), loaded.kvpop.state_dict().items()):
        assert torch.equal(p, q), name


def test_load_rejects_a_plain_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvpop_config.json"):
        kvpop.load(tmp_path)


def test_gradients_reach_base_weights_but_not_the_scorer_through_attention():
    model = retrofitted("qwen3")
    model.train()
    with quiet():
        loss = model(_ids(), labels=_ids()).loss
    loss.backward()
    assert model.get_decoder().layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    for policy in model.kvpop.layers:
        assert all(p.grad is None for p in policy.parameters())


def test_capture_exposes_lse_and_differentiable_priorities():
    model = retrofitted("llama")
    records = Capture()
    with quiet():
        model(_ids(), kvpop_capture=records)
    assert [r.layer_idx for r in records] == [0, 1]
    rec = records[0]
    assert rec.lse.shape == (1, 4, 40) and rec.priority.shape == (1, 2, 40)
    assert rec.priority.requires_grad and torch.isfinite(rec.lse).all()
    rec.priority.sum().backward()
    assert model.kvpop.layers[0].scorer.w1.grad is not None and model.kvpop.layers[0].theta.grad is not None


def test_unsupported_model_type_is_named():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    # its real reason: the layers hold GPT-2's own attention, not a self_attn with grouped key/value heads
    with pytest.raises(ValueError, match=r"'gpt2' is not supported: its decoder layers have no `self_attn` module "
                                         r"with grouped key/value heads \(they hold GPT2Attention as .attn\)"):
        kvpop.retrofit(gpt2, kvpop.KVpopConfig(sink=1, window=2, topk=2))


def test_retrofit_twice_and_wrong_config():
    model = retrofitted("qwen3")
    with pytest.raises(ValueError, match="already retrofitted"):
        kvpop.retrofit(model, model.kvpop.config)
    with pytest.raises(TypeError, match="KVpopConfig"):
        kvpop.retrofit(tiny_model(), {"sink": 4})
    with pytest.raises(ValueError, match="not retrofitted"):
        kvpop.KVpopCache(tiny_model())


def test_empty_and_too_long_inputs():
    model = retrofitted("qwen3", max_positions=64)
    with quiet(), torch.no_grad():
        with pytest.raises(ValueError, match="empty input"):
            model(torch.zeros(1, 0, dtype=torch.long))
        with pytest.raises(ValueError, match="max_position_embeddings=64"):
            model(_ids(65))
        cache = kvpop.KVpopCache(model)
        model(_ids(60), **cache_kwargs(cache))
        with pytest.raises(ValueError, match="60 cached \\+ 5 new"):
            model(_ids(5), **cache_kwargs(cache))


def test_custom_4d_masks_are_refused():
    model = retrofitted("qwen3")
    mask4d = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    with quiet(), pytest.raises(ValueError, match="4D"):
        model(_ids(10), attention_mask=mask4d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_flex_path_on_cuda_equals_cpu_path():
    model = retrofitted("qwen3")
    ids = _ids(300)
    with quiet():
        cpu = model(ids).logits
        gpu = model.cuda()(ids.cuda()).logits.cpu()
        cache = kvpop.KVpopCache(model)
        first = model(ids[:, :100].cuda(), **cache_kwargs(cache)).logits
        rest = [model(ids[:, t : t + 1].cuda(), **cache_kwargs(cache)).logits for t in range(100, 300)]
        decoded = torch.cat([first, *rest], 1).cpu()
    assert_close(gpu, cpu, 2e-4, "flex vs cpu")
    assert_close(decoded, cpu, 2e-4, "cuda decode vs cpu")


def test_save_records_the_base_it_was_retrofitted_on(tmp_path):
    from kvpop.retrofit import base_identity, read_base, same_base

    base = tiny_model("qwen3")
    original = base_identity(base)
    model = kvpop.retrofit(base, kvpop.KVpopConfig(sink=2, window=4, topk=4, scorer_hidden=8))
    with torch.no_grad():  # training changes the weights; the record stays the original base's
        for p in model.parameters():
            p.add_(1.0)
    kvpop.save(model, tmp_path / "m")
    assert read_base(tmp_path / "m") == original
    assert kvpop.load(tmp_path / "m").kvpop.base == original
    assert same_base(original, base_identity(tiny_model("qwen3").to(torch.bfloat16))) is None
    assert "weights" in same_base(original, base_identity(tiny_model("qwen3", seed=1)))
    assert "architecture" in same_base(original, base_identity(tiny_model("llama")))
    # a directory from before the record still loads, without one
    (tmp_path / "m" / "kvpop_base.json").unlink()
    assert kvpop.load(tmp_path / "m").kvpop.base is None


def test_load_names_a_damaged_file(tmp_path):
    from kvpop.files import FileFormatError

    kvpop.save(retrofitted("qwen3"), tmp_path / "m")
    scorers = tmp_path / "m" / "kvpop_scorers.safetensors"
    scorers.write_bytes(scorers.read_bytes()[:-10])
    with pytest.raises(FileFormatError, match="kvpop_scorers.safetensors: the scorer weights is not a readable"):
        kvpop.load(tmp_path / "m")
    kvpop.save(retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=8)), tmp_path / "m")
    (tmp_path / "m" / "kvpop_config.json").write_text('{"sink": 2, "window": 5, "topk": 7, "scorer_hidden": 16}')
    with pytest.raises(FileFormatError, match="kvpop_scorers.safetensors: the scorer weights do not fit"):
        kvpop.load(tmp_path / "m")
    (tmp_path / "m" / "kvpop_config.json").write_text('{"sink": -1}')
    with pytest.raises(FileFormatError, match=r"kvpop_config.json: KVpopConfig.sink=-1 is invalid"):
        kvpop.load(tmp_path / "m")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_float32_model_under_bf16_autocast_attends_in_bf16(arch):
    # RoPE's float32 cos/sin promote q and k to float32 while v is bf16: the rule's attention casts the three to the
    # autocast dtype, as SDPA does (mixed, the CPU kernel refused them; on CUDA the attention and the training
    # target ran in float32). The logits stay those of the float32 forward, to bf16's precision.
    model = retrofitted(arch)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        records = Capture()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(ids, kvpop_capture=records, use_cache=False).logits
    assert {(r.query.dtype, r.key.dtype) for r in records.records} == {(torch.bfloat16, torch.bfloat16)}
    assert all(r.lse.dtype == torch.float32 for r in records.records)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    # decoding through the bounded cache under autocast too (its float32 slots take the bf16 keys)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(ids, **cache_kwargs(kvpop.KVpopCache(model)), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


# --- the two layouts of a save directory: full (base weights inside) and adapter (scorers only) ---

FIXTURES = Path(__file__).parent / "fixtures"
ADAPTER_FILES = {"kvpop_config.json", "kvpop_scorers.safetensors", "kvpop_base.json", "kvpop_format.json"}


def _byte_ids(n=40, seed=0):
    # the presets' byte tokenizer: 259 ids
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _preset(name="tiny-random-qwen3"):
    from kvpop.models import load_model

    model, _ = load_model(name)
    model = kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16))
    with torch.no_grad():  # sharper than the random init, so that eviction differs between scorers
        for policy in model.kvpop.layers:
            policy.scorer.w2.mul_(4.0)
    return model


def test_an_adapter_holds_the_scorers_only_and_loads_like_the_full_save(tmp_path):
    import json

    from kvpop.retrofit import read_layout

    model = _preset()
    ids = _byte_ids(60)
    with torch.no_grad(), quiet():
        want = model(ids).logits
        kvpop.save(model, tmp_path / "full")
        kvpop.save(model, tmp_path / "adapter", base_weights=False)
        full, adapter = kvpop.load(tmp_path / "full", rule="static"), kvpop.load(tmp_path / "adapter", rule="static")
        got_full, got_adapter = full(ids).logits, adapter(ids).logits
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == ADAPTER_FILES
    scorers = (tmp_path / "adapter" / "kvpop_scorers.safetensors").stat().st_size
    adapter_size = sum(p.stat().st_size for p in (tmp_path / "adapter").iterdir())
    full_size = sum(p.stat().st_size for p in (tmp_path / "full").iterdir())
    # the rest is a few small JSON files; the full save carries the base weights on top
    assert adapter_size < scorers + 16_000 < full_size, (adapter_size, scorers, full_size)
    assert torch.equal(got_adapter, want) and torch.equal(got_full, want)
    # eviction acts at this length: the equality covers the scorers, not only the base
    assert (want[:, model.kvpop.config.budget:] - model(ids, kvpop_dense=True).logits[:, model.kvpop.config.budget:]
            ).abs().max() > 1e-3
    assert json.loads((tmp_path / "adapter" / "kvpop_format.json").read_text()) == {
        "format": 2, "base_weights": False, "base": {"preset": "tiny-random-qwen3"}}
    assert read_layout(tmp_path / "full") == read_layout(tmp_path / "full").__class__(2, True, None)
    assert adapter.kvpop.base == full.kvpop.base == model.kvpop.base
    assert adapter.kvpop.config == model.kvpop.config


def test_an_adapter_refuses_another_base_naming_both(tmp_path):
    model = _preset()
    kvpop.save(model, tmp_path / "a", base_weights=False)
    with pytest.raises(ValueError, match=r"trained on the preset tiny-random-qwen3, but the base model "
                                         r"tiny-random-llama is another model \(architecture: model_type qwen3 vs llama"):
        kvpop.load(tmp_path / "a", base="tiny-random-llama")
    # the same architecture with one weight matrix changed: a local copy of the preset, edited
    from kvpop.models import load_model

    base, _ = load_model("tiny-random-qwen3")
    base.save_pretrained(tmp_path / "same")
    with torch.no_grad():
        base.model.embed_tokens.weight.mul_(1.5)
    base.save_pretrained(tmp_path / "changed")
    with pytest.raises(ValueError, match=rf"the base model {tmp_path / 'changed'} is another model "
                                         r"\(weights: model.embed_tokens.weight differs\)"):
        kvpop.load(tmp_path / "a", base=tmp_path / "changed")
    ids = _byte_ids()
    with torch.no_grad(), quiet():
        assert torch.equal(kvpop.load(tmp_path / "a", base=tmp_path / "same", rule="static")(ids).logits,
                           model(ids).logits)
    # a full save holds its base: no other can be given
    kvpop.save(model, tmp_path / "f")
    with pytest.raises(ValueError, match="holds its base weights"):
        kvpop.load(tmp_path / "f", base="tiny-random-qwen3")


def test_an_adapter_on_a_local_directory_finds_it_by_path(tmp_path):
    from kvpop.models import load_model

    plain, tokenizer = load_model("tiny-random-llama")
    plain.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    base, _ = load_model(str(tmp_path / "hf"))
    model = kvpop.retrofit(base, kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16))
    kvpop.save(model, tmp_path / "a", base_weights=False)
    from kvpop.retrofit import read_layout

    assert read_layout(tmp_path / "a").base == {"path": str((tmp_path / "hf").resolve())}
    ids = _byte_ids()
    with torch.no_grad(), quiet():
        want = model(ids).logits
        assert torch.equal(kvpop.load(tmp_path / "a", rule="static")(ids).logits, want)
        # load_model takes the base directory's tokenizer: the adapter holds none
        loaded, tok = load_model(str(tmp_path / "a"), config=model.kvpop.config)
        assert torch.equal(loaded(ids).logits, want) and tok("Hi")["input_ids"] == tokenizer("Hi")["input_ids"]
    (tmp_path / "hf").rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=rf"its base model {tmp_path / 'hf'} .* is not there; .*--base DIR"):
        kvpop.load(tmp_path / "a")
    with torch.no_grad(), quiet():
        assert torch.equal(kvpop.load(tmp_path / "a", base=tmp_path / "moved", rule="static")(ids).logits, want)


def test_save_writes_an_adapter_only_for_an_unchanged_base(tmp_path):
    model = retrofitted("qwen3")  # built from a config: no name to find it by
    with pytest.raises(ValueError, match="records no name of its base; pass base="):
        kvpop.save(model, tmp_path / "a", base_weights=False)
    with pytest.raises(ValueError, match="'nowhere' is neither a preset"):
        kvpop.save(model, tmp_path / "a", base_weights=False, base="nowhere")
    with pytest.raises(ValueError, match="with base_weights=True the base weights are saved"):
        kvpop.save(model, tmp_path / "a", base="tiny-random-qwen3")
    trained = _preset()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5)
    with pytest.raises(ValueError, match="no longer those the model was retrofitted on .*save them whole"):
        kvpop.save(trained, tmp_path / "a", base_weights=False)
    assert not (tmp_path / "a").exists()


def test_a_directory_of_the_first_format_still_loads():
    import json

    from kvpop.models import load_model
    from kvpop.retrofit import read_layout

    path = FIXTURES / "full_save_v1"
    expected = json.loads((FIXTURES / "full_save_v1.json").read_text())
    assert not (path / "kvpop_format.json").exists() and read_layout(path).format == 1
    ids = torch.tensor([expected["input_ids"]])
    # the static rule the directory was saved with (a load runs the recommended policy by default)
    from kvpop.retrofit import read_config

    for model in (kvpop.load(path, rule="static"), load_model(str(path), config=read_config(path))[0]):
        with torch.no_grad(), quiet():
            logits = model(ids).logits[0]
        assert logits.argmax(-1).tolist() == expected["argmax"]
        assert_close(logits[-8:, :32], torch.tensor(expected["logits_tail"]), 1e-5, "format 1")


def test_a_damaged_or_newer_format_file_is_named(tmp_path):
    from kvpop.files import FileFormatError

    kvpop.save(_preset(), tmp_path / "a", base_weights=False)
    layout = tmp_path / "a" / "kvpop_format.json"
    layout.write_text('{"format": 3, "base_weights": true}')
    with pytest.raises(FileFormatError, match="kvpop_format.json: format 3 was written by a newer kvpop"):
        kvpop.load(tmp_path / "a")
    layout.write_text('{"format": 2, "base_weights": false, "base": {"hub": "x"}}')
    with pytest.raises(FileFormatError, match=r"kvpop_format.json: a directory without base weights needs 'base'"):
        kvpop.load(tmp_path / "a")
    layout.write_text('{"format": 2')
    with pytest.raises(FileFormatError, match="kvpop_format.json: the directory's format is not valid JSON"):
        kvpop.load(tmp_path / "a")


def test_an_adapter_loads_in_another_dtype(tmp_path):
    model = _preset()
    kvpop.save(model, tmp_path / "a", base_weights=False)
    loaded = kvpop.load(tmp_path / "a", dtype=torch.bfloat16)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    # the scorers stay float32, as a fresh retrofit's
    assert all(p.dtype == torch.float32 for p in loaded.kvpop.parameters())


# --- kvpop train --freeze-base writes an adapter, and every reader of a saved directory takes it ---


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """A scorer-only run of the tiny preset: its directory and the held-out text it trained on."""
    import json

    from kvpop.train import distill
    from kvpop.train.distill import TrainConfig

    tmp = tmp_path_factory.mktemp("frozen")
    text = tmp / "notes.jsonl"
    text.write_text("".join(json.dumps({"text": f"note {i}: the cache keeps what the scorer ranks highest. " * 8})
                            + "\n" for i in range(40)))
    tcfg = TrainConfig(model="tiny-random-qwen3", data=str(text), seq_len=96, steps=2, batch_size=1, save_every=0,
                       freeze_base=True, out=str(tmp / "run"), max_tokens=96 * 8)
    with quiet():
        distill.train(tcfg, kvpop.KVpopConfig(sink=2, window=6, topk=12, scorer_hidden=16), progress=False)
    return tmp / "run", text


def test_a_frozen_base_run_saves_an_adapter_and_checkpoints_without_the_base(frozen_run):
    from kvpop.retrofit import read_layout
    from kvpop.train.weights import read_weights

    run, _ = frozen_run
    assert {p.name for p in (run / "final").iterdir()} == ADAPTER_FILES
    assert read_layout(run / "final").base == {"preset": "tiny-random-qwen3"}
    for source in (run, run / "final"):  # the newest checkpoint, and the final directory
        weights = read_weights(source)
        assert not weights.holds_base and weights.state and all(k.startswith("kvpop.") for k in weights.state)
    final, last = read_weights(run / "final"), read_weights(run)
    for name, value in final.state.items():
        assert torch.equal(value, last.state[name]), name


def _cli(capsys, *argv):
    from kvpop.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_command_reads_an_adapter_directory(frozen_run, tmp_path, capsys):
    import re

    run, text = frozen_run
    final = run / "final"
    prompt = ("--prompt", "The bounded cache keeps sinks, a window and the best older tokens. " * 2,
              "--max-new-tokens", "4", "--device", "cpu")
    rc, out, err = _cli(capsys, "generate", "--model", final, *prompt)
    assert rc == 0, err
    assert re.search(r"cache: \d+ of 20 slots", err)
    rc, same, err = _cli(capsys, "generate", "--model", final, "--base", "tiny-random-qwen3", *prompt)
    assert rc == 0 and same == out, err
    rc, _, err = _cli(capsys, "generate", "--model", final, "--base", "tiny-random-llama", *prompt)
    assert rc == 1 and (f"kvpop generate: error: {final} holds scorers trained on the preset tiny-random-qwen3, but "
                        "the base model tiny-random-llama is another model") in err
    rc, out, err = _cli(capsys, "info", "--model", final)
    assert rc == 0 and "model type:         qwen3" in out and "from the preset tiny-random-qwen3" in out, out + err
    rc, _, err = _cli(capsys, "eval", "--model", "tiny-random-qwen3", "--trained", final, "--policies", "none",
                      "--data", text, "--seq-len", 64, "--sequences", 1, "--out", tmp_path / "eval", "--no-progress",
                      "--device", "cpu")
    assert rc == 0, err
    rc, _, err = _cli(capsys, "viz", "--model", final, "--text", "a cache of bounded size " * 12, "--last", 16,
                      "--out", tmp_path / "v.png", "--device", "cpu")
    assert rc == 0 and (tmp_path / "v.png").is_file(), err
    rc, _, err = _cli(capsys, "train", "--model", "tiny-random-qwen3", "--init-from", final, "--data", text,
                      "--seq-len", 96, "--steps", 1, "--freeze-base", "--max-tokens", 96 * 8, "--no-progress",
                      "--out", tmp_path / "again")
    assert rc == 0, err
    assert {p.name for p in (tmp_path / "again" / "final").iterdir()} == ADAPTER_FILES
