"""The measured tables of docs/flashcodec.md, rendered from the flashcodec results files.

``make_docs.py`` puts what each renderer of :data:`BLOCKS` returns between that block's
``<!-- name:start -->`` and ``<!-- name:end -->`` markers of docs/flashcodec.md; every figure comes
from the results file the block names (``benchmarks/results/flashcodec_<name>.json``, written by
``benchmarks/flashcodec/<name>.py``). A block whose results file is absent is left as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from flashcodec.tiers import RETIRED_ATTENTION_SUFFIX

__all__ = [
    "BLOCKS",
    "Block",
    "shown_name",
    "row_attention",
    "with_shown_names",
    "render_e2e",
    "render_lossless",
    "render_families",
    "render_reference_peer",
]

_MIB = 1024 * 1024


def _mib(n: int, digits: int = 1) -> str:
    return f"{n / _MIB:.{digits}f}"


def _table(header: str, align: str, rows: Iterable[str]) -> list[str]:
    """A markdown table: the ``header`` line, the separator (per column ``l`` left- or ``r``
    right-aligned) and the ``rows``."""
    return [header, "|" + "".join("---|" if a == "l" else "---:|" for a in align), *rows]


#: how the docs say which attention a flashcodec tier ran with, after its name
ATTENTION_WORDS = {"codes": "attention on the codes", "materialized": "attention on a decoded view"}


def row_attention(row: dict[str, Any]) -> str | None:
    """The attention a results row ran with (its ``attention`` or its config's; files written
    before attention was a field say ``materialization_free``), None for a row that does not say."""
    config = row.get("config") or {}
    for source in (row, config):
        if source.get("attention") in ATTENTION_WORDS:
            return source["attention"]
        if "materialization_free" in source:
            return "codes" if source["materialization_free"] else "materialized"
    return None


def shown_name(name: str, attention: str | None = None) -> str:
    """A flashcodec row's name as the docs show it: the tier's name and, when known, its attention
    in words. A name recorded with the retired attention suffix is that tier on its codes."""
    if name.endswith(RETIRED_ATTENTION_SUFFIX):
        name, attention = name.removesuffix(RETIRED_ATTENTION_SUFFIX), "codes"
    return f"{name} ({ATTENTION_WORDS[attention]})" if attention in ATTENTION_WORDS else name


def with_shown_names(result: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``flashcodec compare`` result whose tier rows carry :func:`shown_name` (peers
    and the baseline keep theirs), so kvbench's tables and the readings name the attention."""
    out = copy.deepcopy(result)
    for run in out.get("runs", []):
        for row in run["rows"]:
            if row.get("kind") == "tier":
                row["name"] = shown_name(row["name"], row_attention(row))
    return out


def _from(results_file: str, date: str) -> str:
    """The line naming a block's results file and the date it was written."""
    return f"From `benchmarks/results/{results_file}` ({date[:10]}):"


def render_e2e(result: dict[str, Any]) -> list[str]:
    """Per configuration: decode speed, peaks, steady bytes and tokens against the baseline and,
    for a tier attending on its codes, against the same tier attending on a decoded view."""

    def row(key: str, r: dict[str, Any]) -> str:
        name = key if key == "baseline" else shown_name(r.get("tier", key), row_attention(r))
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
        "token match vs baseline | tokens = on a decoded view | decode peak / on a decoded view |"
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
                f"| `{shown_name(r['name'], row_attention(r))}` | {r['resident_ratio_decode_mean']:.3f} | {_compare_row(r)} | "
                f"{r['bytes_vs_hqq_q4']:.3f} | {r['kl_vs_hqq_q4']:.2f} | {r['decode_vs_hqq_q4']:.2f} |"
                for r in rows
            ),
        ),
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
    """The exponent coder on the real model's K/V per dtype (group 64): bytes over the uncompressed
    cache's, exceptions, exactness; then both saved coders side by side. (The results file also
    holds every group size and the field entropies the context coder's model was chosen from.)"""
    labels = {"bfloat16": "bf16 (the model's)", "float16": "fp16 (the model run in fp16)"}

    def by_dtype(dtype: str, r: dict[str, Any]) -> str:
        c = r["exponent_coder"]["64"]
        return (
            f"| {labels.get(dtype, dtype)} | {c['memory_ratio']:.3f} | {c['saved_ratio_zlib6']:.3f} "
            f"({c['saved_ratio_zlib1']:.3f}) | {c['exception_rate']:.1e} | {'yes' if c['bit_exact'] else 'no'} | "
            f"{r['png_keep1']['held_ratio']:.3f} | {r['zlib6_raw_bytes']['ratio']:.3f} |"
        )

    def side_by_side(dtype: str, row: dict[str, Any]) -> str:
        return (
            f"| {dtype} | {row['coder']} | {row['ratio']:.3f} | {row['encode_mb_per_s']:.1f} | "
            f"{row['decode_mb_per_s']:.1f} | {'yes' if row['bit_exact'] else 'no'} |"
        )

    runs = result["results"].items()
    lines = [
        _from("flashcodec_lossless.json", result["environment"]["date"]),
        "",
        *_table(
            "| K/V dtype | exponent coder in memory (group 64) | saved, zlib 6 (zlib 1) | exceptions (of elements) "
            "| bit-exact | `png-keep1` held | zlib 6 on the raw bytes |",
            "lrrrlrr",
            (by_dtype(dtype, r) for dtype, r in runs),
        ),
    ]
    compared = [(dtype, row) for dtype, r in runs for row in r.get("side_by_side", [])]
    if compared:
        lines += [
            "",
            "Saved forms side by side (`save_cache(coder=...)`; MB of the uncompressed cache a second):",
            "",
            *_table(
                "| K/V dtype | coder | saved / uncompressed | encode (MB/s) | decode (MB/s) | bit-exact |",
                "llrrrl",
                (side_by_side(dtype, row) for dtype, row in compared),
            ),
        ]
    return lines


def render_reference_peer(result: dict[str, Any]) -> list[str]:
    """The released reference library (PyPI ``flashcodec-kv`` 1.0.0, its own venv) beside our default,
    transformers' 4-bit caches and the uncompressed cache: per row its resident bytes while decoding,
    the library's own byte count, KL and top-1; a refused setting with its error."""
    settings = result["settings"]
    agree = result["baselines_agree"]
    # the summary rows name no attention; the runs' rows of the same names record it
    ours = {r["name"]: r for run in result.get("runs", []) for r in run["rows"] if r.get("kind") == "tier"}

    def name(r: dict[str, Any]) -> str:
        return (
            shown_name(r["name"], row_attention(ours[r["name"]]))
            if r["side"] == "ours" and r["name"] in ours
            else r["name"]
        )

    def ratio(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    def row(r: dict[str, Any]) -> str:
        if r["status"] != "measured":
            return f"| `{name(r)}` | {r['side']} | {_cell(r['status'])} | | | | |"
        return (
            f"| `{name(r)}` | {r['side']} | {ratio(r['resident_ratio_decode_mean'])} | "
            f"{ratio(r['resident_ratio'])} | {ratio(r['library_ratio'])} | {r['kl_mean']:.2e} | "
            f"{100 * r['top1_agreement']:.1f}% |"
        )

    return [
        _from("flashcodec_reference_peer.json", result["stamp"]["date"]),
        f"`{result['model']['name']}` in {result['model']['dtype']}, {settings['windows']} windows of "
        f"{settings['context_tokens']} context + {settings['scored_tokens']} scored tokens; the two "
        f"processes' uncompressed runs give the same NLL: {'yes' if agree['same_nll'] else 'no'}.",
        "",
        *_table(
            "| cache | side | resident x raw, decoding | resident x raw, after the window | library's own count x raw "
            "| KL | top-1 |",
            "llrrrrr",
            (row(r) for r in result["summary"]),
        ),
        "",
        *_reference_reading(result["summary"]),
    ]


def _reference_reading(summary: list[dict[str, Any]]) -> list[str]:
    """How the reference's own byte count compares with what its cache objects keep, and what it refused."""
    ref = [
        r for r in summary if r["side"] == "reference" and r["kind"] == "tier" and r["status"] == "measured"
    ]
    refused = [r for r in summary if r["status"] != "measured"]
    out = []
    if ref:
        # the description after the version prefix is the keyword form and the codec it built
        forms = "; ".join(f"`{r['name']}`: `{r['description'].split(': ', 1)[-1]}`" for r in ref)
        out.append(f"- The reference's settings: {forms}.")
        own = [r["library_ratio"] for r in ref]
        kept = [r["resident_ratio_decode_mean"] for r in ref]
        out.append(
            f"- The reference library's settings count {min(own):.3f}x to {max(own):.3f}x the uncompressed "
            f"cache's bytes by its own `storage_bytes()`; their cache objects keep {min(kept):.3f}x to "
            f"{max(kept):.3f}x while decoding (spare archive capacity, the decoded view and the view each "
            "layer hands to attention are outside its count)."
        )
    out.append(
        "- Refused: "
        + ("; ".join(f"`{r['name']}` ({_cell(r['status'])})" for r in refused) if refused else "none.")
    )
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


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
    _tier_block("lowbit_tiers_w64_2w"),
    _block("e2e", render_e2e),
    _block("families", render_families),
    _block("lossless", render_lossless),
    _block("reference_peer", render_reference_peer),
)
