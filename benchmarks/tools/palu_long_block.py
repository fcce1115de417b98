"""The measured block of docs/palu-mlx.md on long-context decoding, from palu_long_decode.json.

``make_docs.py`` puts what :func:`render_palu_long_block` returns between the
``<!-- palu-long:start -->`` and ``<!-- palu-long:end -->`` markers of docs/palu-mlx.md; the
figures come from ``benchmarks/results/palu_long_decode.json`` (``benchmarks/palu/long_decode.py``).
"""

from __future__ import annotations

from typing import Any

PALU_LONG_START, PALU_LONG_END = "<!-- palu-long:start -->", "<!-- palu-long:end -->"
PALU_LONG_FILE = "palu_long_decode.json"

_MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / _MIB:.2f}"


def render_palu_long_block(result: dict[str, Any]) -> str:
    """Per context: bytes held, the decode step's peak and decode speed of every cache, beside q4's."""
    lines = [
        PALU_LONG_START,
        "",
        f"Measured by `benchmarks/palu/long_decode.py` ({result['date'][:10]}, "
        f"`benchmarks/results/{PALU_LONG_FILE}`) on the embedded model in bfloat16: each cache filled "
        f"from one {result['chunk']}-token chunked prefill's keys and values, then "
        f"{result['rounds']} rounds of {result['steps']} decode steps per cache, taking turns (best round "
        "kept). *peak* is one decode step's allocator peak counted from before the cache existed (the "
        "cache plus the step's transient arrays). `-rebuild` rows run the same palu caches through the "
        "path that rebuilds the whole history for SDPA.",
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
    lines.append(PALU_LONG_END)
    return "\n".join(lines)
