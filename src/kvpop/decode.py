"""Compiled decoding: one token per step through a fixed cache, captured once as a CUDA graph.

Why this exists: a decode step of a small batch is a few hundred tiny kernels, so eager PyTorch is
bound by Python and launch overhead, not by the cache. `KVpopCache` keeps static shapes and updates
its buffers in place (`cache.py`), and a step makes no host sync, so the step can be replayed
without Python in two ways:

- a `torch.compile` backend ("inductor", the default): traced once with `fullgraph=True`, no
  recompilation per step. On CUDA with kvpop's own inductor options (`COMPILE_OPTIONS`: CUDA graphs,
  coordinate-descent tuning of the generated kernels, autotuned matrix products), the fastest step
  measured; it costs a compile of tens of seconds the first time, less from inductor's on-disk cache;
- backend "cudagraph": the *eager* step captured once with `torch.cuda.CUDAGraph` and replayed per
  token, its repeated pieces compiled (`fuse`). Ready in seconds even for a 36-layer 8B model, slower
  per token: the choice for many short decodes (`stepwise_logits`, `kvpop eval --generate`).

The same `Decoder` runs the dense baseline on Hugging Face's `StaticCache`, so the comparison is fair.

    kvpop generate --model tiny-random-qwen3 --prompt "Once upon a time" --compile
    kvpop bench --model qwen3-8b-shape --device cuda --contexts 4096,131072 --compile --fill random

The prefill runs eagerly in chunks; only the one-token step is compiled. Tokens stay on the device
during generation (an EOS stop is checked every `check_every` steps, one host sync each). `generate`
takes left-padded batches (`attention_mask`) and samples on the device (`kvpop.sampling`): the fast
path of `kvpop eval --generate` (`kvpop.eval.generation`).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings

import torch
from torch import Tensor

from kvpop.cache import ChunkedLayerCache, KVpopCache, cache_kwargs
from kvpop.sampling import next_tokens

DEFAULT_BACKEND = "inductor"
"""`torch.compile` backend of a compiled step (with `COMPILE_OPTIONS` on CUDA)."""
CUDA_GRAPH = "cudagraph"
"""Backend name of the eager step captured as a CUDA graph."""
COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True, "max_autotune_gemm": True}
"""Inductor's options for kvpop's compiled decode steps on CUDA (`Decoder`, and `model.generate` with a `KVpopCache`
through `generation_compile_config`), passed to `torch.compile` so that they apply to these compiles only: CUDA
graphs (what mode "reduce-overhead" sets), coordinate-descent tuning of the generated Triton kernels (gpt-fast's
setting) and autotuning of the matrix products. With them and nothing set by the user, the 36-layer decode step of
the Qwen3-8B shape takes 6.71 ms on an H100, 1.45x the bandwidth floor (docs/speed.md, "Decoding"); they cost compile
time (about 80 s for that step), spent once per shape and then read from inductor's on-disk cache."""


def compile_options(device: torch.device) -> dict | None:
    """`COMPILE_OPTIONS` on CUDA, else None (the CPU keeps inductor's defaults)."""
    return dict(COMPILE_OPTIONS) if torch.device(device).type == "cuda" else None


def generation_compile_config(device: torch.device):
    """The `transformers.CompileConfig` with which `model.generate` compiles the decode step of a model retrofitted
    on `device` (`kvpop.retrofit` sets it as `generation_config.compile_config` unless one is set): transformers'
    own defaults (inductor, CUDA graphs) plus `COMPILE_OPTIONS`. None off CUDA, where `generate` does not compile."""
    options = compile_options(device)
    if options is None:
        return None
    from transformers import CompileConfig

    # `mode` and `options` exclude each other in `torch.compile`: the options carry the CUDA graphs
    return CompileConfig(backend=DEFAULT_BACKEND, mode=None, options=options)


def _forward_accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def static_cache(model, max_cache_len: int):
    """Hugging Face's `StaticCache` for `model` (keyword arguments: the signature of transformers 5.17 and 5.24)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def cache_tensors(cache) -> list[Tensor]:
    """The tensors a decode step updates in place: `KVpopCache` slots and counters, or dense keys/values."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "static_tensors"):
            out += layer.static_tensors()
            continue
        for name in ("keys", "values", "cumulative_length"):
            t = getattr(layer, name, None)
            if isinstance(t, Tensor):
                out.append(t)
    return out


def _plain_strides(t: Tensor) -> Tensor:
    """`t` with the strides of a new tensor of its shape (a copy only where they differ).

    Dynamo guards a compiled step on its inputs' strides, size-1 dimensions included, so a first token sliced from
    the prompt (`ids[:, -1:]`, row stride = the prompt's length) compiled the step again for every prompt length
    (76 s at each new context on an H200); `contiguous()` keeps such a view as it is."""
    plain, size = [], 1
    for n in reversed(t.shape):
        plain.insert(0, size)
        size *= max(n, 1)
    return t if t.stride() == tuple(plain) else t.clone(memory_format=torch.contiguous_format)


class Decoder:
    """Prefill eagerly, then decode one token per step with a compiled (CUDA-graph) step on one fixed cache.

    Args:
        model: a causal LM; retrofitted (with a `KVpopCache`) or plain (with a `StaticCache`).
        cache: the cache every call uses; it must not be replaced while the decoder lives.
        compile: False runs the same step eagerly (the reference the tests compare against).
        backend: a `torch.compile` backend ("inductor", the default; "aot_eager" traces without code
            generation, which the CPU tests use) or "cudagraph" (the eager step captured as a CUDA graph).
        mode: `torch.compile` mode; given, it replaces `options` (None: none).
        options: inductor's options; default `COMPILE_OPTIONS` for "inductor" on CUDA (CUDA graphs and
            tuning), none elsewhere.
        fuse: with "cudagraph" (default on), also compile the repeated pieces of a step so the captured
            graph holds fewer kernels: the model's norms and MLPs (`fuse_blocks`), and a `KVpopCache`'s
            per-layer step (`KVpopCache.fuse`); small inductor compiles shared by all layers, applied
            within `decoding()` only. If one fails, the eager step is captured (with a warning).
    """

    def __init__(self, model, cache, *, compile: bool = True, backend: str | None = None, mode: str | None = None,
                 fuse: bool | None = None, options: dict | None = None):
        self.model, self.cache = model, cache
        # the chunked rule's layers count their steps on the device while decoding, and the host runs their
        # decisions between steps (`KVpopCache.steps_on_device`), so a compiled or captured step serves them too
        self._counts = isinstance(cache, KVpopCache) and not cache.is_compileable
        self.kw = cache_kwargs(model, cache)
        # transformers 5.17 still takes `cache_position` (and `StaticCache` writes where it says); 5.24 dropped it
        self._cache_position = _forward_accepts(model, "cache_position")
        self.compiled = compile
        self.step_fn = self._step
        self.backend = None
        self.fuse = False
        self._restore_blocks = None
        # seconds of the first step (it compiles or captures), None before it
        self.first_step_s: float | None = None
        if compile:
            device = next(model.parameters()).device
            backend = backend or DEFAULT_BACKEND
            self.backend = backend
            if backend == CUDA_GRAPH:
                if device.type != "cuda":
                    raise ValueError(f"backend={CUDA_GRAPH!r} needs a CUDA model, got one on {device}; use a "
                                     "torch.compile backend such as 'inductor' or 'aot_eager'")
                # compiled pieces inside the captured graph: fewer kernels per replay (`fuse_blocks`)
                self.fuse = True if fuse is None else fuse
                self.step_fn = CudaGraphStep(self._step, cache, on_failure=self._unfuse)
            else:
                if mode is None and options is None and backend == DEFAULT_BACKEND:
                    options = compile_options(device)
                elif mode is None and options is None and device.type == "cuda":
                    # another backend on CUDA (aot_eager, a test's): inductor's CUDA graphs when it hands over
                    mode = "reduce-overhead"
                # dynamic=False: shapes never change during decoding, and a symbolic shape would only cost guards
                self.step_fn = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend, mode=mode,
                                             options=None if mode is not None else options)

    def _step(self, input_ids: Tensor, position_ids: Tensor, cache_position: Tensor,
              attention_mask: Tensor | None = None) -> Tensor:
        extra = {"cache_position": cache_position} if self._cache_position else {}
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        out = self.model(input_ids=input_ids, position_ids=position_ids, **self.kw, **extra, use_cache=True)
        return out.logits[:, -1]

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, chunk: int = 2048, attention_mask: Tensor | None = None) -> Tensor:
        """Run the prompt [B, S] through the cache eagerly, `chunk` tokens per forward; returns the last logits [B, V].

        `attention_mask` ([B, S], 0 for padding) takes left-padded rows: each row's positions count its
        real tokens only, as `generate` and the reference loops count them.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens >= 1, got shape {tuple(input_ids.shape)}")
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: they must match")
        B, S = input_ids.shape
        if attention_mask is None:
            position = torch.arange(S, device=input_ids.device)[None].expand(B, -1)
        else:
            position = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        for i in range(0, S, chunk):
            ids = input_ids[:, i : i + chunk]
            extra = {"cache_position": torch.arange(i, i + ids.shape[1], device=ids.device)} if self._cache_position else {}
            if attention_mask is not None:
                # every token so far: a dense cache attends them all, a KVpopCache reads the chunk's own columns
                extra["attention_mask"] = attention_mask[:, : i + ids.shape[1]]
            logits = self.model(input_ids=ids, position_ids=position[:, i : i + ids.shape[1]], **self.kw, **extra,
                                use_cache=True, logits_to_keep=1).logits
        return logits[:, -1]

    @contextlib.contextmanager
    def decoding(self) -> contextlib.AbstractContextManager[None]:
        """The state every `step` needs: buffers at fixed addresses, and the cache length frozen for the trace."""
        for t in cache_tensors(self.cache):
            # a static address lets CUDA graphs keep the in-place updates instead of copying the inputs
            torch._dynamo.mark_static_address(t)
        if self.fuse:
            self._restore_blocks = fuse_blocks(self.model)
            if isinstance(self.cache, KVpopCache):
                self.cache.fuse("inductor")
        frozen = self.cache.static_length() if isinstance(self.cache, KVpopCache) else contextlib.nullcontext()
        counted = self.cache.steps_on_device() if self._counts else contextlib.nullcontext()
        try:
            with frozen, counted:
                yield
        finally:
            # the model goes back to its own modules (a captured graph keeps what it recorded)
            self._put_blocks_back()

    def _put_blocks_back(self) -> None:
        if self._restore_blocks is not None:
            self._restore_blocks()
            self._restore_blocks = None

    def _unfuse(self) -> None:
        """Back to the eager blocks and cache step (a compile failed inside the capture's warm-up run)."""
        self._put_blocks_back()
        if isinstance(self.cache, KVpopCache):
            self.cache.fuse(None)
        self.fuse = False

    def close(self) -> None:
        """Let go of the compiled or captured step, and with it the decoder, its cache and the graph's memory.

        The step refers back to the decoder (a bound method), so without this Python frees them only at
        its next full garbage collection, while a long run may already hold the next decoder's cache.
        """
        self.step_fn = None

    def step(self, input_ids: Tensor, position: Tensor, *, cache_position: Tensor | None = None,
             attention_mask: Tensor | None = None) -> Tensor:
        """One token per row: `input_ids` [B, 1], `position` int64 [B, 1] (each row's own); returns logits [B, V].

        `cache_position` (int64 [1], default `position[0]`) is the slot a dense cache writes, the same for
        every row; it differs from `position` for left-padded rows. `attention_mask` ([B, slots] of a
        dense cache, 0 for padding) is needed only by a dense cache of left-padded rows: a `KVpopCache`
        skipped the padding in the prefill, and every decoded token is real.

        Call inside `with decoder.decoding():`, with arguments of the same shapes (and the mask given or
        not) at every step. The logits of a CUDA-graph step live in the graph's memory: use them (argmax,
        copy) before the next step.
        """
        if self.step_fn is None:
            raise RuntimeError("this decoder was closed")
        if self.compiled and input_ids.is_cuda and self.backend != CUDA_GRAPH:
            # a new replay begins: the previous step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        args = (input_ids, position, position[0] if cache_position is None else cache_position)
        if attention_mask is not None:
            args = (*args, attention_mask)
        if self.compiled and self.backend != CUDA_GRAPH:
            args = tuple(_plain_strides(a) for a in args)
        if self.first_step_s is not None:
            out = self.step_fn(*args)
        else:
            # the first step compiles (or captures): timed once, with the one host sync that takes
            start = time.perf_counter()
            out = self.step_fn(*args)
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            self.first_step_s = time.perf_counter() - start
        if self._counts:
            self.cache.step_done()  # the chunked rule's decision after a chunk's last step
        return out

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Tensor | None = None,
                 temperature: float = 0.0, seeds: Tensor | None = None, eos_token_id: int | None = None,
                 check_every: int = 16, chunk: int = 2048) -> Tensor:
        """Greedy or sampled generation: the new tokens [B, n] (n <= max_new_tokens; trimmed after the first EOS of every row).

        Args:
            input_ids: [B, S] prompts, left-padded where `attention_mask` ([B, S], 0 for padding) says so.
                A dense cache (`static_cache`) needs `S + max_new_tokens` slots.
            temperature: 0 is greedy; above it, `kvpop.sampling.gumbel_sample` with a seed per row
                (`seeds`, int64 [B]): token `n` of a row depends on its seed, `n` and its logits only.
        The tokens stay on the device: a stop at `eos_token_id` is checked every `check_every` steps
        (one host sync each); rows that ended go on being fed their own tokens until all have.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        B, S = input_ids.shape
        device = input_ids.device
        if seeds is not None:
            seeds = torch.as_tensor(seeds, dtype=torch.long, device=device)
        step_mask = None
        if attention_mask is None:
            position = torch.full((B, 1), S, dtype=torch.long, device=device)
        else:
            position = attention_mask.long().sum(-1, keepdim=True)  # [B, 1] each row's real tokens
            if not isinstance(self.cache, KVpopCache):
                # a dense cache attends all its slots: the padding stays masked, the slots of new tokens are real
                slots = self.cache.get_max_length()
                if slots < S + max_new_tokens - 1:
                    raise ValueError(f"a dense cache of {slots} slots cannot hold {S} prompt tokens (padding included) "
                                     f"and {max_new_tokens - 1} decoded ones: use static_cache(model, {S + max_new_tokens})")
                step_mask = torch.ones(B, slots, dtype=attention_mask.dtype, device=device)
                step_mask[:, :S] = attention_mask
        logits = self.prefill(input_ids, chunk, attention_mask)
        nxt = next_tokens(logits, seeds, 0, temperature)[:, None]  # [B, 1]
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
        out[:, :1] = nxt
        cache_position = torch.full((1,), S, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        n = 1
        with self.decoding():
            while n < max_new_tokens:
                if eos_token_id is not None:
                    done |= nxt[:, 0] == eos_token_id
                    if n % check_every == 0 and bool(done.all()):
                        break
                logits = self.step(nxt, position, cache_position=cache_position, attention_mask=step_mask)
                nxt = next_tokens(logits, seeds, n, temperature)[:, None]
                out[:, n : n + 1] = nxt
                position += 1
                cache_position += 1
                n += 1
        out = out[:, :n]
        if eos_token_id is not None:
            hit = out == eos_token_id
            if bool(hit.any(-1).all()):
                out = out[:, : int(hit.float().argmax(-1).max()) + 1]
        return out


FUSED_BLOCKS = ("RMSNorm", "MLP")
"""Module class-name endings that `fuse_blocks` compiles: the norms and feed-forward blocks of every layer."""


def fuse_blocks(model, backend: str = "inductor"):
    """Compile the model's norms and MLPs in place (one graph per block shape, shared by all layers).

    A decoder layer of the eager model is ~50 small kernels, four RMSNorms of ~6 each among them;
    inside a captured CUDA graph each is still launched. Compiling these repeated blocks (regional
    compilation: identical modules reuse one compiled graph) fuses them in seconds, where the whole
    8B model step took inductor more than 150 s. Applied to the dense baseline and to KVpop alike.

    Returns:
        a function that puts the original `forward`s back.
    """
    patched = []
    for module in model.modules():
        if type(module).__name__.endswith(FUSED_BLOCKS) and "forward" not in vars(module):
            module.forward = torch.compile(module.forward, fullgraph=True, dynamic=False, backend=backend)
            patched.append(module)

    def restore() -> None:
        for module in patched:
            del module.forward

    return restore


class CudaGraphStep:
    """A decode step captured once as a CUDA graph on its first call, then replayed.

    The step must have static shapes, update the cache in place and never sync with the host (true of
    `KVpopCache` and `StaticCache` steps: the compiled path traces them with `fullgraph=True`). The
    capture needs one real warm-up run on a side stream (library handles, allocator), which inserts
    a token: `KVpopCache`'s buffers are saved before it and restored after, so the first replay
    inserts the token once. A `StaticCache` step writes the same keys and values at the same
    `cache_position` again, so only its other tensors (counters) are restored. Inputs are copied
    into fixed buffers per call; the returned logits live in the graph's memory until the next replay.
    """

    def __init__(self, fn, cache, on_failure=None):
        self.fn, self.cache, self.on_failure = fn, cache, on_failure
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[Tensor] = []
        self.output: Tensor | None = None

    def __call__(self, *args: Tensor) -> Tensor:
        if self.graph is None:
            self._capture(args)
        else:
            for dst, src in zip(self.inputs, args):
                dst.copy_(src)
        self.graph.replay()
        return self.output

    def _capture(self, args: tuple[Tensor, ...]) -> None:
        self.inputs = [a.clone() for a in args]
        if isinstance(self.cache, KVpopCache):
            state = cache_tensors(self.cache)
        else:
            # dense keys/values are rewritten in place at the same position; only counters (a sliding
            # layer's `cumulative_length`) would count the warm-up token twice
            state = [t for layer in self.cache.layers for name, t in vars(layer).items()
                     if isinstance(t, Tensor) and name not in ("keys", "values")]
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            try:
                self.fn(*self.inputs)
            except Exception as err:  # noqa: BLE001 - the compiled pieces are an optimisation only
                if self.on_failure is None:
                    raise
                warnings.warn(f"a compiled piece of the decode step failed ({type(err).__name__}: {err}); "
                              "capturing the eager step instead", stacklevel=2)
                self.on_failure()
                for t, old in zip(state, saved):
                    t.copy_(old)
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        for t, old in zip(state, saved):
            t.copy_(old)
        del saved
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self.fn(*self.inputs)


@torch.no_grad()
def fill_random(model, cache, batch: int, context: int, *, seed: int = 0) -> None:
    """Fill `cache` as if `context` tokens had been seen, with random keys/values, without running the model.

    Decode latency does not depend on the values, and a 128k-token prefill of an 8B model costs minutes.
    `KVpopCache`: every slot the rule would hold after `context` tokens is occupied (sinks, the window
    ring, then top-k positions drawn at random from the older tokens), with random priorities (and random
    static priors for KVpop-TOVA and the cascades); `seen`
    and `processed` = context; a stateful policy starts from its empty memory. Dense caches
    (`DynamicCache`, `StaticCache`): random keys/values at positions `[0, context)`.
    """
    if context < 1 or batch < 1:
        raise ValueError(f"fill_random needs context >= 1 and batch >= 1, got context={context}, batch={batch}")
    c = model.config
    H = c.num_key_value_heads or c.num_attention_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if not isinstance(cache, KVpopCache):
        pos = torch.arange(context, device=device)
        for i in range(len(cache.layers)):
            cache.update(rand(batch, H, context, D), rand(batch, H, context, D), i, {"cache_position": pos})
        return
    from kvpop.ops.dynamic import CASCADES

    policies = model.kvpop.layers
    for layer, policy in zip(cache.layers, policies):
        if isinstance(layer, ChunkedLayerCache):
            # the chunked rule just after a decision: `topk` older tokens in the long-range slots, the ring empty,
            # the chunk's queries still to come
            layer.lazy_initialization(rand(batch, H, 1, D), rand(batch, H, 1, D))
            top = torch.randperm(context, generator=torch.Generator().manual_seed(seed))[: layer.topk].sort().values
            layer.keys.copy_(rand(*layer.keys.shape))
            layer.values.copy_(rand(*layer.values.shape))
            layer.pos.fill_(-1)
            layer.pos[:, :, : len(top)] = top.to(device)
            prior = torch.rand(layer.prior.shape, generator=gen, device=device)
            layer.prior.copy_(torch.where(layer.pos >= 0, prior, float("-inf")))
            layer.queries = torch.zeros(batch, c.num_attention_heads, layer.chunk, D, device=device, dtype=dtype)
            layer.seen.fill_(context)
            layer.processed = context
            continue
        s, w, k = layer.sink, layer.window, layer.topk
        layer.lazy_initialization(rand(batch, H, 1, D), rand(batch, H, 1, D),
                                  with_prior=policy.score in ("prior", *CASCADES))
        sinks = torch.arange(min(s, context))
        window = torch.arange(max(s, context - w), context)
        older = context - w - s  # tokens past the sinks that left the window: the top-k candidates
        top = torch.randperm(max(older, 0), generator=torch.Generator().manual_seed(seed))[:k].sort().values + s
        slot = torch.cat([sinks, s + (window - s) % w, s + w + torch.arange(len(top))])
        kept = torch.cat([sinks, window, top]).to(device)
        slot = slot.to(device)
        layer.keys.copy_(rand(*layer.keys.shape))
        layer.values.copy_(rand(*layer.values.shape))
        layer.pos.fill_(-1)
        layer.pos[:, :, slot] = kept
        pri = torch.rand(layer.pri.shape, generator=gen, device=device)
        layer.pri.copy_(torch.where(layer.pos >= 0, pri, float("-inf")))
        if layer.prior is not None:
            # the static priorities that rank a cascade's static pool
            prior = torch.rand(layer.prior.shape, generator=gen, device=device)
            layer.prior.copy_(torch.where(layer.pos >= 0, prior, float("-inf")))
        layer.seen.fill_(context)
        layer.processed = context
        if policy.stateful or policy.evidence:
            layer.state = policy.init_state(batch, device)


@torch.no_grad()
def stepwise_logits(model, input_ids: Tensor, *, compile: bool | None = None, backend: str | None = None) -> Tensor:
    """Teacher-forced logits [B, S, V] (float32) of `input_ids` fed one token per step through a `KVpopCache`.

    The same numbers as `model(input_ids).logits` for a retrofitted model (the tests check that the
    decode path equals the teacher-forced one for every policy), but for the *dynamic* policies
    (TOVA, H2O), whose teacher-forced pass is itself a token-by-token loop per layer, this runs each
    step as one replayed CUDA graph: on an H200 that is about ten times faster at S = 8192.
    `compile` defaults to "on CUDA"; rows must be unpadded.
    """
    B, S = input_ids.shape
    if compile is None:
        compile = input_ids.is_cuda
    cache = KVpopCache(model)
    # a decoder per call: the eager step captured (seconds) unless told otherwise, never a fresh inductor compile
    backend = backend or (CUDA_GRAPH if input_ids.is_cuda else None)
    decoder = Decoder(model, cache, compile=compile, backend=backend)
    first = decoder.prefill(input_ids[:, :1], chunk=1)  # [B, V]
    out = torch.empty(B, S, first.shape[-1], dtype=torch.float32, device=input_ids.device)
    out[:, 0] = first.float()
    position = torch.ones(B, 1, dtype=torch.long, device=input_ids.device)
    with decoder.decoding():
        for t in range(1, S):
            out[:, t] = decoder.step(input_ids[:, t : t + 1], position).float()
            position.add_(1)
    return out
