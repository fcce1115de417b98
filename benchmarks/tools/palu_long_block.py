"""The measured blocks of docs/palu-mlx.md on long-context decoding, from palu_long_decode.json
(the embedded model) and palu_long_decode_real.json (the real model).

``make_docs.py`` puts what :func:`render_palu_long_block` returns between the
``<!-- palu-long:start -->`` and ``<!-- palu-long:end -->`` markers of docs/palu-mlx.md (and, for
the real model's file, between ``<!-- palu-long-real:start -->`` and ``<!-- palu-long-real:end -->``);
the figures come from ``benchmarks/results/`` (``benchmarks/palu/long_decode.py``).
"""

from __future__ import annotations

from typing import Any

PALU_LONG_START, PALU_LONG_END = "<!-- palu-long:start -->", "<!-- palu-long:end -->"
PALU_LONG_FILE = "palu_long_decode.json"
PALU_LONG_REAL_START, PALU_LONG_REAL_END = "<!-- palu-long-real:start -->", "<!-- palu-long-real:end -->"
PALU_LONG_REAL_FILE = "palu_long_decode_real.json"

#: the real model's decode-peak target: one step's peak at the longest context at most this times q4's
PALU_PEAK_TARGET = 0.5
_MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / _MIB:.2f}"


def render_palu_long_block(
    result: dict[str, Any],
    file: str = PALU_LONG_FILE,
    start: str = PALU_LONG_START,
    end: str = PALU_LONG_END,
    peak_target: float | None = None,
) -> str:
    """Per context: bytes held, the decode step's peak and decode speed of every cache, beside q4's;
    with ``peak_target``, a line per palu cache on its peak at the longest context against that
    multiple of q4's."""
    name = result.get("model", {}).get("name")
    where = "the embedded model" if name in (None, "tiny-qwen3") else name
    where += " in bfloat16"
    if result.get("prefill_dtype") == "float32":
        where += " (the prefill computed in float32 with its keys and values rounded to bfloat16)"
    if result.get("sensitivity"):
        where += "; `+sens` tiers read the model's sensitivity profile (`palu-mlx sensitivity`)"
    rebuild = (
        " `-rebuild` rows run the same palu caches through the path that rebuilds the whole history for SDPA."
        if any(n.endswith("-rebuild") for rows in result["contexts"].values() for n in rows)
        else ""
    )
    lines = [
        start,
        "",
        f"Measured by `benchmarks/palu/long_decode.py` ({result['date'][:10]}, "
        f"`benchmarks/results/{file}`) on {where}: each cache filled "
        f"from one {result['chunk']}-token chunked prefill's keys and values, then "
        f"{result['rounds']} rounds of {result['steps']} decode steps per cache, taking turns (best round "
        "kept). *peak* is one decode step's allocator peak counted from before the cache existed (the "
        f"cache plus the step's transient arrays).{rebuild}",
        "",
    ]
    for context, rows in result["contexts"].items():
        lines += [
            f"**{int(context):,} tokens of context**",
            "",
            "| cache | held MiB | held ×q4 | decode peak MiB | peak ×q4 | tokens/s | speed ×q4 | speed ×baseline |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in rows.items():
            lines.append(
                f"| {name} | {_mib(row['held_bytes'])} | {row['held_vs_q4']:.2f} | "
                f"{_mib(row['decode_peak_bytes'])} | {row['peak_vs_q4']:.2f} | {row['tokens_per_s']:.1f} | "
                f"{row['speed_vs_q4']:.2f} | {row['speed_vs_baseline']:.2f} |"
            )
        lines.append("")
    if peak_target is not None:
        lines += _against_target(result, peak_target)
    lines.append(end)
    return "\n".join(lines)


def _against_target(result: dict[str, Any], target: float) -> list[str]:
    """At the longest context, each palu cache's held bytes and decode peak against q4's, read
    against a peak of at most ``target`` times q4's."""
    context = max(result["contexts"], key=int)
    out = []
    for name, row in result["contexts"][context].items():
        if not name.startswith("palu-") or name.endswith("-rebuild"):
            continue
        verdict = "met" if row["peak_vs_q4"] <= target else "not met"
        out.append(
            f"- At {int(context):,} tokens `{name}` holds {row['held_vs_q4']:.2f}x q4's bytes and one decode "
            f"step peaks at {row['peak_vs_q4']:.2f}x q4's peak (a peak of at most {target}x q4's: {verdict})."
        )
    return [*out, ""] if out else []
