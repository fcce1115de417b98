"""The families block of docs/palu-mlx.md, from ``benchmarks/results/palu_families.json``
(written by ``benchmarks/tools/families.py palu``, which runs the byte test of every family).

``make_docs.py`` puts what :func:`render_palu_families_block` returns between the
``<!-- palu-families:start -->`` and ``<!-- palu-families:end -->`` markers of docs/palu-mlx.md.
"""

from __future__ import annotations

from typing import Any

PALU_FAMILIES_START, PALU_FAMILIES_END = "<!-- palu-families:start -->", "<!-- palu-families:end -->"
PALU_FAMILIES_FILE = "palu_families.json"


def render_palu_families_block(result: dict[str, Any]) -> str:
    """Per family: how its layers are held, the default's bytes over mlx-lm's caches, and whether
    that meets the test's target."""
    lines = [
        PALU_FAMILIES_START,
        "",
        f"From `benchmarks/results/{PALU_FAMILIES_FILE}` ({result['date'][:10]}):",
        "",
        "| family | layers held as | bytes / mlx-lm's caches | within target |",
        "|---|---|---:|---|",
    ]
    for r in result["families"]:
        meets = "yes" if r["meets_target"] else f"no (target {r['target']:.2f})"
        dtype = "" if r["dtype"] == "bfloat16" else f" ({r['dtype']})"
        lines.append(f"| {r['family']}{dtype} | {'; '.join(r['codes'])} | {r['ratio']:.3f} | {meets} |")
    return "\n".join([*lines, "", PALU_FAMILIES_END])
