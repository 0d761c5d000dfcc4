"""The `kvpop` command: help, `info`, and `generate` end to end on a tiny random preset."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import kvpop
from kvpop.cli import COMMANDS, main

HAS_RETROFIT = hasattr(kvpop, "retrofit") and hasattr(kvpop, "KVpopCache")
needs_retrofit = pytest.mark.skipif(not HAS_RETROFIT, reason="retrofit not available yet")

SUMMARY = re.compile(r"\[kvpop\] (\d+) tokens in .* tokens/s.*cache: (\d+) of (\d+) slots per layer and KV head "
                     r"used for (\d+) tokens seen")
PROMPT = "The bounded cache keeps sinks, a window and the best older tokens. " * 2


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def summary(err: str) -> tuple[int, int, int, int]:
    m = SUMMARY.search(err)
    assert m, f"no summary line in stderr:\n{err}"
    return tuple(int(g) for g in m.groups())


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, cmd in COMMANDS.items():
        assert name in out and cmd.help.split()[0] in out
    assert {"generate", "info"} <= set(COMMANDS)


def test_console_script_help():
    exe = shutil.which("kvpop")
    argv = [exe, "--help"] if exe else [sys.executable, "-m", "kvpop.cli", "--help"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "generate" in res.stdout and "info" in res.stdout


def test_no_command_prints_help(capsys):
    rc, out, _ = run(capsys)
    assert rc == 2 and "generate" in out


@needs_retrofit
@pytest.mark.parametrize("name,model_type", [("tiny-random-qwen3", "qwen3"), ("tiny-random-llama", "llama")])
def test_info(capsys, name, model_type):
    rc, out, _ = run(capsys, "info", "--model", name)
    assert rc == 0
    fields = dict(line.split(":", 1) for line in out.strip().splitlines())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    assert fields["model type"] == model_type
    assert fields["layers"] == "2"
    assert fields["query heads"] == "4"
    assert fields["KV heads"].startswith("2")
    assert fields["head dim"] == "16"
    assert fields["max positions"] == "4096"
    assert fields["kvpop supports it"] == "yes"


@needs_retrofit
def test_info_unsupported_model(capsys, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    rc, out, _ = run(capsys, "info", "--model", str(tmp_path))
    assert rc == 0
    assert re.search(r"kvpop supports it:\s+no: .*gpt2", out)


def test_unknown_model(capsys):
    rc, out, err = run(capsys, "info", "--model", "not-a-preset")
    assert rc == 1
    assert "not-a-preset" in err and "tiny-random-qwen3" in err and "hub" in err


@needs_retrofit
def test_generate_end_to_end(capsys):
    argv = ["generate", "--model", "tiny-random-qwen3", "--prompt", PROMPT,
            "--sink", "2", "--window", "8", "--topk", "8", "--max-new-tokens", "24"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert out.strip(), "nothing was streamed"
    n_new, used, budget, seen = summary(err)
    assert n_new == 24
    assert budget == 18 and used == budget
    # the last generated token is returned but never run through the model
    assert seen == len(PROMPT.encode()) + n_new - 1
    # same seed, same text (the scorers of a fresh retrofit are seeded too)
    rc2, out2, _ = run(capsys, *argv)
    assert rc2 == 0 and out2 == out


@needs_retrofit
def test_generate_compiled_equals_eager(capsys, monkeypatch):
    import kvpop.decode

    # the same capture as inductor, without its C++ compilation on a small CPU
    monkeypatch.setattr(kvpop.decode, "DEFAULT_BACKEND", "aot_eager")
    argv = ["generate", "--model", "tiny-random-qwen3", "--prompt", PROMPT,
            "--sink", "2", "--window", "8", "--topk", "8", "--max-new-tokens", "12"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    rc, out_c, err_c = run(capsys, *argv, "--compile")
    assert rc == 0, err_c
    assert summary(err_c) == summary(err)
    assert out_c.strip() == out.strip()
    rc, _, err = run(capsys, *argv, "--compile", "--do-sample")
    assert rc != 0 and "--do-sample" in err


@needs_retrofit
def test_generate_chat_sampling_llama(capsys):
    rc, out, err = run(capsys, "generate", "--model", "tiny-random-llama", "--prompt", "hi", "--chat",
                       "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                       "--max-new-tokens", "10")
    assert rc == 0, err
    n_new, used, budget, seen = summary(err)
    assert 1 <= n_new <= 10 and used <= budget == 4 + 32 + 64


@needs_retrofit
def test_generate_from_kvpop_directory(capsys, tmp_path):
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=3, scorer_hidden=8)), tmp_path,
               tokenizer=tok)
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", PROMPT, "--window", "16",
                     "--max-new-tokens", "5")
    assert rc == 0, err
    assert "already retrofitted; ignoring --window" in err
    _, used, budget, _ = summary(err)
    assert used == budget == 8


@needs_retrofit
@pytest.mark.parametrize("argv,expected", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "x", "--window", "0"], "KVpopConfig.window=0"),
    (["--prompt", "x", "--topk", "-1"], "KVpopConfig.topk=-1"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0"),
])
def test_generate_bad_arguments(capsys, argv, expected):
    rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", *argv)
    assert rc == 1
    assert expected in err
