"""Prefill on raw K/V against prefill on the codes, on the real model (kvbench protocol).

A multi-token step of a :class:`flashcodec.hf.FlashCodecCache` attends its own tokens as given
(``step_raw=True``, the default, as transformers' ``QuantizedCache`` does in its first call) or
as stored (``step_raw=False``, flashcodec's behaviour before). The tokens are stored coded either
way, but a prefill on the codes passes the codec's error through every layer's output into the
next layer's keys and values, so the cache itself differs. This runs ``flashcodec compare`` with
each chosen tier twice: under its own name (raw step) and as ``<tier>+coded-step``; everything else
(the protocol, windows, peers, bytes, speed) is the compare command's.

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/flashcodec/step_raw.py   # results/flashcodec_step_raw.json

Other options go to the compare command (e.g. ``--long-windows 2``; the last of a repeated one wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from common import long_run_args
from kvbench.results import results_path

TIERS = "chan64-int4-w64i8-mf,chan64-int4-w64i8"
CODED = "+coded-step"

COMPARE_ARGS = long_run_args("hf-hqq-q4", context=192, scored=64, speed_rounds=1, speed_steps=8)


def make_harness():
    from flashcodec.compare import FlashCodecHarness, build_candidates
    from flashcodec.hf import FlashCodecCache
    from flashcodec.tiers import tier, tier_names

    class StepRawHarness(FlashCodecHarness):
        """The compare harness with one more candidate per tier: ``<tier>+coded-step``."""

        tool = "flashcodec compare (step_raw)"

        def tiers(self):
            out = {}
            for name in tier_names():
                t = tier(name)
                out[name] = t.description + " (a multi-token step attends its own tokens raw)"
                out[name + CODED] = t.description + " (a multi-token step attends its own tokens as stored)"
            return out

        def candidates(self, loaded, tiers, peers):
            model = loaded.handle
            bases = list(dict.fromkeys(n.removesuffix(CODED) for n in tiers))
            built, absent = build_candidates(model, bases, peers)
            by_name = {c.name: c for c in built}
            out = [by_name["baseline"]]
            for name in tiers:
                base = by_name[name.removesuffix(CODED)]
                if name.endswith(CODED):
                    codec = tier(base.name).codec
                    base = dataclasses.replace(
                        base,
                        name=name,
                        description=self.tiers()[name],
                        make_cache=lambda codec=codec: FlashCodecCache.from_config(
                            model.config, codec=codec, step_raw=False
                        ),
                        config={**base.config, "step_raw": False},
                    )
                else:
                    base = dataclasses.replace(
                        base, description=self.tiers()[name], config={**base.config, "step_raw": True}
                    )
                out.append(base)
            out.extend(c for c in built if c.kind == "peer")
            return out, absent

    return StepRawHarness()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=TIERS, help=f"comma-separated registry tiers (default {TIERS})")
    parser.add_argument(
        "--model", default=None, help="model for the compare (default: its default, the real model)"
    )
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_step_raw.json"))
    args, rest = parser.parse_known_args(argv)  # the rest goes to the compare command
    import warnings

    from kvbench.cli import run_cli, run_compare

    tiers = [t for name in args.tiers.split(",") for t in (name, name + CODED)]
    compare_args = [*COMPARE_ARGS, "--tiers", ",".join(tiers), "--json", str(args.out), *rest]
    if args.model:
        compare_args += ["--model", args.model]

    def run(argv_):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return run_compare(make_harness(), argv_)

    return run_cli(run, compare_args)


if __name__ == "__main__":
    sys.exit(main())
