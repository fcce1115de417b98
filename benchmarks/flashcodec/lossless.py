"""Lossless K/V sizes and speeds on the real model: the exponent coder beside png-keep1 and zlib.

Runs the model (SmolLM2-135M-Instruct by default, the real model of kvbench) once over a window of
kvbench's held-out text with transformers' ``DynamicCache`` and takes every layer's keys and
values exactly as the cache holds them, in bfloat16 (the model's dtype) and, from a second run with
the model in float16, in float16. For each it measures, from the bytes actually held:

* :class:`flashcodec.codecs.lossless.ExponentCoder` per group size: the in-memory form
  (``ExponentPacked.nbytes``), the saved form (``to_bytes`` at zlib levels 1 and 6), exceptions,
  whether decoding gives every bit back, and encode / decode time (best of ``--repeats``),
  also as the time to decode the whole cache against one decode step of the model at that length;
* the tier ``png-keep1`` (a ``CodecKVCache`` holding the same K/V: held bytes);
* zlib level 6 on the raw bytes, as the general-purpose baseline.

Every ratio is over the bytes of the uncompressed cache (2 bytes an element).

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/flashcodec/lossless.py   # results/flashcodec_lossless.json
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib

import torch
from common import add_device_options, save, stamp


def capture(model_dir: str, dtype: torch.dtype, ids: list[int]):
    """``(keys, values, seconds of one decode step)``: every layer's K/V ``[L, H, S, D]``."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:-1]]), cache=cache, logits_to_keep=1)
        keys = torch.cat([layer.keys for layer in cache.layers]).clone()
        values = torch.cat([layer.values for layer in cache.layers]).clone()
        steps = []
        for _ in range(3):  # one decode step at this length (the cache grows by a token each time)
            t = time.perf_counter()
            model(input_ids=torch.tensor([ids[-1:]]), cache=cache, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
    return keys, values, min(steps)


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def measure(keys: torch.Tensor, values: torch.Tensor, step_s: float, groups, repeats: int) -> dict:
    from flashcodec import CodecKVCache
    from flashcodec.codecs import PNGCodec
    from flashcodec.codecs.lossless import ExponentCoder, ExponentPacked

    raw = keys.nbytes + values.nbytes
    out = {
        "shape_per_tensor": list(keys.shape),
        "raw_bytes": raw,
        "decode_step_seconds": step_s,
        "exponent_coder": {},
    }
    for group in groups:
        coder = ExponentCoder(group)
        row = {"memory_bytes": 0, "saved_bytes_zlib1": 0, "saved_bytes_zlib6": 0, "exceptions": 0}
        enc_s = dec_s = 0.0
        exact = True
        for x in (keys, values):
            t_enc, packed = best_time(lambda x=x, c=coder: c.encode(x), repeats)
            t_dec, back = best_time(lambda p=packed, c=coder: c.decode(p), repeats)
            enc_s, dec_s = enc_s + t_enc, dec_s + t_dec
            exact &= torch.equal(back.view(torch.int16), x.view(torch.int16))
            saved = packed.to_bytes(level=6)
            again = coder.decode(ExponentPacked.from_bytes(saved))
            exact &= torch.equal(again.view(torch.int16), x.view(torch.int16))
            row["memory_bytes"] += packed.nbytes
            row["saved_bytes_zlib6"] += len(saved)
            row["saved_bytes_zlib1"] += len(packed.to_bytes(level=1))
            row["exceptions"] += packed.exceptions
        row.update(
            bit_exact=bool(exact),
            memory_ratio=row["memory_bytes"] / raw,
            saved_ratio_zlib1=row["saved_bytes_zlib1"] / raw,
            saved_ratio_zlib6=row["saved_bytes_zlib6"] / raw,
            exception_rate=row["exceptions"] / (keys.numel() + values.numel()),
            encode_seconds=enc_s,
            decode_seconds=dec_s,
            encode_mb_per_s=raw / enc_s / 1e6,
            decode_mb_per_s=raw / dec_s / 1e6,
            decode_whole_cache_in_steps=dec_s / step_s,
        )
        out["exponent_coder"][str(group)] = row
    # png-keep1 on the same tokens: every layer's K/V in one CodecKVCache ([L, H, S, D] as [B, H, S, D])
    png = CodecKVCache(codec=PNGCodec(8, keep_ratio=1.0))
    png.append(keys, values)
    storage = png.storage_bytes()
    out["png_keep1"] = {"held_bytes": storage.held, "held_ratio": storage.held / raw}
    t, packed = best_time(
        lambda: [
            zlib.compress(x.contiguous().view(torch.int16).numpy().tobytes(), 6) for x in (keys, values)
        ],
        1,
    )
    out["zlib6_raw_bytes"] = {
        "bytes": sum(map(len, packed)),
        "ratio": sum(map(len, packed)) / raw,
        "encode_seconds": t,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="kvbench model name or directory (default: the real model)"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text in the cache")
    parser.add_argument("--groups", default="16,32,64,128", help="ExponentCoder group sizes")
    parser.add_argument("--repeats", type=int, default=3)
    add_device_options(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvbench.cli import load_eval_text
    from kvbench.models import resolve_model
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    text, text_path = load_eval_text(None)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)[: args.tokens + 1]
    if len(ids) != args.tokens + 1:
        raise SystemExit(f"the held-out text has only {len(ids)} tokens")
    groups = [int(g) for g in args.groups.split(",")]
    results = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        keys, values, step_s = capture(model_dir, dtype, ids)
        results[name] = measure(keys, values, step_s, groups, args.repeats)
        best = results[name]["exponent_coder"][str(groups[-1] if 64 not in groups else 64)]
        print(
            f"{name}: in memory {best['memory_ratio']:.3f}x, saved {best['saved_ratio_zlib6']:.3f}x, "
            f"png-keep1 {results[name]['png_keep1']['held_ratio']:.3f}x, bit exact {best['bit_exact']}"
        )
    data = {
        "what": "lossless K/V coders on the real model's cache: bytes over the uncompressed cache's, "
        "bit-exactness, encode/decode time (one thread)",
        "model": model_dir,
        "text": str(text_path),
        "tokens": args.tokens,
        "environment": stamp(["flashcodec-kv", "torch", "transformers"], torch.device("cpu")),
        "results": results,
    }
    save(data, "flashcodec_lossless", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
