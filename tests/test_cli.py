"""The `kvpop` command: help, `info`, `generate` end to end on a tiny random preset, and its errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import kvpop
from kvpop.cli import COMMANDS, main
from kvpop.config import DEFAULT_BUDGET

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


def _help(capsys, monkeypatch, name: str) -> str:
    """`kvpop NAME --help`, unwrapped (argparse wraps at COLUMNS, and breaks lines inside hyphenated names)."""
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _option(text: str, flag: str) -> str:
    """The entry of `flag` in a help text: its line and the help lines under it, up to the next option."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if re.match(rf"\s+{re.escape(flag)}([ ,]|$)", x))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("-") or not lines[i].strip()),
               len(lines))
    return " ".join(x.strip() for x in lines[start:end])


def test_every_model_help_names_every_preset(capsys, monkeypatch):
    from kvpop.presets import PRESETS
    from kvpop.shapes import SHAPE_PRESETS

    with_model = [name for name, cmd in COMMANDS.items() if any("--model" in flags for flags, _ in cmd.args)]
    assert {"generate", "info", "train", "eval", "bench"} <= set(with_model)
    for name in with_model:
        line = _option(_help(capsys, monkeypatch, name), "--model")
        missing = [p for p in PRESETS if p not in line]
        assert not missing, f"kvpop {name} --help: --model does not name the presets {missing}"
    bench_line = _option(_help(capsys, monkeypatch, "bench"), "--model")
    assert all(p in bench_line for p in SHAPE_PRESETS), bench_line


def test_every_default_is_in_the_help(capsys, monkeypatch):
    import argparse

    from kvpop.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        text = _help(capsys, monkeypatch, name)
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
                continue
            flag = action.option_strings[0]
            assert "default" in _option(text, flag), f"kvpop {name} --help: {flag} (default {action.default!r}) does not say it"


def test_no_command_prints_help(capsys):
    rc, out, _ = run(capsys)
    assert rc == 2 and "generate" in out


@pytest.mark.parametrize("name,model_type", [("tiny-random-qwen3", "qwen3"), ("tiny-random-llama", "llama")])
def test_info(capsys, name, model_type):
    rc, out, _ = run(capsys, "info", "--model", name)
    assert rc == 0
    fields = _fields(out)
    assert fields["model type"] == model_type
    assert fields["layers"] == "2: full attention in all 2 layers"
    assert fields["query heads"] == "4"
    assert fields["KV heads"].startswith("2")
    assert fields["head dim"] == "16"
    assert fields["max positions"] == "4096"
    assert fields["kvpop supports it"] == "yes"


def _fields(out: str) -> dict[str, str]:
    """The `name: value` rows of `kvpop info` (the KV table below them left out)."""
    rows = (line.split(":", 1) for line in out.splitlines() if not line.startswith(("KV cache", " ")))
    return {k.strip(): v.strip() for k, v in rows}


def _kv_rows(out: str) -> dict[str, tuple[str, ...]]:
    """The KV table of `kvpop info`: `{row name: (dense size, unit, share, retrofitted size, unit, share)}`."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"  (.+?\(\d+\))\s+([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+) %\s+([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+) %", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_info_shows_the_layer_kinds_and_the_kv_each_holds(capsys):
    # tiny-random-gemma3: full attention in layers 2 and 5, a 16-token window in the other 4; 1 KV head of dim 16
    rc, out, _ = run(capsys, "info", "--model", "tiny-random-gemma3", "--length", "1000", "--budget", "40")
    assert rc == 0
    assert _fields(out)["layers"] == "6: full attention in layers 2, 5; a sliding window of 16 tokens in the other 4"
    assert "KV cache at 1000 tokens of one sequence (bfloat16):" in out
    per_token = 1 * 16 * 2 * 2  # KV heads x head dim x (key, value) x bytes
    full, sliding, bounded = 2 * 1000 * per_token, 4 * 16 * per_token, 2 * 40 * per_token
    rows = _kv_rows(out)
    assert set(rows) == {"full attention (2)", "sliding window 16 (4)", "all (6)"}
    dense_total, bounded_total = full + sliding, bounded + sliding
    for name, dense, kept in (("full attention (2)", full, bounded), ("sliding window 16 (4)", sliding, sliding),
                              ("all (6)", dense_total, bounded_total)):
        d, d_unit, d_share, b, b_unit, b_share = rows[name]
        assert float(d) * {"B": 1, "KiB": 1024, "MiB": 2**20}[d_unit] == pytest.approx(dense, rel=1e-3)
        assert float(b) * {"B": 1, "KiB": 1024, "MiB": 2**20}[b_unit] == pytest.approx(kept, rel=1e-3)
        assert float(d_share) == pytest.approx(100 * dense / dense_total, abs=0.05)
        # the retrofitted column's shares are of the retrofitted cache, the total's of the dense one
        total = dense_total if name == "all (6)" else bounded_total
        assert float(b_share) == pytest.approx(100 * kept / total, abs=0.05)
    assert f"full-attention layers compressed {100 * (1 - 40 / 1000):.1f} %" in out


def test_info_defaults_to_the_max_positions_and_reads_a_saved_budget(capsys, tmp_path):
    from kvpop.models import load_model

    rc, out, _ = run(capsys, "info", "--model", "tiny-random-gemma3", "--kv-dtype", "float32")
    assert rc == 0 and "KV cache at 4096 tokens of one sequence (float32):" in out
    assert f"retrofitted, budget {DEFAULT_BUDGET}" in out
    assert _kv_rows(out)["full attention (2)"][:2] == ("1.0", "MiB")  # 2 layers x 4096 x 16 x 2 x 4 bytes
    model, tok = load_model("tiny-random-gemma3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(24, scorer_hidden=8)), tmp_path, tokenizer=tok)
    rc, out, err = run(capsys, "info", "--model", str(tmp_path), "--length", "100", "--budget", "50")
    assert rc == 0 and "retrofitted, budget 24" in out
    assert "ignoring --budget" in err
    # shorter than the budget: nothing is evicted
    rc, out, _ = run(capsys, "info", "--model", "tiny-random-gemma3", "--length", "10")
    assert "full-attention layers compressed 0.0 %, the whole cache 0.0 %" in out
    assert _kv_rows(out)["sliding window 16 (4)"][:2] == ("2.5", "KiB")  # 4 layers x 10 tokens x 64 bytes


@pytest.mark.parametrize("flag,value", [("--length", "0"), ("--budget", "-3")])
def test_info_refuses_a_bad_length_or_budget(capsys, flag, value):
    rc, _, err = run(capsys, "info", "--model", "tiny-random-gemma3", flag, value)
    assert rc == 1 and err.startswith(f"kvpop info: error: {flag} {value}: must be >= 1")


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
    # the backend by name gives the same text; without --compile it is refused, not ignored
    rc, out_b, err_b = run(capsys, *argv, "--compile", "--compile-backend", "aot_eager")
    assert rc == 0 and out_b.strip() == out.strip(), err_b
    rc, _, err = run(capsys, *argv, "--compile-backend", "aot_eager")
    assert rc != 0 and "add --compile" in err and "Traceback" not in err
    rc, _, err = run(capsys, *argv, "--compile", "--compile-backend", "cudagraph")
    assert rc != 0 and "needs a CUDA model" in err and "Traceback" not in err


def test_generate_chat_sampling_llama(capsys):
    rc, out, err = run(capsys, "generate", "--model", "tiny-random-llama", "--prompt", "hi", "--chat",
                       "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                       "--max-new-tokens", "10")
    assert rc == 0, err
    n_new, used, budget, seen = summary(err)
    assert 1 <= n_new <= 10 and used <= budget == DEFAULT_BUDGET


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


def test_generate_runs_a_kvpop_mlp_directory_as_the_cascades(capsys, tmp_path):
    # --tova-pool / --tova-pool-layer: the directory's weights as KVpop-cascade; the layer-wide one at TOVA's split
    # of the same budget (no sinks, window 1), its slots never above the budget
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=7, scorer_hidden=8)), tmp_path,
               tokenizer=tok)
    for flag in ("--tova-pool", "--tova-pool-layer"):
        rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", PROMPT, flag, "5",
                           "--max-new-tokens", "20")
        assert rc == 0, err
        n_new, used, budget, seen = summary(err)
        assert n_new == 20 and used == budget == 12 and seen > budget
    for flag, n, expected in (("--tova-pool", "8", "--tova-pool 8 must lie in [1, topk=7]"),
                              ("--tova-pool-layer", "12", "--tova-pool-layer 12 must lie in [1, budget - 1=11]")):
        rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "x", flag, n)
        assert rc == 1 and expected in err
    rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", "--prompt", "x", "--tova-pool-layer", "3")
    assert rc == 1 and "is not one" in err
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "x", "--tova-pool", "2",
                     "--tova-pool-layer", "3")
    assert rc == 1 and "not both" in err


def test_generate_runs_the_recommended_policy_chunked(capsys, tmp_path):
    # --decision-chunk C: the recommended policy deciding every C steps in the same memory (a ring of C slots)
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=11, scorer_hidden=8)), tmp_path,
               tokenizer=tok)
    argv = ["generate", "--model", str(tmp_path), "--prompt", PROMPT, "--decision-chunk", "4", "--max-new-tokens", "20"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "a ring of 4 slots; one decision every 4 steps" in err
    n_new, used, budget, seen = summary(err)
    assert n_new == 20 and used <= budget == 16 and seen > budget
    # compiled (the steps counted on the device, the decisions between them): the same text and slots
    rc, out_c, err_c = run(capsys, *argv, "--compile", "--compile-backend", "aot_eager")
    assert rc == 0, err_c
    assert out_c.strip() == out.strip() and summary(err_c) == summary(err)
    for argv, expected in ((["--decision-chunk", "16"], "--decision-chunk 16: KVpopConfig.decision_chunk=16 is invalid"),
                           (["--decision-chunk", "4", "--rule", "static"], "applies to the recommended policy")):
        rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "x", *argv)
        assert rc == 1 and expected in err and "Traceback" not in err, err
    rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", "--prompt", "x", "--decision-chunk", "4")
    assert rc == 1 and "no trained scorers" in err
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x", "--decision-chunk", "4")
    assert rc == 1 and "no such file or directory" in err


@pytest.mark.parametrize("argv,expected", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "x", "--window", "0"], "KVpopConfig.window=0"),
    (["--prompt", "x", "--topk", "-1"], "KVpopConfig.topk=-1"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["--prompt", "x", "--do-sample", "--top-p", "1.5"], "--top-p=1.5 must lie in (0, 1]"),
    (["--prompt", "x", "--top-p", "0"], "--top-p=0.0 must lie in (0, 1]"),
    (["--prompt", "x", "--temperature", "0"], "--temperature=0.0 must be a finite number > 0"),
    (["--prompt", "x", "--topk", "600"], "budget=512 leaves no window after sink + topk = 4 + 600"),
    (["--prompt", "x", "--budget", "100", "--window", "50", "--topk", "50"], "budget=100 is not sink + window + topk"),
])
def test_generate_bad_arguments(capsys, argv, expected):
    rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", *argv)
    assert rc == 1
    assert expected in err


# --- defaults, notes and errors ---


def test_one_default_budget_everywhere():
    import argparse

    from kvpop.cli import _rule, build_parser
    from kvpop.eval.bench import _rule_config

    assert kvpop.KVpopConfig().budget == kvpop.KVpopConfig.for_budget().budget == DEFAULT_BUDGET
    assert kvpop.KVpopConfig() == kvpop.KVpopConfig.for_budget()
    parser = build_parser()
    for argv in (["generate", "--model", "m", "--prompt", "p"], ["train", "--model", "m"], ["viz", "--model", "m"]):
        assert _rule(parser.parse_args(argv)) == kvpop.KVpopConfig(), argv
    assert _rule_config(parser.parse_args(["bench", "--model", "m"])) == kvpop.KVpopConfig()
    # the default and why are in every --help that takes --budget
    for name in ("generate", "train", "viz"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        assert f"default {DEFAULT_BUDGET}: the CPU scale" in sub.format_help().replace("\n", " ").replace("  ", " ")
    # the flags still override it
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p", "--window", "32", "--topk", "64"])
    assert (_rule(args).sink, _rule(args).window, _rule(args).topk) == (4, 32, 64)


def test_generate_announces_untrained_scorers(capsys, tmp_path):
    argv = ["--prompt", PROMPT, "--window", "8", "--topk", "8", "--max-new-tokens", "2"]
    rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", *argv)
    assert rc == 0, err
    assert "tiny-random-qwen3 has no trained kvpop scorers: they are untrained (random)" in err
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=3, scorer_hidden=8)), tmp_path,
               tokenizer=tok)
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "2")
    assert rc == 0 and "untrained" not in err


def _short_model_dir(path, positions: int):
    """The tiny preset saved as a Hugging Face directory with only `positions` positions."""
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    model.config.max_position_embeddings = positions
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_generation_near_the_last_position_stops_cleanly_and_keeps_its_tokens(capsys, tmp_path):
    model = _short_model_dir(tmp_path, 64)
    prompt = "x" * 60  # 60 byte tokens: 5 new tokens fit (the last one is never fed back)
    rc, out, err = run(capsys, "generate", "--model", model, "--prompt", prompt, "--window", "8", "--topk", "8",
                       "--max-new-tokens", "20")
    assert rc == 0, err
    assert "the prompt has 60 tokens and the model 64 positions: generating 5 tokens, not --max-new-tokens 20" in err
    n_new, _, _, seen = summary(err)
    assert 1 <= n_new <= 5 and seen == 60 + n_new - 1 <= 64
    assert out.strip(), "the generated tokens were lost"
    rc, _, err = run(capsys, "generate", "--model", model, "--prompt", "x" * 65)
    assert rc == 1 and "the prompt has 65 tokens, more than the model's max_position_embeddings=64" in err


def test_no_progress_silences_transformers_bars(capsys, tmp_path):
    model = _short_model_dir(tmp_path, 128)
    capsys.readouterr()
    rc, _, err = run(capsys, "generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2", "--no-progress")
    assert rc == 0, err
    assert "Loading weights" not in err and "%|" not in err
    # the switch is put back for whatever runs next in this process
    rc, _, err = run(capsys, "generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2")
    assert rc == 0 and "Loading weights" in err


def test_errors_are_one_line_and_debug_shows_the_traceback(capsys):
    rc, _, err = run(capsys, "info", "--model", "no-such-model")
    assert rc == 1 and err.startswith("kvpop info: error: unknown model 'no-such-model'")
    assert "Traceback" not in err and "--debug" in err
    for argv in (["--debug", "info", "--model", "no-such-model"], ["info", "--model", "no-such-model", "--debug"]):
        with pytest.raises(ValueError, match="no-such-model"):
            main(argv)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_that_is_not_there_is_a_clear_error(capsys):
    for device, message in (("cuda", "--device cuda: CUDA is not available"), ("gpu", "--device 'gpu' is not a device")):
        rc, _, err = run(capsys, "generate", "--model", "tiny-random-qwen3", "--prompt", "x", "--device", device)
        assert rc == 1 and message in err and "Traceback" not in err


def _damaged_save(tmp_path, damage: str):
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    path = tmp_path / "saved"
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=3, scorer_hidden=8)), path, tokenizer=tok)
    if damage == "truncated weights":
        f = path / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "truncated scorers":
        f = path / "kvpop_scorers.safetensors"
        f.write_bytes(f.read_bytes()[:50])
    elif damage == "corrupt kvpop config":
        (path / "kvpop_config.json").write_text("{")
    elif damage == "no kvpop config":
        (path / "kvpop_config.json").unlink()
    elif damage == "corrupt hf config":
        (path / "config.json").write_text("")
    return path


@pytest.mark.parametrize("damage,file,message", [
    ("truncated weights", "model.safetensors", "not a readable safetensors file"),
    ("truncated scorers", "kvpop_scorers.safetensors", "not a readable safetensors file"),
    ("corrupt kvpop config", "kvpop_config.json", "the KVpop config is not valid JSON"),
    ("no kvpop config", "kvpop_config.json", "missing, but"),
    ("corrupt hf config", "config.json", "config"),
])
def test_a_damaged_save_directory_is_a_clear_error(capsys, tmp_path, damage, file, message):
    path = _damaged_save(tmp_path, damage)
    for argv in (["generate", "--model", str(path), "--prompt", "x", "--max-new-tokens", "1"],
                 ["info", "--model", str(path)]):
        rc, _, err = run(capsys, *argv)
        if argv[0] == "info" and damage.startswith("truncated"):
            assert rc == 0  # info reads the configs only
            continue
        assert rc == 1, err
        assert "Traceback" not in err and message in err and str(path / file) in err, err


def test_a_model_directory_without_tokenizer_is_named(capsys, tmp_path):
    from kvpop.models import load_model

    model, _ = load_model("tiny-random-qwen3")
    model.save_pretrained(tmp_path)
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hello")
    assert rc == 1 and f"no tokenizer found in '{tmp_path}'" in err


def test_info_names_the_rule_of_a_kvpop_directory(capsys, tmp_path):
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=8, tova_pool=5)), tmp_path / "c",
               tokenizer=tok)
    rc, out, _ = run(capsys, "info", "--model", str(tmp_path / "c"))
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("retrofitted with"))
    assert "sink=4 window=8 topk=20 (budget 32), policy kvpop, scorer mlp" in line
    assert "KVpop-cascade with 5 TOVA slots" in line
    assert "layer-wide" not in line
    kvpop.detach(model)
    cfg = kvpop.KVpopConfig.for_budget(32, scorer_hidden=8).with_tova_pool(24, layer=True)
    kvpop.save(kvpop.retrofit(model, cfg), tmp_path / "l", tokenizer=tok)
    rc, out, _ = run(capsys, "info", "--model", str(tmp_path / "l"))
    line = next(x for x in out.splitlines() if x.startswith("retrofitted with"))
    assert rc == 0 and "sink=0 window=1 topk=31" in line
    assert "KVpop-cascade with 24 TOVA slots (layer-wide: TOVA's head average, fed first)" in line


def test_demo_runs_the_model_it_is_given(capsys, monkeypatch, tmp_path):
    """`kvpop demo --model` hands the model to the whole job (SmolLM2-135M by default)."""
    from kvpop.eval import demo

    asked = []
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: asked.append(kw["model_name"]) or {})
    assert run(capsys, "demo", "--model", "tiny-random-gemma3", "--out", str(tmp_path / "d"))[0] == 0
    assert run(capsys, "demo", "--out", str(tmp_path / "d"))[0] == 0
    assert asked == ["tiny-random-gemma3", "smollm2-135m"]
