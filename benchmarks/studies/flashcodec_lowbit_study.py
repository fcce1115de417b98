"""Where the bytes of a rotated KIVI code below 4 bits go, and what cheaper side information costs.

Question: at 2-3 bits an element, an fp16 scale and zero point per 64 values is 0.5 bits an
element, a sixth of the budget; the int8 window of the newest tokens is another few tenths. Which
of (a) 8-bit scales and zero points (a log-coded scale against one fp16 base per block and head,
the zero point an integer number of half steps), (b) scale-only (symmetric) value codes, (c)
128-token key groups, (d) a smaller window, (e) the first few tokens kept in int8 (attention
sinks) keeps the KL of the fp16-side code at fewer bytes?

Method (fake quantization, as ``kv_recipes.py``): per window the context is prefilled exactly,
each layer's context K/V go through the recipe (tokens older than the tail rotated by the seeded
Hadamard matrix of :func:`flashcodec.codecs.rotated.hadamard_rotation`, coded, decoded and rotated
back; the tail, ``window`` tokens plus the incomplete block, int8 per token as the tiers' tail) and
the scored tokens run in one forward over that cache (their own K/V exact). KL is
``KL(exact || recipe)`` over the scored positions. It ranks archive codes; the window's worth is
underrated (the scored tokens see each other exactly), so window sizes are judged by
``flashcodec compare`` (``real_tiers.py``). ``bits`` is codes plus side information per archived
element (the tail not counted).

    OMP_NUM_THREADS=1 nice -n 10 hatch run bench:python benchmarks/studies/flashcodec_lowbit_study.py
    # writes benchmarks/results/flashcodec_lowbit_study.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import exact_windows, score_replaced_kv, stamp
from flashcodec.codecs.rotated import hadamard_rotation
from flashcodec.codecs.tail import Uint8Tail
from kvbench.results import results_path, write_json

_LEVELS = {2: (-2, 1), 3: (-4, 3), 4: (-8, 7), 8: (-127, 127)}
_GAUSS_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352}
#: the log-coded scale: 2**(-1/LOG_STEPS) apart, 256 codes below the base
LOG_STEPS = 16


@dataclass(frozen=True)
class Recipe:
    name: str
    key_bits: int = 3
    value_bits: int = 2
    key_group: int = 64
    side: str = "fp16"  # "fp16" | "u8" (log scale + half-step zero) | "u8s" (log scale, fp16 zero)
    value_side: str | None = None  # the values' side information when not ``side``
    key_sink: bool = True  # token 0's key exact (block 0's zero points; needs fp16 zero points)
    value_zero: bool = True  # False: scale-only values (levels symmetric about 0)
    value_fit: str = "minmax"  # "minmax" | "gauss"
    window: int = 64
    sinks: int = 0  # first tokens kept int8 (keys and values)
    tail_raw: bool = False  # the tail (window + incomplete block) as it came, not int8 per token
    block: int = 64

    def bits(self, d: int = 64) -> float:
        sides = {"fp16": (16, 16), "u8": (8, 8), "u8s": (8, 16)}
        side, vside = sides[self.side], sides[self.value_side or self.side]
        k = self.key_bits + sum(side) / self.key_group
        v = self.value_bits + (sum(vside) if self.value_zero else vside[0]) / d
        return (k + v) / 2


def _u8_scale(s: torch.Tensor, base_dims: tuple[int, ...]) -> torch.Tensor:
    """``s`` rounded up to ``base * 2**(-u / LOG_STEPS)`` (u in 0..255), ``base`` the fp16 max over ``base_dims``."""
    base = s.amax(dim=base_dims, keepdim=True).half().float()
    base = torch.where(base > 0, base, torch.ones_like(base))
    u = torch.floor(-LOG_STEPS * torch.log2(s.clamp_min(1e-30) / base)).clamp(0, 255)
    return base * torch.exp2(-u / LOG_STEPS)


def quantize(
    x: torch.Tensor, bits: int, dim: int, side: str, zero: bool, fit: str, base_dims
) -> torch.Tensor:
    """Fake-quantize ``x [..., R, D]`` (fp32) per slice along ``dim``; returns the reconstruction."""
    lo_code, hi_code = _LEVELS[bits]
    steps = hi_code - lo_code
    if fit == "gauss" and bits < 8:
        std, mean = torch.std_mean(x, dim=dim, keepdim=True, correction=0)
        s = _GAUSS_STEP[bits] * std
        mid = mean + s / 2 if zero else s / 2
    elif zero:
        lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
        s = (hi - lo) / steps
        mid = lo - lo_code * s
    else:
        s = x.abs().amax(dim=dim, keepdim=True) / (steps / 2)
        mid = s / 2
    if side == "fp16":
        zf = mid.half().float()
        if fit != "gauss":
            lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
            s = torch.maximum((zf - lo) / -lo_code, (hi - zf) / hi_code)
        s = (s * (1 + 2**-10)).half().float()
    elif side == "u8s":
        zf = mid.half().float()
        if fit != "gauss":
            lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
            s = torch.maximum((zf - lo) / -lo_code, (hi - zf) / hi_code)
        s = _u8_scale(s, base_dims)
    elif zero:
        # the zero point in half steps, int8: a slice whose middle is beyond 127 half steps from 0
        # gets a coarser step
        s = _u8_scale(torch.maximum(s, mid.abs() / 63.5), base_dims)
        zf = torch.round(mid / (s / 2)).clamp(-128, 127) * (s / 2)
    else:
        s = _u8_scale(s, base_dims)
        zf = s / 2
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x - zf) / safe).clamp(lo_code, hi_code)
    return q * s + zf


def apply(recipe: Recipe, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's context K/V ``[B, H, S, D]`` through ``recipe`` (fake quantization)."""
    s, d = k.shape[-2], k.shape[-1]
    r = recipe.block
    n = max(0, (s - recipe.window) // r) * r
    m = hadamard_rotation(d)
    tail = Uint8Tail()
    out = []
    for x, side in ((k, "k"), (v, "v")):
        xf = x.float()
        y = xf.clone()
        if n:
            a = (xf[..., :n, :] @ m).unflatten(-2, (-1, r))  # [B, H, n/r, r, D]
            if side == "k":
                g = recipe.key_group
                a = a.flatten(-3, -2).unflatten(-2, (-1, g)) if g != r else a
                c = quantize(a, recipe.key_bits, -2, recipe.side, True, "minmax", (-2, -1))
                c = c.flatten(-3, -2)
                if recipe.key_sink:  # token 0's key is block 0's zero point (kept exactly)
                    c[..., 0, :] = a.flatten(-3, -2)[..., 0, :]
            else:
                vside = recipe.value_side or recipe.side
                c = quantize(
                    a, recipe.value_bits, -1, vside, recipe.value_zero, recipe.value_fit, (-2, -1)
                ).flatten(-3, -2)
            y[..., :n, :] = c @ m.T
        if n < s and not recipe.tail_raw:
            y[..., n:, :] = tail.decode(tail.encode(xf[..., n:, :]), torch.float32)
        if recipe.sinks:
            y[..., : recipe.sinks, :] = tail.decode(tail.encode(xf[..., : recipe.sinks, :]), torch.float32)
        out.append(y.to(x.dtype))
    return out[0], out[1]


def recipes() -> list[Recipe]:
    base = dict(key_bits=3, value_bits=2)
    out = [
        Recipe("k3v2-fp16-w64", **base),
        Recipe("k3v2-fp16-w0", **base, window=0),
        Recipe("k3v2-u8-w64", **base, side="u8"),
        Recipe("k3v2-u8-w0", **base, side="u8", window=0),
        Recipe("k3v2-u8-w0-nosink", **base, side="u8", window=0, key_sink=False),
        Recipe("k3v2-u8s-w0", **base, side="u8s", window=0),
        Recipe("k3v2-u8s-u8-w0", **base, side="u8s", value_side="u8", window=0),
        Recipe("k3v2-u8-w0-nosink-s1", **base, side="u8", window=0, key_sink=False, sinks=1),
        Recipe("k3v2-u8-w0-nosink-s4", **base, side="u8", window=0, key_sink=False, sinks=4),
        Recipe("k3v2-u8-vsym-w0", **base, side="u8", value_zero=False, window=0),
        Recipe("k3v2-u8-vsymg-w0", **base, side="u8", value_zero=False, value_fit="gauss", window=0),
        Recipe("k3v2-u8-vg-w0", **base, side="u8", value_fit="gauss", window=0),
        Recipe("k3v2-u8-g128-w0", **base, side="u8", key_group=128, window=0),
        Recipe("k3v2-u8-w0-s4", **base, side="u8", window=0, sinks=4),
        Recipe("k3v3-u8-w0", key_bits=3, value_bits=3, side="u8", window=0),
        Recipe("k3v3-u8-w0-nosink", key_bits=3, value_bits=3, side="u8", window=0, key_sink=False),
        Recipe("k3v3-u8s-u8-w0", key_bits=3, value_bits=3, side="u8s", value_side="u8", window=0),
        Recipe("k3v3-fp16-w64", key_bits=3, value_bits=3),
        Recipe("k4v4-fp16-w64", key_bits=4, value_bits=4),
        Recipe("k4v4-u8-w64", key_bits=4, value_bits=4, side="u8"),
        Recipe("k8v8-fp16-w64", key_bits=8, value_bits=8),
        Recipe("k8v8-u8-w64", key_bits=8, value_bits=8, side="u8"),
        Recipe("k8v8-u8-w64-nosink", key_bits=8, value_bits=8, side="u8", key_sink=False),
        Recipe("k8v8-u8s-u8-w64", key_bits=8, value_bits=8, side="u8s", value_side="u8"),
        Recipe(
            "k8v8-u8s-u8-w32-raw",
            key_bits=8,
            value_bits=8,
            side="u8s",
            value_side="u8",
            window=32,
            tail_raw=True,
        ),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=1792)
    parser.add_argument("--scored", type=int, default=256)
    parser.add_argument("--only", default=None, help="comma-separated recipe names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = recipes()
    if args.only:
        keep = set(args.only.split(","))
        chosen = [r for r in chosen if r.name in keep]
    model, windows = exact_windows(args.model, args.windows, args.context, args.scored)
    rows = []
    for recipe in chosen:
        t0 = time.perf_counter()
        kl, top1 = score_replaced_kv(model, windows, args.context, lambda _i, k, v, r=recipe: apply(r, k, v))
        row = {**asdict(recipe), "bits_archive": recipe.bits(), "kl_mean": kl, "top1_agreement": top1}
        rows.append(row)
        print(
            f"{recipe.name:22s} bits {recipe.bits():.3f}  KL {kl:.3e}  top-1 {top1:.3f}  "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    out = args.out or results_path("flashcodec_lowbit_study.json")
    write_json(
        out,
        {
            "stamp": stamp(["flashcodec-kv", "kvbench", "torch", "transformers"]),
            "model": args.model,
            "dtype": "bfloat16",
            "protocol": "fake quantization, one forward of the scored tokens (see the script's docstring)",
            "windows": args.windows,
            "context_tokens": args.context,
            "scored_tokens": args.scored,
            "log_steps": LOG_STEPS,
            "command": "python benchmarks/studies/flashcodec_lowbit_study.py "
            + " ".join(argv or sys.argv[1:]),
            "rows": rows,
        },
    )
    print(f"wrote {out}")
    return 0 if math.isfinite(sum(r["kl_mean"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
