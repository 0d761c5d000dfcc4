"""Score a store of finished generations (`kvpop eval --generate`'s OUT/generations.jsonl) on any machine.

    python bench/score_generations.py runs/fid/generations.jsonl --budget 1024 --out runs/fid_scored

`kvpop eval --generate` keeps every finished generation in its store before it scores them. Where the scoring
cannot run (the GPU machine has no math-verify for pass@1, or the process ran out of time), this script scores the
store elsewhere with the same functions (`kvpop.eval.fidelity`): the dense model's NLL of each text, the on-policy
agreement past the budget, repeated 4-grams and pass@1 of the held-out champ problems the store was made from
(the first `--problems` of the eval split, greedy). Prints the fidelity table, writes fidelity.json and
fidelity.png into `--out`, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from kvpop.presets import model_help


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store", help="a generations.jsonl written by kvpop eval --generate")
    p.add_argument("--budget", type=int, required=True, help="the budget of the store's bounded rows")
    p.add_argument("--model", default="smollm2-135m", help=f"the dense model that generated the store and scores it: {model_help()} (default smollm2-135m)")
    p.add_argument("--problems", type=int, default=8, help="held-out champ problems of the store (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/scored")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    from kvpop.eval import fidelity as F
    from kvpop.eval.metrics import is_correct
    from kvpop.models import load_model
    from kvpop.train.data import champ_problems

    base, tok = load_model(args.model, device=args.device)
    problems = champ_problems("eval", seed=args.seed)[: args.problems]
    prompts = [F.champ_prompt(tok, q["problem"]) for q in problems]
    fields = {f.name for f in dataclasses.fields(F.Generation)}
    gens = []
    for line in Path(args.store).read_text().splitlines():
        record = json.loads(line)
        g = F.Generation(**{k: v for k, v in record.items() if k in fields})
        if g.mode != "greedy" or g.problem >= len(problems):
            continue
        logp, top = F.dense_scores(base, prompts[g.problem], g.tokens)
        g.logp, g.dense_argmax = [round(float(x), 5) for x in logp], top.tolist()
        # the answer a user gets ends at the first EOS
        end = g.tokens.index(tok.eos_token_id) + 1 if tok.eos_token_id in g.tokens else len(g.tokens)
        g.correct = is_correct(tok.decode(g.tokens[:end], skip_special_tokens=True), problems[g.problem]["answer"])
        gens.append(g)
    policies = ["dense"] + sorted({g.policy for g in gens} - {"dense"})
    rows = [F.summarise([g for g in gens if g.policy == name], name, args.budget, "greedy") for name in policies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = F.format_fidelity_table(rows)
    (out / "fidelity.txt").write_text(table + "\n")
    (out / "fidelity.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    F.plot_nll_by_position(gens, [args.budget], out / "fidelity.png",
                           title=f"{args.model}: dense NLL of each policy's own text (B = {args.budget})")
    print(table)
    print(json.dumps({"rows": [{"policy": r.policy, "nll": r.nll, "nll_past_budget": r.nll_past_budget,
                                "agreement": r.agreement} for r in rows]}))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
