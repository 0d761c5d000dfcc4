"""Command-line flags of the evaluation commands: `kvpop bench` and `python -m kvpop.eval.bench` share them."""

from __future__ import annotations

from kvpop.presets import model_help

BENCH_ARGS: list[tuple[tuple[str, ...], dict]] = [
    (("--model",), dict(required=True, metavar="PATH_OR_PRESET", help=model_help(shapes=True))),
    (("--contexts",), dict(default="256,512,1024", help="comma-separated context lengths (default 256,512,1024)")),
    (("--caches",), dict(default="dense,kvpop", help="comma-separated cache kinds: dense, kvpop, cascade (the "
                                                    "layer-wide KVpop-cascade at the same budget), a policy name, or "
                                                    "tova+chunkC, h2o+chunkC, cascade+chunkC (deciding once every C "
                                                    "steps) (default dense,kvpop)")),
    (("--tova-pool-layer",), dict(type=int, default=None, metavar="N",
                                  help="cache kind cascade: its TOVA pool, N of the budget - 1 long-range slots "
                                       "(default: the recommended policy's, (budget - 1) * 3 // 4)")),
    (("--new-tokens",), dict(type=int, default=16, help="timed decode steps per run (default 16)")),
    (("--warmup",), dict(type=int, default=2, help="untimed decode steps before timing (default 2)")),
    (("--batch",), dict(type=int, default=1, help="sequences per step (default 1)")),
    (("--prefill-chunk",), dict(type=int, default=2048, help="tokens per prefill forward (default 2048)")),
    (("--sink",), dict(type=int, default=4, help="sink tokens (default 4)")),
    (("--window",), dict(type=int, default=None, help="protected window (default a quarter of the budget)")),
    (("--topk",), dict(type=int, default=None, help="long-range slots (default: budget - sink - window)")),
    (("--budget",), dict(type=int, default=None, help="sink + window + topk (default 512, KVpopConfig.for_budget; "
                                                    "the paper's GPU setting is 2048)")),
    (("--num-layers",), dict(type=int, default=None, help="decoder layers of a *-shape preset (default: the real count)")),
    (("--device",), dict(default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")),
    (("--dtype",), dict(default=None, choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default: bfloat16 for *-shape presets, else the model's own)")),
    (("--seed",), dict(type=int, default=0, help="seeds prompts and fresh scorers (default 0)")),
    (("--compile",), dict(action="store_true", help="also time a compiled decode step (torch.compile; on CUDA with "
                                                    "CUDA graphs and kvpop's tuning; dense on a StaticCache) beside "
                                                    "each eager row")),
    (("--compile-backend",), dict(default=None, choices=["cudagraph", "inductor", "aot_eager"],
                                  help="with --compile: inductor (the default, tuned on CUDA) or cudagraph (the eager "
                                       "step captured as a CUDA graph: ready in seconds, slower per token)")),
    (("--fill",), dict(default="prefill", choices=["prefill", "random"],
                       help="prefill: run the model over the context (default); random: fill the caches with "
                            "random keys/values as if the context had been seen (decode latency only)")),
    (("--json-out",), dict(default=None, metavar="PATH", help="also write the JSON result to PATH (an existing file "
                                                              "needs --force)")),
    (("--plot",), dict(default=None, metavar="PATH", help="write the memory/latency plot (PNG) to PATH (an existing "
                                                          "file needs --force)")),
    (("--force",), dict(action="store_true", help="replace an existing --json-out or --plot")),
]
