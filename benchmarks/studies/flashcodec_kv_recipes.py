"""Which quantization recipe suits real K/V: a factor study on the real model (fake quantization).

Question: on SmolLM2-135M-Instruct (bf16), what makes 4-bit K/V lose, and what would fix it?
Candidates are the recipes of the literature, data-free: keys per (block, channel) or per token,
values per channel or per token (KIVI's split), a fixed Hadamard rotation of each head's channels
(QuaRot, TurboQuant) before quantizing, the first key (the attention sink) exact, and fewer bits
(2, 3) for a budget of 0.6x hqq 4-bit's bytes.

Method: per window, the context (``--context`` tokens) is prefilled with an exact cache; every
layer's context K/V then goes through the recipe (the tokens older than the newest ``--window``,
in whole blocks of 64, quantized as the recipe says; the rest int8 per token, as the tiers'
int8 window) and the ``--scored`` tokens after it run in one forward over that cache (their own
K/V exact). KL is ``KL(exact || recipe)`` of the next-token distributions over the scored
positions, top-1 the share of positions whose argmax agrees. This is faster than the kvbench
protocol (one forward instead of one per token) and ranks recipes; the tiers' own figures come
from ``flashcodec compare`` (``real_tiers.py``). ``bits`` counts codes plus fp16 scale and zero
metadata per element at ``D = 64`` for the archived part (window not counted).

4- and 8-bit codes use the library's quantizer (:func:`flashcodec.codecs.kivi.quantize_zero`, the
kivi tiers' codes); 2 and 3 bits (no codec stores them) a plain asymmetric quantizer with fp16
scale and zero point.

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/studies/flashcodec_kv_recipes.py
    # writes benchmarks/results/flashcodec_kv_recipes.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import add_window_options, exact_windows, save_window_result, score_replaced_kv
from flashcodec.codecs.kivi import dequantize_zero, quantize_zero
from kvbench.results import results_path

BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``[n, n]`` (``n`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def fake_quant(x: torch.Tensor, bits: int, dim: int, zero_at: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` through asymmetric ``bits``-bit codes with an fp16 scale and zero point per slice along ``dim``."""
    if bits in (4, 8):
        d = x.shape[-1]
        return dequantize_zero(*quantize_zero(x, bits, dim, zero_at=zero_at), d)
    lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = lo.half().float()
    return ((x - zero) / scale).round().clamp(0, levels) * scale + zero


#: a side's recipe: (grouping "channel" | "token" | "exact", bits, Hadamard rotation)
Side = tuple[str, int, bool]


def quantize_side(x: torch.Tensor, side: Side, sink: bool) -> torch.Tensor:
    """fp32 ``x [B, H, n*64, D]`` through a side's recipe; ``sink``: block 0's zero points are token 0."""
    group, bits, rotate = side
    if group == "exact":
        return x
    rot = hadamard(x.shape[-1]) if rotate else None
    y = x @ rot if rot is not None else x
    if group == "token":
        out = fake_quant(y, bits, -1)
    else:
        blocks = y.unflatten(2, (-1, BLOCK))
        out = fake_quant(blocks, bits, -2)
        if sink:
            first = blocks[:, :, :1]
            out[:, :, :1] = fake_quant(first, bits, -2, zero_at=first[..., :1, :])
        out = out.flatten(2, 3)
    return out @ rot.T if rot is not None else out


def recipe_fn(keys: Side, values: Side, sink: bool, window: int):
    def apply(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[2]
        done = max(0, s - window) // BLOCK * BLOCK
        kf, vf = k.float(), v.float()
        ko, vo = kf.clone(), vf.clone()
        if done:
            ko[:, :, :done] = quantize_side(kf[:, :, :done], keys, sink)
            vo[:, :, :done] = quantize_side(vf[:, :, :done], values, False)
        if done < s:  # the int8 window, per token
            ko[:, :, done:] = fake_quant(kf[:, :, done:], 8, -1)
            vo[:, :, done:] = fake_quant(vf[:, :, done:], 8, -1)
        return ko.to(k.dtype), vo.to(v.dtype)

    return apply


def bits_of(side: Side) -> float:
    group, bits, _ = side
    if group == "exact":
        return 16.0
    return bits + 32 / 64  # an fp16 scale and zero per 64 elements (a 64-token block or D = 64)


C4, T4 = ("channel", 4, False), ("token", 4, False)
#: (label, keys, values, first key exact)
RECIPES: list[tuple[str, Side, Side, bool]] = [
    ("keys and values per channel (chan64)", C4, C4, False),
    ("keys per channel, values per token (kivi)", C4, T4, False),
    ("kivi, first key exact", C4, T4, True),
    ("kivi, first key exact, values rotated", C4, ("token", 4, True), True),
    ("kivi, first key exact, keys rotated", ("channel", 4, True), T4, True),
    ("keys and values per token, rotated (QuaRot-like)", ("token", 4, True), ("token", 4, True), False),
    ("keys only: per channel", C4, ("exact", 16, False), False),
    ("keys only: per channel, first key exact", C4, ("exact", 16, False), True),
    ("values only: per token", ("exact", 16, False), T4, False),
    ("values only: per channel", ("exact", 16, False), C4, False),
    ("keys int8 per channel, values int4 per token, first key exact", ("channel", 8, False), T4, True),
    ("keys and values int8 (kivi 8/8), first key exact", ("channel", 8, False), ("token", 8, False), True),
    ("keys int3, values int3 rotated, first key exact", ("channel", 3, False), ("token", 3, True), True),
    ("keys int3, values int2 rotated, first key exact", ("channel", 3, False), ("token", 2, True), True),
    (
        "keys int2 rotated, values int2 rotated, first key exact",
        ("channel", 2, True),
        ("token", 2, True),
        True,
    ),
    ("keys int2, values int2 rotated, first key exact", ("channel", 2, False), ("token", 2, True), True),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_options(parser)
    parser.add_argument("--window", type=int, default=64, help="newest context tokens kept int8 per token")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(results_path("flashcodec_kv_recipes.json")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, windows = exact_windows(args.model, args.windows, args.context, args.scored)
    rows = []
    for label, keys, values, sink in RECIPES:
        t0 = time.perf_counter()
        apply = recipe_fn(keys, values, sink, args.window)
        kl, top1 = score_replaced_kv(model, windows, args.context, lambda _, k, v, apply=apply: apply(k, v))
        row = {
            "name": label,
            "keys": {"group": keys[0], "bits": keys[1], "hadamard": keys[2]},
            "values": {"group": values[0], "bits": values[1], "hadamard": values[2]},
            "first_key_exact": sink,
            "bits_per_element": (bits_of(keys) + bits_of(values)) / 2,
            "kl_mean": kl,
            "top1_agreement": top1,
        }
        rows.append(row)
        print(
            f"{label:62s} {row['bits_per_element']:5.2f} b  KL {row['kl_mean']:.2e}  "
            f"top-1 {row['top1_agreement']:.3f}  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    save_window_result(args.out, args, rows, int8_window_tokens=args.window, block_size=BLOCK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
