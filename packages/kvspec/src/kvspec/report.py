"""What a reader sees of a ``kvspec.compare/1`` result: a terminal table, a markdown table, a chart.

:func:`render_table` (terminal), :func:`render_markdown` (docs) and :func:`plot_comparison`
(PNG: storage ratio vs perplexity increase, and decode speed) read the layout that
:func:`kvspec.measure.build_result` writes; :func:`emit` prints and writes them for a command.

Beyond the standard library it imports only :mod:`kvspec.results`; matplotlib is imported when used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .results import CompareError, write_json

__all__ = [
    "format_bytes",
    "render_table",
    "render_markdown",
    "plot_comparison",
    "require_matplotlib",
    "emit",
]


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"n/a"``."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fmt(value: Any, spec: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


#: (header, function of a row) for the terminal and markdown tables, in order
_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("cache", lambda r: r["name"]),
    ("kind", lambda r: r["kind"]),
    ("KV held", lambda r: format_bytes(r["kv_bytes"])),
    ("x raw", lambda r: _fmt(r["kv_ratio"], ".3f")),
    ("peak mem", lambda r: format_bytes(r["peak_memory_bytes"])),
    ("ppl", lambda r: _fmt(r["perplexity"], ".3f")),
    ("d ppl", lambda r: _fmt(r["ppl_delta"], "+.3f")),
    ("token match", lambda r: _fmt(100 * r["token_match"], ".1f") + "%"),
    ("decode x", lambda r: _fmt(r["decode_speed_ratio"], ".2f")),
    ("prefill x", lambda r: _fmt(r["prefill_time_ratio"], ".2f")),
]


def _header_line(result: dict[str, Any]) -> str:
    m, s, st = result["model"], result["settings"], result["stamp"]
    dims = f"{m.get('layers')} layers, {m.get('kv_heads')} KV heads x {m.get('head_dim')}"
    return (
        f"{result['tool']}: {m.get('name')} ({m.get('architecture')}, {dims}, {m.get('dtype')}) "
        f"on {s.get('device', 'cpu')}, {st['machine']['cpu_count']} CPUs; "
        f"{s['windows']} windows x ({s['context_tokens']} context + {s['scored_tokens']} scored) tokens, "
        f"{s.get('prompts', '?')} prompts x {s['new_tokens']} greedy tokens"
    )


def render_table(result: dict[str, Any], sample_chars: int = 72) -> str:
    """The result as a plain-text table for a terminal, with the absent peers and text samples."""
    headers = [h for h, _ in _COLUMNS]
    body = [[f(r) for _, f in _COLUMNS] for r in result["rows"]]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
    left = {0, 1}

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [_header_line(result), "", line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in body]
    out.append("")
    out.append(f"peak mem: {result['measures']['peak_memory_bytes']}")
    out.append(
        "x raw: KV bytes held / uncompressed KV bytes; decode x: tokens/s vs baseline (higher is faster);"
    )
    out.append("prefill x: prefill time vs baseline (higher is slower); all ratios from this one run.")
    for item in result.get("absent", []):
        out.append(f"absent: {item['name']} ({item['kind']}): {item['reason']}")
    out.append("")
    out.append("greedy continuation of prompt 1:")
    name_width = max(len(r["name"]) for r in result["rows"])
    for r in result["rows"]:
        sample = " ".join(r["sample"].split())
        if len(sample) > sample_chars:
            sample = sample[: sample_chars - 3] + "..."
        out.append(f"  {r['name'].ljust(name_width)}  {sample!r}")
    return "\n".join(out)


def render_markdown(result: dict[str, Any], columns: Sequence[str] | None = None) -> str:
    """The rows as a GitHub markdown table (``columns``: a subset of the table headers, in order)."""
    chosen = [(h, f) for h, f in _COLUMNS if columns is None or h in columns]
    if columns is not None and len(chosen) != len(columns):
        known = [h for h, _ in _COLUMNS]
        raise ValueError(f"unknown columns {sorted(set(columns) - set(known))}; known: {known}")
    lines = ["| " + " | ".join(h for h, _ in chosen) + " |"]
    lines.append("|" + "|".join("---" if h in ("cache", "kind") else "---:" for h, _ in chosen) + "|")
    for r in result["rows"]:
        lines.append("| " + " | ".join(f(r).replace("|", "\\|") for _, f in chosen) + " |")
    return "\n".join(lines)


def _log_height(y: float) -> float:
    # where a value sits on a symlog-like axis, for deciding whether two labels would collide
    return math.copysign(math.log10(1 + abs(y) * 1000), y)


_KIND_COLORS = {"baseline": "black", "tier": "tab:blue", "peer": "tab:orange"}


def plot_comparison(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a PNG: storage ratio vs perplexity increase (one point per row), and decode speed bars.

    Needs matplotlib; without it raises CompareError saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise CompareError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None

    rows = result["rows"]
    fig, (ax_q, ax_s) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    deltas = [r["ppl_delta"] for r in rows]
    labels: dict[tuple[float, float], list[str]] = {}
    for r in rows:
        ax_q.scatter(r["kv_ratio"], r["ppl_delta"], color=_KIND_COLORS[r["kind"]], s=36, zorder=3)
        # rows on (nearly) the same spot share one label instead of overprinting each other
        y = r["ppl_delta"]
        key_y = round(y, 2) if abs(y) < 1 else float(f"{y:.2g}")
        labels.setdefault((round(r["kv_ratio"], 2), key_y + 0.0), []).append(r["name"])
    span = max(r["kv_ratio"] for r in rows) - min(r["kv_ratio"] for r in rows) or 1.0
    placed: list[tuple[float, float, bool]] = []
    for (x, y), names in sorted(labels.items()):
        # a label close to the previous one (in x, at a similar height) goes below its point instead
        near = [
            below
            for px, py, below in placed
            if x - px < 0.15 * span and abs(_log_height(y) - _log_height(py)) < 0.6
        ]
        below = bool(near) and not near[-1]
        placed.append((x, y, below))
        offset = (5, -11) if below else (5, 4)
        ax_q.annotate(" / ".join(names), (x, y), textcoords="offset points", xytext=offset, fontsize=8)
    ax_q.axhline(0.0, color="grey", lw=0.8)
    positive = [abs(d) for d in deltas if d]
    if positive and max(positive) / max(min(positive), 1e-12) > 100:
        # tiers can differ by orders of magnitude; a symlog axis keeps the small ones visible
        ax_q.set_yscale("symlog", linthresh=max(min(positive), 1e-3))
    ax_q.set_xlabel("KV bytes held / uncompressed KV bytes")
    ax_q.set_ylabel("perplexity increase over baseline")
    ax_q.set_title("storage vs quality (lower left is better)", fontsize=10)
    ax_q.grid(alpha=0.3)
    for kind, color in _KIND_COLORS.items():
        if any(r["kind"] == kind for r in rows):
            ax_q.scatter([], [], color=color, label=kind)
    ax_q.legend(fontsize=8, loc="upper right")

    names = [r["name"] for r in rows][::-1]
    speeds = [r["decode_speed_ratio"] for r in rows][::-1]
    ax_s.barh(names, speeds, color=[_KIND_COLORS[r["kind"]] for r in rows][::-1])
    ax_s.axvline(1.0, color="grey", lw=0.8)
    ax_s.set_xlabel("decode tokens/s relative to baseline")
    ax_s.set_title("decode speed (higher is faster)", fontsize=10)
    ax_s.tick_params(axis="y", labelsize=8)
    ax_s.grid(axis="x", alpha=0.3)
    m = result["model"]
    fig.suptitle(f"{result['tool']} on {m.get('name')} ({result['stamp']['date'][:10]})", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


def require_matplotlib() -> None:
    """CompareError now (before minutes of measuring) when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CompareError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None


def emit(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """Print the table, then write the JSON and the chart where asked and say where they are."""
    print(render_table(result))
    if json_path:
        print(f"\nJSON: {write_json(json_path, result)}")
    if plot_path:
        print(f"chart: {plot_comparison(result, plot_path)}")
