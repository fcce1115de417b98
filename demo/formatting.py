"""Numbers as the page shows them: the per-turn stats table and the comparison table.

Pure functions of measured values; a value that was not measured shows as ``n/a``, never as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbench.report import format_bytes

from .stats import SideStats, TokenMatch

__all__ = [
    "STATS_HEADERS",
    "COMPARISON_HEADERS",
    "fmt_ms",
    "fmt_ratio",
    "fmt_share",
    "stats_rows",
    "match_line",
    "comparison_rows",
    "details_line",
]

NA = "n/a"

STATS_HEADERS = [
    "cache",
    "context + new tokens",
    "KV held",
    "KV resident",
    "held vs native",
    "peak memory",
    "steady memory",
    "prefill",
    "per token (median)",
    "token match",
]

COMPARISON_HEADERS = [
    "cache",
    "kind",
    "KV held",
    "held x",
    "resident x",
    "peak decode",
    "decode tok/s",
    "decode x",
    "NLL",
    "d ppl",
    "KL",
    "top-1",
    "token match",
]


def fmt_ms(value: float | None) -> str:
    """Milliseconds with two decimals: ``12.345`` -> ``"12.35 ms"``."""
    return NA if value is None else f"{value:.2f} ms"


def fmt_ratio(value: float | None) -> str:
    """A ratio to the native cache: ``0.53125`` -> ``"0.531x"``."""
    return NA if value is None else f"{value:.3f}x"


def fmt_share(value: float | None) -> str:
    """A share as a percentage: ``0.9166`` -> ``"91.7%"``."""
    return NA if value is None else f"{100 * value:.1f}%"


def _bytes(value: int | None) -> str:
    return NA if value is None else format_bytes(value)


def stats_rows(native: SideStats, compressed: SideStats, match: TokenMatch) -> list[list[str]]:
    """The stats table of one turn: the native row, then the compressed row (cells as text)."""

    def row(side: SideStats, ratio: str, matched: str) -> list[str]:
        return [
            side.name,
            f"{side.context_tokens} + {side.new_tokens}",
            _bytes(side.kv_held),
            _bytes(side.kv_resident if side.kv_resident is not None else side.kv_held),
            ratio,
            _bytes(side.peak_bytes),
            _bytes(side.steady_bytes),
            fmt_ms(1000.0 * side.prefill_s),
            fmt_ms(side.ms_per_token),
            matched,
        ]

    ratio = compressed.kv_held / native.kv_held if native.kv_held else None
    return [
        row(native, fmt_ratio(1.0), "reference"),
        row(compressed, fmt_ratio(ratio), f"{match.same}/{match.total} ({fmt_share(match.share)})"),
    ]


def match_line(match: TokenMatch) -> str:
    """One sentence on where the replies part."""
    if match.first_divergence is None:
        return f"The replies agree on all {match.total} tokens."
    return (
        f"{match.same} of {match.total} tokens agree; the replies first differ at token "
        f"{match.first_divergence + 1}."
    )


def comparison_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The comparison table from :func:`kvbench.protocol.measure` rows (same order)."""
    out = []
    for r in rows:
        out.append(
            [
                r["name"],
                r["kind"],
                _bytes(r["kv_bytes"]),
                fmt_ratio(r["kv_ratio"]),
                fmt_ratio(r["resident_ratio"]),
                _bytes(r["peak_decode_bytes"]),
                f"{r['decode_tokens_per_s']:.1f}",
                fmt_ratio(r["decode_speed_ratio"]),
                f"{r['nll']:.3f}",
                f"{r['ppl_delta']:+.3f}",
                f"{r['kl_mean']:.2e}",
                fmt_share(r["top1_agreement"]),
                fmt_share(r["token_match"]),
            ]
        )
    return out


def details_line(details: dict | None) -> str:
    """What a cache reported about its run, as one phrase: ``{"decode_steps_on_codes": 11,
    "fallbacks": {}}`` -> ``"decode steps on codes: 11; fallbacks: none"``."""
    if not details:
        return ""
    parts = []
    for key, value in details.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
        parts.append(f"{key.replace('_', ' ')}: {value}")
    return "; ".join(parts)
