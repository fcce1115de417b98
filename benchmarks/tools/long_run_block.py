"""The long run's section of docs/benchmarks.md: the default tiers at 4,096 scored positions.

The default main job scores a few hundred positions per cache, too few to tell KLs a few tens of
percent apart. The long run scores 16 windows of 2,048 tokens, the last 256 of each, for the tiers
the README names and the peers they are read against:

* flashcodec: ``flashcodec compare`` (kvbench's protocol: every scored token decoded one at a time,
  hqq 4- and 8-bit and the float32 noise floor in the same process) -> ``compare_flashcodec_long.json``;
* palu-mlx: ``benchmarks/palu/real_model.py`` (MLX on this class of CPU is too slow for kvbench's
  token-at-a-time protocol at this size, so the scored tokens are read 32 at a time beside mlx-lm's
  ``QuantizedKVCache(4)``, resumable per candidate) -> ``palu_real_model_long.json``.

:func:`render_long_run` returns the section (a list of lines) for whichever of the two files exist.
The speed columns of the flashcodec run are left out: that run times one short round, so its
speeds are not figures to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashcodec_blocks import with_shown_names
from kvbench.results import read_json

FLASHCODEC_LONG_FILE = "compare_flashcodec_long.json"
PALU_LONG_RUN_FILE = "palu_real_model_long.json"

#: the commands that wrote the two files (the flashcodec tiers are the README's default, its
#: smallest tier at hqq 4-bit's KL and its 8-bit tier, beside the default they replaced)
FLASHCODEC_COMMAND = (
    "OMP_NUM_THREADS=1 hatch run bench:python benchmarks/studies/flashcodec_tiers.py --model smollm2-135m --tiers "
    "kivi64r-k4v4-w64i8-s8,kivi64r-k4v4-w64i8,kivi64r-k3v2-w0i8-s8z4,kivi64r-k8v8-w32-s8 --attention codes "
    "--peers hf-hqq-q4,hf-hqq-q8 --noise-floor --windows 1 --context-tokens 192 --scored-tokens 64 "
    "--prompt-count 1 --new-tokens 8 --long-context 2048 --long-windows 16 --long-scored-tokens 256 "
    "--speed-rounds 1 --speed-steps 4 --no-memory-curve --json benchmarks/results/compare_flashcodec_long.json"
)
PALU_COMMAND = (
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 hatch run bench:python "
    "benchmarks/palu/real_model.py --windows 16 --context 1792 --scored 256 --only "
    "mlx-lm-q4,palu-2.25bit-scaled+rel,float32-kv --out benchmarks/results/palu_real_model_long.json"
)

#: the peer each package's rows are read against
HQQ4, Q4 = "hf-hqq-q4", "mlx-lm-q4"


def _interval(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return ""
    low, high = pair["ci95"]
    return f"{pair['ppl_delta']:+.3f} [{low:+.3f}, {high:+.3f}]"


def _flashcodec(result: dict[str, Any], reading) -> list[str]:
    run = with_shown_names(result)["runs"][-1]
    rows = run["rows"]
    st = run["settings"]
    hqq = next(r for r in rows if r["name"] == HQQ4)

    def resident(r: dict[str, Any]) -> float:
        return r.get("resident_ratio_decode_mean") or r["kv_ratio"]

    lines = [
        f"**flashcodec** (`{FLASHCODEC_LONG_FILE}`, {result['stamp']['date'][:10]}): "
        f"`{result['model']['name']}` in {result['model']['dtype']}, {st['windows']} windows of "
        f"{st['context_tokens']:,} tokens of context + {st['scored_tokens']} scored "
        f"({st['windows'] * st['scored_tokens']:,} scored positions), each scored token decoded on its own. "
        "*d ppl vs hqq-q4*: the tier's perplexity minus hqq 4-bit's on the same positions, with kvbench's "
        "paired 95% bootstrap interval.",
        "",
        "| cache | resident x decoding | x hqq-q4 | KL | KL x hqq-q4 | KL p99 | top-1 | d ppl [95%] | d ppl vs hqq-q4 [95%] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows[1:]:
        lines.append(
            f"| `{r['name']}` | {resident(r):.3f} | {resident(r) / resident(hqq):.3f} | {r['kl_mean']:.2e} | "
            f"{r['kl_mean'] / hqq['kl_mean']:.2f} | {r['kl_p99']:.2e} | {r['top1_agreement']:.1%} | "
            f"{_interval({'ppl_delta': r['ppl_delta'], 'ci95': r['ppl_delta_ci95']})} | "
            f"{_interval(r.get('ppl_vs_peers', {}).get(HQQ4))} |"
        )
    lines += ["", *(f"- {point}" for point in reading(rows, speed=False))]
    lines += ["", f"Reproduce: `{FLASHCODEC_COMMAND}`", ""]
    return lines


def _palu(result: dict[str, Any]) -> list[str]:
    rows, setup = result["rows"], result["setup"]
    q4 = rows.get(Q4)  # None while a resumed run has not reached it: its columns say so

    def against_q4(value: float | None, of_q4: float | None) -> str:
        return "–" if value is None or not of_q4 else f"{value / of_q4:.2f}"

    def ppl_delta(row: dict[str, Any]) -> str:
        if "ppl_delta_ci95" not in row:
            return ""
        return _interval({"ppl_delta": row["ppl"] - rows["baseline"]["ppl"], "ci95": row["ppl_delta_ci95"]})

    def kl_vs_q4(row: dict[str, Any]) -> str:
        vs = row.get("vs_q4")
        if vs is None:
            return ""
        low, high = vs["kl_delta_ci95"]
        return f"{vs['kl_delta']:+.2e} [{low:+.2e}, {high:+.2e}]"

    lines = [
        f"**palu-mlx** (`{PALU_LONG_RUN_FILE}`, {result['date'][:10]}): `{setup['model']['name']}`, "
        f"{setup['windows']} windows of {setup['context_tokens']:,} tokens of context + "
        f"{setup['scored_tokens']} scored ({setup['windows'] * setup['scored_tokens']:,} scored positions), "
        f"read {setup['step_tokens']} at a time, the model computed in float32 with bfloat16 keys and values. "
        "Intervals: kvbench's paired 95% bootstrap over the scored positions (*d ppl*: perplexity minus "
        "the baseline's; *KL - q4's* and *d ppl vs q4*: minus mlx-lm's 4-bit cache's on the same positions). "
        "`float32-kv` is the noise floor: the uncompressed cache holding the float32 keys and values that "
        "every other row gets rounded to bfloat16 (its bytes are float32's).",
        "",
        "| cache | bytes x uncompressed | bytes x q4 | KL | KL x q4 | KL - q4's [95%] | top-1 | perplexity "
        "| d ppl [95%] | d ppl vs q4 [95%] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in sorted(rows.items(), key=lambda item: item[1]["bytes_x_raw"], reverse=True):
        kl = row.get("kl", 0.0)
        vs = row.get("vs_q4")
        lines.append(
            f"| `{name}` | {row['bytes_x_raw']:.3f} | "
            f"{against_q4(row['bytes_x_raw'], q4 and q4['bytes_x_raw'])} | {kl:.3g} | "
            f"{against_q4(kl, q4 and q4['kl'])} | {kl_vs_q4(row)} | {row.get('top1', 1.0):.1%} | "
            f"{row['ppl']:.2f} | {ppl_delta(row)} | "
            f"{_interval(vs and {'ppl_delta': vs['ppl_delta'], 'ci95': vs['ppl_delta_ci95']})} |"
        )
    missing = [n for n in ("baseline", Q4) if n not in rows]
    if missing:
        lines += ["", f"- Not run yet: {', '.join(missing)}."]
    lines += ["", f"Reproduce (resumable per candidate): `{PALU_COMMAND}`", ""]
    return lines


def render_long_run(results_dir: Path, reading) -> list[str]:
    """The section for the long-run files in ``results_dir`` (none: an empty list). ``reading`` is
    make_docs's reading of one run's rows (passed in: this module sits below make_docs)."""
    flashcodec, palu = results_dir / FLASHCODEC_LONG_FILE, results_dir / PALU_LONG_RUN_FILE
    if not flashcodec.is_file() and not palu.is_file():
        return []
    lines = [
        "## The long run: 4,096 scored positions in windows of 2,048 tokens",
        "",
        "The default run above scores a few hundred positions per cache. The long run scores 16 windows "
        "of 2,048 tokens, the last 256 of each (each package's line gives the exact setting; 16 such windows "
        "take all of kvbench's held-out text) for the tiers the README "
        "names and the peers they are read against, so KL differences of a few tens of percent are told apart.",
        "",
    ]
    if flashcodec.is_file():
        lines += _flashcodec(read_json(flashcodec), reading)
    if palu.is_file():
        lines += _palu(read_json(palu))
    return lines
