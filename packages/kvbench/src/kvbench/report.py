"""What a reader sees of a compare result: terminal tables, markdown tables, a chart.

:func:`render_table` (terminal), :func:`render_markdown` (docs) and :func:`plot_comparison`
(PNG: bits per element vs KL with each kind's frontier, resident memory vs context, decode speed)
read the layout that :func:`kvbench.results.build_result` writes; :func:`emit` prints and writes
them for a command.

Beyond the standard library it imports only :mod:`kvbench.results`; matplotlib is imported when used.
"""

from __future__ import annotations

import math
import numbers
import os
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .checks import check_count, check_result, check_rows
from .results import CompareError, write_json

__all__ = [
    "format_bytes",
    "render_table",
    "render_markdown",
    "plot_comparison",
    "frontier",
    "LEGEND",
    "require_matplotlib",
    "emit",
]


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"n/a"``."""
    if n is None:
        return "n/a"
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise CompareError(f"format_bytes takes a number of bytes or None; got {n!r}")
    value = float(n)
    if not math.isfinite(value):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fmt(value: Any, spec: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


def _resident(r: dict[str, Any]) -> int:
    return r["kv_bytes"] if r.get("kv_resident_bytes") is None else r["kv_resident_bytes"]


#: (header, function of a row) for the terminal and markdown tables, in order
_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("cache", lambda r: r["name"]),
    ("kind", lambda r: r["kind"]),
    ("bits/el", lambda r: _fmt(r["bits_per_element"], ".2f")),
    ("held x", lambda r: _fmt(r["kv_ratio"], ".3f")),
    ("resident x", lambda r: _fmt(r["resident_ratio"], ".3f")),
    ("resident x decoding", lambda r: _fmt(r.get("resident_ratio_decode_mean"), ".3f")),
    ("peak decode", lambda r: format_bytes(r["peak_decode_bytes"])),
    ("KL", lambda r: _fmt(r["kl_mean"], ".2e")),
    ("top-1", lambda r: _fmt(100 * r["top1_agreement"], ".1f") + "%"),
    ("d ppl", lambda r: _fmt(r["ppl_delta"], "+.3f")),
    ("token match", lambda r: _fmt(100 * r["token_match"], ".1f") + "%"),
    ("decode x", lambda r: _fmt(r["decode_speed_ratio"], ".2f")),
    ("prefill x", lambda r: _fmt(r["prefill_time_ratio"], ".2f")),
]

#: the footer that explains the columns (terminal and docs)
LEGEND = (
    "bits/el: bits held per K/V element (the uncompressed cache spends its dtype's width); "
    "held x / resident x: bytes held (compressed representation) / everything the cache object keeps, "
    "over the uncompressed cache's bytes, after the first window; resident x decoding: the same, averaged "
    "over that window's decode positions (a cache whose size jumps is charged its average); peak decode: peak memory during decode above the level "
    "before the cache existed; KL: mean KL(baseline || cache) of the next-token distributions, "
    "nats; top-1: positions whose most likely next token matches the baseline's; d ppl: perplexity "
    "increase; token match: greedy tokens equal to the baseline's (an illustration); decode x: "
    "tokens/s vs baseline; prefill x: prefill time vs baseline (higher is slower). All from one run."
)


def _run_line(result: dict[str, Any], run: dict[str, Any]) -> str:
    s = run["settings"]
    return (
        f"{run['name']} context: {s['windows']} windows x ({s['context_tokens']} context + "
        f"{s['scored_tokens']} scored) tokens = {s['windows'] * s['scored_tokens']} scored positions"
    )


def _header_line(result: dict[str, Any]) -> str:
    m, st = result["model"], result["stamp"]
    dims = f"{m.get('layers')} layers, {m.get('kv_heads')} KV heads x {m.get('head_dim')}"
    device = result.get("inputs", {}).get("device") or "cpu"
    return (
        f"{result['tool']}: {m.get('name')} ({m.get('architecture')}, {dims}, {m.get('dtype')}) "
        f"on {device}, {st['machine']['cpu_count']} CPUs"
    )


def _table(
    rows: list[dict[str, Any]], columns: list[tuple[str, Callable[[dict[str, Any]], str]]]
) -> list[str]:
    headers = [h for h, _ in columns]
    body = [[f(r) for _, f in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [line(headers), line(["-" * w for w in widths]), *(line(row) for row in body)]


def render_table(result: dict[str, Any], sample_chars: int = 72) -> str:
    """The result as plain-text tables for a terminal (one per run), with absent peers and samples."""
    check_result(result)
    check_count("sample_chars", sample_chars, low=4)
    try:
        return _render_table(result, sample_chars)
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise CompareError(f"result is missing or has a bad field for the table: {err!r}") from None


def _render_table(result: dict[str, Any], sample_chars: int) -> str:
    out = [_header_line(result)]
    for run in result["runs"]:
        out += ["", _run_line(result, run), *_table(run["rows"], _COLUMNS)]
    out += ["", f"peak: {result['measures']['peak_label']}"]
    out += textwrap.wrap(LEGEND, 100)
    for item in result.get("absent", []):
        out.append(f"absent: {item['name']} ({item['kind']}): {item['reason']}")
    rows = result["runs"][0]["rows"]
    out += ["", "greedy continuation of prompt 1 (short context):"]
    name_width = max(len(r["name"]) for r in rows)
    for r in rows:
        sample = " ".join(r["sample"].split())
        if len(sample) > sample_chars:
            sample = sample[: sample_chars - 3] + "..."
        out.append(f"  {r['name'].ljust(name_width)}  {sample!r}")
    return "\n".join(out)


def render_markdown(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` (one run's) as a GitHub markdown table (``columns``: a subset of the headers, in order)."""
    rows = check_rows(rows, "rows")
    if isinstance(columns, str):
        raise CompareError(f"columns must be a list of headers, not one string; got {columns!r}")
    chosen = [(h, f) for h, f in _COLUMNS if columns is None or h in columns]
    if columns is not None and len(chosen) != len(columns):
        known = [h for h, _ in _COLUMNS]
        raise CompareError(f"unknown columns {sorted(set(columns) - set(known))}; known: {known}")
    lines = ["| " + " | ".join(h for h, _ in chosen) + " |"]
    lines.append("|" + "|".join("---" if h in ("cache", "kind") else "---:" for h, _ in chosen) + "|")
    for r in rows:
        lines.append("| " + " | ".join(f(r).replace("|", "\\|") for _, f in chosen) + " |")
    return "\n".join(lines)


_KIND_COLORS = {"baseline": "black", "tier": "tab:blue", "peer": "tab:orange", "reference": "tab:gray"}
#: KL values below this are drawn on it (log axis); the label says so
KL_FLOOR = 1e-6


def frontier(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The lower-left (Pareto) frontier of ``(bits, kl, name)`` points: no other point has both
    fewer-or-equal bits and lower-or-equal KL. Sorted by bits."""
    best: list[tuple[float, float, str]] = []
    for x, y, name in sorted(points, key=lambda p: (p[0], p[1])):
        if not best or y < best[-1][1]:
            best.append((x, y, name))
    return best


def plot_comparison(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a PNG of three panels, from the long-context run when there is one:
    bits per element vs KL (log-log, each kind's frontier drawn), resident bytes vs context
    length, and decode speed relative to the baseline.

    Needs matplotlib; without it raises CompareError saying how to install it.
    """
    check_result(result)
    plt = _pyplot()
    run = result["runs"][-1]
    rows = run["rows"]
    fig, (ax_q, ax_m, ax_s) = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [5, 4, 3]})
    # --- bits vs KL
    for kind, color in _KIND_COLORS.items():
        pts = [
            (r["bits_per_element"], max(r["kl_mean"], KL_FLOOR), r["name"])
            for r in rows
            if r["kind"] == kind and r["bits_per_element"]
        ]
        if not pts:
            continue
        ax_q.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=36, zorder=3, label=kind)
        for x, y, name in pts:
            ax_q.annotate(name, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        if kind != "baseline":
            line = frontier(pts)
            ax_q.plot([p[0] for p in line], [p[1] for p in line], color=color, lw=1.2, alpha=0.7)
    ax_q.set_xscale("log", base=2)
    ax_q.set_yscale("log")
    ax_q.set_xlabel("bits held per K/V element (log)")
    ax_q.set_ylabel(f"mean KL to baseline, nats (log; floor {KL_FLOOR:g})")
    ax_q.set_title(f"rate vs quality, {run['name']} context (lower left is better)", fontsize=10)
    ax_q.grid(alpha=0.3, which="both")
    ax_q.legend(fontsize=8, loc="upper right")
    # --- resident bytes vs context
    curves = [r for r in rows if r.get("memory_curve")]
    for r in curves:
        xs = [p["tokens"] for p in r["memory_curve"]]
        ys = [(p["resident"] if p["resident"] is not None else p["held"]) / 2**20 for p in r["memory_curve"]]
        style = "-" if r["kind"] != "peer" else "--"
        ax_m.plot(
            xs,
            ys,
            style,
            marker="o",
            ms=3,
            lw=1,
            label=r["name"],
            color=None if r["kind"] != "baseline" else "black",
        )
    if curves:
        ax_m.set_xscale("log", base=2)
        ax_m.legend(fontsize=6, ncol=2)
    ax_m.set_xlabel("tokens in the cache")
    ax_m.set_ylabel("resident MiB (everything the cache keeps)")
    ax_m.set_title("resident memory vs context", fontsize=10)
    ax_m.grid(alpha=0.3)
    # --- speed
    names = [r["name"] for r in rows][::-1]
    speeds = [r["decode_speed_ratio"] for r in rows][::-1]
    ax_s.barh(names, speeds, color=[_KIND_COLORS[r["kind"]] for r in rows][::-1])
    ax_s.axvline(1.0, color="grey", lw=0.8)
    ax_s.set_xlabel("decode tokens/s relative to baseline")
    ax_s.set_title(f"decode speed at {run['settings']['context_tokens']} tokens of context", fontsize=10)
    ax_s.tick_params(axis="y", labelsize=7)
    ax_s.grid(axis="x", alpha=0.3)
    m = result["model"]
    fig.suptitle(
        f"{result['tool']} on {m.get('name')} ({m.get('dtype')}, {result['stamp']['date'][:10]})", fontsize=11
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise CompareError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    return plt


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
