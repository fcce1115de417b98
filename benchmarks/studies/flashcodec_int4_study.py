"""Why jpeg-k8-int4 loses to transformers' hqq 4-bit cache at the same bytes.

Question: ``jpeg-k8-int4`` (attention on the codes) and ``QuantizedCache(backend="hqq", nbits=4)`` hold the same bytes
(4.5 bits an element), yet the peer's KL is ten times lower. Which part of the difference is the
quantizer layout (symmetric or zero point, along D per token or per DCT frequency, group size,
per-channel keys) and which is how the peer schedules precision (its last ``residual_length``
= 128 tokens stay in bf16 and are re-quantized in one go when that window fills)?

Method (part 1, ``factors``): the embedded model in bf16 on the held-out text, ``--windows``
windows of ``--context`` tokens prefilled in one call, then ``--scored`` tokens fed one per call
(the kvbench protocol's long run). A fake-quantizing transformers cache stores exact K/V and
hands attention, per layer, every complete 8-token block (or group) through a quantizer and the
rest raw: exactly what a flashcodec tier's archive + raw tail return, for any quantizer. KL is
``KL(baseline || candidate)`` averaged over the scored positions; top-1 is the share of positions
whose argmax agrees; Δppl the perplexity difference on the scored tokens. ``bits`` is codes plus
per-row metadata per element (the peer and ``jpeg-k8-int4``: 4.5). The quantizers are the
library's own functions (``flashcodec.codecs.quant``, ``JPEGCodec``, ``ZeroPointJPEGCodec``).
Variants with ``recent64`` keep the newest 64 tokens raw (the peer keeps 0-127). The peer itself
runs with residual_length 128 (its default) and 8 (about flashcodec's raw tail of 0-7 tokens).

Part 2 (``compare``, unless ``--no-compare``): ``flashcodec compare`` with the chosen tiers beside
hf-hqq-q4 at reduced sizes (the command is recorded), its rows copied here.

    hatch run bench:python benchmarks/studies/flashcodec_int4_study.py   # writes results/flashcodec_int4_study.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import compare_result, log_probs, model_and_text, stamp
from flashcodec import JPEGCodec
from flashcodec.codecs import MixedJPEGCodec, ZeroPointJPEGCodec
from flashcodec.codecs.quant import (
    dequantize_int4,
    dequantize_int4_zero,
    quantize_int4,
    quantize_int4_zero,
)
from kvbench.models import embedded_model_path
from kvbench.results import results_path, write_json

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # fp32 [B, H, n*r, D] -> its reconstruction


def per_token_sym(x: torch.Tensor) -> Quantizer:
    """Symmetric int4 along D per token, fp32 scale (jpeg-k8-int4's quantizer without the DCT)."""
    return dequantize_int4(*quantize_int4(x), x.shape[-1])


def per_token_zero(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 along D per token, fp16 scale + zero: hqq's per-token layout (axis 1) at
    group 64 = D, without its zero-point optimizer."""
    return dequantize_int4_zero(*quantize_int4_zero(x), x.shape[-1])


def _dct_rows(x: torch.Tensor, quantize: Quantizer) -> torch.Tensor:
    """Block DCT (r = 8), ``quantize`` the ``[n, 8, D]`` coefficient rows, inverse DCT."""
    m = JPEGCodec(8).analysis_matrix(torch.float32)
    blocks = x.unflatten(2, (-1, 8))
    return (m.T @ quantize(m @ blocks)).flatten(2, 3)


def dct_sym_groups32(x: torch.Tensor) -> torch.Tensor:
    """DCT rows, symmetric int4 in two groups of 32 along D with fp16 scales: 2 x 2 bytes a row,
    the bytes of jpeg-k8-int4's one fp32 scale."""

    def quantize(c: torch.Tensor) -> torch.Tensor:
        g = c.unflatten(-1, (-1, 32))
        scale = (g.abs().amax(-1, keepdim=True) / 7 * (1 + 2**-10)).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return ((g / safe).round().clamp(-7, 7) * scale).flatten(-2)

    return _dct_rows(x, quantize)


def per_channel_block8(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 per (8-token block, channel), fp16 scale + zero: KIVI's key layout at a
    group of 8 tokens. Not a budget candidate (4 bits of metadata an element): the ceiling of
    what per-channel key quantization buys."""
    blocks = x.unflatten(2, (-1, 8)).transpose(-1, -2)  # [B, H, n, D, 8]: tokens along the row
    back = dequantize_int4_zero(*quantize_int4_zero(blocks), 8)
    return back.transpose(-1, -2).flatten(2, 3)


def exact(x: torch.Tensor) -> torch.Tensor:
    return x


#: name -> (quantizer, bits per element incl. metadata at D = 64, what it is)
QUANTIZERS: dict[str, tuple[Quantizer, float, str]] = {
    "exact": (exact, 16.0, "no quantization"),
    "jpeg-k8-int4": (JPEGCodec(8, 8, quant_bits=4).roundtrip, 4.5, "DCT rows, symmetric, fp32 scale a row"),
    "jpeg-k8-int4z": (ZeroPointJPEGCodec(8).roundtrip, 4.5, "DCT rows, zero point, fp16 scale + zero a row"),
    "token-sym": (per_token_sym, 4.5, "per token along D, symmetric, fp32 scale"),
    "token-zero": (per_token_zero, 4.5, "per token along D, zero point, fp16 scale + zero"),
    "dct-sym-g32": (dct_sym_groups32, 4.5, "DCT rows, symmetric, two groups of 32 with fp16 scales"),
    "mixed-dc8": (MixedJPEGCodec(8).roundtrip, 5.0, "DCT: DC row int8, 7 AC rows int4, fp32 scales"),
    "channel-block8": (
        per_channel_block8,
        8.0,
        "per (8-token block, channel), zero point, fp16 scale + zero",
    ),
}


def _both(quantizer: str, recent: int = 0) -> tuple[str, str, str, int]:
    """A factor quantizing keys and values alike, labelled by the quantizer (and ``+ recent<n>``)."""
    return (quantizer + (f" + recent{recent}" if recent else ""), quantizer, quantizer, recent)


#: (label, key quantizer, value quantizer, newest tokens kept raw)
FACTORS: list[tuple[str, str, str, int]] = [
    _both("jpeg-k8-int4"),
    ("jpeg-k8-int4 keys only", "jpeg-k8-int4", "exact", 0),
    ("jpeg-k8-int4 values only", "exact", "jpeg-k8-int4", 0),
    *(_both(q) for q in ("token-sym", "token-zero", "jpeg-k8-int4z", "dct-sym-g32", "mixed-dc8")),
    ("channel-block8 keys, jpeg-k8-int4z values", "channel-block8", "jpeg-k8-int4z", 0),
    ("channel-block8 keys only", "channel-block8", "exact", 0),
    _both("jpeg-k8-int4", recent=64),
    _both("jpeg-k8-int4z", recent=64),
]

#: (label, QuantizedCache keyword arguments beyond backend="hqq", nbits=4)
PEERS: list[tuple[str, dict]] = [
    ("hf-hqq-q4 (residual_length 128, its default)", {}),
    ("hf-hqq-q4 residual_length 8", {"residual_length": 8}),
    (
        "hf-hqq-q4 axis 1 (per token), residual_length 8",
        {"residual_length": 8, "axis_key": 1, "axis_value": 1},
    ),
]


def fake_quant_cache(model, quant_k: Quantizer, quant_v: Quantizer, recent: int):
    """A DynamicCache whose layers return quantized complete blocks and the rest raw (see above)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Layer(DynamicLayer):
        def lazy_initialization(self, k, v):
            super().lazy_initialization(k, v)
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
            self.qk, self.qv = self.keys.float(), self.values.float()

        def update(self, k, v, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(k, v)
            self.keys = torch.cat([self.keys, k], 2)
            self.values = torch.cat([self.values, v], 2)
            done = max(0, self.keys.shape[2] - recent) // 8 * 8
            have = self.qk.shape[2]
            if done > have:  # quantize the newly completed blocks once, as an archive does
                self.qk = torch.cat([self.qk, quant_k(self.keys[:, :, have:done].float())], 2)
                self.qv = torch.cat([self.qv, quant_v(self.values[:, :, have:done].float())], 2)
            dt = self.keys.dtype
            return (
                torch.cat([self.qk[:, :, :done].to(dt), self.keys[:, :, done:]], 2),
                torch.cat([self.qv[:, :, :done].to(dt), self.values[:, :, done:]], 2),
            )

    cache = DynamicCache(config=model.config)
    cache.layers = [Layer() for _ in range(model.config.num_hidden_layers)]
    return cache


def score(base: list[torch.Tensor], got: list[torch.Tensor], windows: list[list[int]], context: int) -> dict:
    kl = torch.cat([(b.exp() * (b - g)).sum(-1) for b, g in zip(base, got, strict=True)])
    top1 = torch.cat([(b.argmax(-1) == g.argmax(-1)).float() for b, g in zip(base, got, strict=True)])

    def ppl(lps: list[torch.Tensor]) -> float:
        nll = torch.cat(
            [
                -lp[torch.arange(len(w) - context), torch.tensor(w[context:])]
                for lp, w in zip(lps, windows, strict=True)
            ]
        )
        return math.exp(float(nll.mean()))

    return {
        "kl_mean": float(kl.mean()),
        "top1_agreement": float(top1.mean()),
        "ppl_delta": ppl(got) - ppl(base),
    }


def factors(args: argparse.Namespace) -> dict:
    from transformers import DynamicCache, QuantizedCache

    path = embedded_model_path()
    model, ids = model_and_text(path)
    size = args.context + args.scored
    windows = [ids[i * size : (i + 1) * size] for i in range(args.windows)]
    base = [log_probs(model, DynamicCache(config=model.config), w, args.context) for w in windows]
    rows = []
    for label, kq, vq, recent in FACTORS:
        t = time.perf_counter()
        got = [
            log_probs(
                model, fake_quant_cache(model, QUANTIZERS[kq][0], QUANTIZERS[vq][0], recent), w, args.context
            )
            for w in windows
        ]
        rows.append(
            {
                "name": label,
                "keys": kq,
                "values": vq,
                "recent_raw_tokens": recent,
                "key_bits": QUANTIZERS[kq][1],
                "value_bits": QUANTIZERS[vq][1],
                **score(base, got, windows, args.context),
            }
        )
        print(f"{label:48s} KL {rows[-1]['kl_mean']:.2e}  ({time.perf_counter() - t:.0f} s)", flush=True)
    for label, kwargs in PEERS:
        got = [
            log_probs(
                model, QuantizedCache(backend="hqq", config=model.config, nbits=4, **kwargs), w, args.context
            )
            for w in windows
        ]
        rows.append(
            {
                "name": label,
                "peer_kwargs": kwargs,
                "key_bits": 4.5,
                "value_bits": 4.5,
                **score(base, got, windows, args.context),
            }
        )
        print(f"{label:48s} KL {rows[-1]['kl_mean']:.2e}", flush=True)
    return {
        "model": path.name,
        "dtype": "bfloat16",
        "windows": args.windows,
        "context_tokens": args.context,
        "scored_tokens": args.scored,
        "quantizers": {name: {"bits": bits, "what": what} for name, (_, bits, what) in QUANTIZERS.items()},
        "rows": rows,
    }


COMPARE_ARGS = [
    "--tiers", "jpeg-k8-int4z,jpeg-k8-int4", "--peers", "hf-hqq-q4",
    "--windows", "4", "--context-tokens", "192", "--scored-tokens", "64",
    "--long-context", "2048", "--long-windows", "1", "--long-scored-tokens", "128",
    "--speed-rounds", "1", "--speed-steps", "8", "--quiet",
]  # fmt: skip

KEPT = ("name", "kv_ratio", "resident_ratio", "kl_mean", "top1_agreement", "ppl_delta", "decode_tokens_per_s")


def compare(compare_json: Path | None) -> dict:
    """Run (or, given ``compare_json``, read) ``flashcodec compare`` with :data:`COMPARE_ARGS`."""
    result = compare_result(COMPARE_ARGS, compare_json)
    return {
        "command": "python -m flashcodec.compare " + " ".join(COMPARE_ARGS),
        "stamp": result.get("stamp"),
        "settings": {run["name"]: run["settings"] for run in result["runs"]},
        "runs": {
            run["name"]: [{k: row.get(k) for k in KEPT} for row in run["rows"]] for run in result["runs"]
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=1920)
    parser.add_argument("--scored", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compare", action="store_true", help="skip part 2")
    parser.add_argument(
        "--compare-json", type=Path, help="read part 2 from this compare JSON (made with COMPARE_ARGS)"
    )
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_int4_study.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {
        "stamp": stamp(["flashcodec-kv", "kvbench", "torch", "transformers", "hqq"]),
        "factors": factors(args),
    }
    if not args.no_compare:
        out["compare"] = compare(args.compare_json)
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
