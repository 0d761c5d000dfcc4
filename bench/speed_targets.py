"""The speed targets of the defaults, from the JSON results `bench/gpu_speed_defaults.sh` leaves in a folder.

    python bench/speed_targets.py OUT_DIR

Reads whichever results are there (a phase that did not run is left out) and prints one line per target: the
measured ratio, the bound, whether it is met, and the numbers behind it; then the compile times (first and from
inductor's cache), then one JSON line. Targets:
- decode, Qwen3-8B shape, 36 layers, B = 2048 (`kvpop bench`, compiled rows): the static rule and the layer-wide
  cascade at most 1.5x the bandwidth floor at 4k and 128k, the cascade within 5 % of the static rule, each flat
  (128k within 10 % of 4k);
- `model.generate` at SmolLM2's shape, 4k prompt, batch 1 and 4 (`bench/bench_generate.py`): KVpop's ms per token
  with the prefill counted at most compiled `StaticCache`'s (the cascade's beside it);
- prefill of one 8192-token prompt at B = 2048 (`bench/bench_prefill.py`, the last repeat of each row): the recommended
  policy's walk, and its chunked rule's rounds (`cascade+chunkC`), at most 3x the dense forward at the Qwen3-8B shape
  and 2x at SmolLM2's (TOVA's, H2O's and the static rule's ratios beside it, for the record);
- a distillation step (`bench/bench_distill.py`): "auto" at least as fast as FlexAttention over the sequence (what
  "auto" picks below its threshold) at SmolLM2's shape and at the Qwen3-4B shape.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # a log whose last line is the JSON result
        return json.loads(text.splitlines()[-1])


def _decode_rows(*results: dict | None) -> dict[tuple[str, int], dict]:
    """Compiled rows without an error, by (cache, context); a later result replaces an earlier one's row."""
    rows = {}
    for result in results:
        for r in (result or {}).get("rows", []):
            if r.get("compiled") and not r.get("error"):
                rows[(r["cache"], r["context"])] = r
    return rows


def targets(folder: Path) -> tuple[list[dict], dict]:
    lines, compile_s = [], {}

    def check(name: str, value: float | None, bound: float, detail: str, at_most: bool = True) -> None:
        met = None if value is None else (value <= bound if at_most else value >= bound)
        lines.append({"target": name, "value": value, "bound": bound, "met": met, "detail": detail})

    cold, warm = _load(folder, "decode_cold.json"), _load(folder, "decode_long.json")
    dense = _load(folder, "decode_dense.json")
    chunked = _load(folder, "decode_chunked.json")
    rows = _decode_rows(cold, warm, chunked)
    for kind in ("kvpop", "cascade", "cascade+chunk64"):
        for context in (4096, 131072):
            r = rows.get((kind, context))
            if r is not None:
                check(f"decode 8B {kind} {context // 1024}k x floor", r.get("x_floor"), 1.5,
                      f"{r['ms_per_token']:.2f} ms, floor {r.get('floor_ms') or float('nan'):.2f} ms")
        a, b = rows.get((kind, 4096)), rows.get((kind, 131072))
        if a and b:
            check(f"decode 8B {kind} 128k / 4k", b["ms_per_token"] / a["ms_per_token"], 1.10,
                  f"{a['ms_per_token']:.2f} -> {b['ms_per_token']:.2f} ms, peak {a['peak_mb']:.0f} -> {b['peak_mb']:.0f} MB")
    for context in (4096, 131072):
        s, c = rows.get(("kvpop", context)), rows.get(("cascade", context))
        if s and c:
            check(f"decode 8B cascade / static {context // 1024}k", c["ms_per_token"] / s["ms_per_token"], 1.05,
                  f"{c['ms_per_token']:.2f} against {s['ms_per_token']:.2f} ms")
    d = _decode_rows(dense).get(("dense", 4096))
    s = rows.get(("kvpop", 4096))
    if d and s:
        check("decode 8B static / compiled dense 4k", s["ms_per_token"] / d["ms_per_token"], 1.0,
              f"{s['ms_per_token']:.2f} against {d['ms_per_token']:.2f} ms")
    for label, result in (("first", cold), ("cached", warm), ("dense first", dense)):
        for r in (result or {}).get("rows", []):
            if r.get("compiled") and r.get("compile_s") is not None and r["context"] == 4096:
                compile_s[f"decode 8B {r['cache']} ({label})"] = r["compile_s"]

    for batch in (1, 4):
        for tag, label in (("", "first"), ("_cached", "cached")):
            result = _load(folder, f"generate_b{batch}{tag}.json")
            if result is None:
                continue
            by_kind = {r["cache"]: r for r in result["rows"]}
            base = by_kind.get("static")
            for kind in ("kvpop", "cascade"):
                r = by_kind.get(kind)
                if r is None:
                    continue
                if base is not None and not tag:
                    check(f"generate SmolLM2 b{batch} {kind} / static", r["wall_ms_per_token"] / base["wall_ms_per_token"],
                          1.0, f"{r['wall_ms_per_token']:.2f} against {base['wall_ms_per_token']:.2f} ms/token, prefill "
                          f"{r['wall_prefill_s']:.3f} against {base['wall_prefill_s']:.3f} s, decode "
                          f"{r['wall_decode_ms']:.2f} against {base['wall_decode_ms']:.2f} ms")
            for kind, r in by_kind.items():
                if r.get("compile_s") is not None:
                    compile_s[f"generate SmolLM2 b{batch} {kind} ({label})"] = r["compile_s"]

    for shape, label, bound in (("8b", "8B", 3.0), ("smollm2", "SmolLM2", 2.0)):
        result = _load(folder, f"prefill_{shape}.json")
        if result is None:
            continue
        last = {r["policy"]: r["wall_all"][-1] for r in result["rows"]}
        if "dense" not in last:
            continue
        chunked = sorted((p for p in last if p.startswith("cascade+chunk")), key=lambda p: int(p.split("chunk")[1]))
        for policy in ("cascade", *chunked, "tova", "h2o", "kvpop"):
            if policy not in last:
                continue
            ratio = last[policy] / last["dense"]
            detail = f"{last[policy]:.3f} against {last['dense']:.3f} s, {result['rows'][0]['context']} tokens"
            if policy == "cascade" or policy in chunked:
                check(f"prefill {label} {policy} / dense", ratio, bound, detail)
            else:
                lines.append({"target": f"prefill {label} {policy} / dense (for the record)", "value": ratio,
                              "bound": None, "met": None, "detail": detail})

    for shape, today in (("smollm2", "flex"), ("4b", "flex")):
        auto = _load(folder, f"distill_{shape}_auto.json")
        other = _load(folder, f"distill_{shape}_{today}.json")
        if auto and other:
            a, o = auto["rows"][0], other["rows"][0]
            check(f"distill {shape} auto ({a['attention_auto']}) / {today}", a["step_s_median"] / o["step_s_median"], 1.0,
                  f"{1e3 * a['step_s_median']:.0f} against {1e3 * o['step_s_median']:.0f} ms/step, {a['num_layers']} "
                  f"layers, S = {a['seq_len']}")
        gathered = _load(folder, f"distill_{shape}_gather.json")
        if auto and gathered:
            a, g = auto["rows"][0], gathered["rows"][0]
            lines.append({"target": f"distill {shape} gather / auto (for the record)",
                          "value": g["step_s_median"] / a["step_s_median"], "bound": None, "met": None,
                          "detail": f"{1e3 * g['step_s_median']:.0f} against {1e3 * a['step_s_median']:.0f} ms/step"})
    return lines, compile_s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python bench/speed_targets.py OUT_DIR (a folder of bench/gpu_speed_defaults.sh results)",
              file=sys.stderr)
        return 2
    folder = Path(argv[0])
    lines, compile_s = targets(folder)
    width = max([len(x["target"]) for x in lines] + [6])
    for x in lines:
        value = "-" if x["value"] is None else f"{x['value']:.3f}"
        bound = "" if x["bound"] is None else f"<= {x['bound']:.2f}"
        verdict = {True: "met", False: "MISSED", None: ""}[x["met"]]
        print(f"{x['target']:<{width}}  {value:>7}  {bound:>7}  {verdict:<6}  {x['detail']}")
    for name, seconds in compile_s.items():
        print(f"compile  {name:<{width}}  {seconds:7.1f} s")
    print(json.dumps({"targets": lines, "compile_s": compile_s, "folder": str(folder)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
