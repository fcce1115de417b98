"""The measured block of docs/palu-mlx.md on the real model, from palu_real_model.json.

``make_docs.py`` puts what :func:`render_palu_real_block` returns between the
``<!-- palu-real:start -->`` and ``<!-- palu-real:end -->`` markers of docs/palu-mlx.md; the
figures come from ``benchmarks/results/palu_real_model.json`` (``benchmarks/palu/real_model.py``).
The table lists the file's rows of the tiers a user can pick (:data:`palu_mlx.tiers.TIERS` and
their ``+cal`` / ``+sens`` twins) and its peers, smallest first; the study configurations it also
holds are counted, not listed (``benchmarks/studies/palu_tiers.py``). The lines under it are computed
from the listed rows: which tiers reach the targets the page names, and which need a file.
"""

from __future__ import annotations

from typing import Any

from palu_mlx.tiers import CALIBRATED_TIERS, SENSITIVITY_TIERS, TIERS

PALU_REAL_START, PALU_REAL_END = "<!-- palu-real:start -->", "<!-- palu-real:end -->"
PALU_REAL_FILE = "palu_real_model.json"
#: the same protocol on the registry's default, its best fitted tiers, the rotation tiers and the
#: peers that hold their codes (``real_model.py --out .../palu_frontier.json --only ...``)
PALU_FRONTIER_START, PALU_FRONTIER_END = "<!-- palu-frontier:start -->", "<!-- palu-frontier:end -->"
PALU_FRONTIER_FILE = "palu_frontier.json"
#: the names of palu's own rows (the others are peers)
_OURS = ("palu", "rotation")
#: the palu rows the table lists: the tiers a user can pick
USER_TIERS = frozenset({*TIERS, *CALIBRATED_TIERS, *SENSITIVITY_TIERS})

#: the peer every ratio is read against
Q4 = "mlx-lm-q4"

#: what a row needs besides the model, by the end of its name
_NEEDS = (
    ("+cal", "a calibration file"),
    ("+sens", "a sensitivity profile"),
)


def needs(name: str) -> str:
    """What the tier needs besides the model: a file of one of two kinds, or nothing."""
    for suffix, what in _NEEDS:
        if name.endswith(suffix):
            return what
    return "nothing"


def _name(name: str) -> str:
    return f"`{name}`"


def _listed(rows: list[tuple[str, dict[str, Any]]], q4_kl: float) -> str:
    return "; ".join(
        f"{_name(n)} {r['bytes_x_q4']:.3f}x q4's bytes at {r['kl'] / q4_kl:.2f}x its KL"
        + ("" if needs(n) == "nothing" else f" (needs {needs(n)})")
        for n, r in rows
    )


def render_palu_real_block(
    result: dict[str, Any],
    file: str = PALU_REAL_FILE,
    start: str = PALU_REAL_START,
    end: str = PALU_REAL_END,
) -> str:
    """The table of every cache in ``file``'s ``result``, then what it says about the targets against
    q4, between the markers ``start`` and ``end``."""
    rows = result["rows"]
    setup = result["setup"]
    q4_kl = rows[Q4]["kl"]
    ordered = sorted(
        ((n, r) for n, r in rows.items() if not n.startswith(_OURS) or n in USER_TIERS),
        key=lambda item: item[1]["bytes_x_q4"],
    )
    studies = sum(1 for n in rows if n.startswith(_OURS) and n not in USER_TIERS)
    lines = [
        start,
        "",
        f"Generated from `benchmarks/results/{file}` ({result['date'][:10]}): "
        f"{setup['model']['name']}, {setup['windows']} windows of {setup['context_tokens']:,} tokens of "
        f"context and {setup['scored_tokens']} scored tokens ({setup['windows'] * setup['scored_tokens']} "
        f"scored positions), read {setup['step_tokens']} at a time. *needs*: what a tier reads besides "
        "the model (`+cal`: a `palu-mlx calibrate` file; `+sens`: a sensitivity profile of the model, "
        "`benchmarks/palu/sensitivity.py`)."
        + (f" The file's {studies} study configurations are not listed." if studies else ""),
        "",
        "| cache | needs | bytes x uncompressed | bytes x q4 | KL | KL x q4 | top-1 | perplexity |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in ordered:
        kl = row.get("kl", 0.0)
        lines.append(
            f"| {_name(name)} | {needs(name) if name.startswith(_OURS) else ''} | {row['bytes_x_raw']:.3f} | "
            f"{row['bytes_x_q4']:.3f} | {kl:.3g} | {kl / q4_kl:.2f} | {row.get('top1', 1.0):.1%} | {row['ppl']:.2f} |"
        )
    palu = [(n, r) for n, r in ordered if n.startswith(_OURS)]
    quarter = [(n, r) for n, r in palu if r["bytes_x_q4"] <= 1.0 and r["kl"] <= 0.25 * q4_kl]
    half = [(n, r) for n, r in palu if r["bytes_x_q4"] <= 0.5 and r["kl"] <= q4_kl]
    at_q4_kl = [(n, r) for n, r in palu if r["kl"] <= q4_kl]
    no_file = [(n, r) for n, r in at_q4_kl if needs(n) == "nothing"]
    lines += [
        "",
        f"- At no more than q4's bytes with at most a quarter of its KL: {_listed(quarter, q4_kl) or 'none'}.",
        "- At no more than half of q4's bytes with at most its KL: "
        + (
            _listed(half, q4_kl)
            if half
            else "none; the smallest tier with at most q4's KL is " + _listed(at_q4_kl[:1], q4_kl)
        )
        + ".",
        "- The smallest tier that needs no file and has at most q4's KL: "
        + (_listed(no_file[:1], q4_kl) if no_file else "none")
        + ".",
        "",
        end,
    ]
    return "\n".join(lines)
