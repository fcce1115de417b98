"""The passkey (needle) retrieval check of one package's tiers and peers beside the uncompressed cache.

    python benchmarks/tools/passkey.py --package flashcodec --model /tmp/smollm2-135m \\
        --tiers chan64-int4-w64i8,jpeg-k8-int8 --peers hf-hqq-q4,hf-hqq-q8
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python benchmarks/tools/passkey.py --package palu --model /tmp/smollm2-135m --dtype float32 \\
        --lengths 1024,2048 --tiers palu-3bit --peers mlx-lm-q4,mlx-lm-q8

The model and the candidates come from the package's own compare harness (the same loading,
tiers and peers as ``flashcodec compare`` / ``palu-mlx compare``); the trials and the scoring are
:mod:`kvbench.passkey`'s. The result (``kvbench.passkey/1``, stamped with machine, versions and
date) is rewritten after every trial, so a run that stops is resumed by running the same command
again: finished (candidate, length) pairs are read back, not run again, and a stopped pair goes on
from its next trial. A rerun with other
settings (trials, seed, template, model, dtype) is refused instead of mixing results; pass
``--fresh`` to start over.

``--template plain`` (the default) feeds the bare text; ``chat`` wraps each prompt with the
model's chat template, as an instruct model is usually prompted. On SmolLM2-135M-Instruct the
uncompressed baseline retrieved more from the bare text (see docs/kvbench.md), so plain is the
default.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.cli import OneLineParser, load_eval_text, parse_selection, run_cli
from kvbench.passkey import (
    ANSWER_TOKENS,
    DEPTH_RANGE,
    PASSKEY_SCHEMA,
    filler_lines,
    passkey_result,
    run_passkey,
)
from kvbench.results import CompareError, read_json, results_path, text_digest, write_json

DEFAULT_LENGTHS = "1024,2048,4096,8192"
#: settings that must match for an earlier file's rows to be reused
RESUME_KEYS = (
    "package",
    "model_sha256",
    "dtype",
    "trials",
    "seed",
    "template",
    "answer_tokens",
    "text_sha256",
)


def _harness(package: str) -> Any:
    if package == "flashcodec":
        from flashcodec.compare import FlashCodecHarness

        # the package's tiers and the study configurations (benchmarks/studies), each with its own attention
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
        from flashcodec_tiers import ALL_TIERS

        return FlashCodecHarness(ALL_TIERS)
    from palu_mlx.compare import PaluHarness

    return PaluHarness()


def _lengths(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise CompareError(
            f"--lengths {value!r} must be comma-separated token counts like 1024,2048"
        ) from None
    if not out or any(n < 1 for n in out):
        raise CompareError(f"--lengths {value!r} must be positive token counts")
    return out


def _chat_template(tokenizer: Any):
    """The model's chat template around one user message, up to the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise CompareError(
            "--template chat: the model's tokenizer has no chat template; use --template plain"
        )

    def wrap(user: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )

    return wrap


def _prior(out: Path, settings: dict[str, Any], fresh: bool) -> list[dict[str, Any]]:
    """Rows of an earlier run of the same settings at ``out`` (none with ``--fresh`` or no file)."""
    if fresh or not out.is_file():
        return []
    old = read_json(out)
    if old.get("schema") != PASSKEY_SCHEMA:
        raise CompareError(
            f"--out {str(out)!r} is not a passkey result ({old.get('schema')!r}); pick another path"
        )
    changed = [k for k in RESUME_KEYS if old.get("settings", {}).get(k) != settings[k]]
    if changed:
        raise CompareError(
            f"--out {str(out)!r} holds a run with other settings ({', '.join(changed)}); "
            "pass --fresh to start over or choose another --out"
        )
    return list(old.get("rows", []))


def _table(rows: list[dict[str, Any]]) -> str:
    """Accuracy per candidate (rows) and length (columns), the baseline's beside each."""
    rows = [r for r in rows if not r.get("partial")]
    lengths = sorted({r["length"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    cell = {(r["name"], r["length"]): r for r in rows}
    lines = [f"{'candidate':26s}" + "".join(f"{n:>16d}" for n in lengths)]
    for name in names:
        parts = []
        for n in lengths:
            r = cell.get((name, n))
            if r is None:
                parts.append(f"{'-':>16s}")
            else:
                mark = "" if r["baseline_retrieves"] else "*"
                parts.append(f"{r['correct']:>6d}/{r['trials']} (b {r['baseline_accuracy']:.2f}){mark}")
        lines.append(f"{name:26s}" + "".join(f"{p:>16s}" for p in parts))
    if any(not r["baseline_retrieves"] for r in rows):
        lines.append(
            "* the uncompressed baseline does not retrieve at this length: it does not test the cache"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--package", choices=("palu", "flashcodec"))
    known, _ = first.parse_known_args(argv)
    package = known.package or "flashcodec"
    harness = _harness(package)
    tier_names, peer_names = tuple(harness.tiers()), tuple(harness.peers())

    parser = OneLineParser(prog="passkey.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", choices=("palu", "flashcodec"), required=True)
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=harness.dtypes, help="model and cache dtype")
    parser.add_argument(
        "--lengths", default=DEFAULT_LENGTHS, help=f"context lengths in tokens (default {DEFAULT_LENGTHS})"
    )
    parser.add_argument("--trials", type=int, default=20, help="prompts per length (default 20)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the passkeys and filler starts (default 0)"
    )
    parser.add_argument(
        "--template", choices=("chat", "plain"), default="plain", help="prompt wrapping (default plain)"
    )
    parser.add_argument(
        "--tiers", default="none", help=f"comma-separated tiers or 'none' (default): {', '.join(tier_names)}"
    )
    parser.add_argument(
        "--peers", default="none", help=f"comma-separated peers or 'none' (default): {', '.join(peer_names)}"
    )
    parser.add_argument("--text", help="filler text (default: kvbench's held-out text)")
    parser.add_argument("--out", help="result file (default $KVBENCH_RESULTS/passkey_<package>.json)")
    parser.add_argument("--fresh", action="store_true", help="ignore the rows already in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.trials < 1:
        raise CompareError(f"--trials {args.trials} must be at least 1")
    lengths = _lengths(args.lengths)
    tiers = parse_selection(args.tiers, tier_names, "--tiers")
    peers = parse_selection(args.peers, peer_names, "--peers")
    out = Path(args.out) if args.out else results_path(f"passkey_{package}.json")
    text, text_path = load_eval_text(args.text)

    loaded = harness.load(args)
    if loaded.max_positions and max(lengths) > loaded.max_positions:
        raise CompareError(
            f"--lengths reach {max(lengths)} tokens but the model has {loaded.max_positions} positions"
        )
    tokenizer = loaded.runner.tokenizer
    if args.template == "chat":
        template, encode = (
            _chat_template(tokenizer),
            loaded.encode_text,
        )  # the template holds the special tokens
    else:
        template, encode = None, loaded.encode_prompt
    candidates, absent = harness.candidates(loaded, tiers, peers)

    settings = {
        "package": package,
        "model_sha256": loaded.info.get("weights_sha256"),
        "dtype": args.dtype,
        "device": getattr(args, "device", None),
        "trials": args.trials,
        "seed": args.seed,
        "template": args.template,
        "answer_tokens": ANSWER_TOKENS,
        "depth_range": list(DEPTH_RANGE),
        "text": str(text_path),
        "text_sha256": text_digest(text),
        "protocol": "a fresh cache per trial; one prefill up to the question, the question one token per "
        f"call, {ANSWER_TOKENS} greedy tokens; correct when the first 5-digit number is the passkey",
    }
    prior = _prior(out, settings, args.fresh)
    chosen = {c.name for c in candidates}
    # rows of candidates or lengths not chosen this time stay in the file
    kept = [r for r in prior if r["name"] not in chosen or r["length"] not in lengths]
    rows: dict[tuple[str, int], dict[str, Any]] = {(r["name"], r["length"]): r for r in prior}

    def save() -> None:
        ordered = sorted(rows.values(), key=lambda r: (r["length"], _order(r, candidates)))
        every = sorted({r["length"] for r in ordered} | set(lengths))
        result = passkey_result(
            tool=f"benchmarks/tools/passkey.py --package {package}",
            packages=harness.packages,
            model=loaded.info,
            settings={**settings, "lengths": every},
            rows=ordered,
            absent=absent,
        )
        write_json(out, result)

    def finished(row: dict[str, Any]) -> None:  # a finished pair, or one trial more of a pair
        rows[(row["name"], row["length"])] = row
        save()

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' cache deprecation notes
        result_rows = run_passkey(
            loaded.runner,
            candidates,
            encode,
            lengths,
            args.trials,
            args.seed,
            not args.quiet,
            on_result=finished,
            on_trial=finished,
            done=[r for r in prior if r["name"] in chosen and r["length"] in lengths],
            template=template,
            lines=filler_lines(text),
        )
    for r in kept + result_rows:
        rows[(r["name"], r["length"])] = r
    save()
    print(_table(result_rows))
    print(f"{time.perf_counter() - started:.0f} s; written {out}", file=sys.stderr)
    for item in absent:
        print(f"absent: {item['name']}: {item['reason']}", file=sys.stderr)
    return 0


def _order(row: dict[str, Any], candidates: Sequence[Any]) -> int:
    names = [c.name for c in candidates]
    return names.index(row["name"]) if row["name"] in names else len(names)


if __name__ == "__main__":
    sys.exit(run_cli(main))
