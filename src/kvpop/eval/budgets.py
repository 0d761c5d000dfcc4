"""Per-layer budgets at the same total memory (`docs/method.md` Sec. 8): measure, then allocate.

    kvpop budgets --model smollm2-135m --data champ --seq-len 2048 --budget 256 --sequences 2 --out b256.json
    kvpop train ... --budget 256 --layer-budgets b256.json
    kvpop eval ... --budgets 256 --policies tova,oracle --layer-budgets b256.json   # + rows `tova+layers`, ...

Sensitivity of a layer at `k` long-range slots: the share of its dense attention mass that a static
rule drops - the oracle's (the teacher's own top-k, the best a static scorer can do), or a trained
scorer's own ranking (`--trained DIR`: where *that* scorer loses mass) - averaged over
query heads and the queries where eviction can act (`q >= sink + window`). It comes from the dense
pass alone: with the layer's captured queries and keys, one sparse-attention pass per candidate `k`
returns its log-normaliser, and `1 - exp(lse_sparse - lse_dense)` is the mass lost at each query.
No full forward per layer and budget, and no `S x S` tensor on the GPU (FlexAttention).

Allocation: each layer's lost mass against `k` is made convex (its lower hull), then the
`L x topk` long-range slots go, a segment at a time, to the layer whose lost mass falls fastest per
slot (greedy on convex curves is optimal). The result is per-layer *budgets* `B_l = sink + window +
k_l` with `sum_l B_l = L x B`, so that any policy's split (sink, window) turns them into its
`layer_topk = B_l - sink - window` at the same memory (`KVpopConfig.with_layer_budgets`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kvpop.attention import Capture
from kvpop.config import KVpopConfig
from kvpop.eval.metrics import priorities_from_records
from kvpop.files import read_json_object
from kvpop.ops.attention import sparse_attention
from kvpop.ops.topk import eviction_positions
from kvpop.retrofit import detach, retrofit

GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
"""Candidate long-range slots per layer, as multiples of the uniform `topk`."""


def candidate_topk(topk: int, seq_len: int, sink: int, window: int, grid: Sequence[float] = GRID) -> list[int]:
    """The distinct `k` the sensitivity is measured at: `grid x topk`, capped at the eligible tokens."""
    cap = max(0, seq_len - sink - window)
    return sorted({min(cap, round(g * topk)) for g in grid})


@torch.no_grad()
def lost_mass(
    records: Sequence,  # LayerRecords of a dense pass (kvpop_dense=True)
    cfg: KVpopConfig,
    candidates: Sequence[int],
    priorities: Sequence[Tensor] | None = None,
) -> Tensor:
    """Mass of dense attention a static rule drops, per layer and candidate `k`: float64 [L, K].

    The rule ranks by `priorities` (per layer float32 [B, Hkv, S]: a trained policy's), by default the
    oracle's (the teacher's own ranking, from the same records). Summed over (batch, query head,
    query `q >= sink + window`); divide by `counted(...)` for the mean.
    """
    teacher = priorities_from_records(records, cfg) if priorities is None else list(priorities)
    out = torch.zeros(len(teacher), len(candidates), dtype=torch.float64)
    # one row per captured layer, in order (a hybrid model's full-attention layers only)
    for row, (rec, pri) in enumerate(zip(sorted(records, key=lambda r: r.layer_idx), teacher)):
        q, k = rec.query, rec.key
        pos, valid = rec.position, rec.valid
        start = cfg.sink + cfg.window
        counted = valid & (pos >= start)  # [B, S]
        for j, topk in enumerate(candidates):
            evict = eviction_positions(pri, pos[:, None], valid[:, None], cfg.sink, cfg.window, topk, ordered=True)
            # values do not matter for the normaliser: the keys stand in for them (no copy)
            _, lse = sparse_attention(q, k, k, pos, valid, pos, valid, evict, cfg.sink, cfg.window, rec.scale,
                                      return_lse=True, softcap=rec.softcap)
            kept = torch.exp((lse - rec.lse.float()).clamp(max=0.0))  # [B, Hq, S]; sparse mass <= dense mass
            lost = (1.0 - kept) * counted[:, None, :]
            out[row, j] = lost.double().sum().cpu()
    return out


def counted(input_ids: Tensor, num_query_heads: int, sink: int, window: int) -> int:
    """(batch, query head, query) triples `lost_mass` sums over, for unpadded rows [B, S]."""
    B, S = input_ids.shape
    return B * num_query_heads * max(0, S - sink - window)


def _lower_hull(x: Sequence[float], y: Sequence[float]) -> list[tuple[float, float]]:
    """Lower convex hull of the points `(x_i, y_i)` (x increasing), from left to right."""
    hull: list[tuple[float, float]] = []
    for p in zip(x, y):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the chord from hull[-2] to p
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(curves: Tensor, candidates: Sequence[int], topk: int) -> list[int]:
    """Long-range slots per layer summing to `L x topk` that minimise the total lost mass.

    Args:
        curves: float [L, K], each layer's lost mass (any scale, the same for all layers) at `candidates`.
        candidates: increasing `k` values, starting at 0, the largest >= `topk`.
        topk: the uniform split's top-k.
    Returns:
        `k_l` per layer, integers in `[0, max(candidates)]`, summing to exactly `L x topk`.
    """
    L = curves.shape[0]
    if list(candidates) != sorted(set(candidates)) or candidates[0] != 0 or candidates[-1] < topk:
        raise ValueError(f"candidates {list(candidates)} must increase from 0 to at least topk={topk}")
    segments = []  # (slope, layer, length): lost mass per slot along each layer's convex curve
    for layer in range(L):
        hull = _lower_hull([float(c) for c in candidates], curves[layer].tolist())
        for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
            segments.append(((y2 - y1) / (x2 - x1), layer, int(x2 - x1)))
    # steepest fall first; ties go to the lower layer, then the earlier segment (a stable order)
    segments.sort(key=lambda s: s[0])
    left, k = L * topk, [0] * L
    for _, layer, length in segments:
        take = min(length, left)
        k[layer] += take
        left -= take
        if left == 0:
            break
    if left:
        raise ValueError(f"{L} layers x {candidates[-1]} slots cannot hold {L * topk}: extend the grid")
    return k


@torch.no_grad()
def measure(model: nn.Module, batches: Iterable[Tensor], cfg: KVpopConfig | None = None,
            grid: Sequence[float] = GRID) -> tuple[list[int], Tensor, int]:
    """Per-layer lost mass of a static rule for unpadded `batches` of ids [B, S] of one length.

    Args:
        model: a base model (the oracle's rule, at the split of `cfg`), or a model retrofitted with a
            static policy (a trained KVpop: its own priorities and split; `cfg` must be None). The
            attention measured is the model's dense attention either way.
    Returns:
        the candidate `k`s, the mean lost mass float64 [L, K], and the number of counted queries.
    """
    own = getattr(model, "kvpop", None) is not None
    if own:
        if cfg is not None:
            raise ValueError("a retrofitted model measures its own split: pass cfg=None")
        cfg = model.kvpop.config
        if cfg.layer_topk is not None or model.kvpop.policies[0].dynamic or cfg.topk == 0:
            raise ValueError(f"measuring needs a uniform static ranking; {cfg.policy!r} with layer_topk="
                             f"{cfg.layer_topk} and topk={cfg.topk} has none")
    else:
        model = retrofit(model, KVpopConfig(sink=cfg.sink, window=cfg.window, topk=max(1, cfg.topk),
                                            policy="oracle", gamma_init=cfg.gamma_init, decay_step=cfg.decay_step))
    try:
        device = next(model.parameters()).device
        heads = model.config.num_attention_heads
        total, n, candidates = None, 0, None
        for ids in batches:
            ids = ids.to(device)
            if candidates is None:
                candidates = candidate_topk(cfg.topk, ids.shape[1], cfg.sink, cfg.window, grid)
            records = Capture()
            model(ids, kvpop_dense=True, kvpop_capture=records, use_cache=False, logits_to_keep=1)
            priorities = None
            if own:
                sparse = Capture()
                model(ids, kvpop_capture=sparse, use_cache=False, logits_to_keep=1)
                priorities = [r.priority.detach() for r in sorted(sparse, key=lambda r: r.layer_idx)]
            sums = lost_mass(records, model.kvpop.config, candidates, priorities)
            total = sums if total is None else total + sums
            n += counted(ids, heads, cfg.sink, cfg.window)
    finally:
        if not own:
            detach(model)
    if total is None or n == 0:
        raise ValueError(f"no query beyond sink + window = {cfg.sink + cfg.window}: give longer sequences")
    return candidates, total / n, n


def mean_lost(curves: Tensor, candidates: Sequence[int], ks: Sequence[int]) -> float:
    """Mean over layers of the lost mass at `k_l` slots, linear between the measured candidates."""
    import numpy as np

    x = np.asarray(candidates, dtype=np.float64)
    return float(np.mean([np.interp(k, x, row) for k, row in zip(ks, curves.double().numpy())]))


def layer_budgets(cfg: KVpopConfig, candidates: Sequence[int], curves: Tensor) -> list[int]:
    """Per-layer budgets `B_l = sink + window + k_l` with `sum_l B_l = L x cfg.budget`."""
    return [cfg.sink + cfg.window + k for k in allocate(curves, candidates, cfg.topk)]


def write(path: str | Path, cfg: KVpopConfig, budgets: Sequence[int], candidates: Sequence[int], curves: Tensor,
          **extra) -> Path:
    """The allocation as JSON: what `--layer-budgets FILE` reads back (`read`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"budget": cfg.budget, "sink": cfg.sink, "window": cfg.window, "layer_budgets": list(budgets),
           "candidates_topk": list(candidates), "lost_mass": curves.tolist(), **extra}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    return path


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read(path: str | Path) -> tuple[int, list[int]]:
    """`(budget, layer_budgets)` from a file `write` made; a clear error for anything else."""
    path = Path(path)
    doc = read_json_object(path, "the per-layer budget file")
    if "budget" not in doc or "layer_budgets" not in doc:
        raise ValueError(f"{path}: not a per-layer budget file written by `kvpop budgets` (no 'budget' and "
                         "'layer_budgets')")
    budget, budgets = doc["budget"], doc["layer_budgets"]
    if not _count(budget) or not isinstance(budgets, list) or not budgets or not all(_count(b) for b in budgets):
        raise ValueError(f"{path}: 'budget' must be an integer >= 1 and 'layer_budgets' a list of integers >= 1")
    if sum(budgets) != len(budgets) * budget:
        raise ValueError(f"{path}: layer_budgets sum to {sum(budgets)}, not layers x budget = {len(budgets) * budget}")
    return budget, budgets


__all__ = ["GRID", "allocate", "candidate_topk", "layer_budgets", "lost_mass", "mean_lost", "measure", "read", "write"]
