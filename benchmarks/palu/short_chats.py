"""What a short conversation's cache holds: palu's tiers beside mlx-lm's caches at chat lengths.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        hatch run bench:python benchmarks/palu/short_chats.py

Writes ``benchmarks/results/palu_short_chats.json``. Most chat turns are short, and a per-sequence
fixed cost (a fitted basis, exact windows, spare capacity) can make a short one dearer than no
compression. Each cache here takes one prefill of the first ``n`` tokens of kvbench's held-out
text on the real model (computed in float32, keys and values rounded to bfloat16 as a bfloat16
model caches them) and reports ``nbytes`` summed over the layers: every array it holds,
capacity included, as mlx-lm's own ``KVCache`` (which grows 256 tokens at a time) counts it too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
from kvbench.models import default_text_path
from kvbench.results import environment_stamp, results_path, write_json
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from palu_mlx import KVCacheBuilder, KVCacheConfig
from palu_mlx.compare import load_model, tier_config
from palu_mlx.models import model_kv_dims

OUT = results_path("palu_short_chats.json")
#: prompt lengths: a one-line question, a short turn, a few turns, a long context
LENGTHS = (14, 101, 300, 1673)
#: registry tiers measured beside the zero-argument default (the fitted palu-2.25bit-scaled+rel by
#: name: the file's "palu default" row measured it when KVCacheConfig() was that tier)
TIER_NAMES = ("rotation-4bit", "rotation-3.5bit", "palu-2.25bit-scaled+rel")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    head_dim, n_kv = model_kv_dims(model)
    configs = {name: tier_config(name, head_dim, n_kv) for name in TIER_NAMES}
    tokens = tokenizer.encode(default_text_path().read_text(encoding="utf-8"), add_special_tokens=False)
    makers = {
        "mlx-lm KVCache": lambda: make_prompt_cache(model),
        "mlx-lm-q4": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers],
        "palu default (KVCacheConfig())": lambda: KVCacheBuilder.for_model(model, KVCacheConfig()),
        **{
            name: (lambda config=config: KVCacheBuilder.for_model(model, config))
            for name, config in configs.items()
        },
    }
    rows = []
    for n in LENGTHS:
        held = {}
        for name, make in makers.items():
            caches = make()
            model(mx.array(tokens[:n])[None], cache=caches)
            mx.eval([c.state for c in caches])
            held[name] = sum(int(c.nbytes) for c in caches)
        base = held["mlx-lm KVCache"]
        rows.append({"tokens": n, "bytes": held, "x_mlx_lm": {k: v / base for k, v in held.items()}})
        print(n, "  ".join(f"{k} {v / base:.3f}x" for k, v in held.items()), flush=True)
    write_json(
        args.out,
        {
            **environment_stamp(["mlx", "mlx-lm", "palu-mlx", "kvbench"]),
            "command": "LD_PRELOAD=<OpenBLAS> hatch run bench:python benchmarks/palu/short_chats.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": info,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
