"""The paper's figures as small PNGs: eviction pattern (Fig. 6), recall per layer (Fig. 7), memory and latency (Fig. 4),
training runs' loss curves side by side (`train_log.jsonl` records, e.g. 1 GPU against 2), recall against training
steps (`bench/recall_curve.py`), and the long-context suite's accuracy by needle depth and prompt length
(`kvpop eval --suite`).

Each `plot_*` function takes plain arrays (numpy or torch), writes one PNG and returns its path.
`eviction_counts` runs a retrofitted model over a text and returns what the eviction-pattern plot
shows. Figures are drawn on `matplotlib.figure.Figure` directly, not through pyplot, so no display
is needed and the caller's matplotlib backend is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch
from matplotlib.colors import BoundaryNorm
from matplotlib.figure import Figure

from kvpop.cache import KVpopCache, cache_kwargs
from kvpop.retrofit import kvpop_modules

DPI = 110
# visible stand-ins for characters a tick label would swallow
VISIBLE = {"\n": "⏎", "\r": "↵", "\t": "⇥", " ": "␣"}


def visible_token(text: str) -> str:
    """A token string with newlines, tabs and spaces drawn as visible symbols (never empty)."""
    return "".join(VISIBLE.get(ch, ch) for ch in text) or "∅"


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One readable label per token id: each decoded on its own, whitespace made visible."""
    return [visible_token(tokenizer.decode([int(i)])) for i in ids]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


@torch.no_grad()
def eviction_counts(model, input_ids, last: int = 112, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """How many KV heads of each layer still hold each of the `last` newest evictable tokens.

    The sequence goes once through a `KVpopCache` (prefilled in one chunk unless `chunk` is given;
    the result is the same, only memory differs), and each layer's slot positions
    (`cache.layers[i].pos`, -1 = empty) are read at the end. The tokens shown are not the last
    `last` of the sequence: those sit in the protected window, which every head keeps. They are the
    `last` tokens ending just before it, positions `S - w - last .. S - w - 1` (never before the
    sinks), where the eviction decisions are visible.

    Args:
        model: a model prepared by `kvpop.retrofit`.
        input_ids: int64 [1, S] or [S], one sequence without padding.
        last: how many tokens to report.
        chunk: prefill chunk length (None: the whole sequence at once).
    Returns:
        kept_counts: int64 [L, T] in `[0, Hkv]`, on the cpu.
        positions: int64 [T], the positions of the reported tokens.
    """
    cfg = kvpop_modules(model).config
    ids = torch.as_tensor(input_ids)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1:
        raise ValueError(f"eviction_counts takes one sequence, got a batch of {ids.shape[0]}")
    S = ids.shape[1]
    end = S - cfg.window  # the first position inside the protected window
    start = max(cfg.sink, end - last)
    if end <= start:
        raise ValueError(
            f"a sequence of {S} tokens has nothing evictable: it needs more than sink + window = "
            f"{cfg.sink} + {cfg.window} tokens"
        )
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = KVpopCache(model)
    step = chunk or S
    for i in range(0, S, step):
        model(ids[:, i : i + step], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    positions = torch.arange(start, end, device=device)
    counts = []
    for layer in cache.layers:
        held = (layer.pos[0][:, :, None] == positions).any(dim=1)  # [Hkv, T]
        counts.append(held.sum(0))
    return torch.stack(counts).cpu(), positions.cpu()


def plot_eviction_pattern(
    kept_counts,  # [L, T] int
    tokens: Sequence[str],
    n_heads: int,
    path: str | Path,
    title: str = "Eviction pattern",
    positions=None,  # [T] int, optional: named in the axis label
) -> Path:
    """Fig. 6: layers x tokens, colour = number of KV heads retaining the token.

    Args:
        kept_counts: int [L, T], values in `[0, n_heads]` (see `eviction_counts`).
        tokens: T tick labels (made visible with `visible_token`).
        n_heads: KV heads per layer, the top of the colour scale.
    """
    counts = np.asarray(kept_counts)
    L, T = counts.shape
    if len(tokens) != T:
        raise ValueError(f"{len(tokens)} token labels for {T} columns")
    width = min(24.0, 2.0 + 0.13 * T)
    height = 1.6 + 0.16 * L
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    cmap = matplotlib.colormaps["viridis"].resampled(n_heads + 1)
    norm = BoundaryNorm(np.arange(-0.5, n_heads + 1), cmap.N)
    im = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, origin="lower")
    ax.set_xticks(range(T))
    ax.set_xticklabels([visible_token(t) for t in tokens], rotation=90, fontsize=7)
    step = max(1, L // 12)
    ax.set_yticks(range(0, L, step))
    ax.set_ylabel("layer")
    if positions is not None:
        pos = np.asarray(positions)
        ax.set_xlabel(f"token (positions {pos[0]}..{pos[-1]}, the last before the protected window)")
    else:
        ax.set_xlabel("token")
    ax.set_title(title)
    bar = fig.colorbar(im, ax=ax, ticks=range(n_heads + 1), fraction=0.03, pad=0.01)
    bar.set_label("KV heads retaining")
    return _save(fig, path)


def plot_recall_per_layer(recall, path: str | Path, title: str = "Top-k retention recall per layer") -> Path:
    """Fig. 7: recall per layer, a box over its heads with the heads as points, and the global mean.

    Args:
        recall: float [L, H] in [0, 1] (NaN entries are ignored).
    """
    recall = np.asarray(recall, dtype=float)
    L, H = recall.shape
    fig = Figure(figsize=(min(14.0, 2.5 + 0.3 * L), 3.6))
    ax = fig.subplots()
    columns = [col[np.isfinite(col)] for col in recall]
    ax.boxplot(columns, positions=range(L), widths=0.6, showfliers=False, medianprops={"color": "tab:orange"})
    rng = np.random.default_rng(0)
    for layer, col in enumerate(columns):
        jitter = rng.uniform(-0.18, 0.18, size=col.size)
        ax.scatter(layer + jitter, col, s=10, color="tab:blue", alpha=0.6, linewidths=0, zorder=3)
    mean = float(np.nanmean(recall))
    ax.axhline(mean, color="tab:red", linestyle="--", linewidth=1, label=f"mean {mean:.3f}")
    ax.set_xticks(range(0, L, max(1, L // 15)))
    ax.set_xticklabels(range(0, L, max(1, L // 15)))
    ax.set_xlim(-0.7, L - 0.3)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"recall (over {H} heads)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_memory_latency(rows: Sequence[dict], path: str | Path, title: str = "Decoding cost against context") -> Path:
    """Fig. 4: memory (left) and per-token latency (right) against context length, one line per cache.

    Args:
        rows: dicts with "cache", "context", "ms_per_token", "peak_mb" (and optionally
            "memory_kind", used in the axis label), as `kvpop.eval.bench.bench_decode` returns.
            Rows whose numbers are missing (e.g. out of memory) are skipped.
    """
    rows = [r for r in rows if r.get("ms_per_token") is not None and r.get("peak_mb") is not None]
    if not rows:
        raise ValueError("no rows with measurements to plot")
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    kinds = sorted({r.get("memory_kind", "peak memory") for r in rows})
    fig = Figure(figsize=(9.0, 3.6))
    ax_mem, ax_lat = fig.subplots(1, 2)
    for cache in caches:
        mine = sorted((r for r in rows if r["cache"] == cache), key=lambda r: r["context"])
        x = [r["context"] for r in mine]
        ax_mem.plot(x, [r["peak_mb"] for r in mine], marker="o", label=cache)
        ax_lat.plot(x, [r["ms_per_token"] for r in mine], marker="o", label=cache)
    contexts = sorted({r["context"] for r in rows})
    for ax in (ax_mem, ax_lat):
        if contexts[-1] >= 4 * contexts[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([_short(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_mem.set_ylabel(f"MB ({', '.join(kinds)})")
    ax_mem.set_title("memory")
    ax_lat.set_ylabel("ms per token (median)")
    ax_lat.set_title("decode latency")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_training_curves(
    runs: dict[str, Sequence[dict]], path: str | Path, keys: Sequence[str] = ("loss_kl", "loss_score"),
    title: str = "Training losses per step",
) -> Path:
    """One panel per logged quantity, one line per run, against the step.

    Args:
        runs: run name -> its `train_log.jsonl` records (dicts with "step" and every key in `keys`).
        keys: the logged quantities to draw, one panel each.
    """
    if not runs or not all(runs.values()):
        raise ValueError(f"every run needs at least one record; got {({n: len(r) for n, r in runs.items()})}")
    for name, records in runs.items():
        missing = sorted({k for k in ("step", *keys) for r in records if k not in r})
        if missing:
            raise ValueError(f"run {name!r}: records lack {missing}; a train_log.jsonl record has 'step', 'loss_kl', ...")
    fig = Figure(figsize=(4.5 * len(keys), 3.4))
    axes = np.atleast_1d(fig.subplots(1, len(keys)))
    for ax, key in zip(axes, keys):
        for (name, records), style in zip(runs.items(), ("-", "--", ":", "-.") * len(runs)):
            ax.plot([r["step"] for r in records], [r[key] for r in records], style, linewidth=1.2, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_recall_curve(curves: Sequence[dict], path: str | Path,
                      title: str = "Top-k retention recall against the oracle, held out") -> Path:
    """Recall against training steps, one panel per budget, one line per run (`bench/recall_curve.py`).

    Args:
        curves: dicts with `name`, `budget`, `points` (pairs of steps and recall, the steps counted over
            the whole chain of runs) and `starts` (the steps at which a later run of the chain began:
            a dotted line each, e.g. full distillation after scorer-only pre-training).
    """
    if not curves:
        raise ValueError("no curve to draw")
    budgets = sorted({c["budget"] for c in curves}, reverse=True)
    fig = Figure(figsize=(5.5 * len(budgets), 3.6))
    axes = np.atleast_1d(fig.subplots(1, len(budgets)))
    for ax, budget in zip(axes, budgets):
        for c in (c for c in curves if c["budget"] == budget):
            steps, recall = zip(*c["points"]) if c["points"] else ((), ())
            (line,) = ax.plot(steps, recall, marker="o", markersize=3, linewidth=1.2, label=c["name"])
            for start in c["starts"]:
                ax.axvline(start, color=line.get_color(), linestyle=":", linewidth=1.0)
        ax.set_ylim(0.0, 1.02)
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel("recall vs oracle")
        ax.set_title(f"B = {budget}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_depth_heatmaps(panels: dict, path: str | Path, title: str = "accuracy by needle depth and prompt length") -> Path:
    """The suite's heatmap: one panel per task, needle depth (rows) x prompt length (columns), colour = accuracy.

    Args:
        panels: task -> (accuracy [D, L] in [0, 1], NaN where nothing ran; sample counts [D, L] int;
            the D depths; the L lengths), as `kvpop.eval.suite_report.heatmap_grid` returns.
    Each cell is written as correct/n, so a cell of one sample is not read as a rate.
    """
    if not panels:
        raise ValueError("no panels to plot")
    fig = Figure(figsize=(1.4 + 2.6 * len(panels), 3.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)[0])
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    im = None
    for ax, (task, (acc, n, depths, lengths)) in zip(axes, panels.items()):
        acc = np.asarray(acc, dtype=float)
        n = np.asarray(n)
        if acc.shape != (len(depths), len(lengths)) or n.shape != acc.shape:
            raise ValueError(f"panel {task!r}: accuracy {acc.shape} and counts {n.shape} must be "
                             f"[{len(depths)} depths, {len(lengths)} lengths]")
        im = ax.imshow(np.ma.masked_invalid(acc), cmap=cmap, vmin=0.0, vmax=1.0, origin="upper", aspect="auto")
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                if n[i, j]:
                    ax.text(j, i, f"{round(acc[i, j] * n[i, j])}/{n[i, j]}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([_short(int(x)) for x in lengths])
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{d:.0%}" for d in depths])
        ax.set_xlabel("prompt length (tokens)")
        if ax is axes[0]:
            ax.set_ylabel("needle depth")
        ax.set_title(task)
    bar = fig.colorbar(im, ax=list(axes), fraction=0.05, pad=0.02)
    bar.set_label("accuracy")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_policy_grid(rows: Sequence[str], columns: Sequence[str], accuracy, counts, path: str | Path,
                     title: str = "long-context tasks") -> Path:
    """Policies (rows) against tasks at each needle depth (columns), colour = accuracy, cells correct/n
    (`kvpop.eval.suite_report.policy_grid` gives the arguments)."""
    acc, n = np.asarray(accuracy, dtype=float), np.asarray(counts)
    if acc.shape != (len(rows), len(columns)) or n.shape != acc.shape:
        raise ValueError(f"accuracy {acc.shape} and counts {n.shape} must be [{len(rows)} rows, {len(columns)} columns]")
    fig = Figure(figsize=(2.6 + 1.1 * len(columns), 0.9 + 0.38 * len(rows)), layout="constrained")
    ax = fig.subplots()
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(acc), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            if n[i, j]:
                ax.text(j, i, f"{round(acc[i, j] * n[i, j])}/{n[i, j]}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02).set_label("accuracy")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
