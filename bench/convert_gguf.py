"""Convert a GGUF preset's file into its cache directory with a tokenizer converted on another machine.

transformers before 5.23 builds the tokenizer of a Gemma GGUF file wrongly (`kvpop.gguf_models.check_tokenizer_support`),
and a machine without network cannot install a newer one. Its weights convert right, so this writes the preset's
directory from the file's weights and the tokenizer of a conversion made where transformers is newer (its
`tokenizer.json` and `tokenizer_config.json`); `--model gemma3-270m` then loads it like any other conversion.

    python bench/convert_gguf.py gemma3-270m $HOME/stage/gemma3.gguf --tokenizer $HOME/stage/tokenizer
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvpop import gemma3, gguf_models, smollm2

PRESETS = {"gemma3-270m": gemma3.source, "smollm2-135m": smollm2.source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("gguf", type=Path, help="the preset's GGUF file (its SHA-256 is checked)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory holding the converted tokenizer")
    args = parser.parse_args()
    src = PRESETS[args.preset]()
    start = time.perf_counter()
    out = gguf_models.ensure_converted(
        src.converted_dir(), src.sha256, lambda work: src.prepare(work, args.gguf),
        lambda gguf, out: gguf_models.convert(gguf, out, src.sha256, tokenizer=args.tokenizer), src.about)
    print(f"{args.preset}: {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
