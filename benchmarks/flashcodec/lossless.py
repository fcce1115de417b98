"""Lossless K/V sizes and speeds on the real model: the exponent and context coders beside png-keep1 and zlib.

Runs the model (SmolLM2-135M-Instruct by default, the real model of kvbench) once over a window of
kvbench's held-out text with transformers' ``DynamicCache`` and takes every layer's keys and
values exactly as the cache holds them, in bfloat16 (the model's dtype) and, from a second run with
the model in float16, in float16. For each it measures, from the bytes actually held:

* :class:`flashcodec.codecs.lossless.ExponentCoder` per group size: the in-memory form
  (``ExponentPacked.nbytes``), the saved form (``to_bytes`` at zlib levels 1 and 6), exceptions,
  whether decoding gives every bit back, and encode / decode time (best of ``--repeats``),
  also as the time to decode the whole cache against one decode step of the model at that length,
  and the saved form's time (encode + ``to_bytes``, ``from_bytes`` + decode, zlib 6);
* :class:`flashcodec.codecs.lossless_context.ContextCoder` (``save_cache(coder="context")``):
  keys and values coded together as ``save_cache`` codes a cache, its bytes (and bits an element
  per part), exactness and encode / decode time (best of ``--context-repeats``);
* ``side_by_side``: both coders' saved forms, ratio and MB/s, in one list;
* ``entropy``: the empirical entropies (bits an element) the context model was chosen from: the
  exponent given nothing, its channel, the same channel's previous token, both, the neighbouring
  channel; the sign and top two mantissa bits given the exponent (and the channel, and the
  previous sign); the other mantissa bits;
* the tier ``png-keep1`` (a ``CodecKVCache`` holding the same K/V: held bytes);
* zlib level 6 on the raw bytes, as the general-purpose baseline.

Every ratio is over the bytes of the uncompressed cache (2 bytes an element).

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/flashcodec/lossless.py   # results/flashcodec_lossless.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

import numpy as np
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


def entropy_bits(*columns: np.ndarray) -> float:
    """Empirical joint entropy, bits an element, of integer columns of one length."""
    key = np.zeros(columns[0].size, np.int64)
    for c in columns:
        key = key * (int(c.max()) + 1) + c.ravel().astype(np.int64)
    counts = np.unique(key, return_counts=True)[1]
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def conditional_bits(target: np.ndarray, *context: np.ndarray) -> float:
    """H(target | context) = H(target, context) - H(context)."""
    return entropy_bits(target, *context) - entropy_bits(*context) if context else entropy_bits(target)


def entropies(x: torch.Tensor) -> dict:
    """Bits an element of ``x [L, H, S, D]``'s fields, given the contexts a coder could model."""
    e_bits, m_bits = {torch.bfloat16: (8, 7), torch.float16: (5, 10)}[x.dtype]
    steps = x.shape[-2]
    b = x.permute(2, 0, 1, 3).reshape(steps, -1).contiguous().view(torch.int16).numpy().view(np.uint16)
    b = b.astype(np.int64)  # [S, channels], channels in (L, H, D) order
    exponent = (b >> m_bits) & ((1 << e_bits) - 1)
    sign = b >> 15
    top2 = (b >> (m_bits - 2)) & 3
    low = b & ((1 << (m_bits - 2)) - 1)
    lanes = np.broadcast_to(np.arange(b.shape[1]), b.shape)
    # previous token (the first has none: a value no exponent takes) and neighbouring channel
    none = 1 << e_bits
    prev = np.concatenate([np.full((1, b.shape[1]), none), exponent[:-1]])
    prev_sign = np.concatenate([np.full((1, b.shape[1]), 2), sign[:-1]])
    d = x.shape[-1]
    neighbour = np.concatenate([np.full((steps, 1), none), exponent[:, :-1]], axis=1)
    neighbour[:, ::d] = none  # channel 0 of each head has no neighbour in its head
    sm = sign * 4 + top2
    return {
        "exponent": conditional_bits(exponent),
        "exponent_given_channel": conditional_bits(exponent, lanes),
        "exponent_given_previous_token": conditional_bits(exponent, prev),
        "exponent_given_previous_token_and_channel": conditional_bits(exponent, prev, lanes),
        "exponent_given_neighbour_channel": conditional_bits(exponent, neighbour),
        "sign_top2_mantissa": conditional_bits(sm),
        "sign_top2_mantissa_given_exponent": conditional_bits(sm, exponent),
        "sign_top2_mantissa_given_exponent_and_channel": conditional_bits(sm, exponent, lanes),
        "sign_given_exponent_and_channel": conditional_bits(sign, exponent, lanes),
        "sign_given_exponent_channel_and_previous_sign": conditional_bits(sign, exponent, lanes, prev_sign),
        "other_mantissa_bits_given_exponent": conditional_bits(low, exponent),
        "other_mantissa_bits_raw": float(m_bits - 2),
        "order0_16_bits": conditional_bits(b),
    }


def measure_context(keys: torch.Tensor, values: torch.Tensor, step_s: float, repeats: int) -> dict:
    """The context coder on keys and values coded together (as ``save_cache(coder="context")``)."""
    from flashcodec.codecs.lossless_context import ContextCoder

    raw = keys.nbytes + values.nbytes
    n = keys.numel() + values.numel()
    coder = ContextCoder()
    enc_s, blob = best_time(lambda: coder.encode_many([keys, values]), repeats)
    dec_s, back = best_time(lambda: ContextCoder.decode_many(blob), repeats)
    exact = all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(back, (keys, values), strict=True)
    )
    header = json.loads(blob[9 : 9 + int.from_bytes(blob[5:9], "little")])
    return {
        "model": dict(
            zip(("codes", "lane_weight", "shared_weight", "shared_mass"), header["model"], strict=True)
        ),
        "bytes": len(blob),
        "ratio": len(blob) / raw,
        "bit_exact": bool(exact),
        "escapes": header["escapes"],
        "bits_per_element": {name: 8 * size / n for name, size in header["parts"].items()},
        "encode_seconds": enc_s,
        "decode_seconds": dec_s,
        "encode_mb_per_s": raw / enc_s / 1e6,
        "decode_mb_per_s": raw / dec_s / 1e6,
        "decode_whole_cache_in_steps": dec_s / step_s,
        "constriction": header["constriction"],
    }


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
        enc_s = dec_s = save_s = load_s = 0.0
        exact = True
        for x in (keys, values):
            t_enc, packed = best_time(lambda x=x, c=coder: c.encode(x), repeats)
            t_dec, back = best_time(lambda p=packed, c=coder: c.decode(p), repeats)
            enc_s, dec_s = enc_s + t_enc, dec_s + t_dec
            exact &= torch.equal(back.view(torch.int16), x.view(torch.int16))
            t_bytes, saved = best_time(lambda p=packed: p.to_bytes(level=6), repeats)
            t_from, again = best_time(lambda b=saved: ExponentPacked.from_bytes(b), repeats)
            save_s, load_s = save_s + t_enc + t_bytes, load_s + t_from + t_dec
            again = coder.decode(again)
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
            saved_encode_mb_per_s=raw / save_s / 1e6,
            saved_decode_mb_per_s=raw / load_s / 1e6,
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
    parser.add_argument(
        "--context-repeats", type=int, default=1, help="timing repeats of the (slow) context coder"
    )
    parser.add_argument("--no-entropy", action="store_true", help="skip the entropy measurements")
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
        results[name] = r = measure(keys, values, step_s, groups, args.repeats)
        group = 64 if 64 in groups else groups[-1]
        best = r["exponent_coder"][str(group)]
        print(
            f"{name}: in memory {best['memory_ratio']:.3f}x, saved {best['saved_ratio_zlib6']:.3f}x, "
            f"png-keep1 {r['png_keep1']['held_ratio']:.3f}x, bit exact {best['bit_exact']}",
            flush=True,
        )
        r["context_coder"] = ctx = measure_context(keys, values, step_s, args.context_repeats)
        r["side_by_side"] = [
            {
                "coder": f"exponent (group {group}, zlib 6)",
                "ratio": best["saved_ratio_zlib6"],
                "encode_mb_per_s": best["saved_encode_mb_per_s"],
                "decode_mb_per_s": best["saved_decode_mb_per_s"],
                "bit_exact": best["bit_exact"],
            },
            {
                "coder": "context",
                "ratio": ctx["ratio"],
                "encode_mb_per_s": ctx["encode_mb_per_s"],
                "decode_mb_per_s": ctx["decode_mb_per_s"],
                "bit_exact": ctx["bit_exact"],
            },
        ]
        for row in r["side_by_side"]:
            print(
                f"  {row['coder']}: {row['ratio']:.4f}x, encode {row['encode_mb_per_s']:.1f} MB/s, "
                f"decode {row['decode_mb_per_s']:.1f} MB/s, bit exact {row['bit_exact']}",
                flush=True,
            )
        if not args.no_entropy:
            r["entropy"] = {"keys": entropies(keys), "values": entropies(values)}
            for which, h in r["entropy"].items():
                print(f"  {which} entropy (bits/element): " + ", ".join(f"{k} {v:.3f}" for k, v in h.items()))
    data = {
        "what": "lossless K/V coders on the real model's cache: bytes over the uncompressed cache's, "
        "bit-exactness, encode/decode time (one thread); the exponent and context coders side by side; "
        "the entropies the context model was chosen from",
        "model": model_dir,
        "text": str(text_path),
        "tokens": args.tokens,
        "environment": stamp(["flashcodec-kv", "torch", "transformers", "constriction"], torch.device("cpu")),
        "results": results,
    }
    save(data, "flashcodec_lossless", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
