"""The decode-speed block of docs/palu-mlx.md, from the files ``benchmarks/palu/decode_speed.py``
writes: ``palu_decode_speed.json`` (decode steps in float32, the prefill's dtype) and
``palu_decode_speed_bf16.json`` (the model cast to bfloat16 for the decode steps).

``make_docs.py`` puts what :func:`render_palu_speed_block` returns between the
``<!-- palu-speed:start -->`` and ``<!-- palu-speed:end -->`` markers of docs/palu-mlx.md.
The tables show the peers and the tier's default attention path (packed codes, default chunk); the
other paths a file measured (the float32 latents, other chunk sizes) stay in the file.
"""

from __future__ import annotations

from typing import Any

PALU_SPEED_START, PALU_SPEED_END = "<!-- palu-speed:start -->", "<!-- palu-speed:end -->"
#: the files, in the order the block shows them
PALU_SPEED_FILES = ("palu_decode_speed.json", "palu_decode_speed_bf16.json")

#: preloaded so that MLX's Linux CPU wheel multiplies float32 through an optimized BLAS
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_MIB = 1024 * 1024


def _setting(result: dict[str, Any]) -> str:
    dtype = result.get("decode_dtype", "float32")
    if dtype == "bfloat16":
        return (
            "the prefill computed in float32 with bfloat16 keys and values, then the model cast to "
            "bfloat16: every decode step runs in bfloat16 (on Linux without a BLAS)"
        )
    return "computed in float32 (through OpenBLAS) with bfloat16 keys and values"


def _reading(result: dict[str, Any]) -> list[str]:
    tier = result["tier"]
    out = []
    for context, measured in result["contexts"].items():
        rows = measured["candidates"]
        packed = rows.get(f"{tier} (packed)")
        if packed is None:
            continue
        out.append(
            f"`{tier}` decodes at {packed['vs_q4_median_of_rounds']:.2f}x q4's tokens/s at "
            f"{int(context):,} tokens of context (median over rounds of the same-round ratio)"
        )
    return out


def render_palu_speed_block(results: dict[str, dict[str, Any]]) -> str:
    """One part per file in ``results`` (file name -> document): its setting, a table per context
    (tokens/s, the same-round ratio to q4, bytes held, one step's transient) and the command."""
    lines = [PALU_SPEED_START, ""]
    for file in PALU_SPEED_FILES:
        result = results.get(file)
        if result is None:
            continue
        model = result.get("model", {}).get("name", "the model")
        lines += [
            f"**Decode in {result.get('decode_dtype', 'float32')}** (`benchmarks/results/{file}`, "
            f"{result['date'][:10]}): `{model}`, {_setting(result)}; the candidates take turns for "
            f"{result['rounds']} rounds of {result['steps']} decode steps, and *x q4* is each round's "
            "tokens/s over mlx-lm's `QuantizedKVCache(bits=4)`'s in the same round, the median over "
            "rounds. *transient* is one step's allocator peak over what was allocated before it.",
            "",
        ]
        for context, measured in result["contexts"].items():
            loads = measured.get("load_average_per_round") or []
            load = f", load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""
            lines += [
                f"*{int(context):,} tokens of context{load}*",
                "",
                "| cache | tokens/s (median) | x q4 | held MiB | transient MiB |",
                "|---|---:|---:|---:|---:|",
            ]
            for name, row in measured["candidates"].items():
                if name.startswith(result["tier"]) and name != f"{result['tier']} (packed)":
                    continue  # another attention path: a study of the default one
                lines.append(
                    f"| {name} | {row['tokens_per_s_median']:.2f} | {row['vs_q4_median_of_rounds']:.2f} | "
                    f"{row['held_bytes'] / _MIB:.2f} | {row['step_peak_over_active_bytes'] / _MIB:.2f} |"
                )
            lines.append("")
        lines += [f"- {point}." for point in _reading(result)]
        lines += ["", f"Reproduce: `LD_PRELOAD={OPENBLAS} hatch run bench:{result['command']}`", ""]
    lines.append(PALU_SPEED_END)
    return "\n".join(lines)
