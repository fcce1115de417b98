"""A Hadamard rotation before KIVI's codes, at 2 to 8 bits, on the real model beside hqq 4/8-bit.

Candidates are :class:`flashcodec.codecs.RotatedKIVICodec` configurations (``kivi64r-*``: keys and
values rotated; ``kivi64rk-*``: keys only; ``kivi64rg-*``: rotated, levels fitted to a Gaussian
instead of min-max; ``rkg``: both; ``u``: no rotation, for 2 and 3 bits without one), each named like the kivi tiers (``kivi<block>...-k<key
bits>v<value bits>-w<window>i8``: ``kivi64r-k3v2-w64i8`` has 64-token blocks and the newest 64-127
tokens int8; the first key exact). A candidate the package's registry or the study registry
(``benchmarks/studies/flashcodec_tiers.py``) already holds runs as that tier; the others are this
script's own (:func:`candidate_tiers`), run beside the ``kivi64-*`` configurations they would
replace through a compare harness that knows them all; no registry is changed.

Two protocols:

* default: ``flashcodec compare`` (kvbench's protocol, as ``real_tiers.py``: SmolLM2-135M-Instruct,
  bf16, one window of 1,792 prefilled + 256 scored tokens decoded one at a time, attention on the
  codes, hqq 4/8-bit in the same run); writes ``flashcodec_rotated_tiers.json``
  with ``summary_long`` (bytes resident averaged over decoding, KL, top-1, ratios to hqq-q4).
* ``--quick``: a ranking (as ``kv_recipes.py``): per window the context is prefilled exactly, each
  layer's K/V go through a :class:`flashcodec.CodecKVCache` of the candidate (archive coded, window
  int8) and the scored tokens run in one forward over the decoded cache (their own K/V exact);
  bytes are the cache's held bytes at the context length. Writes ``flashcodec_rotated_quick.json``.

    OMP_NUM_THREADS=1 nice -n 10 hatch run bench:python benchmarks/studies/flashcodec_rotated_tiers.py
    OMP_NUM_THREADS=1 nice -n 10 hatch run bench:python benchmarks/studies/flashcodec_rotated_tiers.py --quick
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import (
    ALL_TIERS,
    add_window_options,
    compare_result,
    exact_windows,
    save_window_result,
    score_replaced_kv,
)
from flashcodec.codecs import BlockCodec, KIVICodec
from flashcodec.codecs.rotated import RotatedKIVICodec
from flashcodec.tiers import Tier, make_registry
from kvbench.results import results_path
from real_tiers import compare_cli, write_summary

_NAME = re.compile(r"kivi(?P<r>\d+)(?P<family>r|rk|rg|rkg|u)?-k(?P<k>\d)v(?P<v>\d)-w(?P<w>\d+)i8")


def _codec(name: str) -> BlockCodec:
    """``kivi<r>[r|rk|rg|rkg|u]-k<K>v<V>-w<W>i8`` -> its codec: ``r``-token blocks, ``W`` newest tokens
    int8 (KIVICodec without a family, as the registered ``kivi64-*`` tiers)."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a candidate name: {name!r} (kivi<r>[r|rk|rg|rkg|u]-k<K>v<V>-w<W>i8)")
    r, w, k, v = (int(match[g]) for g in ("r", "w", "k", "v"))
    family = match["family"]
    if family is None:
        return KIVICodec(r, k, v, raw_window=w)
    options = {
        "r": {},
        "rk": {"rotate_values": False},
        "rg": {"range_fit": "gauss"},
        "rkg": {"rotate_values": False, "range_fit": "gauss"},
        "u": {"rotate_keys": False, "rotate_values": False},
    }[family]
    return RotatedKIVICodec(r, k, v, raw_window=w, **options)


def _describe(name: str, codec: BlockCodec) -> str:
    if name in ALL_TIERS:
        return ALL_TIERS[name].description
    r, w = codec.block_size, codec.raw_window
    window = f"newest {w}-{w + r - 1} tokens int8" if w else f"the incomplete block's 0-{r - 1} tokens int8"
    if not isinstance(codec, RotatedKIVICodec):
        return f"int{codec.key_bits} keys per ({r}-token block, channel), int{codec.value_bits} values per token; {window}"
    if not codec.rotate_keys and not codec.rotate_values:
        return (
            f"int{codec.key_bits} keys per ({r}-token block, channel), int{codec.value_bits} values per token, "
            f"no rotation; first key exact; {window}"
        )
    sides = "keys and values" if codec.rotate_values else "keys"
    fit = "levels fitted to a Gaussian" if codec.range_fit == "gauss" else "min-max levels"
    return (
        f"{sides} Hadamard-rotated, then int{codec.key_bits} keys per ({r}-token block, channel), "
        f"int{codec.value_bits} values per token, {fit}; first key exact; {window}"
    )


def candidate_tiers(names: Iterable[str]) -> dict[str, Tier]:
    """The candidates of ``names`` that neither registry holds, as tiers by name (attention on the codes)."""
    out: dict[str, Tier] = {}
    for name in names:
        if name not in ALL_TIERS and name not in out:
            codec = _codec(name)
            out[name] = Tier(name, _describe(name, codec), codec, "codes")
    return out


def compare_main(extra: dict[str, Tier]):
    """``flashcodec compare`` offering the registries' tiers and ``extra`` after them."""
    from flashcodec.compare import main

    registry = make_registry(*ALL_TIERS.values(), *extra.values())
    return lambda argv: main(argv, registry=registry)


#: the kvbench run: the registered references, then rotated 4- and 8-bit candidates, then the
#: sub-4-bit ones the quick ranking kept (2-bit keys lose whatever the values get; Gaussian-fitted
#: levels help only at 2 bits; the smallest is 128-token blocks and no window beyond the block) and
#: 3-bit codes without the rotation at the same bytes
COMPARE_TIERS = ",".join(
    (
        "kivi64-k4v4-w64i8",
        "kivi64r-k4v4-w64i8",
        "kivi64-k8v8-w64i8",
        "kivi64r-k8v8-w64i8",
        "kivi64r-k3v3-w64i8",
        "kivi64r-k4v2-w64i8",
        "kivi64r-k3v2-w64i8",
        "kivi64u-k3v2-w64i8",
        "kivi64rg-k2v2-w64i8",
        "kivi128r-k3v2-w0i8",
    )
)
#: the quick ranking: each family at every width worth a look, then smaller windows and larger blocks
QUICK_TIERS = ",".join(
    [
        "kivi64-k4v4-w64i8",
        "kivi64-k8v8-w64i8",
        *(
            f"kivi64{f}-k{k}v{v}-w64i8"
            for f in ("r", "rk")
            for k, v in ((8, 8), (4, 4), (3, 4), (3, 3), (4, 2), (3, 2), (2, 4), (2, 3), (2, 2))
        ),
        *(
            f"kivi64{f}-k{k}v{v}-w64i8"
            for f in ("rg", "rkg")
            for k, v in ((4, 4), (3, 3), (4, 2), (3, 2), (2, 3), (2, 2))
        ),
        "kivi64r-k3v3-w0i8",
        "kivi64r-k3v2-w32i8",
        "kivi64r-k3v2-w0i8",
        "kivi32r-k3v2-w32i8",
        "kivi128r-k3v2-w0i8",
        "kivi128rg-k3v2-w0i8",
        *(f"kivi64u-k{k}v{v}-w64i8" for k, v in ((3, 3), (3, 2), (2, 2))),
    ]
)


def run_compare(names: list[str], out: Path, model: str | None, long_windows: int = 1) -> None:
    extra = candidate_tiers(names)
    cli = compare_cli(names, model, long_windows)
    t0 = time.perf_counter()
    result = compare_result(cli, main=compare_main(extra))
    result["command"] = (
        f"python benchmarks/studies/flashcodec_rotated_tiers.py --tiers {','.join(names)} --long-windows {long_windows}"
    )
    result["compare_args"] = cli
    result["candidates"] = {n: _describe(n, _codec(n)) for n in names}
    result["wall_s"] = time.perf_counter() - t0
    write_summary(result, out)


def run_quick(names: list[str], args: argparse.Namespace) -> None:
    from flashcodec import CodecKVCache

    model, windows = exact_windows(args.model or "smollm2-135m", args.windows, args.context, args.scored)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        codec = _codec(name)
        held, raw = 0, 0

        def through_codec(_: int, k: torch.Tensor, v: torch.Tensor, codec=codec) -> tuple:
            nonlocal held, raw
            coded = CodecKVCache(codec=codec)
            keys, values = coded.update_and_fetch(k, v)
            st = coded.storage_bytes()
            held, raw = held + st.held, raw + st.raw
            return keys.clone(), values.clone()

        kl, top1 = score_replaced_kv(model, windows, args.context, through_codec)
        row = {
            "name": name,
            "description": _describe(name, codec),
            "codec": repr(codec),
            "bytes_x_raw": held / raw,
            "kl_mean": kl,
            "top1_agreement": top1,
        }
        rows.append(row)
        print(
            f"{name:24s} bytes {row['bytes_x_raw']:.3f}  KL {row['kl_mean']:.2e}  top-1 {row['top1_agreement']:.3f}"
            f"  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    save_window_result(
        args.out or results_path("flashcodec_rotated_quick.json"),
        args,
        rows,
        model=args.model or "smollm2-135m",
        protocol="one forward of the scored tokens over the decoded cache (see the script's docstring)",
        command="python benchmarks/studies/flashcodec_rotated_tiers.py --quick " + " ".join(sys.argv[1:]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiers", default=None, help="comma-separated candidate names (default: per protocol)"
    )
    parser.add_argument("--quick", action="store_true", help="the one-forward ranking instead of kvbench")
    add_window_options(parser, model=None, note="--quick: ")
    parser.add_argument("--long-windows", type=int, default=1, help="kvbench: windows of the long run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [
        n.strip()
        for n in (args.tiers or (QUICK_TIERS if args.quick else COMPARE_TIERS)).split(",")
        if n.strip()
    ]
    for name in names:
        _codec(name)  # a bad name fails before any model is loaded
    if args.quick:
        run_quick(names, args)
    else:
        run_compare(
            names, args.out or results_path("flashcodec_rotated_tiers.json"), args.model, args.long_windows
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
