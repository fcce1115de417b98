"""Prefill on raw K/V against prefill on the codes, on the real model (kvbench protocol).

A multi-token step of a :class:`flashcodec.hf.FlashCodecCache` attends its own tokens as given
(``step_raw=True``, the default, as transformers' ``QuantizedCache`` does in its first call) or
as stored (``step_raw=False``, flashcodec's behaviour before). The tokens are stored coded either
way, but a prefill on the codes passes the codec's error through every layer's output into the
next layer's keys and values, so the cache itself differs. This runs ``flashcodec compare`` with
each chosen tier under each attention ``--attention`` asks for (default both), twice: as
``<tier>+<attention>`` (raw step) and ``<tier>+<attention>+coded-step``; everything else (the
protocol, windows, peers, bytes, speed) is the compare command's.

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/studies/flashcodec_step_raw.py   # results/flashcodec_step_raw.json

Other options go to the compare command (e.g. ``--long-windows 2``; the last of a repeated one wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import ALL_TIERS, ATTENTION_OPTIONS, attention_list, long_run_args, study_tier
from flashcodec.tiers import ATTENTIONS
from kvbench.results import results_path

TIERS = "chan64-int4-w64i8"
CODED = "+coded-step"

COMPARE_ARGS = long_run_args("hf-hqq-q4", context=192, scored=64, speed_rounds=1, speed_steps=8)


def case_name(tier: str, attention: str, coded_step: bool = False) -> str:
    """A candidate's name: the tier, its attention, and ``+coded-step`` when the step is coded."""
    return f"{tier}+{attention}" + (CODED if coded_step else "")


def make_harness():
    from flashcodec.compare import FlashCodecHarness, build_candidates
    from flashcodec.hf import FlashCodecCache

    cases = {
        case_name(name, attention, coded): (name, attention, coded)
        for name in ALL_TIERS
        for attention in ATTENTIONS
        for coded in (False, True)
    }

    class StepRawHarness(FlashCodecHarness):
        """The compare harness with a candidate per tier, attention and multi-token step."""

        tool = "flashcodec compare (step_raw)"

        def tiers(self):
            return {
                case: ALL_TIERS[name].description
                + (" (a multi-token step attends its own tokens as stored)" if coded else " (a multi-token step attends its own tokens raw)")
                for case, (name, _, coded) in cases.items()
            }  # fmt: skip

        def candidates(self, loaded, tiers, peers):
            model = loaded.handle
            built, absent = build_candidates(model, [], peers)  # the baseline and the peers
            out, peer_rows = built[:1], built[1:]
            for case in tiers:
                name, attention, coded = cases[case]
                built, _ = build_candidates(model, [name], [], tier_of=study_tier, attention=attention)
                codec = study_tier(name).codec
                out.append(
                    dataclasses.replace(
                        built[1],
                        name=case,
                        description=self.tiers()[case],
                        make_cache=lambda codec=codec, coded=coded: FlashCodecCache.from_config(
                            model.config, codec=codec, step_raw=not coded
                        ),
                        config={**built[1].config, "step_raw": not coded},
                    )
                )
            return out + peer_rows, absent

    return StepRawHarness()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=TIERS, help=f"comma-separated tiers (default {TIERS})")
    parser.add_argument(
        "--attention", choices=ATTENTION_OPTIONS, default="both", help="the attentions to run each tier with"
    )
    parser.add_argument(
        "--model", default=None, help="model for the compare (default: its default, the real model)"
    )
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_step_raw.json"))
    args, rest = parser.parse_known_args(argv)  # the rest goes to the compare command
    import warnings

    from kvbench.cli import run_cli, run_compare

    tiers = [
        case_name(name, attention, coded)
        for name in args.tiers.split(",")
        for attention in attention_list(name, args.attention)
        for coded in (False, True)
    ]
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
