"""Capture real post-RoPE keys and values from a Hugging Face causal LM, with their statistics.

Runs any ``transformers`` causal LM (a local path or, on a machine with a network, a hub id) on
held-out text, takes the key/value cache of chosen layers and

* prints and records, per tensor, the three statistics that decide which codec fits a layer:
  ``var_delta_ratio`` = Var(Δ)/Var(X) along the sequence (small: first differences are cheap,
  flashcodec "png"), ``dct_low2_energy`` = the fraction of block energy in the lowest 2 DCT-II
  coefficients of blocks of 8 tokens (large: flashcodec "jpeg" truncation is cheap), and
  ``rank90_per_group`` = the rank that keeps 90% of singular-value energy (``sum s^2``) of each
  group of heads stacked along the token axis (small: palu's low-rank latents are cheap);
* optionally (``--add-to-kvspec``) merges them into kvspec's test vectors as family ``"real"``
  through :func:`kvspec.vectors.add_vectors`, with provenance.

The keys in transformers' ``DynamicCache`` are post-RoPE (and, for qwen3, post q/k-norm): the
attention module rotates them before ``cache.update``, so they are exactly what a KV-cache codec
sees. Usage::

    python benchmarks/tools/capture_kv.py                                  # embedded model, stats only
    python benchmarks/tools/capture_kv.py --layers 0,mid,last --tokens 256 --add-to-kvspec
    python benchmarks/tools/capture_kv.py --model Qwen/Qwen3-0.6B --out /tmp/qwen3_kv.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np
from kvbench.results import environment_stamp, results_path, write_json

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT = results_path("real_kv_stats.json")
KVSPEC_SOURCE_DATA = REPO_ROOT / "packages" / "kvspec" / "src" / "kvspec" / "data"
HELDOUT_LABEL = "kvbench/data/heldout.txt"


def read_text(text_file: Path | None) -> tuple[str, str]:
    """``(text, label)`` of ``--text-file``: kvbench's held-out text (labelled :data:`HELDOUT_LABEL`)
    when None, else the file (labelled by its path)."""
    if text_file is None:
        from kvbench.models import default_text_path

        return default_text_path().read_text(encoding="utf-8"), HELDOUT_LABEL
    return Path(text_file).read_text(encoding="utf-8"), str(text_file)


__all__ = [
    "attention_layer_indices",
    "capture_kv",
    "dct_low_energy_fraction",
    "dct_matrix",
    "kv_statistics",
    "rank_for_energy_per_group",
    "resolve_layers",
    "var_delta_ratio",
]


# --------------------------------------------------------------------------- statistics
def var_delta_ratio(x: np.ndarray) -> float:
    """Var(Δ)/Var(X) along the sequence of ``x`` float ``[B, H, S, D]`` (S >= 3).

    Δ are first differences along S. Both variances are per (b, h, d) channel over tokens, summed
    over channels before dividing, so high-energy channels weigh more (as they do in a codec's
    error). Below 1: neighbouring tokens are alike; above 1: they are anti-correlated.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 4 or x.shape[2] < 3:
        raise ValueError(f"x must be [B, H, S, D] with S >= 3; got shape {x.shape}")
    delta = np.diff(x, axis=2)
    return float(delta.var(axis=2).sum() / x.var(axis=2).sum())


def dct_matrix(block: int) -> np.ndarray:
    """Orthonormal DCT-II matrix float64 ``[block, block]`` (row j is frequency j): flashcodec's own."""
    import torch
    from flashcodec.codecs import dct_matrix as codec_dct

    return codec_dct(block, dtype=torch.float64).numpy()


def dct_low_energy_fraction(x: np.ndarray, block: int = 8, keep: int = 2) -> float:
    """Fraction of energy in the lowest ``keep`` DCT-II coefficients of ``block``-token blocks.

    ``x`` float ``[B, H, S, D]``; the first ``S // block * block`` tokens are used. Raw values
    (not mean-centred), as a block-DCT codec transforms them; the transform is orthonormal, so the
    total energy of the coefficients equals that of the block.
    """
    x = np.asarray(x, dtype=np.float64)
    b, h, s, d = x.shape
    n_blocks = s // block
    if n_blocks < 1:
        raise ValueError(f"need at least one block of {block} tokens; got S={s}")
    blocks = x[:, :, : n_blocks * block].reshape(b, h, n_blocks, block, d)
    coeffs = np.einsum("jn,bhknd->bhkjd", dct_matrix(block), blocks)
    energy = (coeffs**2).sum(axis=(0, 1, 2, 4))  # per frequency
    return float(energy[:keep].sum() / energy.sum())


def rank_for_energy_per_group(x: np.ndarray, group_size: int = 2, energy: float = 0.90) -> list[int]:
    """Per group of ``group_size`` contiguous heads: the smallest rank holding ``energy`` of sum(s^2).

    ``x`` float ``[B, H, S, D]``. As palu does, a group's heads are stacked along the token axis
    (``[B * group_size * S, D]``), the mean row is subtracted and the singular values taken.
    Returns one int per group, in head order.
    """
    x = np.asarray(x, dtype=np.float64)
    b, h, s, d = x.shape
    if h % group_size:
        raise ValueError(f"group_size must divide the {h} heads; got {group_size}")
    ranks = []
    for g in range(h // group_size):
        m = x[:, g * group_size : (g + 1) * group_size].reshape(-1, d)
        m = m - m.mean(axis=0, keepdims=True)
        s2 = np.linalg.svd(m, compute_uv=False) ** 2
        ranks.append(int(np.searchsorted(np.cumsum(s2) / s2.sum(), energy) + 1))
    return ranks


def kv_statistics(x: np.ndarray, group_size: int = 2) -> dict:
    """The three codec-deciding statistics of one tensor ``[B, H, S, D]``, plus its scale."""
    ranks = rank_for_energy_per_group(x, group_size)
    return {
        "var_delta_ratio": round(var_delta_ratio(x), 4),
        "dct_low2_energy": round(dct_low_energy_fraction(x, block=8, keep=2), 4),
        "rank90_per_group": ranks,
        "rank90_group_size": group_size,
        "head_dim": int(x.shape[-1]),
        "std": round(float(np.asarray(x, dtype=np.float64).std()), 4),
        "max_abs": round(float(np.abs(x).max()), 4),
    }


# --------------------------------------------------------------------------- capture
def attention_layer_indices(config) -> list[int]:
    """Indices of the layers that hold a K/V cache (all, or the ``full_attention`` ones of a hybrid)."""
    layer_types = getattr(config, "layer_types", None)
    n_layers = config.num_hidden_layers
    if layer_types:
        # sliding-window layers also keep K/V; only linear-attention (recurrent) layers do not
        return [i for i, t in enumerate(layer_types) if t != "linear_attention"]
    return list(range(n_layers))


def resolve_layers(spec: str, available: list[int]) -> list[int]:
    """Parse ``"0,mid,last"``-style specs against the cache-holding layer indices ``available``.

    ``first``/``mid``/``last`` pick among ``available``; integers must be in it. Order kept,
    duplicates dropped.
    """
    named = {"first": available[0], "mid": available[len(available) // 2], "last": available[-1]}
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if part in named:
            idx = named[part]
        else:
            try:
                idx = int(part)
            except ValueError:
                raise ValueError(f"--layers entries must be ints or first/mid/last; got {part!r}") from None
            if idx not in available:
                raise ValueError(f"--layers: layer {idx} holds no K/V cache; choose from {available}")
        if idx not in out:
            out.append(idx)
    return out


def capture_kv(model, input_ids, layers: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Run ``model`` on ``input_ids`` int64 ``[1, S]`` and return ``{layer: (keys, values)}``.

    Keys and values are float32 numpy ``[1, H_kv, S, D]``, post-RoPE, read from the
    ``DynamicCache`` the forward pass fills.
    """
    return {i: (k, v) for i, (k, v, _) in capture_kv_with_pre_rope(model, input_ids, layers).items()}


def capture_kv_with_pre_rope(model, input_ids, layers: list[int]) -> dict[int, tuple[np.ndarray, ...]]:
    """``{layer: (post-RoPE keys, values, pre-RoPE keys)}``, float32 numpy ``[1, H_kv, S, D]`` each.

    Pre-RoPE keys are what the attention module holds just before the rotation: the output of its
    key norm where it has one (qwen3's ``k_norm``), else of its key projection, reshaped to heads.
    """
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    pre: dict[int, np.ndarray] = {}
    hooks = []
    for i in layers:
        attn = decoder.layers[i].self_attn
        module = getattr(attn, "k_norm", None) or attn.k_proj
        head_dim = attn.head_dim

        def keep(_module, _inputs, output, i=i, head_dim=head_dim):
            x = output.detach().float()
            pre[i] = x.reshape(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2).cpu().numpy().copy()

        hooks.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    cache = out.past_key_values
    captured = {}
    for i in layers:
        layer = cache.layers[i]
        captured[i] = (
            layer.keys.detach().float().cpu().numpy().copy(),
            layer.values.detach().float().cpu().numpy().copy(),
            pre[i],
        )
    return captured


def layer_statistics(model, input_ids) -> list[dict]:
    """For every layer holding K/V: the codec-deciding statistics of its post-RoPE keys, pre-RoPE
    keys and values (Var(Δ)/Var(X), energy in the lowest 2 of 8 DCT coefficients, the rank per KV
    head holding 90% and 99% of the centred energy)."""
    layers = attention_layer_indices(model.config)
    captured = capture_kv_with_pre_rope(model, input_ids, layers)
    rows = []
    for i in layers:
        keys, values, pre_keys = captured[i]
        row = {"layer": i}
        for label, x in (("keys_post_rope", keys), ("keys_pre_rope", pre_keys), ("values", values)):
            r90 = rank_for_energy_per_group(x, 1, 0.90)
            r99 = rank_for_energy_per_group(x, 1, 0.99)
            row[label] = {
                "var_delta_ratio": round(var_delta_ratio(x), 4),
                "dct_low2_energy": round(dct_low_energy_fraction(x, block=8, keep=2), 4),
                "rank90_per_head": r90,
                "rank99_per_head": r99,
            }
        rows.append(row)
    return rows


def _sha256_file(path: Path) -> str:
    from kvbench.model_store import file_sha256

    return file_sha256(path)


def _model_label(model_arg: str) -> str:
    """A repo-relative path for a local model inside the repository, else the argument as given."""
    path = Path(model_arg)
    if path.exists():
        try:
            return str(path.resolve().relative_to(REPO_ROOT))
        except ValueError:
            return str(path.resolve())
    return model_arg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF causal LM path or hub id (default: the embedded model)")
    p.add_argument("--layers", default="first,mid,last", help="comma list of ints or first/mid/last")
    p.add_argument("--tokens", type=int, default=256, help="sequence length S to capture")
    p.add_argument("--start", type=int, default=0, help="first token of the window in the encoded text")
    p.add_argument("--text-file", type=Path, default=None, help=f"text to run on (default: {HELDOUT_LABEL})")
    p.add_argument("--group-size", type=int, default=2, help="heads per group for rank90")
    p.add_argument(
        "--stats-tokens",
        type=int,
        default=512,
        help="tokens for the per-layer statistics of every layer, pre- and post-RoPE (0: skip)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="statistics JSON")
    p.add_argument(
        "--add-to-kvspec", action="store_true", help="merge the K/V into kvspec's vectors (family 'real')"
    )
    p.add_argument(
        "--kvspec-data-dir",
        type=Path,
        default=KVSPEC_SOURCE_DATA,
        help="the kvspec vectors folder to add to (default: this checkout's packages/kvspec/src/kvspec/data)",
    )
    p.add_argument("--name-prefix", default=None, help="vector name prefix (default: real_<model dir name>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        from kvbench.models import embedded_model_path

        args.model = str(embedded_model_path())
    text, text_label = read_text(args.text_file)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, args.start : args.start + args.tokens]
    if ids.shape[1] < args.tokens:
        raise ValueError(
            f"--tokens {args.tokens} from --start {args.start}: the text has only {ids.shape[1]} tokens there"
        )
    layers = resolve_layers(args.layers, attention_layer_indices(model.config))
    captured = capture_kv(model, ids, layers)

    per_layer = []
    if args.stats_tokens:
        stats_ids = tokenizer(text, return_tensors="pt").input_ids[
            :, args.start : args.start + args.stats_tokens
        ]
        per_layer = layer_statistics(model, stats_ids)
        print(
            f"per layer, {stats_ids.shape[1]} tokens: Var(d)/Var(x), DCT low-2 energy, mean rank90 / rank99 per head"
        )
        for row in per_layer:
            cells = []
            for label in ("keys_post_rope", "keys_pre_rope", "values"):
                st = row[label]
                cells.append(
                    f"{label}: {st['var_delta_ratio']:.2f} {st['dct_low2_energy']:.2f} "
                    f"{np.mean(st['rank90_per_head']):.1f}/{np.mean(st['rank99_per_head']):.1f}"
                )
            print(f"  L{row['layer']}  " + "  ".join(cells))

    model_label = _model_label(args.model)
    weights = sorted(Path(args.model).glob("*.safetensors")) if Path(args.model).exists() else []
    prefix = args.name_prefix or "real_" + Path(model_label).name.replace("-", "").replace("_", "").lower()
    n_layers = model.config.num_hidden_layers
    rows = []
    vectors = []
    print(f"{'layer':>5} {'tensor':>6} {'Var(d)/Var(x)':>14} {'DCT low-2 energy':>17} {'rank90/group':>14}")
    for layer in layers:
        keys, values = captured[layer]
        entry = {"layer": layer, "of_layers": n_layers, "shape": list(keys.shape)}
        for label, x in (("keys", keys), ("values", values)):
            stats = kv_statistics(x, args.group_size)
            entry[label] = stats
            print(
                f"{layer:>5} {label[0].upper():>6} {stats['var_delta_ratio']:>14.4f} "
                f"{stats['dct_low2_energy']:>17.4f} {str(stats['rank90_per_group']):>14}"
            )
        rows.append(entry)
        provenance = {
            "model": model_label,
            "model_weights_sha256": _sha256_file(weights[0]) if len(weights) == 1 else None,
            "text": text_label,
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "token_range": [args.start, args.start + args.tokens],
            "layer": layer,
            "num_hidden_layers": n_layers,
            "tensor": "post-RoPE keys and values from transformers DynamicCache after one forward pass",
            "script": "benchmarks/tools/capture_kv.py",
            "transformers": transformers.__version__,
        }
        vectors.append((f"{prefix}_l{layer}_f32", keys, values, provenance, entry))

    if args.add_to_kvspec:
        from kvspec.vectors import TestVector, add_vectors, vector_statistics

        tvs = []
        for name, keys, values, provenance, entry in vectors:
            statistics = vector_statistics(keys, values)
            for label in ("keys", "values"):
                statistics[label].update(
                    {
                        k: entry[label][k]
                        for k in (
                            "var_delta_ratio",
                            "dct_low2_energy",
                            "rank90_per_group",
                            "rank90_group_size",
                        )
                    }
                )
            tvs.append(
                TestVector(
                    name=name,
                    family="real",
                    dtype="float32",
                    keys=keys,
                    values=values,
                    provenance=provenance,
                    statistics=statistics,
                )
            )
        add_vectors(tvs, data_dir=args.kvspec_data_dir)
        print(f"added {[t.name for t in tvs]} to kvspec vectors in {args.kvspec_data_dir}")

    record = {
        **environment_stamp(["torch", "transformers", "numpy"]),
        "command": "python benchmarks/tools/capture_kv.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": model_label,
        "text": text_label,
        "token_range": [args.start, args.start + args.tokens],
        "definitions": {
            "var_delta_ratio": "sum over (b,h,d) of Var_t(x[t+1]-x[t]) / sum over (b,h,d) of Var_t(x[t])",
            "dct_low2_energy": "energy in DCT-II coefficients 0-1 of 8-token blocks / total block energy (raw values)",
            "rank90_per_group": "per group of rank90_group_size contiguous KV heads stacked along tokens, mean-centred: "
            "smallest r with sum(s[:r]^2) >= 0.9 sum(s^2)",
        },
        "vectors": [name for name, *_ in vectors] if args.add_to_kvspec else [],
        "layers": rows,
        "per_layer_tokens": args.stats_tokens,
        "per_layer_definitions": {
            "keys_pre_rope": "the key norm's output (before the rotation), per head",
            "rank90_per_head / rank99_per_head": "per KV head, mean-centred over tokens: smallest r with "
            "sum(s[:r]^2) >= 0.9 (0.99) sum(s^2)",
        },
        "per_layer": per_layer,
    }
    print(f"wrote {write_json(args.out, record)}")
    return record


if __name__ == "__main__":
    main()
