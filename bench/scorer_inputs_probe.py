"""Is KVpop-mlp's recall limited by its inputs? Held-out top-k retention recall of scorers fed different inputs.

    python bench/scorer_inputs_probe.py --train-seqs 32 --eval-seqs 8 --steps 200 --budgets 256,512 \\
        --variants A,B,C,A@1,D,A-big --layers 0::3 --out /tmp/probe/run     # about 23 min on 2 CPU cores

Offline, on features cached from dense forwards of SmolLM2-135M-Instruct over champ rows of S = 2048 tokens
from a document start (training rows from the `train` split, measured rows from the held-out `eval` split,
both built like `kvpop eval`'s `held_out_rows`), scorers are trained with the project's boundary loss
(`kvpop.train.loss`, teacher = the oracle of `kvpop.eval.metrics.priorities_from_records` with the window of
the budget measured, the same fixed decay `gamma = 0.9` for teacher and student) and measured with
`kvpop.eval.metrics.RetentionRecall`, per budget (`KVpopConfig.for_budget`: 4 sinks, `w = B / 4`). Inputs:

- `A`     per (layer, KV head) MLP on that head's `[k; v]` as cached (post-RoPE keys), hidden 256: KVpop-mlp;
- `A-big` the same with hidden 1024 (capacity);
- `B`     one MLP per layer on all KV heads' `[k; v]` concatenated, hidden 256, one score per KV head;
- `C`     one MLP per layer on the attention-input hidden state (output of `input_layernorm`), hidden 256,
          one score per KV head;
- `D`     per (layer, KV head) MLP on `[hidden; k; v]`, hidden 256;
- `M`     the product's stateful mLSTM scorer per layer (`MLSTMScorer`, the default `mlstm_dim` and
          `mlstm_hidden`), each token read out `w` steps after it arrives (the paper's delay = window);
- `M0`    its delay-0 twin (read out at insertion). Both at the budget's full top-k: the probe compares
          scorers, not the memory `--match-mlp-memory` pays for the state.

`--curve-every N` measures the held-out recall every N training steps too (recall vs steps).

Also reported, untrained: `tova-static` (the priority a token would get from the attention of the query that
pushes it out of the window, `max_g log p(t + w -> t)`, with the same decay) and `recency` (score 0: only the
decay ranks, so the newest eligible tokens stay). A variant name may carry a seed, `A@1`, to see the spread.
Prints a table and per-layer recall, writes OUT/scorer_inputs_probe.json (rewritten after every variant)
and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvpop.attention import Capture
from kvpop.config import KVpopConfig
from kvpop.eval.evaluate import held_out_rows
from kvpop.eval.metrics import RetentionRecall, priorities_from_records
from kvpop.models import load_model
from kvpop.policy import static_priority
from kvpop.retrofit import retrofit
from kvpop.scorers.mlstm import MLSTMScorer
from kvpop.train.distill import scorer_lr_factor
from kvpop.train.loss import BoundaryPairs, boundary_labels, boundary_loss, teacher_priority

# name -> (input, hidden, one MLP per layer (True) or per (layer, KV head))
VARIANTS = {
    "A": ("kv", 256, False),
    "A-big": ("kv", 1024, False),
    "B": ("layer_kv", 256, True),
    "C": ("hidden", 256, True),
    "D": ("hidden_kv", 256, False),
}

MLSTM_VARIANTS = {"M": "window", "M0": 0}
"""name -> readout delay of the stateful scorer ("window": the budget's protected window, the paper's)."""


class LayerMLSTMs(nn.Module):
    """One `MLSTMScorer` per layer over its heads' cached `[k; v]`: [B, L, H, S, 2D] -> scores [B, L * H, S]."""

    def __init__(self, layers: int, heads: int, head_dim: int, delay: int, cfg: KVpopConfig):
        super().__init__()
        self.scorers = nn.ModuleList(MLSTMScorer(heads, head_dim, d=cfg.mlstm_dim, hidden=cfg.mlstm_hidden, delay=delay)
                                     for _ in range(layers))

    def forward(self, kv: Tensor) -> Tensor:
        D = kv.shape[-1] // 2
        return torch.cat([s(kv[:, i, ..., :D], kv[:, i, ..., D:]) for i, s in enumerate(self.scorers)], 1)


class GroupMLP(nn.Module):
    """`G` independent two-layer SiLU MLPs, evaluated by one batched matmul (the form of `MLPScorer`)."""

    def __init__(self, groups: int, din: int, hidden: int, dout: int):
        super().__init__()
        self.hidden = hidden
        self.w1 = nn.Parameter(torch.empty(groups, din, hidden).uniform_(-1 / math.sqrt(din), 1 / math.sqrt(din)))
        self.b1 = nn.Parameter(torch.zeros(groups, hidden))
        self.w2 = nn.Parameter(torch.empty(groups, hidden, dout).uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden)))
        self.b2 = nn.Parameter(torch.zeros(groups, dout))

    def forward(self, x: Tensor) -> Tensor:  # x: [B, G, S, din] -> [B, G, S, dout]
        h = F.silu(torch.matmul(x, self.w1) + self.b1[:, None, :])
        return torch.matmul(h, self.w2) + self.b2[:, None, :]


def scorer_input(kind: str, kv: Tensor, hid: Tensor) -> Tensor:
    """The scorer's input for a batch of cached features, float32.

    Args:
        kv: [B, L, H, S, 2D], `[k; v]` as cached.
        hid: [B, L, S, E], attention-input hidden states.
    Returns:
        [B, L * H, S, din] for per-head scorers, [B, L, S, din] for per-layer ones.
    """
    B, L, H, S, _ = kv.shape
    if kind == "kv":
        return kv.float().flatten(1, 2)
    if kind == "layer_kv":
        # every head's [k; v] side by side, so one MLP per layer sees the whole layer's cache entry
        return kv.float().permute(0, 1, 3, 2, 4).flatten(3)
    if kind == "hidden":
        return hid.float()
    if kind == "hidden_kv":
        return torch.cat([hid.float()[:, :, None].expand(B, L, H, S, hid.shape[-1]), kv.float()], -1).flatten(1, 2)
    raise ValueError(f"unknown input kind {kind!r}")


def scores(mlp: GroupMLP | LayerMLSTMs, kind: str, per_layer: bool, kv: Tensor, hid: Tensor) -> Tensor:
    """Scores `r[t]` as [B, L * H, S] (layers and heads flattened, layer-major)."""
    if isinstance(mlp, LayerMLSTMs):
        return mlp(kv)
    B, L, H, S, _ = kv.shape
    out = mlp(scorer_input(kind, kv, hid))
    if per_layer:
        return out.permute(0, 1, 3, 2).reshape(B, L * H, S)  # [B, L, S, H] -> [B, L * H, S]
    return out[..., 0]


@torch.no_grad()
def extract(model, rows: Tensor, layers: list[int], budgets: dict[int, KVpopConfig], check_key: bool) -> list[dict]:
    """Cached features and teacher priorities of each row, one forward at a time.

    Per row: `kv` bf16 [L, H, S, 2D], `hid` bf16 [L, S, E], and per budget `pi` float32 [L * H, S] (oracle),
    `tova` float32 [L * H, S] (untrained proxy) and the boundary `pairs` (`BoundaryPairs` of [1, L * H, S]).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attns = [model.model.layers[i].self_attn for i in layers]
    grab: dict[str, dict[int, Tensor]] = {"hid": {}, "v": {}, "k": {}, "rope": {}}
    hooks = []
    for i, attn in zip(layers, attns):
        def pre(mod, args, kwargs, i=i):
            grab["hid"][i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            grab["rope"][i] = kwargs["position_embeddings"]
        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.v_proj.register_forward_hook(lambda m, a, o, i=i: grab["v"].__setitem__(i, o)))
        hooks.append(attn.k_proj.register_forward_hook(lambda m, a, o, i=i: grab["k"].__setitem__(i, o)))
    cfg = model.kvpop.config
    out = []
    try:
        for n, ids in enumerate(rows):
            records = Capture()
            model(input_ids=ids[None], kvpop_dense=True, kvpop_capture=records, use_cache=False, logits_to_keep=1)
            recs = [r for r in sorted(records, key=lambda r: r.layer_idx) if r.layer_idx in layers]
            H, S, D = recs[0].key.shape[1:]
            v = torch.stack([grab["v"][i].view(1, S, H, D).transpose(1, 2)[0] for i in layers])  # [L, H, S, D]
            k = torch.stack([r.key[0] for r in recs])  # [L, H, S, D]
            if check_key and n == 0:
                # the record's key must be k_proj's output after RoPE: then v (from v_proj) is the matching value
                for i, r in zip(layers, recs):
                    kp = grab["k"][i].view(1, S, H, D).transpose(1, 2)
                    cos, sin = grab["rope"][i]
                    _, kr = apply_rotary_pos_emb(kp, kp, cos, sin)
                    err = (kr - r.key).abs().max().item()
                    if err > 1e-4:
                        raise RuntimeError(f"layer {i}: recorded key differs from rotated k_proj output by {err:.2e}")
                print(f"key check: recorded keys == RoPE(k_proj) in all {len(layers)} layers", flush=True)
            row = {
                "kv": torch.cat([k, v], -1).to(torch.bfloat16),
                "hid": torch.stack([grab["hid"][i][0] for i in layers]).to(torch.bfloat16),
            }
            for b, bc in budgets.items():
                pi = torch.cat(priorities_from_records(recs, cfg, bc.window), 1)  # [1, L * H, S]
                row[f"pi{b}"] = pi[0]
                row[f"tova{b}"] = torch.cat([tova_static(r, bc.window, cfg) for r in recs], 1)[0]
                row[f"pairs{b}"] = boundary_labels(pi, bc.sink, bc.window, bc.topk)
            out.append(row)
            grab = {key: {} for key in grab}
    finally:
        for h in hooks:
            h.remove()
    return out


def tova_static(rec, window: int, cfg: KVpopConfig) -> Tensor:
    """Untrained proxy: `r[t] = max_g log p(t + w -> t)`, the attention token `t` gets from the query that
    pushes it out of the window (TOVA's signal at the moment the token becomes eligible), plus the decay."""
    q, k, lse = rec.query.float(), rec.key.float(), rec.lse.float()  # [1, Hq, S, D], [1, H, S, D], [1, Hq, S]
    B, Hq, S, D = q.shape
    H = k.shape[1]
    kr = k.repeat_interleave(Hq // H, 1)[:, :, : S - window]
    logp = (q[:, :, window:] * kr).sum(-1) * rec.scale - lse[:, :, window:]  # [1, Hq, S - w]
    r = torch.full((B, Hq, S), math.log(cfg.target_eps))
    r[:, :, : S - window] = logp
    r = r.view(B, H, Hq // H, S).amax(2)
    return teacher_priority(r, rec.log_gamma, cfg.decay_step)


def stack_pairs(pairs: list[BoundaryPairs]) -> BoundaryPairs:
    return BoundaryPairs(*(torch.cat(field, 0) for field in zip(*pairs)))


def recall(rows: list[dict], budget: int, bc: KVpopConfig, L: int, priority_of) -> dict:
    """Held-out recall of `priority_of(row) -> float32 [L * H, S]` against the oracle, per layer and overall."""
    acc = RetentionRecall(bc.sink, bc.window, bc.topk)
    for row in rows:
        S = row[f"pi{budget}"].shape[-1]
        # one [1, H, S] priority per layer, as the accumulator takes them
        pi_t, pi_s = row[f"pi{budget}"].view(L, -1, S), priority_of(row).view(L, -1, S)
        acc.update([t[None] for t in pi_t], [s[None] for s in pi_s])
    res = acc.result()
    return {"mean": res.mean, "per_layer": res.per_layer.tolist(), "per_head": res.per_head.tolist()}


def variant_shape(name: str) -> tuple[str, bool]:
    """The input kind and per-layer flag of a variant name (`A`, `A@1`, `M`, ...)."""
    base = name.partition("@")[0]
    if base in MLSTM_VARIANTS:
        return "kv", False
    kind, _, per_layer = VARIANTS[base]
    return kind, per_layer


def train_variant(name: str, train: list[dict], budget: int, bc: KVpopConfig, args, log_gamma: Tensor,
                  held: list[dict] | None = None) -> tuple[GroupMLP | LayerMLSTMs, dict]:
    """Scorers of one variant for one budget, trained with the boundary loss on random training rows.

    With `held` and `args.curve_every`, the held-out recall every that many steps goes into the info's `curve`."""
    base, _, seed = name.partition("@")
    L, H, S, D2 = train[0]["kv"].shape
    E = train[0]["hid"].shape[-1]
    torch.manual_seed(int(seed or 0))
    kind, per_layer = variant_shape(name)
    if base in MLSTM_VARIANTS:
        delay = bc.window if MLSTM_VARIANTS[base] == "window" else MLSTM_VARIANTS[base]
        mlp = LayerMLSTMs(L, H, D2 // 2, delay, bc)
    else:
        _, hidden, _ = VARIANTS[base]
        din = {"kv": D2, "layer_kv": H * D2, "hidden": E, "hidden_kv": E + D2}[kind]
        mlp = GroupMLP(L if per_layer else L * H, din, hidden, H if per_layer else 1)
    opt = torch.optim.AdamW(mlp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-4)
    warmup = max(1, round(0.05 * args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: scorer_lr_factor(s, warmup, args.steps))
    # the same row order for every variant (and budget): differences are the inputs, not the data seen
    gen = torch.Generator().manual_seed(args.seed)
    position = torch.arange(S)[None].expand(args.batch, S)
    lg = log_gamma.repeat(L)  # [L * H], the record's fixed decay
    losses, accs, curve, start = [], [], [], time.perf_counter()
    for step in range(args.steps):
        pick = torch.randint(len(train), (args.batch,), generator=gen).tolist()
        kv = torch.stack([train[i]["kv"] for i in pick])
        hid = torch.stack([train[i]["hid"] for i in pick])
        pairs = stack_pairs([train[i][f"pairs{budget}"] for i in pick])
        pi_hat = static_priority(scores(mlp, kind, per_layer, kv, hid), position, lg, bc.decay_step)
        loss, stats = boundary_loss(pi_hat, pairs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        accs.append(stats["accuracy"].item())
        if held is not None and args.curve_every and (step + 1) % args.curve_every == 0:
            r = recall(held, budget, bc, L, student_of(mlp, kind, per_layer, bc, log_gamma, L, S))["mean"]
            curve.append({"step": step + 1, "recall": r, "loss": sum(losses[-args.curve_every:]) / args.curve_every})
            print(f"  {name} B={budget} step {step + 1}: held-out recall {r:.4f}", flush=True)
        if (step + 1) % max(1, args.steps // 5) == 0:
            k = max(1, args.steps // 10)
            print(f"  {name} B={budget} step {step + 1}/{args.steps}: loss {sum(losses[-k:]) / k:.4f} "
                  f"acc {sum(accs[-k:]) / k:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    k = max(1, args.steps // 10)
    return mlp, {"train_s": time.perf_counter() - start, "loss_last": sum(losses[-k:]) / k,
                 "acc_last": sum(accs[-k:]) / k, "params": sum(p.numel() for p in mlp.parameters()),
                 **({"curve": curve} if curve else {})}


def student_of(mlp, kind: str, per_layer: bool, bc: KVpopConfig, log_gamma: Tensor, L: int, S: int):
    """A trained variant as `recall`'s `priority_of(row)`: its scores plus the fixed decay."""

    @torch.no_grad()
    def student(row):
        r = scores(mlp, kind, per_layer, row["kv"][None], row["hid"][None])
        return static_priority(r, torch.arange(S)[None], log_gamma.repeat(L), bc.decay_step)[0]

    return student


def parse_layers(spec: str, n: int) -> list[int]:
    """`all`, a slice `start:stop:step` (`0::3`) or a comma list."""
    if spec == "all":
        return list(range(n))
    if ":" in spec:
        return list(range(n))[slice(*(int(x) if x else None for x in spec.split(":")))]
    return [int(x) for x in spec.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-seqs", type=int, default=32)
    p.add_argument("--eval-seqs", type=int, default=8)
    p.add_argument("--train-recall-seqs", type=int, default=8, help="training rows whose recall is reported")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budgets", default="512,256")
    p.add_argument("--variants", default="A,B,C,A-big,D")
    p.add_argument("--layers", default="all")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--curve-every", type=int, default=0, help="held-out recall every N steps too (0: only at the end)")
    p.add_argument("--out", default="/tmp/s16/probe/run")
    args = p.parse_args(argv)
    if args.curve_every < 0:
        raise SystemExit(f"--curve-every {args.curve_every}: must be >= 0 (0: recall only at the end)")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    model, tok = load_model("smollm2-135m", device="cpu")
    budgets = {int(b): KVpopConfig.for_budget(int(b)) for b in args.budgets.split(",")}
    retrofit(model, next(iter(budgets.values())))
    model.eval()
    layers = parse_layers(args.layers, len(model.model.layers))
    variants = args.variants.split(",")
    for v in variants:
        if v.partition("@")[0] not in VARIANTS and v.partition("@")[0] not in MLSTM_VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: use {sorted(VARIANTS) + sorted(MLSTM_VARIANTS)} (optionally @seed)")
    train_ids = held_out_rows("champ", tok, args.seq_len, args.train_seqs, split="train", seed=args.seed)
    eval_ids = held_out_rows("champ", tok, args.seq_len, args.eval_seqs, split="eval", seed=args.seed)
    print(f"rows: train {tuple(train_ids.shape)}, eval {tuple(eval_ids.shape)}; layers {layers}; "
          f"budgets {[(b, c.sink, c.window, c.topk) for b, c in budgets.items()]}", flush=True)
    train = extract(model, train_ids, layers, budgets, check_key=True)
    print(f"train features: {time.perf_counter() - t0:.0f} s", flush=True)
    held = extract(model, eval_ids, layers, budgets, check_key=False)
    extract_s = time.perf_counter() - t0
    print(f"features: {extract_s:.0f} s", flush=True)
    # the record's decay (gamma_init of an untrained retrofit), shared by teacher and student
    log_gamma = torch.tensor([math.log(model.kvpop.config.gamma_init)] * train[0]["kv"].shape[1])
    L, H, S = len(layers), train[0]["kv"].shape[1], args.seq_len
    scale = {k: {"rms": train[0][k].float().pow(2).mean().sqrt().item(), "absmax": train[0][k].float().abs().max().item()}
             for k in ("kv", "hid")}
    del model

    result = {"command": "python bench/scorer_inputs_probe.py " + " ".join(argv or __import__("sys").argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {platform.processor() or ''} threads={args.threads}, torch {torch.__version__}",
              "args": vars(args), "layers": layers, "input_scale_row0": scale, "extract_s": extract_s,
              "budgets": {b: {"sink": c.sink, "window": c.window, "topk": c.topk} for b, c in budgets.items()},
              "rows": {}}
    sub = train[: args.train_recall_seqs]
    path = out / "scorer_inputs_probe.json"
    for b, bc in budgets.items():
        # score 0 for every token: only the decay ranks (the same for every row)
        recency = static_priority(torch.zeros(1, L * H, S), torch.arange(S)[None], log_gamma.repeat(L),
                                  bc.decay_step)[0]
        for name, fn in (("recency", lambda row, r=recency: r), ("tova-static", lambda row, b=b: row[f"tova{b}"])):
            r = recall(held, b, bc, L, fn)
            result["rows"][f"{name}|{b}"] = {"variant": name, "budget": b, "eval": r, "train": recall(sub, b, bc, L, fn)}
            print(f"{name:12s} B={b}: held-out recall {r['mean']:.4f}", flush=True)
        for name in variants:
            mlp, info = train_variant(name, train, b, bc, args, log_gamma, held)
            kind, per_layer = variant_shape(name)
            student = student_of(mlp, kind, per_layer, bc, log_gamma, L, S)

            row = {"variant": name, "budget": b, **info, "eval": recall(held, b, bc, L, student),
                   "train": recall(sub, b, bc, L, student)}
            result["rows"][f"{name}|{b}"] = row
            print(f"{name:12s} B={b}: held-out recall {row['eval']['mean']:.4f}, train {row['train']['mean']:.4f} "
                  f"({info['train_s']:.0f} s, {info['params']} params)", flush=True)
            path.write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(result, indent=1))

    print(f"\nheld-out top-k retention recall vs the oracle ({len(held)} eval rows; train = {len(sub)} training rows), "
          f"S = {S}, layers {args.layers}, {args.steps} steps x {args.batch} seq")
    print(f"{'variant':12s} " + " ".join(f"{'B=' + str(b) + ' eval':>11s} {'train':>7s}" for b in budgets))
    names = ["recency", "tova-static"] + variants
    for name in names:
        cells = []
        for b in budgets:
            r = result["rows"].get(f"{name}|{b}")
            cells.append(f"{r['eval']['mean']:11.4f} {r['train']['mean']:7.4f}" if r else f"{'-':>11s} {'-':>7s}")
        print(f"{name:12s} " + " ".join(cells))
    for b in budgets:
        print(f"\nper-layer held-out recall, B = {b}")
        print("layer " + " ".join(f"{n:>8s}" for n in names))
        for j, layer in enumerate(layers):
            print(f"{layer:5d} " + " ".join(f"{result['rows'][f'{n}|{b}']['eval']['per_layer'][j]:8.3f}" for n in names))
    print(json.dumps({"bench": "scorer_inputs_probe", "wall_s": result["wall_s"],
                      "recall": {k: round(v["eval"]["mean"], 4) for k, v in result["rows"].items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
