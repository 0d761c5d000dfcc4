"""Reading the files kvpop loads, each failure one clear error that names the file and what is wrong.

kvpop reads data only: JSON, safetensors, plain text. Nothing it reads is unpickled, so no file can
run code. JSON configs and safetensors weights fail in their own ways (`JSONDecodeError` naming no
file, `RecursionError` on deep nesting, `SafetensorError`, `IsADirectoryError`, a symlink loop's
`OSError`); the readers here turn every one of them into `FileFormatError`, a `ValueError` whose
message starts with the path. A model directory's `config.json` is checked before transformers
builds anything from it: a config that describes far more model than its weights files hold (a
billion layers) is refused before a byte is allocated. The writers make a file appear whole or not
at all (temporary name, fsync, rename).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvpop import limits


class FileFormatError(ValueError):
    """A file kvpop reads is missing, truncated or malformed; the message names the file."""


MAX_JSON_BYTES = 256 << 20
"""The largest JSON file kvpop reads as a config, manifest or state (its own are kilobytes to megabytes)."""
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""Suffixes of pickled files: kvpop names them when it refuses them."""


def check_file(path: str | Path, what: str) -> Path:
    """`path` as a regular file to read, or a clear error: missing, a directory, a symlink loop, unreadable."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise FileFormatError(f"{path}: {what} is a symlink to nothing ({os.readlink(path)})") from None
        raise FileFormatError(f"{path}: {what} is missing") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise FileFormatError(f"{path}: {what} is a symlink loop") from None
        raise FileFormatError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    if path.is_dir():
        raise FileFormatError(f"{path}: {what} must be a file, found a directory")
    import stat

    if not stat.S_ISREG(st.st_mode):
        raise FileFormatError(f"{path}: {what} must be a regular file, found a device, pipe or socket")
    return path


def check_dir(path: str | Path, what: str) -> Path:
    """`path` as a directory to read, or a clear error: missing, a file, a symlink loop."""
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise FileFormatError(f"{path}: {what} does not exist") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise FileFormatError(f"{path}: {what} is a symlink loop") from None
        raise FileFormatError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    if not path.is_dir():
        raise FileFormatError(f"{path}: {what} must be a directory, found a file")
    return path


def read_json(path: str | Path, what: str) -> Any:
    """`path` parsed as JSON; `what` says what the file is for (e.g. "the KVpop config")."""
    path = check_file(path, what)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise FileFormatError(f"{path}: {what} is {size / 2**20:.0f} MiB, more than the {MAX_JSON_BYTES >> 20} MiB a "
                              "kvpop JSON file can be; it is not one kvpop wrote")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FileFormatError(f"{path}: {what} is not UTF-8 text, so no JSON: a binary file (weights, a pickle?) or "
                              "a damaged one") from None
    except OSError as err:
        raise FileFormatError(f"{path}: cannot read {what} ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        state = "empty" if not text.strip() else f"not valid JSON ({err})"
        raise FileFormatError(f"{path}: {what} is {state}; the file is damaged or was cut off") from None
    except RecursionError:
        raise FileFormatError(f"{path}: {what} nests too deeply to be a kvpop file") from None
    except ValueError as err:
        # an integer of more digits than Python converts
        raise FileFormatError(f"{path}: {what} holds a value kvpop cannot read ({str(err)[:120]})") from None


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """`read_json`, and a clear error unless the file holds a JSON object."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise FileFormatError(f"{path}: {what} must be a JSON object, found {type(value).__name__}")
    return value


def _safetensors_error(path: Path, what: str, err: BaseException) -> FileFormatError:
    return FileFormatError(f"{path}: {what} is not a readable safetensors file ({err}); the file is damaged, was cut "
                           "off or was not written by safetensors")


def read_safetensors(path: str | Path, what: str, device: str = "cpu") -> dict:
    """The tensors of a safetensors file, or a clear error (missing, truncated, a header that lies about its data)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = check_file(path, what)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise _safetensors_error(path, what, err) from None


def safetensors_shapes(path: str | Path, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in a safetensors file, from its header alone (checked whole
    by safetensors: offsets that overlap, leave gaps or run past the end are refused); no data is read."""
    from safetensors import SafetensorError, safe_open

    path = check_file(path, what)
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                tensor = f.get_slice(name)
                out[name] = (tensor.get_dtype(), tuple(tensor.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise _safetensors_error(path, what, err) from None


def check_safetensors(path: str | Path, what: str) -> None:
    """Read the header of a safetensors file: a truncated or foreign file is named before anything loads it."""
    safetensors_shapes(path, what)


def refuse_pickle(path: str | Path, what: str, convert: str | None = None) -> FileFormatError:
    """The error for a pickled file where kvpop reads data only: unpickling can run any code the file holds."""
    how = f"; convert it once with `{convert}`" if convert else ""
    return FileFormatError(f"{path}: {what} is a pickle, which kvpop never loads (unpickling a file can run any code "
                           f"it holds){how}")


# --- model directories: config.json checked before anything is built from it ---

COUNT_FIELDS = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads"),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
}
"""The sizes a Hugging Face config.json gives, under the names architectures use for them."""
MAX_COUNT = 1 << 40
"""No size in a config.json is this large: a value above it is refused as a wrong value, not a model."""
MAX_LAYERS = 4096
"""More decoder layers than any model has (the deepest public ones have under 200); a config.json asking for
more is refused before transformers builds a module per layer."""
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}
WEIGHTS_SLACK = 16
"""A config.json may describe at most this many times more parameters than its weights files hold values
(quantised files pack several parameters per value): more is a config that does not belong to the weights."""


def _sizes(config: dict[str, Any], where: Path) -> dict[str, int]:
    """The sizes of a raw config.json (its `text_config` where it has one), each checked to be a positive integer."""
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    sizes = {}
    for field, names in COUNT_FIELDS.items():
        for name in names:
            if name not in config or config[name] is None:
                continue
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_COUNT:
                raise FileFormatError(f"{where}: {name}={value!r} must be a positive integer below 2**40")
            sizes[field] = value
            break
    # an output matrix of its own (untied) doubles the embeddings; unsaid, the lower count is taken
    sizes["output_matrices"] = 1 if config.get("tie_word_embeddings") is False else 0
    dtype = config.get("dtype", config.get("torch_dtype"))
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPE_BYTES:
        sizes["dtype_bytes"] = DTYPE_BYTES[dtype.removeprefix("torch.")]
    layers = sizes.get("num_hidden_layers")
    if layers is not None and layers > MAX_LAYERS:
        raise FileFormatError(f"{where}: num_hidden_layers={layers} is more than any model has (at most {MAX_LAYERS} "
                              "are read): the file is damaged or not a model's config")
    return sizes


def _declared_values(file: Path) -> int | None:
    """The values a safetensors file's header declares, read leniently: None where it cannot be read (a damaged
    file is named when the weights load, `check_safetensors`; reading its config needs none of them)."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_JSON_BYTES:
                return None
            header = json.loads(f.read(n))
        return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def check_model_config(path: str | Path, what: str = "the model") -> dict[str, int]:
    """Check a model directory's `config.json` before transformers reads it; returns its sizes (`_sizes`).

    Refused: sizes that are not positive integers, more layers than any model has, and a config that
    describes far more parameters than the directory's safetensors files declare (in their headers).
    """
    path = check_dir(path, what)
    config = read_json_object(path / "config.json", f"the config of {what}")
    sizes = _sizes(config, path / "config.json")
    declared = [_declared_values(f) for f in sorted(path.glob("*.safetensors")) if not f.name.startswith("kvpop_")]
    if declared and None not in declared and "quantization_config" not in config:
        stored, described = sum(declared), limits.parameter_estimate(sizes)
        if described > WEIGHTS_SLACK * stored + (1 << 20):
            raise FileFormatError(
                f"{path / 'config.json'}: describes a model of about {described:.3g} parameters, but the weights files "
                f"hold {stored:.3g} values: the config does not belong to these weights")
    return sizes


def _weights_files(path: Path) -> tuple[list[Path], list[Path]]:
    weights = [p for p in sorted(path.glob("*.safetensors")) if not p.name.startswith("kvpop_")]
    pickled = [p for p in sorted(path.iterdir()) if p.suffix in PICKLE_SUFFIXES and p.is_file()]
    return weights, pickled


def load_pretrained(path: str | Path, what: str, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained` of a local directory: safetensors weights only, `config.json` and
    every weights file checked first, the weights' memory checked against what the machine has."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = check_dir(path, what)
    weights, pickled = _weights_files(path)
    for file in weights:
        check_safetensors(file, f"a weights file of {what}")
    sizes = check_model_config(path, what)
    if not weights and pickled:
        raise refuse_pickle(pickled[0], f"the weights of {what}",
                            f"python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('{path}')"
                            f".save_pretrained('{path}-safetensors')\"")
    limits.check_weights(sizes, kwargs.get("dtype"), kwargs.get("device_map"), what)
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                    trust_remote_code=False, **kwargs)
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(f"{path}: cannot load {what} ({type(err).__name__}: {first})") from None


def check_scorers(model: Any, cfg: Any, attach: Any, scorers: str | Path | dict[str, tuple[int, ...]] | None = None,
                  where: str | Path = "the KVpop config",
                  hint: str = "the file is damaged, or was written for a machine with more memory") -> None:
    """Before the scorers of `cfg` are made for `model` (`kvpop.load`, `kvpop train`): they must fit, with the bounded
    cache of one sequence at `cfg`'s budget, the memory of the model's device, and where `scorers` is given (a
    safetensors file, or name -> shape of the weights to load into them) they must have exactly its tensors.

    Checked on a weightless copy of the model that `attach` (`kvpop.retrofit`) retrofits: a config asking for a
    scorer of a billion hidden units or a window of 10**12 tokens allocates nothing."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(model.config))
        attach(skeleton, cfg)
    mods = skeleton.kvpop
    wanted = {name: tuple(t.shape) for name, t in mods.state_dict().items()}
    if scorers is not None:
        source = scorers if isinstance(scorers, dict) else None
        found = source if source is not None else \
            {name: shape for name, (_, shape) in safetensors_shapes(scorers, "the scorer weights").items()}
        if wanted != found:
            differ = [f"{n}: {list(found[n]) if n in found else 'missing'} in the weights, {list(wanted[n])} for the "
                      "config" for n in sorted(wanted) if found.get(n) != wanted[n]]
            differ += [f"{n}: in the weights only" for n in sorted(found.keys() - wanted.keys())]
            raise FileFormatError(f"{where if source is not None else scorers}: the scorer weights do not fit "
                                  f"{'its config' if source is not None else where} ({'; '.join(differ[:3])}"
                                  f"{f'; {len(differ) - 3} more' if len(differ) > 3 else ''})")
    ref = next(model.parameters())
    need = {"scorer weights": sum(math.prod(shape) for shape in wanted.values()) * 4,
            "KV slots": limits.kv_slot_bytes(limits.Shape.of(model.config), mods.config, 1, ref.element_size())}
    c = mods.config
    limits.check_fits(need, ref.device, f"{where}: {c.policy} scorers ({c.scorer}, hidden {c.scorer_hidden}) and "
                      f"budget {c.budget} (sink {c.sink}, window {c.window}, topk {c.topk}) for one sequence", hint)


def refuse_existing(path: str | Path | None, flag: str, force: bool) -> None:
    """Before any work: a command never replaces a file the user has unless asked (`--force`).

    Called first, so a refusal costs nothing; a directory where a file is to go is refused even with `--force`."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    if path.exists() and not force:
        raise ValueError(f"{flag} {path} exists: pass --force to replace it, or choose another file")


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file to write `path` through, whole or not at all: a temporary file beside it, fsync, then a rename
    over `path` when the block ends; an error in the block removes the temporary file and leaves `path` as it was.

    Args:
        mode: "w" (text) or "wb" (bytes).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode={mode!r} must be 'w' or 'wb'")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `path` whole or not at all: a temporary file, fsync, then rename over `path`."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
