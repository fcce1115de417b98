"""The measured tables of docs/flashcodec.md, rendered from the flashcodec results files.

``make_docs.py`` puts what each renderer of :data:`BLOCKS` returns between that block's
``<!-- name:start -->`` and ``<!-- name:end -->`` markers of docs/flashcodec.md; every figure comes
from the results file the block names (``benchmarks/results/flashcodec_<name>.json``, written by
``benchmarks/flashcodec/<name>.py``). A block whose results file is absent is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

__all__ = [
    "BLOCKS",
    "Block",
    "render_reconstruct",
    "render_vram",
    "render_attention",
    "render_e2e",
    "render_real_tiers",
    "render_rotated_tiers",
    "render_step_raw",
    "render_lossless",
    "render_kv_recipes",
    "render_int4_study",
    "render_window_compare",
    "render_copy_positions",
    "render_families",
]

_MIB = 1024 * 1024


def _mib(n: int, digits: int = 1) -> str:
    return f"{n / _MIB:.{digits}f}"


def _signal_line(signal: dict[str, Any]) -> str:
    stats = signal["stats"]
    var, energy = stats["var_delta_over_var_x"], stats["dct_energy_in_k2_r8"]
    return (
        f"`{signal['name']}` {list(signal['shape'])} {signal['dtype']}: Var(Δ)/Var(X) keys "
        f"{var['keys']:.4f}, values {var['values']:.4f}; energy in k=2 keys {energy['keys']:.4f}, "
        f"values {energy['values']:.4f}."
    )


def _psnr(side: dict[str, Any]) -> str:
    return "exact" if side["exact"] else f"{side['psnr_db']:.2f}"


def _table(header: str, align: str, rows: Iterable[str]) -> list[str]:
    """A markdown table: the ``header`` line, the separator (per column ``l`` left- or ``r``
    right-aligned) and the ``rows``."""
    return [header, "|" + "".join("---|" if a == "l" else "---:|" for a in align), *rows]


def _from(results_file: str, date: str, more: str = ":", within: str = "") -> str:
    """The line naming a block's results file and the date it was written (``within`` the brackets
    after it, ``more`` after them)."""
    return f"From `benchmarks/results/{results_file}` ({date[:10]}{within}){more}"


def render_reconstruct(result: dict[str, Any]) -> list[str]:
    """Per signal: its smoothness statistics and each tier's PSNR, cosine and measured storage."""
    lines = [_from("flashcodec_reconstruct.json", result["date"]), ""]
    for signal in result["signals"]:
        rows = (
            f"| `{row['tier']}` | {_psnr(row['keys'])} | {row['keys']['cosine']:.5f} | {_psnr(row['values'])} | "
            f"{row['values']['cosine']:.5f} | {100 * row['storage']['ratio']:.1f}% |"
            for row in signal["tiers"]
        )
        header = "| tier | keys PSNR (dB) | keys cosine | values PSNR (dB) | values cosine | storage (nbytes / raw) |"
        lines += [_signal_line(signal), "", *_table(header, "llllll", rows), ""]
    return lines[:-1]


def render_vram(result: dict[str, Any]) -> list[str]:
    """Per (S, tier): bytes held / allocated / viewed after the fill, fill and step times, blocks
    decoded per step, re-decode time; then the step against the smallest S."""

    def row(r: dict[str, Any]) -> str:
        st = r["storage_after_fill"]
        return (
            f"| {r['seq_len']} | `{r['tier']}` | {_mib(st['held_bytes'])} | {st['ratio']:.3f} | "
            f"{_mib(st['allocated_bytes'])} | {_mib(st['view_bytes'])} | {r['fill_ms_min']:.0f} | "
            f"{r['step_ms_min']:.3f} / {r['step_ms_median']:.3f} | {r['blocks_decoded_per_step_max']} | "
            f"{r['redecode_ms_min']:.1f} |"
        )

    flat = result["flatness_vs_smallest_S"]
    sizes = sorted({int(s) for by_s in flat.values() for s in by_s})
    small, large = sizes[0], sizes[-1]
    ratios = ((tier, by_s[str(large)]) for tier, by_s in flat.items())
    return [
        _from("flashcodec_vram.json", result["date"]),
        "",
        *_table(
            "| S | tier | held (MiB) | held / raw | allocated (MiB) | view (MiB) | fill (ms) | "
            "step min / median (ms) | blocks/step (max) | re-decode (ms) |",
            "l" * 10,
            map(row, result["rows"]),
        ),
        "",
        f"A step at S = {large} against S = {small} ({large // small}x the tokens), measured in the same run "
        "(`flatness_vs_smallest_S`):",
        "",
        *_table(
            "| tier | fastest step | median step | re-decode |",
            "llll",
            (
                f"| `{tier}` | {r['step_min_ratio']:.3f}x | {r['step_ratio']:.3f}x | {r['redecode_ratio']:.1f}x |"
                for tier, r in ratios
            ),
        ),
    ]


def render_attention(result: dict[str, Any]) -> list[str]:
    """Per (S, tier): the materialized and the coefficient decode step's time, peak and error."""

    def row(r: dict[str, Any]) -> str:
        mat, coef = r["materialized"], r["coefficient_torch"]
        return (
            f"| {r['seq_len']} | `{r['tier']}` | {mat['step_ms_median']:.2f} | {coef['step_ms_median']:.2f} | "
            f"{coef['time_ratio_vs_materialized']:.2f} | {_mib(mat['peak_bytes'])} | {_mib(coef['peak_bytes'])} | "
            f"{coef['peak_ratio_materialized_over_this']:.1f} | {mat['max_rel_error_vs_fp64_truth']:.1e} | "
            f"{coef['max_rel_error_vs_fp64_truth']:.1e} |"
        )

    header = (
        "| S | tier | materialized step (ms) | coefficient step (ms) | time coef / mat | materialized peak (MiB) "
        "| coefficient peak (MiB) | peak mat / coef | rel. error vs fp64: materialized | coefficient |"
    )
    return [
        _from("flashcodec_attention.json", result["date"]),
        "",
        *_table(header, "l" * 10, map(row, result["results"])),
    ]


def render_e2e(result: dict[str, Any]) -> list[str]:
    """Per configuration: decode speed, peaks, steady bytes and tokens against the baseline and,
    for a ``-mf`` tier, against its materialized twin."""

    def row(name: str, r: dict[str, Any]) -> str:
        match = r.get("token_match_vs_baseline")
        twin = r.get("tokens_equal_materialized")
        ratio = r.get("decode_peak_ratio_this_over_materialized")
        return (
            f"| `{name}` | {r['decode_tokens_per_s']:.1f} | {r['decode_ms_per_token']:.1f} | "
            f"{_mib(r['peak_bytes'], 2)} | {_mib(r['decode_peak_bytes'], 2)} | {_mib(r['steady_bytes'], 2)} | "
            f"{'—' if match is None else f'{match:.3f}'} | {'—' if twin is None else ('yes' if twin else 'no')} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} |"
        )

    header = (
        "| configuration | decode tok/s | ms / token | peak (MiB) | decode peak (MiB) | steady (MiB) | "
        "token match vs baseline | tokens = materialized twin | decode peak / twin's |"
    )
    rows = (row(name, r) for name, r in result["results"].items())
    return [_from("flashcodec_e2e.json", result["date"]), "", *_table(header, "l" * 9, rows)]


def _compare_row(row: dict[str, Any]) -> str:
    return f"{row['kl_mean']:.2e} | {100 * row['top1_agreement']:.1f}% | {row['ppl_delta']:+.3f}"


def _tier_table(result: dict[str, Any], results_file: str) -> list[str]:
    """Tiers beside hqq on the real model: bytes, quality and decode speed against hqq 4-bit
    (``summary_long``, every figure from one run), fewest bytes first."""
    rows = sorted(
        (r for r in result["summary_long"] if r["name"] != "baseline"),
        key=lambda r: (round(r["resident_ratio_decode_mean"], 3), r["kl_mean"]),
    )
    return [
        _from(results_file, result["stamp"]["date"]),
        "",
        *_table(
            "| cache | bytes x raw | KL | top-1 | Δ ppl | bytes x hqq-q4 | KL x hqq-q4 | decode x hqq-q4 |",
            "lrrrrrrr",
            (
                f"| `{r['name']}` | {r['resident_ratio_decode_mean']:.3f} | {_compare_row(r)} | "
                f"{r['bytes_vs_hqq_q4']:.3f} | {r['kl_vs_hqq_q4']:.2f} | {r['decode_vs_hqq_q4']:.2f} |"
                for r in rows
            ),
        ),
    ]


def render_real_tiers(result: dict[str, Any]) -> list[str]:
    """The kivi / chan64 tiers beside hqq on the real model (``benchmarks/flashcodec/real_tiers.py``)."""
    return _tier_table(result, "flashcodec_real_tiers.json")


def render_rotated_tiers(result: dict[str, Any]) -> list[str]:
    """The rotated kivi tiers beside the unrotated one and hqq on the real model, two long windows
    (``benchmarks/flashcodec/rotated_tiers.py --long-windows 2``)."""
    return _tier_table(result, "flashcodec_rotated_tiers_2w.json")


def render_step_raw(result: dict[str, Any]) -> list[str]:
    """Each tier with its multi-token step's own tokens raw and as stored (``+coded-step``), beside
    hqq 4-bit: quality and prefill time against the baseline (the last run)."""
    run = result["runs"][-1]

    def row(r: dict[str, Any]) -> str:
        label = f"`{r['name']}`" + (" (raw step)" if r["kind"] == "tier" and "+" not in r["name"] else "")
        return f"| {label} | {_compare_row(r)} | {r['prefill_time_ratio']:.2f} |"

    rows = (row(r) for r in run["rows"] if r["name"] != "baseline")
    return [
        _from("flashcodec_step_raw.json", result["stamp"]["date"], within=f", run `{run['name']}`"),
        "",
        *_table("| cache | KL | top-1 | Δ ppl | prefill time vs baseline |", "lrrrr", rows),
    ]


def render_families(result: dict[str, Any]) -> list[str]:
    """Per family of tiny random-weight model: its layer types, the zero-argument default's bytes
    over DynamicCache's, whether that meets the tests' target, and whether the tokens are the
    materialized path's."""

    def row(r: dict[str, Any]) -> str:
        window = f" (window {r['window']})" if r["window"] and "sliding_attention" in r["layer_types"] else ""
        types = ", ".join(t.removesuffix("_attention") for t in r["layer_types"]) + window
        meets = "yes" if r["meets_target"] else f"no (target {r['target']:.2f})"
        same = "yes" if r["same_tokens"] else "no"
        return f"| {r['family']} | {types} | {r['ratio']:.3f} | {meets} | {same} |"

    return [
        _from("flashcodec_families.json", result["date"]),
        "",
        *_table(
            "| family | layers | bytes / DynamicCache | within target | tokens = materialized path |",
            "llrll",
            (row(r) for r in result["families"]),
        ),
    ]


def render_lossless(result: dict[str, Any]) -> list[str]:
    """The exponent coder on the real model's K/V per dtype (group 64), then per group size:
    bytes over the uncompressed cache's, exceptions, exactness, speed."""
    labels = {"bfloat16": "bf16 (the model's)", "float16": "fp16 (the model run in fp16)"}

    def by_dtype(dtype: str, r: dict[str, Any]) -> str:
        c = r["exponent_coder"]["64"]
        return (
            f"| {labels.get(dtype, dtype)} | {c['memory_ratio']:.3f} | {c['saved_ratio_zlib6']:.3f} "
            f"({c['saved_ratio_zlib1']:.3f}) | {c['exception_rate']:.1e} | {'yes' if c['bit_exact'] else 'no'} | "
            f"{r['png_keep1']['held_ratio']:.3f} | {r['zlib6_raw_bytes']['ratio']:.3f} |"
        )

    def by_group(dtype: str, group: str, c: dict[str, Any], r: dict[str, Any]) -> str:
        return (
            f"| {dtype} | {group} | {c['memory_ratio']:.3f} | {c['encode_mb_per_s']:.0f} | "
            f"{c['decode_mb_per_s']:.0f} | {c['decode_whole_cache_in_steps']:.2f} | "
            f"{r['zlib6_raw_bytes']['encode_seconds']:.1f} |"
        )

    runs = result["results"].items()
    return [
        _from("flashcodec_lossless.json", result["environment"]["date"]),
        "",
        *_table(
            "| K/V dtype | exponent coder in memory (group 64) | saved, zlib 6 (zlib 1) | exceptions (of elements) "
            "| bit-exact | `png-keep1` held | zlib 6 on the raw bytes |",
            "lrrrlrr",
            (by_dtype(dtype, r) for dtype, r in runs),
        ),
        "",
        *_table(
            "| K/V dtype | group (tokens) | in memory | encode (MB/s) | decode (MB/s) | decoding the whole cache, "
            "in decode steps of the model | zlib 6 alone: encode (s) |",
            "lrrrrrr",
            (by_group(dtype, g, c, r) for dtype, r in runs for g, c in r["exponent_coder"].items()),
        ),
    ]


def render_kv_recipes(result: dict[str, Any]) -> list[str]:
    """Each quantization recipe on the real model's K/V: bits an element, KL, top-1 agreement."""
    rows = (
        f"| {r['name']} | {r['bits_per_element']:.2f} | {r['kl_mean']:.2e} | {100 * r['top1_agreement']:.1f}% |"
        for r in result["rows"]
    )
    return [
        _from("flashcodec_kv_recipes.json", result["stamp"]["date"]),
        "",
        *_table("| recipe | bits an element | KL | top-1 |", "lrrr", rows),
    ]


def _bits(row: dict[str, Any]) -> str:
    k, v = row["key_bits"], row["value_bits"]
    return f"{k:g}" if k == v else f"{k:g} / {v:g}"


def render_int4_study(result: dict[str, Any]) -> list[str]:
    """The factors behind int4 against hqq 4-bit (each variant's bits, KL, top-1), then the reduced
    compare's runs (held and resident bytes over bf16, KL, Δ perplexity)."""
    factors = result["factors"]

    def variant(r: dict[str, Any]) -> str:
        raw = r.get("recent_raw_tokens", r.get("peer_kwargs", {}).get("residual_length", 128))
        return f"| {r['name']} | {_bits(r)} | {raw} | {r['kl_mean']:.2e} | {100 * r['top1_agreement']:.1f}% |"

    quantizers = "; ".join(f"`{name}` {q['what']}" for name, q in factors["quantizers"].items())
    lines = [
        _from("flashcodec_int4_study.json", result["stamp"]["date"], f"; quantizers: {quantizers}."),
        "",
        *_table(
            "| variant | bits (keys / values) | raw window (tokens, at most) | KL | top-1 |",
            "lrrrr",
            map(variant, factors["rows"]),
        ),
    ]
    for name, rows in result["compare"]["runs"].items():
        lines += [
            "",
            f"The compare's `{name}` run:",
            "",
            *_table(
                "| cache | held x bf16 | resident x bf16 | KL | top-1 | Δ ppl |",
                "lrrrrr",
                (
                    f"| `{r['name']}` | {r['kv_ratio']:.3f} | {r['resident_ratio']:.3f} | {_compare_row(r)} |"
                    for r in rows
                    if r["name"] != "baseline"
                ),
            ),
        ]
    return lines


def _ci(value: float, ci: list[float], digits: int = 3) -> str:
    return f"{value:+.{digits}f} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def render_window_compare(result: dict[str, Any]) -> list[str]:
    """Each run of the window compare: bytes averaged over decoding, KL, top-1, Δ perplexity with
    its paired 95% interval, against the baseline and against hqq-q4, and decode speed."""

    def row(r: dict[str, Any]) -> str:
        peer = (r.get("ppl_vs_peers") or {}).get("hf-hqq-q4")
        vs = "—" if peer is None else _ci(peer["ppl_delta"], peer["ci95"])
        return (
            f"| `{r['name']}` | {r['kv_ratio_decode_mean']:.3f} | {r['resident_ratio_decode_mean']:.3f} | "
            f"{r['kl_mean']:.2e} | {100 * r['top1_agreement']:.1f}% | {_ci(r['ppl_delta'], r['ppl_delta_ci95'])} | "
            f"{vs} | {r['decode_speed_ratio']:.2f} |"
        )

    lines = [_from("flashcodec_window_compare.json", result["stamp"]["date"])]
    for run in result["runs"]:
        st = run["settings"]
        lines += [
            "",
            f"Run `{run['name']}`: {st['windows']} windows of {st['context_tokens']:,} tokens of context, "
            f"{st['scored_tokens']:,} scored each.",
            "",
            *_table(
                "| cache | held x decoding | resident x decoding | KL | top-1 | Δ ppl [95%] | vs hqq-q4 [95%] "
                "| decode x baseline |",
                "lrrrrrrr",
                (row(r) for r in run["rows"] if r["name"] != "baseline"),
            ),
        ]
    return lines


def render_copy_positions(result: dict[str, Any]) -> list[str]:
    """Δ NLL (nats) on positions that copy a bigram from the context and on the rest, against the
    baseline and against hqq-q4, with paired 95% intervals."""
    st = result["settings"]

    def row(name: str, c: dict[str, Any]) -> str:
        copy, other = c["copy"], c["other"]
        vs = [
            "—" if "dnll_vs_peer" not in part else _ci(part["dnll_vs_peer"], part["dnll_vs_peer_ci95"], 5)
            for part in (copy, other)
        ]
        return (
            f"| `{name}` | {c['all']['kl_mean']:.2e} | {_ci(copy['dnll'], copy['dnll_ci95'], 5)} | "
            f"{_ci(other['dnll'], other['dnll_ci95'], 5)} | {vs[0]} | {vs[1]} |"
        )

    intro = f": {st['windows']} windows, {100 * st['copy_share']:.0f}% of the scored positions copy."
    return [
        _from("flashcodec_copy_positions.json", result["stamp"]["date"], intro),
        "",
        *_table(
            "| cache | KL | Δ NLL, copy | Δ NLL, other | vs hqq, copy | vs hqq, other |",
            "llllll",
            (row(name, c) for name, c in result["caches"].items()),
        ),
    ]


class Block(NamedTuple):
    """One generated block of docs/flashcodec.md: its markers, its results file and its renderer."""

    start: str
    end: str
    results_file: str
    render: Callable[[dict[str, Any]], list[str]]

    def text(self, result: dict[str, Any]) -> str:
        """The block, markers included."""
        return "\n".join([self.start, "", *self.render(result), "", self.end])


def _block(name: str, render: Callable[[dict[str, Any]], list[str]]) -> Block:
    return Block(f"<!-- fc-{name}:start -->", f"<!-- fc-{name}:end -->", f"flashcodec_{name}.json", render)


def _tier_block(name: str) -> Block:
    """A block of tiers beside hqq on the real model (``real_tiers.py --long-windows 2 --out ...``)."""
    return _block(name, lambda result: _tier_table(result, f"flashcodec_{name}.json"))


#: every generated block of docs/flashcodec.md
BLOCKS: tuple[Block, ...] = (
    _block("reconstruct", render_reconstruct),
    _block("vram", render_vram),
    _block("attention", render_attention),
    _block("e2e", render_e2e),
    _block("real_tiers", render_real_tiers),
    _block("rotated_tiers_2w", render_rotated_tiers),
    _tier_block("lowbit_tiers_2w"),
    _tier_block("lowbit_tiers_w64_2w"),
    _tier_block("lowbit_tiers_s8z4_2w"),
    _tier_block("value_sink_2w"),
    _block("step_raw", render_step_raw),
    _block("lossless", render_lossless),
    _block("kv_recipes", render_kv_recipes),
    _block("int4_study", render_int4_study),
    _block("window_compare", render_window_compare),
    _block("copy_positions", render_copy_positions),
    _block("families", render_families),
)
