"""Per-layer K/V statistics of one or more causal LMs, side by side, with outlier channels and sinks.

``capture_kv.py`` records the embedded model's statistics and its kvspec test vectors; this tool
runs the same statistics (its functions, imported) on every layer of each ``--model`` over the same
held-out text and adds the two properties a codec designer asks of a real model next:

* per tensor (pre-RoPE keys, post-RoPE keys, values): Var(Δ)/Var(X) along the sequence, the share
  of energy in the lowest 2 DCT-II coefficients of 8-token blocks (raw, as a block-DCT codec sees
  it, and with each channel's mean removed, since a constant offset alone fills coefficient 0), the
  rank per KV head holding 90% and 99% of the centred energy, and **outlier channels**: channels
  (head, dim) whose RMS or max-abs over the tokens exceeds ``--outlier-factor`` times the median
  channel's of that layer and tensor;
* per layer, **attention sinks**: the share of attention mass the first 1 and 4 tokens receive,
  averaged over query heads and over the queries at positions >= 4 (earlier queries can see
  nothing else), beside the share a uniform causal attention would give them; plus the share
  landing on the 64 most recent tokens and the three positions past the first four that draw the
  most mass.

Attention weights need the eager attention implementation; a forward hook on each attention module
reduces them as they are made, so no [heads, S, S] tensor outlives its layer. Pre-RoPE keys come
from a hook on the key projection (or key norm), post-RoPE keys and values from the DynamicCache,
as in ``capture_kv.py``. With ``--doc`` the tool also renders the section of docs/embedded-model.md
between ``<!-- kvstats:start -->`` and ``<!-- kvstats:end -->`` from the JSON it wrote (or, with
``--render-only``, from the JSON already there). Usage::

    python benchmarks/tools/kv_statistics.py --model /path/to/hf-model --name my-model \\
        --model benchmarks/model/tiny-qwen3 --name tiny-qwen3 --tokens 2048 --out /tmp/kv_stats.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from capture_kv import (
    HELDOUT_LABEL,
    REPO_ROOT,
    _model_label,
    _sha256_file,
    attention_layer_indices,
    capture_kv_with_pre_rope,
    dct_low_energy_fraction,
    rank_for_energy_per_group,
    read_text,
    var_delta_ratio,
)
from kvbench.results import environment_stamp, results_path, write_json

BENCH_DIR = Path(__file__).resolve().parents[1]
DEFAULT_OUT = results_path("smollm2_kv_stats.json")
DOC_START, DOC_END = "<!-- kvstats:start -->", "<!-- kvstats:end -->"
TENSORS = ("keys_pre_rope", "keys_post_rope", "values")
#: the first-token counts whose attention share is recorded
SINK_SPANS = (1, 4)
#: queries before this position see only sink candidates, so they are left out of the sink shares
SINK_QUERY_START = max(SINK_SPANS)
RECENT_WINDOW = 64

__all__ = [
    "attention_mass_statistics",
    "outlier_channels",
    "tensor_statistics",
    "model_statistics",
    "summarize_layers",
    "render_doc_block",
]


# --------------------------------------------------------------------------- statistics
def outlier_channels(x: np.ndarray, factor: float = 4.0, top: int = 3) -> dict:
    """Channels of ``x`` float ``[B, H, S, D]`` whose magnitude exceeds ``factor`` x the median's.

    A channel is one (head, dim) pair; its magnitude is taken two ways over the tokens: RMS (not
    mean-centred: a constant offset costs a per-channel quantizer range as much as a swing does)
    and max-abs (what sets an absmax quantizer's scale). Ratios are to the median channel of the
    same tensor. ``top`` lists the channels with the largest RMS ratio as ``[head, dim, ratio]``.
    """
    x = np.asarray(x, dtype=np.float64)
    b, h, s, d = x.shape
    ch = x.transpose(1, 3, 0, 2).reshape(h * d, b * s)  # channel-major: row = head * d + dim
    rms = np.sqrt((ch**2).mean(axis=1))
    maxabs = np.abs(ch).max(axis=1)
    rms_ratio = rms / np.median(rms)
    max_ratio = maxabs / np.median(maxabs)
    order = np.argsort(-rms_ratio)[:top]
    return {
        "n_channels": int(h * d),
        "rms_over_factor": int((rms_ratio > factor).sum()),
        "maxabs_over_factor": int((max_ratio > factor).sum()),
        "max_rms_ratio": round(float(rms_ratio.max()), 2),
        "max_maxabs_ratio": round(float(max_ratio.max()), 2),
        "top_rms": [[int(c // d), int(c % d), round(float(rms_ratio[c]), 2)] for c in order],
    }


def tensor_statistics(x: np.ndarray, outlier_factor: float = 4.0) -> dict:
    """The codec-deciding statistics of one tensor ``[B, H, S, D]`` (per KV head for the ranks)."""
    x = np.asarray(x, dtype=np.float64)
    centred = x - x.mean(axis=2, keepdims=True)
    return {
        "var_delta_ratio": round(var_delta_ratio(x), 4),
        "dct_low2_energy": round(dct_low_energy_fraction(x, block=8, keep=2), 4),
        "dct_low2_energy_centred": round(dct_low_energy_fraction(centred, block=8, keep=2), 4),
        "rank90_per_head": rank_for_energy_per_group(x, 1, 0.90),
        "rank99_per_head": rank_for_energy_per_group(x, 1, 0.99),
        "std": round(float(x.std()), 4),
        "max_abs": round(float(np.abs(x).max()), 4),
        "outliers": outlier_channels(x, outlier_factor),
    }


def attention_mass_statistics(weights, query_start: int = SINK_QUERY_START) -> dict:
    """Where the attention mass of one layer goes: ``weights`` torch ``[B, H_q, S, S]`` (causal,
    rows summing to 1), reduced over batch, heads and the queries at positions >= ``query_start``.
    """
    import torch

    w = weights.detach().float()
    s = w.shape[-1]
    q = w[:, :, query_start:]  # [B, H, S - query_start, S]
    out: dict = {}
    t = torch.arange(query_start, s, dtype=torch.float64)
    for k in SINK_SPANS:
        per_head = q[..., :k].sum(-1).mean(dim=(0, 2))  # [H]
        out[f"first{k}_mass"] = round(float(per_head.mean()), 4)
        out[f"first{k}_mass_max_head"] = round(float(per_head.max()), 4)
        # a query at t attending uniformly over its t + 1 keys gives the first k tokens k / (t + 1)
        out[f"first{k}_mass_uniform"] = round(float((k / (t + 1)).mean()), 4)
    # the last RECENT_WINDOW keys up to and including the query's own position
    idx = torch.arange(s)
    qpos = torch.arange(query_start, s)[:, None]
    recent = ((idx[None, :] <= qpos) & (idx[None, :] > qpos - RECENT_WINDOW)).to(q.dtype)
    out[f"recent{RECENT_WINDOW}_mass"] = round(float((q * recent).sum(-1).mean()), 4)
    received = q.mean(dim=(0, 1, 2))  # [S]: mean mass each key position draws
    received[: max(SINK_SPANS)] = -1.0
    top = torch.topk(received, 3)
    out["top_later_keys"] = [
        [int(p), round(float(m), 4)] for m, p in zip(top.values, top.indices, strict=True)
    ]
    return out


def summarize_layers(rows: list[dict]) -> dict:
    """Min / median / max over layers (with the layers holding min and max) of each scalar."""

    def scalars(row: dict) -> dict[str, float]:
        out = {}
        for tensor in TENSORS:
            st = row[tensor]
            out[f"{tensor}.var_delta_ratio"] = st["var_delta_ratio"]
            out[f"{tensor}.dct_low2_energy"] = st["dct_low2_energy"]
            out[f"{tensor}.dct_low2_energy_centred"] = st["dct_low2_energy_centred"]
            out[f"{tensor}.rank90_mean"] = float(np.mean(st["rank90_per_head"]))
            out[f"{tensor}.rank99_mean"] = float(np.mean(st["rank99_per_head"]))
            out[f"{tensor}.outliers_rms"] = st["outliers"]["rms_over_factor"]
            out[f"{tensor}.outliers_maxabs"] = st["outliers"]["maxabs_over_factor"]
            out[f"{tensor}.max_rms_ratio"] = st["outliers"]["max_rms_ratio"]
        for key, value in row["attention"].items():
            if isinstance(value, float) and not key.endswith("_uniform"):
                out[f"attention.{key}"] = value
        return out

    table = [scalars(r) for r in rows]
    layers = [r["layer"] for r in rows]
    summary = {}
    for key in table[0]:
        values = np.array([t[key] for t in table], dtype=np.float64)
        summary[key] = {
            "min": round(float(values.min()), 4),
            "median": round(float(np.median(values)), 4),
            "max": round(float(values.max()), 4),
            "min_layer": layers[int(values.argmin())],
            "max_layer": layers[int(values.argmax())],
        }
    return summary


# --------------------------------------------------------------------------- capture
def model_statistics(model, input_ids, outlier_factor: float = 4.0) -> tuple[list[dict], float, float | None]:
    """Every cache-holding layer's statistics from one forward pass over ``input_ids`` ``[1, S]``,
    the mean next-token loss (nats) of that pass (a check that the weights load correctly) and the
    largest error of the pre-RoPE keys rotated against the cache's keys (see :func:`_rope_check`).

    ``model`` must use the eager attention implementation: the others never form the weights.
    """
    import torch

    layers = attention_layer_indices(model.config)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    attention: dict[int, dict] = {}
    loss: list[float] = []
    hooks = []

    for i in layers:

        def reduce_weights(_module, _inputs, output, i=i):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(
                    "attention weights not returned: load the model with attn_implementation='eager'"
                )
            attention[i] = attention_mass_statistics(weights)

        hooks.append(decoder.layers[i].self_attn.register_forward_hook(reduce_weights))

    def keep_loss(_module, _inputs, logits):
        lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        loss.append(float(-lp.gather(-1, input_ids[0, 1:, None]).mean()))

    hooks.append(model.get_output_embeddings().register_forward_hook(keep_loss))
    try:
        captured = capture_kv_with_pre_rope(model, input_ids, layers)
    finally:
        for hook in hooks:
            hook.remove()
    rope_error = _rope_check(model, decoder, captured, input_ids.shape[1])
    rows = []
    for i in layers:
        keys, values, pre_keys = captured[i]
        row: dict = {"layer": i}
        for label, x in (("keys_pre_rope", pre_keys), ("keys_post_rope", keys), ("values", values)):
            row[label] = tensor_statistics(x, outlier_factor)
        row["attention"] = attention[i]
        rows.append(row)
    return rows, round(loss[0], 4), rope_error


def _rope_check(model, decoder, captured: dict, seq_len: int) -> float | None:
    """Largest |rotate(pre-RoPE keys) - cache keys| over the layers: 0 when the hooked tensor is
    exactly what the model rotates. None where the architecture does not expose its rotation the
    way llama and qwen3 do (a rotary_emb module and its module's apply_rotary_pos_emb)."""
    import torch

    apply = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    rotary = getattr(decoder, "rotary_emb", None)
    if apply is None or rotary is None:
        return None
    probe = torch.zeros(1, seq_len, model.config.hidden_size, dtype=model.dtype)
    cos, sin = rotary(probe, torch.arange(seq_len)[None])
    worst = 0.0
    for keys, _values, pre in captured.values():
        pre_t = torch.from_numpy(pre).to(cos.dtype)
        rotated, _ = apply(pre_t, pre_t, cos, sin)
        worst = max(worst, float((rotated.float() - torch.from_numpy(keys)).abs().max()))
    return worst


def _config_summary(config, path: str) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    # the loaded config reports the dtype it was loaded in; the file says how the weights are stored
    on_disk = Path(path) / "config.json"
    raw = json.loads(on_disk.read_text()) if on_disk.is_file() else {}
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", None)),
        "vocab_size": config.vocab_size,
        "stored_dtype": raw.get("dtype") or raw.get("torch_dtype"),
    }


def run_model(path: str, name: str, note: str | None, text: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, args.start : args.start + args.tokens]
    if ids.shape[1] < args.tokens:
        raise ValueError(f"{name}: the text has only {ids.shape[1]} tokens from --start {args.start}")
    t0 = time.perf_counter()
    rows, loss, rope_error = model_statistics(model, ids, args.outlier_factor)
    seconds = time.perf_counter() - t0
    for row in rows:  # name the tokens that draw attention, so a delimiter sink reads as one
        for entry in row["attention"]["top_later_keys"]:
            entry.append(tokenizer.decode([int(ids[0, entry[0]])]))
    first = int(ids[0, 0])
    weights = sorted(Path(path).glob("*.safetensors")) if Path(path).exists() else []
    print(f"{name}: {len(rows)} layers, {ids.shape[1]} tokens, loss {loss:.3f} nats, {seconds:.0f} s")
    return {
        "name": name,
        "model": _model_label(path),
        "note": note,
        "weights_sha256": _sha256_file(weights[0]) if len(weights) == 1 else None,
        "config": _config_summary(model.config, path),
        "compute_dtype": args.dtype,
        "attn_implementation": "eager",
        "tokens": int(ids.shape[1]),
        "characters_covered": len(tokenizer.decode(ids[0], skip_special_tokens=True)),
        # a sink on a special start token and one on an ordinary first word are not the same design
        "first_token": {
            "id": first,
            "text": tokenizer.decode([first]),
            "special": first in set(tokenizer.all_special_ids),
        },
        "next_token_loss_nats": loss,
        "pre_rope_check_max_abs_error": rope_error,
        "seconds": round(seconds, 1),
        "per_layer": rows,
        "summary": summarize_layers(rows),
    }


# --------------------------------------------------------------------------- docs
def _mean(xs: list[int]) -> str:
    return f"{float(np.mean(xs)):.1f}"


def _stat(s: dict, fmt: str = ".2f") -> str:
    return f"{s['min']:{fmt}} / {s['median']:{fmt}} / {s['max']:{fmt}} (L{s['max_layer']})"


SUMMARY_ROWS = (
    ("K pre-RoPE rank 90", "keys_pre_rope.rank90_mean", ".1f"),
    ("K post-RoPE rank 90", "keys_post_rope.rank90_mean", ".1f"),
    ("V rank 90", "values.rank90_mean", ".1f"),
    ("K pre-RoPE rank 99", "keys_pre_rope.rank99_mean", ".1f"),
    ("K post-RoPE rank 99", "keys_post_rope.rank99_mean", ".1f"),
    ("V rank 99", "values.rank99_mean", ".1f"),
    ("K pre-RoPE Var(d)/Var(x)", "keys_pre_rope.var_delta_ratio", ".2f"),
    ("K post-RoPE Var(d)/Var(x)", "keys_post_rope.var_delta_ratio", ".2f"),
    ("V Var(d)/Var(x)", "values.var_delta_ratio", ".2f"),
    ("K post-RoPE DCT low-2, raw", "keys_post_rope.dct_low2_energy", ".2f"),
    ("K post-RoPE DCT low-2, centred", "keys_post_rope.dct_low2_energy_centred", ".2f"),
    ("V DCT low-2, raw", "values.dct_low2_energy", ".2f"),
    ("V DCT low-2, centred", "values.dct_low2_energy_centred", ".2f"),
    ("K pre-RoPE outlier channels (RMS)", "keys_pre_rope.outliers_rms", ".0f"),
    ("K post-RoPE outlier channels (RMS)", "keys_post_rope.outliers_rms", ".0f"),
    ("K post-RoPE outlier channels (max-abs)", "keys_post_rope.outliers_maxabs", ".0f"),
    ("K post-RoPE largest channel RMS / median", "keys_post_rope.max_rms_ratio", ".1f"),
    ("V outlier channels (RMS)", "values.outliers_rms", ".0f"),
    ("V outlier channels (max-abs)", "values.outliers_maxabs", ".0f"),
    ("V largest channel RMS / median", "values.max_rms_ratio", ".1f"),
    ("attention on token 0", "attention.first1_mass", ".3f"),
    ("attention on token 0, strongest head", "attention.first1_mass_max_head", ".3f"),
    ("attention on tokens 0-3", "attention.first4_mass", ".3f"),
    (f"attention on the last {RECENT_WINDOW} tokens", f"attention.recent{RECENT_WINDOW}_mass", ".2f"),
)


def _check(error: float | None) -> str:
    return "not checked" if error is None else f"{error:.1e}"


def _token(text: str) -> str:
    """A token as a table cell: quoted (leading spaces and newlines show), bars escaped."""
    return "`" + repr(text).replace("|", "\\|") + "`"


def _outlier_dims(model: dict, tensor: str = "keys_pre_rope") -> tuple[list[tuple[int, int]], int]:
    """How often each rotary pair index (dim mod head_dim / 2: llama and qwen3 rotate dim i with
    i + head_dim / 2) is among the top RMS channels of ``tensor``, most frequent first, and of how many."""
    half = model["config"]["head_dim"] // 2
    counts: dict[int, int] = {}
    total = 0
    for row in model["per_layer"]:
        for _head, dim, _ratio in row[tensor]["outliers"]["top_rms"]:
            counts[dim % half] = counts.get(dim % half, 0) + 1
            total += 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), total


def render_doc_block(record: dict, json_label: str, per_layer: bool = False) -> str:
    """The generated part of the section: every number read from ``record``. The layers are
    summarized (min / median / max); ``per_layer`` adds a table of every layer per model."""
    models = record["models"]
    f = record["outlier_factor"]
    lines = [
        DOC_START,
        "",
        f"`{json_label}` ({record['date'][:10]}, written by `benchmarks/tools/kv_statistics.py`): "
        f"`{record['command']}`. {record['tokens']} tokens of `{record['text']}` from token {record['start']} "
        f"for each model (each its own tokenizer), one forward pass in {record['compute_dtype']} with eager "
        "attention; torch "
        + str(record["versions"]["torch"])
        + ", transformers "
        + str(record["versions"]["transformers"])
        + ".",
        "",
        "| model | layers | query / KV heads | head_dim | RoPE theta | stored as | first token | next-token loss (nats) "
        "| max \\|RoPE(pre-RoPE K) - cached K\\| |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for m in models:
        c, ft = m["config"], m["first_token"]
        first = f"{_token(ft['text'])} ({'special' if ft['special'] else 'a text token'})"
        lines.append(
            f"| {m['name']} | {c['num_hidden_layers']} | {c['num_attention_heads']} / {c['num_key_value_heads']} | "
            f"{c['head_dim']} | {c['rope_theta']:g} | {c['stored_dtype']} | {first} | {m['next_token_loss_nats']:.3f} | {_check(m.get('pre_rope_check_max_abs_error'))} |"
        )
    lines += [  # each model's --note is in the command above
        "",
        f"Over layers, min / median / max (the layer holding the max). Ranks are means over KV heads, out "
        f"of the head_dim; outlier channels: (head, dim) channels whose RMS over the tokens exceeds {f:g}x the "
        f"median channel's, out of KV heads x head_dim; attention shares are averaged over query heads and "
        f"the queries at positions >= {record['sink_query_start']}.",
        "",
        "| statistic | " + " | ".join(m["name"] for m in models) + " |",
        "|---|" + "---:|" * len(models),
    ]
    for label, key, fmt in SUMMARY_ROWS:
        lines.append(f"| {label} | " + " | ".join(_stat(m["summary"][key], fmt) for m in models) + " |")
    uniform = "; ".join(
        f"{m['name']} {m['per_layer'][0]['attention']['first1_mass_uniform']:.3f} / "
        f"{m['per_layer'][0]['attention']['first4_mass_uniform']:.3f}"
        for m in models
    )
    lines += [
        "",
        f"Uniform causal attention would give tokens 0 and 0-3: {uniform}.",
    ]
    for m in models:
        if not m["summary"]["keys_pre_rope.outliers_rms"]["max"]:
            continue  # no outlier channels: where the largest ones sit says nothing
        dims, total = _outlier_dims(m)
        c = m["config"]
        half = c["head_dim"] // 2
        most = dims[:4]
        # a pair at index i turns by theta^(-2i / head_dim) radians per token
        turns = ", ".join(
            f"{i}: {m['tokens'] * c['rope_theta'] ** (-2 * i / c['head_dim']):.2f}" for i, _ in most
        )
        lines += [
            "",
            f"{m['name']}: the 3 pre-RoPE key channels with the largest RMS in each layer ({total} in all) "
            f"fall at rotary pair index (dim mod {half}) "
            + ", ".join(f"{i} ({n}x)" for i, n in most)
            + f" most often; over the {m['tokens']} tokens those pairs turn by (radians) {turns}.",
        ]
    if not per_layer:
        lines += [
            "",
            f"Every layer's figures are in `{json_label}` (`per_layer`); `--per-layer` renders them here.",
        ]
    for m in models if per_layer else []:
        lines += [
            "",
            f"**{m['name']}, per layer.** r90/r99: mean rank per KV head; Var(d): Var(d)/Var(x); DCT: low-2 "
            f"energy raw (centred); out: outlier channels by RMS (largest RMS / median); sink: attention on "
            f"token 0 (mean over heads / strongest head); later sink: the key position past the first four "
            f"drawing the most attention, and its share.",
            "",
            "| layer | K pre r90/r99 | K post r90/r99 | V r90/r99 | K post Var(d) | V Var(d) | K post DCT | V DCT "
            "| K post out | V out | sink | later sink |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in m["per_layer"]:
            kp, k, v, a = row["keys_pre_rope"], row["keys_post_rope"], row["values"], row["attention"]
            pos, mass, *text = a["top_later_keys"][0]
            later = f"{pos} {_token(text[0])}: {mass:.3f}" if text else f"{pos}: {mass:.3f}"
            lines.append(
                f"| {row['layer']} | {_mean(kp['rank90_per_head'])}/{_mean(kp['rank99_per_head'])} | "
                f"{_mean(k['rank90_per_head'])}/{_mean(k['rank99_per_head'])} | "
                f"{_mean(v['rank90_per_head'])}/{_mean(v['rank99_per_head'])} | "
                f"{k['var_delta_ratio']:.2f} | {v['var_delta_ratio']:.2f} | "
                f"{k['dct_low2_energy']:.2f} ({k['dct_low2_energy_centred']:.2f}) | "
                f"{v['dct_low2_energy']:.2f} ({v['dct_low2_energy_centred']:.2f}) | "
                f"{k['outliers']['rms_over_factor']} ({k['outliers']['max_rms_ratio']:.1f}) | "
                f"{v['outliers']['rms_over_factor']} ({v['outliers']['max_rms_ratio']:.1f}) | "
                f"{a['first1_mass']:.3f} / {a['first1_mass_max_head']:.3f} | {later} |"
            )
    lines += ["", DOC_END]
    return "\n".join(lines)


def update_doc(doc: Path, block: str) -> bool:
    """Replace the text between the markers of ``doc`` with ``block``; False if the markers are absent."""
    text = doc.read_text(encoding="utf-8")
    a, b = text.find(DOC_START), text.find(DOC_END)
    if a < 0 or b < a:
        return False
    doc.write_text(text[:a] + block + text[b + len(DOC_END) :], encoding="utf-8")
    return True


# --------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="HF causal LM path or hub id; repeat for several (default: the embedded model)",
    )
    p.add_argument(
        "--name", action="append", default=None, help="a label per --model, in order (default: dir name)"
    )
    p.add_argument(
        "--note", action="append", default=None, help="a provenance note per --model, in order ('' for none)"
    )
    p.add_argument("--tokens", type=int, default=2048, help="sequence length S")
    p.add_argument("--start", type=int, default=0, help="first token of the window in the encoded text")
    p.add_argument("--text-file", type=Path, default=None, help=f"text to run on (default: {HELDOUT_LABEL})")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute dtype (float32: bf16 weights upcast exactly, and it is the faster one on CPU here)",
    )
    p.add_argument(
        "--outlier-factor", type=float, default=4.0, help="outlier: channel magnitude / median above this"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="statistics JSON")
    p.add_argument("--doc", type=Path, default=None, help="markdown file whose kvstats block to regenerate")
    p.add_argument("--render-only", action="store_true", help="only regenerate --doc from the existing --out")
    p.add_argument(
        "--per-layer", action="store_true", help="with --doc: also a table of every layer per model"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.render_only:
        if args.doc is None:
            raise SystemExit("--render-only needs --doc")
        record = json.loads(args.out.read_text())
    else:
        record = measure(args, argv)
    if args.doc is not None:
        try:
            label = str(args.out.resolve().relative_to(REPO_ROOT))
        except ValueError:
            label = str(args.out)
        if not update_doc(args.doc, render_doc_block(record, label, args.per_layer)):
            raise SystemExit(f"{args.doc} has no {DOC_START} ... {DOC_END} block")
        print(f"updated {args.doc}")
    return record


def measure(args, argv) -> dict:
    import torch

    if args.model is None:
        from kvbench.models import embedded_model_path

        args.model = [str(embedded_model_path())]
    names = list(args.name or [])
    notes = list(args.note or [])
    if len(names) > len(args.model) or len(notes) > len(args.model):
        raise SystemExit("more --name / --note than --model")
    names += [Path(m).name for m in args.model[len(names) :]]
    notes += [None] * (len(args.model) - len(notes))
    text, text_label = read_text(args.text_file)
    torch.manual_seed(0)
    models = [
        run_model(p, n, note or None, text, args) for p, n, note in zip(args.model, names, notes, strict=True)
    ]
    record = {
        **environment_stamp(["torch", "transformers", "numpy"]),
        "command": "python benchmarks/tools/kv_statistics.py "
        + " ".join(_quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "text": text_label,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokens": args.tokens,
        "start": args.start,
        "compute_dtype": args.dtype,
        "outlier_factor": args.outlier_factor,
        "sink_query_start": SINK_QUERY_START,
        "definitions": {
            "keys_pre_rope": "output of the attention's key norm where it has one (qwen3), else of k_proj, per head",
            "keys_post_rope / values": "the DynamicCache after one forward pass",
            "var_delta_ratio": "sum over (b,h,d) of Var_t(x[t+1]-x[t]) / sum over (b,h,d) of Var_t(x[t])",
            "dct_low2_energy": "energy in DCT-II coefficients 0-1 of 8-token blocks / total block energy (raw values)",
            "dct_low2_energy_centred": "the same after subtracting each channel's mean over the tokens",
            "rank90_per_head / rank99_per_head": "per KV head, mean-centred over tokens: smallest r with "
            "sum(s[:r]^2) >= 0.9 (0.99) sum(s^2)",
            "outliers": "channel = (KV head, dim); rms_over_factor / maxabs_over_factor: channels whose RMS / "
            "max-abs over tokens exceeds outlier_factor x the median channel's; top_rms: [head, dim, RMS ratio]",
            "attention.firstK_mass": "attention share on tokens 0..K-1, mean over query heads and queries at "
            "positions >= sink_query_start; _max_head: the largest per-head mean; _uniform: uniform causal attention",
            f"attention.recent{RECENT_WINDOW}_mass": f"share on the {RECENT_WINDOW} most recent keys (own position included)",
            "attention.top_later_keys": "[position, mean share, token] of the 3 key positions >= 4 drawing the most attention",
            "summary": "min / median / max over layers (layer of min, max); rank*_mean: mean over KV heads",
        },
        "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, record)
    print(f"wrote {args.out}")
    return record


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


if __name__ == "__main__":
    main()
