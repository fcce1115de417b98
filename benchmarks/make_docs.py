"""Generate docs/benchmarks.md (and README.md's results block) from benchmarks/results/compare_*.json.

    python benchmarks/make_docs.py            # rewrite docs/benchmarks.md and the README block
    python benchmarks/make_docs.py --check    # exit 1 if either is not what the results give

Every figure on the page comes from the result files written by ``palu-mlx compare`` and
``flashcodec compare`` (the main job, ``benchmarks/main_job.py``, runs both and then this script).
The output depends on nothing else (no clock, no machine), so regenerating from the committed
results gives the committed page byte for byte. The reading below the tables is derived from the
same figures by fixed rules (frontier, nearest peer, speed bands), so it changes with them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvspec.report import format_bytes, render_markdown
from kvspec.results import read_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

#: (result file stem, section title, what the package is compared with)
SECTIONS = (
    ("compare_palu", "palu-mlx beside mlx-lm's caches", "mlx-lm's `KVCache` and `QuantizedKVCache`"),
    (
        "compare_flashcodec",
        "flashcodec beside transformers' caches",
        "transformers' `DynamicCache` and `QuantizedCache`",
    ),
)

#: how each method works, where it explains the figures (descriptions of the code, no figures)
MECHANISMS = {
    "compare_palu": "palu stores low-rank latents and, at every step, reconstructs the whole history to "
    "full K/V before mlx's attention (there is no fused low-rank attention kernel): the bytes held "
    "shrink, the work per decode step does not, and it grows with the context. mlx-lm's "
    "`QuantizedKVCache` instead attends on its quantized keys and values directly.",
    "compare_flashcodec": "flashcodec's materialized tiers keep a decoded view of the whole history beside "
    "their archive and attend over it; the `-mf` tier attends on the stored coefficients and releases "
    "that view. transformers' `QuantizedCache` dequantizes its stored states at every step (its hqq and "
    "quanto backends keep the newest tokens, up to a residual length, in full precision; fp8 codes every "
    "token with one scale per tensor).",
}

#: perplexity differences below this share of the baseline's perplexity are read as "the same quality":
#: a few hundred scored tokens cannot separate smaller differences from noise
SAME_QUALITY = 0.01
#: decode speed ratios inside [1 - SPEED_BAND, 1 + SPEED_BAND] are read as "about the same"
SPEED_BAND = 0.15


def load_results(results_dir: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """``{stem: result}`` for every section whose JSON exists."""
    return {
        stem: read_json(results_dir / f"{stem}.json")
        for stem, _, _ in SECTIONS
        if (results_dir / f"{stem}.json").is_file()
    }


# --------------------------------------------------------------------------- reading rules
def dominates(a: dict[str, Any], b: dict[str, Any], tie: float) -> bool:
    """``a`` is no larger and no worse than ``b`` (perplexity within ``tie`` counts as equal), and
    strictly better on one of the two."""
    no_larger = a["kv_ratio"] <= b["kv_ratio"] * (1 + 1e-9)
    no_worse = a["ppl_delta"] <= b["ppl_delta"] + tie
    smaller = a["kv_ratio"] < b["kv_ratio"] * (1 - 1e-3)
    better = a["ppl_delta"] < b["ppl_delta"] - tie
    return no_larger and no_worse and (smaller or better)


def frontier(rows: list[dict[str, Any]], tie: float) -> list[dict[str, Any]]:
    """Rows no other row dominates (see :func:`dominates`), smallest first."""
    return sorted(
        (r for r in rows if not any(dominates(o, r, tie) for o in rows)), key=lambda r: r["kv_ratio"]
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ppl(row: dict[str, Any]) -> str:
    return f"{row['ppl_delta']:+.3f}"


def _at(row: dict[str, Any]) -> str:
    return f"`{row['name']}` ({row['kv_ratio']:.3f}x, {_ppl(row)} ppl)"


def reading(result: dict[str, Any]) -> list[str]:
    """Bullet points read off one result by fixed rules: what keeps the baseline's quality, what
    wins and loses against the peers, how decode speed compares, what the byte counts leave out."""
    rows = result["rows"]
    base = rows[0]
    tie = SAME_QUALITY * base["perplexity"]
    tiers = [r for r in rows if r["kind"] == "tier"]
    peers = [r for r in rows if r["kind"] == "peer"]
    out: list[str] = [
        f"Rule used below: perplexities closer than {_pct(SAME_QUALITY)} of the baseline's "
        f"({tie:.3f}) count as the same quality."
    ]

    same = sorted((r for r in tiers + peers if abs(r["ppl_delta"]) <= tie), key=lambda r: r["kv_ratio"])
    if same:
        best = same[0]
        out.append(
            "Same quality as the baseline: "
            + ", ".join(f"`{r['name']}` ({r['kv_ratio']:.3f}x)" for r in same)
            + f". The smallest is `{best['name']}` at {best['kv_ratio']:.3f}x the uncompressed bytes, "
            f"{_pct(best['token_match'])} greedy token match."
        )
    else:
        out.append("No tier or peer keeps the baseline's quality.")
    out.append(
        "On the storage/quality frontier (nothing else is both smaller and better): "
        + ", ".join(_at(r) for r in frontier(rows, tie))
        + "."
    )

    for tier in tiers if peers else []:
        beaten_by = [p for p in peers if dominates(p, tier, tie)]
        beats = [p for p in peers if dominates(tier, p, tie)]
        if beaten_by:
            p = min(beaten_by, key=lambda r: r["kv_ratio"])
            out.append(
                f"{_at(tier)} loses to {_at(p)}, which is no larger and no worse." + _match_note(tier, p)
            )
        elif beats:
            p = max(beats, key=lambda r: r["kv_ratio"])
            out.append(f"{_at(tier)} beats {_at(p)}: no larger and no worse." + _match_note(p, tier))
        else:
            p = min(peers, key=lambda r: abs(r["kv_ratio"] - tier["kv_ratio"]))
            if abs(tier["kv_ratio"] - p["kv_ratio"]) <= 1e-3 * p["kv_ratio"]:
                size = "the same size"
            else:
                size = "smaller" if tier["kv_ratio"] < p["kv_ratio"] else "larger"
            quality = "better" if tier["ppl_delta"] < p["ppl_delta"] else "worse"
            out.append(f"{_at(tier)} is {size} but {quality} than {_at(p)}.")

    slow = [r for r in rows[1:] if r["decode_speed_ratio"] < 1 - SPEED_BAND]
    fast = [r for r in rows[1:] if r["decode_speed_ratio"] > 1 + SPEED_BAND]
    even = [r for r in rows[1:] if r not in slow and r not in fast]
    parts = []
    if slow:
        parts.append("slower: " + ", ".join(f"`{r['name']}` {r['decode_speed_ratio']:.2f}x" for r in slow))
    if even:
        parts.append(f"within {_pct(SPEED_BAND)}: " + ", ".join(f"`{r['name']}`" for r in even))
    if fast:
        parts.append("faster: " + ", ".join(f"`{r['name']}` {r['decode_speed_ratio']:.2f}x" for r in fast))
    out.append(
        f"Decode speed against the baseline's {base['decode_tokens_per_s']:.1f} tokens/s: "
        + "; ".join(parts)
        + "."
    )

    by_name = {r["name"]: r for r in rows}
    for row in rows:
        twin = by_name.get(row["name"].removesuffix("-mf")) if row["name"].endswith("-mf") else None
        if twin is None or not row.get("kv_resident_bytes") or not twin.get("kv_resident_bytes"):
            continue
        out.append(
            f"`{row['name']}` against `{twin['name']}` (same codes, attention computed on them instead of on a "
            f"decoded view): perplexity {row['perplexity']:.3f} vs {twin['perplexity']:.3f}, decode "
            f"{row['decode_tokens_per_s'] / twin['decode_tokens_per_s']:.2f}x its speed, resident bytes "
            f"{row['kv_resident_bytes'] / twin['kv_resident_bytes']:.3f}x, peak memory "
            f"{row['peak_memory_bytes'] / twin['peak_memory_bytes']:.2f}x."
        )

    if abs(base["kv_ratio"] - 1) > 1e-9:
        out.append(
            f"The baseline itself holds {base['kv_ratio']:.3f}x the bytes of its tokens: it reserves "
            "capacity ahead of the tokens it holds, and that memory is counted."
        )
    resident = [r for r in rows if r.get("kv_resident_bytes") is not None]
    if resident:
        out.append(
            "KV held counts the compressed representation. Everything the cache object keeps, spare capacity "
            "and the decoded view attention reads included: "
            + ", ".join(f"`{r['name']}` {r['kv_resident_bytes'] / r['kv_raw_bytes']:.3f}x" for r in resident)
            + "."
        )
    return out


def _match_note(worse: dict[str, Any], better: dict[str, Any]) -> str:
    """A clause when greedy token match points the other way than perplexity and size do."""
    if worse["token_match"] - better["token_match"] < 0.1:
        return ""
    return (
        f" Its greedy token match is higher, though: {_pct(worse['token_match'])} against "
        f"{_pct(better['token_match'])} for `{better['name']}`."
    )


# --------------------------------------------------------------------------- page
def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")


def _section(stem: str, title: str, peers: str, result: dict[str, Any]) -> list[str]:
    m, s, st = result["model"], result["settings"], result["stamp"]
    mach = st["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in st["versions"].items() if v is not None)
    missing = ", ".join(k for k, v in st["versions"].items() if v is None)
    lines = [
        f"## {title}",
        "",
        f"`{result['tool']}` compares every tier with the uncompressed baseline and with {peers}.",
        "",
        f"- **Run:** {st['date']} on {mach['platform']} ({mach['processor']}, {mach['cpu_count']} CPUs, "
        f"Python {mach['python']}), device `{s.get('device')}`"
        + (
            f"; load average {mach['load_average'][0]:.1f} / {mach['load_average'][1]:.1f} (1 / 5 min) at the end."
            if mach.get("load_average")
            else "."
        ),
        f"- **Timing:** best of {s['speed_rounds']} round-robin rounds of {s['speed_steps']} one-token calls "
        "after a prefill of one window's context.",
        f"- **Versions:** {versions}." + (f" Not installed: {missing}." if missing else ""),
        f"- **Model:** `{m['name']}`: {m['architecture']}, {m['layers']} layers, {m['kv_heads']} KV heads of "
        f"dim {m['head_dim']}, {m['dtype']}, {format_bytes(m['weights_bytes'])} of weights"
        + (f" (sha256 `{m['weights_sha256'][:12]}`)." if m.get("weights_sha256") else "."),
        f"- **Text:** {s['windows']} windows of {s['context_tokens']} context + {s['scored_tokens']} scored "
        f"tokens from `{Path(s['text']).name}` (sha256 `{s['text_sha256'][:12]}`); greedy: {s['prompts']} prompts "
        f"({s['prompt_source']}) x {s['new_tokens']} new tokens.",
        "",
        render_markdown(result),
        "",
        f"Peak memory: {result['measures']['peak_memory_bytes']}.",
        "",
        f"![{stem}](../benchmarks/results/{stem}.png)",
        "",
    ]
    for item in result.get("absent", []):
        lines.append(f"- **Absent:** `{item['name']}` ({item['kind']}): {_cell(item['reason'])}")
    if result.get("absent"):
        lines.append("")
    lines += ["**Reading.**", ""]
    lines += [f"- {point}" for point in reading(result)]
    if stem in MECHANISMS:
        lines += [f"- How it works, where that explains the figures: {MECHANISMS[stem]}"]
    lines += ["", "<details><summary>Greedy continuation of the first prompt, per cache</summary>", ""]
    lines += ["| cache | text |", "|---|---|"]
    lines += [f"| {r['name']} | `{_cell(r['sample']) or ' '}` |" for r in result["rows"]]
    lines += ["", "</details>", "", "| cache | what it is |", "|---|---|"]
    lines += [f"| {r['name']} | {_cell(r['description'])} |" for r in result["rows"]]
    lines.append("")
    return lines


def render_doc(results: dict[str, dict[str, Any]]) -> str:
    """The whole of docs/benchmarks.md for ``results`` (``{stem: result}``)."""
    lines = [
        "# Benchmarks: every tier beside the baseline and the peers",
        "",
        "<!-- generated by benchmarks/make_docs.py from benchmarks/results/compare_*.json: do not edit by hand -->",
        "",
        "Measured by the main job (`hatch run demo`, i.e. `python benchmarks/main_job.py`), which runs "
        "`palu-mlx compare` and `flashcodec compare` on the embedded model and regenerates this page with "
        "`python benchmarks/make_docs.py`. Run the same commands with `--model` on your own model.",
        "",
        "## How each figure is measured",
        "",
        "Each cache runs the same protocol in one process, one after the other, after an untimed warm-up:",
        "held-out text is cut into windows; for each window a fresh cache is prefilled with the context, "
        "then the rest of the window is fed one true token per call, scoring each token from the logits "
        "before it (teacher-forced decoding: every scored prediction reads the compressed history the way "
        "generation would). Then each prompt is continued greedily. Ratios compare a cache with the "
        "baseline of the same run.",
        "",
        "| column | meaning |",
        "|---|---|",
    ]
    first = next(iter(results.values()), None)
    if first is not None:
        names = {
            "kv_bytes": "KV held",
            "kv_ratio": "x raw",
            "peak_memory_bytes": "peak mem",
            "perplexity": "ppl",
            "ppl_delta": "d ppl",
            "token_match": "token match",
            "decode_speed_ratio": "decode x",
            "prefill_time_ratio": "prefill x",
        }
        for key, column in names.items():
            meaning = (
                first["measures"][key]
                if key != "peak_memory_bytes"
                else "see each section (framework specific)"
            )
            lines.append(f"| {column} | {_cell(meaning)} |")
    lines.append("")
    for stem, title, peers in SECTIONS:
        if stem in results:
            lines += _section(stem, title, peers, results[stem])
        else:
            lines += [f"## {title}", "", f"No results yet: `benchmarks/results/{stem}.json` is missing.", ""]
    lines += _caveats(results)
    return "\n".join(lines).rstrip() + "\n"


def _caveats(results: dict[str, dict[str, Any]]) -> list[str]:
    models = {r["model"]["name"]: r["model"] for r in results.values()}
    described = "; ".join(
        f"`{n}` has {m['layers']} layers, {m['kv_heads']} KV heads of dim {m['head_dim']} and "
        f"{format_bytes(m['weights_bytes'])} of weights"
        for n, m in models.items()
    )
    return [
        "## What the embedded model cannot tell",
        "",
        f"- It is tiny ({described}) and trained briefly on a small corpus, so its perplexity is high and its "
        "greedy text is weak. Relative effects (which tier is smaller, which hurts perplexity more) are "
        "informative; absolute perplexities and token-match rates are not what a real model shows.",
        "- Real models have longer contexts, more layers for errors to compound through, and different K/V "
        "statistics per layer (outlier channels, anti-correlated values). A tier that is near-lossless "
        "here can hurt a large dense model; run the compare command on the model you care about.",
        "- Speeds are CPU timings of a model this small, where per-call overhead dominates; on a GPU and a "
        "large model the balance between attention, reconstruction and weights differs. The machine may be "
        "shared, so timing ratios carry noise that the storage and perplexity columns do not.",
        "- Peak memory is measured differently per framework (see each section), over a short run: it "
        "shows transient buffers (activations, decoded views) next to a cache of a few hundred tokens, "
        "not the steady state of a long context.",
        "",
    ]


def render_readme_block(results: dict[str, dict[str, Any]]) -> str:
    """The headline tables for README.md (between the results markers), from the same results."""
    lines = [START, ""]
    for stem, title, _ in SECTIONS:
        if stem not in results:
            continue
        r = results[stem]
        lines += [
            f"**{title}** (`{r['tool']}` on `{r['model']['name']}`, {r['stamp']['date'][:10]}):",
            "",
            render_markdown(r, columns=["cache", "x raw", "d ppl", "token match", "decode x"]),
            "",
        ]
    lines += [
        "x raw: KV bytes held / uncompressed; d ppl: perplexity increase over the baseline; decode x: "
        "decode speed vs the baseline of the same run. Generated by `benchmarks/make_docs.py`.",
        "",
        END,
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str | None:
    """``text`` with the part between the results markers replaced by ``block``; None without markers."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[:start] + block + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a file differs from what the results give"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="results folder (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    results = load_results(args.results)
    targets = [(DOC, render_doc(results))]
    if README.is_file():
        current = README.read_text(encoding="utf-8")
        updated = replace_block(current, render_readme_block(results))
        if updated is not None:
            targets.append((README, updated))
    stale = []
    for path, text in targets:
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        if old == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("not up to date with benchmarks/results: " + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
