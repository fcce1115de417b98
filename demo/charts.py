"""The comparison tab's bars: storage, speed, NLL and token match of each cache, from measure's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["comparison_figure"]

# (row field, title, scale): what each panel shows
PANELS = (
    ("kv_ratio", "KV held vs uncompressed (x, lower is smaller)", 1.0),
    ("decode_tokens_per_s", "decode tokens/s (higher is faster)", 1.0),
    ("nll", "teacher-forced NLL of the continuation (nats/token)", 1.0),
    ("token_match", "greedy token match (%)", 100.0),
)
COLORS = {"baseline": "#7f7f7f", "tier": "#1f77b4", "peer": "#ff7f0e"}


def comparison_figure(rows: Sequence[dict[str, Any]]):
    """A matplotlib figure: one horizontal bar panel per measure, one bar per cache (baseline
    grey, the package's tiers blue, the stack's peers orange)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure is rendered for the page
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    colors = [COLORS.get(r["kind"], "#2ca02c") for r in rows]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 0.35 * len(rows) + 1.4), sharey=True)
    for ax, (key, title, scale) in zip(axes, PANELS, strict=True):
        values = [(r[key] or 0.0) * scale for r in rows]
        ax.barh(names, values, color=colors)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()  # baseline on top, as in the table (once: the panels share the axis)
    fig.tight_layout()
    return fig
