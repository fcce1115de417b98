"""The data-free rotation code of short sliding windows, on every layer of the real model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        hatch run bench:python benchmarks/palu/rotation_code.py

Writes ``benchmarks/results/palu_rotation_code.json``. palu gives the rotation code
(:mod:`palu_mlx.rotation_code`: a fixed Hadamard rotation per head, 4 bits per rotated channel under
a per-token scale, nothing fitted) to sliding windows too short to pay for a fitted projection. A
window of the real model would be too few tokens to score, so the code runs here on every layer of
``smollm2-135m`` (full attention), beside mlx-lm's ``KVCache``, its 4-bit ``QuantizedKVCache`` and
palu's zero-argument default, under kvbench's protocol (``kvbench.protocol.measure``: KL and top-1
agreement with the uncompressed model, bytes averaged over the decode positions), computed in
float32 with keys and values rounded to bfloat16 (``palu-mlx compare --compute-dtype float32``).
The rotation code (:class:`~palu_mlx.rotation_code.RotationKVCache`, each head's mean key and
value taken over the prefill) runs with a 32-token exact recent window and 4 exact first tokens
(the default's) and with only the first token exact; and, to show what the means buy, without
them (a plain ``CalibratedKVCache`` on the same code) with only the first token exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from kvbench.models import default_text_path
from kvbench.protocol import Candidate, Settings, measure, text_windows
from kvbench.results import environment_stamp, results_path, write_json
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from palu_mlx import CalibratedKVCache, KVCacheBuilder, KVCacheConfig
from palu_mlx.compare import MLXRunner, load_model
from palu_mlx.models import model_kv_dims
from palu_mlx.rope import model_rotaries
from palu_mlx.rotation_code import ROTATION_BITS, RotationKVCache, rotation_code

OUT = results_path("palu_rotation_code.json")


def rotation_caches(model: Any, recent: int, sinks: int, means: bool = True) -> list[Any]:
    """The rotation code on every full-attention layer, keys before RoPE where palu probes them;
    ``means``: each head's mean subtracted (RotationKVCache), else not (CalibratedKVCache)."""
    head_dim, heads = model_kv_dims(model)
    config = dataclasses.replace(
        KVCacheConfig(method="palu").for_head_dim(head_dim), palu_recent_tokens=recent, palu_sink_tokens=sinks
    )
    rotaries = model_rotaries(model, head_dim) or [None] * len(model.layers)
    code = rotation_code(heads, head_dim)
    cls = RotationKVCache if means else CalibratedKVCache
    return [
        cls(config, code, code, rotaries[i]) if type(c) is KVCache else c
        for i, c in enumerate(make_prompt_cache(model))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="kvbench's real model unless a name or path is given")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--scored-tokens", type=int, default=128)
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    settings = Settings(
        windows=args.windows,
        context_tokens=args.context_tokens,
        scored_tokens=args.scored_tokens,
        new_tokens=1,
        speed_rounds=1,
        speed_steps=1,
        prompt_count=1,
    )
    text = default_text_path().read_text(encoding="utf-8")
    windows = text_windows(tokenizer.encode(text), settings)
    head_dim = model_kv_dims(model)[0]
    group = 64 if head_dim % 64 == 0 else 32
    candidates = [
        Candidate("baseline", "baseline", "mlx-lm KVCache", lambda: make_prompt_cache(model)),
        Candidate(
            "mlx-lm-q4",
            "peer",
            f"mlx-lm QuantizedKVCache, 4-bit, group size {group}",
            lambda: [QuantizedKVCache(group_size=group, bits=4) for _ in make_prompt_cache(model)],
        ),
        Candidate(
            "palu-default",
            "tier",
            "KVCacheBuilder.for_model(model, KVCacheConfig())",
            lambda: KVCacheBuilder.for_model(model, KVCacheConfig()),
        ),
        Candidate(
            "rotation-code",
            "tier",
            f"rotation code, {ROTATION_BITS} bits, 4 first and 32 newest tokens exact",
            lambda: rotation_caches(model, recent=32, sinks=4),
        ),
        Candidate(
            "rotation-code-r0",
            "tier",
            f"rotation code, {ROTATION_BITS} bits, the first token exact",
            lambda: rotation_caches(model, recent=0, sinks=1),
        ),
        Candidate(
            "rotation-code-r0-no-means",
            "tier",
            f"rotation code without the means, {ROTATION_BITS} bits, the first token exact",
            lambda: rotation_caches(model, recent=0, sinks=1, means=False),
        ),
    ]
    rows = measure(runner=MLXRunner(model, tokenizer), candidates=candidates, windows=windows,
                   prompts=[windows[0][: settings.context_tokens]], settings=settings)  # fmt: skip
    keep = ("name", "description", "resident_ratio_decode_mean", "kv_ratio_decode_mean", "kl_mean",
            "kl_p99", "top1_agreement", "positions_scored")  # fmt: skip
    result = {
        **environment_stamp(["mlx", "mlx-lm", "palu-mlx", "kvbench"]),
        "command": "LD_PRELOAD=<OpenBLAS> hatch run bench:python benchmarks/palu/rotation_code.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "tool": "benchmarks/palu/rotation_code.py",
        "model": info,
        "settings": settings.as_dict(),
        "rows": [{k: row.get(k) for k in keep} for row in rows],
    }
    write_json(args.out, result)
    for row in result["rows"]:
        print(f"{row['name']:26s} bytes x {row['resident_ratio_decode_mean']:.3f}  KL {row['kl_mean']:.4g}  "
              f"top-1 {row['top1_agreement']:.3f}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
