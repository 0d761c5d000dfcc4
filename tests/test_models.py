"""`kvpop.models`: presets built offline and deterministically, byte tokenizer, loading by path."""

from __future__ import annotations

import pytest
import torch

import kvpop
from kvpop.files import FileFormatError
from kvpop.models import PRESETS, byte_tokenizer, load_model, resolve_device

TEXTS = ["", "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnew lines\r\n",
         "naïve café, 你好, 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # any attempt to reach the hub would fail loudly instead of downloading
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.parametrize("name,model_type", [("tiny-random-qwen3", "qwen3"), ("tiny-random-llama", "llama")])
def test_preset_shape(name, model_type):
    model, tokenizer = load_model(name)
    c = model.config
    assert c.model_type == model_type
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.max_position_embeddings == 4096
    assert c.vocab_size == len(tokenizer) == 259
    assert model.dtype == torch.float32
    assert not model.training
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n.startswith("tiny-random")))
def test_preset_is_deterministic_and_leaves_global_rng_alone(name):
    state = torch.random.get_rng_state()
    a, _ = load_model(name)
    b, _ = load_model(name)
    assert torch.equal(state, torch.random.get_rng_state())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.arange(20)[None]
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_presets_differ():
    q, _ = load_model("tiny-random-qwen3")
    ll, _ = load_model("tiny-random-llama")
    assert not torch.equal(q.get_input_embeddings().weight, ll.get_input_embeddings().weight)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(text):
    tok = byte_tokenizer()
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_tokenizer_bytes_and_specials():
    tok = byte_tokenizer()
    assert tok("A")["input_ids"] == [65]
    assert tok("é")["input_ids"] == list("é".encode())
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    assert tok.decode([257, 104, 105, 258], skip_special_tokens=True) == "hi"


def test_chat_template():
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError) as info:
        load_model("no-such-model/anywhere")
    msg = str(info.value)
    assert "no-such-model/anywhere" in msg
    assert all(name in msg for name in PRESETS)
    assert "local" in msg and "hub" in msg


def test_directory_without_a_model_is_an_error(tmp_path):
    with pytest.raises((OSError, ValueError)):
        load_model(str(tmp_path))


def test_dtype_and_device():
    model, _ = load_model("tiny-random-qwen3", dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16
    model, _ = load_model("tiny-random-qwen3", dtype=torch.float64)
    assert model.dtype == torch.float64
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-random-qwen3", dtype="float33")


def test_local_hf_directory(tmp_path):
    model, tok = load_model("tiny-random-llama")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path))
    ids = torch.arange(30)[None]
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert tok2.decode(tok2(TEXTS[4])["input_ids"]) == TEXTS[4]
    assert tok2.chat_template == tok.chat_template


def test_local_hf_directory_without_tokenizer(tmp_path):
    model, _ = load_model("tiny-random-llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(str(tmp_path))


def test_kvpop_directory_comes_back_retrofitted(tmp_path):
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(0)
    model = kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=4, topk=4, scorer_hidden=8))
    kvpop.save(model, tmp_path, tokenizer=tok)
    again, tok2 = load_model(str(tmp_path))
    assert hasattr(again, "kvpop")
    # by default the recommended policy over the saved scorers; the saved config runs them as trained
    assert again.kvpop.config == model.kvpop.config.for_rule(None)
    again, tok2 = load_model(str(tmp_path), config=model.kvpop.config)
    assert again.kvpop.config == model.kvpop.config
    ids = torch.arange(40)[None]
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert len(tok2) == len(tok)


def test_an_incomplete_save_is_an_error_not_a_plain_model(tmp_path):
    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=4, topk=4, scorer_hidden=8)), tmp_path,
               tokenizer=tok)
    (tmp_path / "kvpop_config.json").unlink()
    # it would load as the base model with fresh random scorers and another budget
    with pytest.raises(FileFormatError, match="kvpop_config.json: missing, but .* incomplete kvpop.save directory"):
        load_model(str(tmp_path))


def test_a_tokenizer_that_encodes_nothing_is_refused(tmp_path):
    model, _ = load_model("tiny-random-llama")
    model.save_pretrained(tmp_path)
    # a config alone: transformers builds a tokenizer with one token that turns every text into nothing
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(str(tmp_path))


def test_resolve_device():
    assert resolve_device(None) == resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model("tiny-random-qwen3", device="cuda:0")
