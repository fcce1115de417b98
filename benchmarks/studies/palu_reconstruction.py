"""palu-mlx reconstruction error per bit on the kvspec test vectors, beside naive uniform quantization.

    hatch run bench:python benchmarks/studies/palu_reconstruction.py

Writes ``benchmarks/results/palu_reconstruction.json``: relative Frobenius error of K and V
against bits per element for every palu tier that needs no file (:data:`palu_mlx.tiers.TIERS`, then the
study configurations of ``benchmarks/studies/palu_tiers.py``) and the naive uniform
2/4-bit baseline, on every kvspec test vector of the planted, random-walk, gaussian, outlier and
real families (each vector: half of it as the prefill, the rest in 8-token appends).

This is a codec-level measurement on stored vectors. What a tier does to a model (KL, top-1
agreement, perplexity, memory, speed) is measured by ``palu-mlx compare`` (kvbench's protocol).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from kvbench.results import environment_stamp, results_path, write_json
from kvspec.conformance import relative_error as rel_err
from kvspec.vectors import load_vectors
from palu_mlx import PaluKVCache, naive_roundtrip
from palu_mlx.kvspec_adapter import PaluAdapter
from palu_mlx.state_checks import STATE_META
from palu_mlx.tiers import TIERS as REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.palu_tiers import STUDY_TIERS  # noqa: E402

#: every tier that needs no file: the registry's, then the study configurations
TIERS = {**REGISTRY, **STUDY_TIERS}

FAMILIES = ("planted_lowrank", "random_walk", "gaussian", "outlier_keys", "real")
#: the tier the summary sets against naive 2-bit
HEADLINE = "reference-default"
#: numpy <-> mlx conversions of the conformance adapter (vectors are stored as float32 numpy)
ADAPTER = PaluAdapter()
to_mx, to_np = ADAPTER.to_native, ADAPTER.to_numpy


def stamp() -> dict:
    """Machine, versions, date and the command line, so every figure can be traced to its run."""
    return {
        **environment_stamp(["palu-mlx", "kvcache-spec", "mlx", "mlx-lm", "numpy"]),
        "command": " ".join(["python benchmarks/studies/palu_reconstruction.py", *sys.argv[1:]]),
    }


def palu_on_vector(vector, config) -> dict:
    """Stream ``vector`` through a fresh palu cache; errors of the final fetch and measured bits."""
    cache = PaluKVCache(config)
    s = vector.shape[2]
    bounds = [0, s // 2, *range(s // 2 + 8, s, 8), s]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        keys, values = cache.update_and_fetch(
            to_mx(vector.keys[:, :, a:b], vector.dtype), to_mx(vector.values[:, :, a:b], vector.dtype)
        )
    elements = int(np.prod(vector.shape) + np.prod(vector.values_shape))
    # the cache's own arrays: not the meta_state record every state also carries for saving
    state = {name: a for name, a in cache.state.items() if name != STATE_META}
    state_bytes = sum(a.nbytes for a in state.values())
    # arrays with a token axis: exact tokens, the mixed-bit coder's segments, the fixed coder's codes
    token_bytes = sum(
        a.nbytes
        for name, a in state.items()
        if ".seg" in name or name.endswith(".codes") or name.startswith("exact_")
    )
    return {
        "key_rel_err": rel_err(to_np(keys), vector.keys),
        "value_rel_err": rel_err(to_np(values), vector.values),
        "bits_per_element": 8 * state_bytes / elements,
        "bits_per_element_with_capacity": cache.storage_stats().bits_per_element,
        "bits_per_element_per_token_arrays": 8 * token_bytes / elements,
        "key_rank": cache.key_rank,
        "value_rank": cache.value_rank,
        "fitted": cache.fitted,
    }


def naive_on_vector(vector, bits: int) -> dict:
    """Uniform ``bits``-bit group-64 quantization of the whole vector (per token, so no stream)."""
    k_hat, k_bytes = naive_roundtrip(to_mx(vector.keys, vector.dtype), bits, 64)
    v_hat, v_bytes = naive_roundtrip(to_mx(vector.values, vector.dtype), bits, 64)
    elements = int(np.prod(vector.shape) + np.prod(vector.values_shape))
    return {
        "key_rel_err": rel_err(to_np(k_hat), vector.keys),
        "value_rel_err": rel_err(to_np(v_hat), vector.values),
        "bits_per_element": 8 * (k_bytes + v_bytes) / elements,
        "bits_per_element_with_capacity": 8 * (k_bytes + v_bytes) / elements,
        "bits_per_element_per_token_arrays": 8 * (k_bytes + v_bytes) / elements,
    }


def run_reconstruction() -> dict:
    vectors = [v for v in load_vectors() if v.family in FAMILIES]
    rows = []
    for vector in vectors:
        base = {
            "vector": vector.name,
            "family": vector.family,
            "dtype": vector.dtype,
            "shape": list(vector.shape),
        }
        for bits in (2, 4):
            rows.append({**base, "method": f"naive {bits}-bit (group 64)", **naive_on_vector(vector, bits)})
        for name, tier in TIERS.items():
            rows.append({**base, "method": f"palu {name}", **palu_on_vector(vector, tier.config)})
        print(f"  {vector.name}: done", flush=True)

    # per family and method: mean errors and bits, and palu default vs naive 2-bit
    summary: dict[str, dict] = {}
    for family in sorted({r["family"] for r in rows}):
        fam = [r for r in rows if r["family"] == family]
        per_method = {}
        for method in dict.fromkeys(r["method"] for r in fam):
            sel = [r for r in fam if r["method"] == method]
            per_method[method] = {
                k: float(np.mean([r[k] for r in sel]))
                for k in (
                    "key_rel_err",
                    "value_rel_err",
                    "bits_per_element",
                    "bits_per_element_per_token_arrays",
                )
            }
        summary[family] = per_method
    verdicts = []
    for family, methods in summary.items():
        palu, naive = methods[f"palu {HEADLINE}"], methods["naive 2-bit (group 64)"]
        for tensor in ("key", "value"):
            p, n = palu[f"{tensor}_rel_err"], naive[f"{tensor}_rel_err"]
            verdicts.append(
                {
                    "family": family,
                    "tensor": tensor,
                    "palu_headline_rel_err": p,
                    "naive_2bit_rel_err": n,
                    "palu_headline_bits": palu["bits_per_element"],
                    "naive_2bit_bits": naive["bits_per_element"],
                    "palu_wins": p < n,
                }
            )
    return {
        **stamp(),
        "definitions": {
            "rel_err": "||x_hat - x||_F / ||x||_F over the whole vector after the stream",
            "bits_per_element": "8 * bytes of the arrays in cache.state (codes, scales, biases, projections, "
            "means, singular values; cut to the tokens held) / (B*H*S*(D+Dv))",
            "bits_per_element_per_token_arrays": "the same without the per-layer projections, means and "
            "singular values: the rate a long context tends to",
            "bits_per_element_with_capacity": "8 * cache.nbytes (buffers at their grown 256-token capacity) / elements",
            "stream": "prefill of S//2 tokens, then 8-token appends",
            "palu tiers": {name: tier.description for name, tier in TIERS.items()},
            "palu common": "every tier has head_dim=None and palu_n_head_groups=1 (vectors have 1-4 heads); "
            "palu_min_fit_tokens=None: D tokens are held exact before the fit",
        },
        "vectors": [v.name for v in vectors],
        "rows": rows,
        "summary_by_family": summary,
        "palu_headline_vs_naive_2bit": verdicts,
    }


def main(argv: list[str] | None = None) -> int:
    result = run_reconstruction()
    write_json(results_path("palu_reconstruction.json"), result)
    for v in result["palu_headline_vs_naive_2bit"]:
        print(
            f"  {v['family']:>16} {v['tensor']:>5}: palu {HEADLINE} {v['palu_headline_rel_err']:.3f} "
            f"@ {v['palu_headline_bits']:.2f} b/el vs naive 2-bit {v['naive_2bit_rel_err']:.3f} "
            f"@ {v['naive_2bit_bits']:.2f} b/el"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
