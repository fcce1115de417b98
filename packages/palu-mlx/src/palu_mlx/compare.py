"""``palu-mlx compare``: every palu tier beside mlx-lm's own caches, on one model, in one run.

    palu-mlx compare                                   # the repository's embedded model, all tiers
    python -m palu_mlx.compare --model mlx-community/Llama-3.2-1B-Instruct-4bit --text notes.txt
    palu-mlx compare --tiers reference-default --peers mlx-lm-q4 --json out.json --plot out.png

Needs the ``compare`` extra (``pip install "palu-mlx[compare]"``: kvbench).

Candidates, all built for the loaded model's layers (layers whose default cache is not mlx-lm's
plain ``KVCache``, e.g. rotating windows or SSM state, keep their default in every candidate):

* ``baseline``: mlx-lm's ``KVCache`` (uncompressed, the model's dtype);
* tiers: :data:`palu_mlx.tiers.TIERS` (same names), sized for the model's head dim by
  :meth:`palu_mlx.tiers.Tier.for_head_dim` (one projection per KV head);
* peers: :data:`palu_mlx.peers.PEERS`: mlx-lm's ``QuantizedKVCache`` at 8 and 4 bits (group
  size 64, or 32 for head dims 64 does not divide), KIVI in plain MLX, and VeloxQuant-MLX's
  caches where that optional package is installed. A peer that cannot run here is listed under
  ``absent`` with the reason.

The protocol, options, JSON layout, table and chart are kvbench's, shared with ``flashcodec
compare``; this module is the MLX runner and the candidates.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvbench.cli import Loaded, run_cli, run_compare
from kvbench.models import model_names, resolve_model
from kvbench.protocol import Candidate, KVBytes
from kvbench.results import CompareError, weights_digest
from kvspec import KVConfigError
from kvspec.adapter import flatten_arrays
from mlx.utils import tree_flatten

from .builder import KVCacheBuilder, model_kv_dims
from .config import KVCacheConfig
from .peers import PEERS, PeerUnavailable, peer, resident_nbytes
from .peers.mlx_lm_quant import PEER_BITS
from .tiers import CALIBRATED_SUFFIX, CALIBRATED_TIERS, TIERS, Tier, tier

__all__ = [
    "PEER_BITS",
    "tier_config",
    "load_model",
    "MLXRunner",
    "build_candidates",
    "peer_candidate",
    "PaluHarness",
    "main",
]


_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def tier_config(
    name: str, head_dim: int, n_kv_heads: int | None, calibration: str | None = None
) -> KVCacheConfig:
    """The :class:`KVCacheConfig` of tier ``name`` for a model with ``head_dim`` and ``n_kv_heads``:
    the registry's own sizing, :meth:`~palu_mlx.tiers.Tier.for_head_dim` (one projection per KV
    head, ranks capped at the head dim), so what runs under a name is what the registry says.
    ``n_kv_heads`` is accepted for callers that size tiers per model. A calibrated tier
    (:data:`palu_mlx.tiers.CALIBRATED_TIERS`, :data:`~palu_mlx.tiers.SENSITIVITY_TIERS`) needs
    ``calibration``, its file for the model (:meth:`~palu_mlx.tiers.Tier.with_calibration`).
    """
    return tier(name).sized(head_dim, calibration)


def round_kv_outputs(model: Any, dtype: Any) -> None:
    """Make every layer's ``self_attn.k_proj`` (``k_norm`` where there is one) and ``v_proj``
    round its output to ``dtype``.

    With a float32 model this gives the K/V a ``dtype`` model would cache while the matrix
    products stay in float32 (on Linux, MLX's CPU wheel multiplies bfloat16 matrices without a
    BLAS, several times slower than float32 through an optimized BLAS). The modules keep their
    parameters and names (a calibration file still fits); only their class gains the rounding.
    """
    for index, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        # keys leave through k_norm where the model has one (qwen3): its float32 weights would
        # promote rounded keys back
        key_module = "k_norm" if callable(getattr(attn, "k_norm", None)) else "k_proj"
        projections = [getattr(attn, name, None) for name in (key_module, "v_proj")]
        if any(not callable(p) for p in projections):
            raise CompareError(
                f"--compute-dtype: layer {index} has no self_attn.k_proj / v_proj to round; "
                "use --compute-dtype same"
            )
        for projection in projections:
            base = type(projection)
            if getattr(base, "_rounds_to", None) is not None:
                continue

            def call(self, x, base=base):
                return base.__call__(self, x).astype(self._rounds_to)

            projection.__class__ = type(
                f"Rounded{base.__name__}", (base,), {"__call__": call, "_rounds_to": dtype}
            )


def load_model(
    model: str | None, dtype: str = "bfloat16", compute_dtype: str = "same"
) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)`` for a named model (None: kvbench's default, the real model), a
    local directory or a hub id, its floating-point weights cast to ``dtype`` (float32 / bfloat16
    / float16). ``compute_dtype="float32"``: weights and activations in float32, keys and values
    rounded to ``dtype`` (:func:`round_kv_outputs`), so the caches hold what a ``dtype`` model
    caches.

    Raises CompareError with one line when the path is not a model or mlx-lm cannot load it.
    """
    import mlx_lm

    if model is None or model in model_names():
        try:
            source: str = resolve_model(model)
        except FileNotFoundError as err:
            raise CompareError(f"--model {model or 'default'}: {err}") from None
    else:
        source = model
        path = Path(model).expanduser()
        if path.exists():
            if not (path / "config.json").is_file():
                raise CompareError(f"--model {model!r} is not a model directory (it has no config.json)")
            source = str(path)
        elif not _HUB_ID.match(model):
            raise CompareError(f"--model {model!r} is neither a local directory nor a hub id like org/name")
    try:
        loaded, tokenizer = mlx_lm.load(source)[:2]
    except Exception as err:  # mlx-lm raises ValueError, OSError, hub errors ...; one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CompareError(
            f"--model {source!r}: mlx-lm cannot load it ({type(err).__name__}: {first})"
        ) from None
    if compute_dtype == "same":
        loaded.set_dtype(_DTYPES[dtype])
    else:
        loaded.set_dtype(_DTYPES[compute_dtype])
        round_kv_outputs(loaded, _DTYPES[dtype])
    loaded.kv_dtype = _DTYPES[dtype]
    # the held-out text is tokenized whole, then cut into windows; the length warning does not apply
    getattr(tokenizer, "_tokenizer", tokenizer).model_max_length = int(1e12)
    head_dim, n_kv = model_kv_dims(loaded)
    weights = tree_flatten(loaded.parameters())
    info = {
        "name": Path(source).name if Path(source).exists() else source,
        "source": source,
        "architecture": getattr(loaded, "model_type", None)
        or getattr(getattr(loaded, "args", None), "model_type", None),
        "layers": len(loaded.layers),
        "kv_heads": n_kv,
        "head_dim": head_dim,
        "dtype": dtype,  # what the caches hold and are measured against
        "compute_dtype": dtype if compute_dtype == "same" else compute_dtype,
        "weights_bytes": sum(v.nbytes for _, v in weights),
        "weights_sha256": weights_digest(source) if Path(source).is_dir() else None,
        "framework": f"mlx {mx.__version__}",
    }
    return loaded, tokenizer, info


class MLXRunner:
    """Drives an mlx-lm model for :func:`kvbench.protocol.measure` (batch 1, greedy)."""

    peak_label = (
        "MLX allocator peak (mx.get_peak_memory) minus the memory allocated before the cache was made "
        "(weights): cache, activations and logits"
    )

    def __init__(self, model: Any, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        self._active_before = 0
        self.kv_itemsize = _kv_dtype(model).size

    def _logits(self, cache: list[Any], tokens: list[int]) -> np.ndarray:
        logits = self.model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)[0, -1]
        return np.array(logits.astype(mx.float32))  # np.array evaluates: the call is done when it returns

    def prefill(self, cache: list[Any], tokens: Sequence[int]) -> np.ndarray:
        return self._logits(cache, list(tokens))

    def step(self, cache: list[Any], token: int) -> np.ndarray:
        return self._logits(cache, [int(token)])

    def kv_bytes(self, cache: list[Any]) -> KVBytes:
        if getattr(cache, "count_arrays", False):
            # a peer whose nbytes is its own estimate: count what its caches keep
            return KVBytes(held=resident_nbytes(list(cache)))
        # every other cache here reports the bytes of its arrays at their grown capacity
        return KVBytes(held=sum(int(c.nbytes) for c in cache))

    def raw_bytes(self, cache: list[Any]) -> int:
        # KVCache reserves 256-token steps; keys_and_values() is its K/V cut to the tokens held
        total = 0
        for c in cache:
            if getattr(c, "keys", None) is not None and hasattr(c, "keys_and_values"):
                total += sum(int(a.nbytes) for a in c.keys_and_values())
            else:  # other layer kinds (rotating windows, SSM state): what their state holds
                total += sum(int(a.nbytes) for a in flatten_arrays(c.state))
        return total

    def reset_peak(self) -> None:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        self._active_before = mx.get_active_memory()

    def restart_peak(self) -> None:
        mx.reset_peak_memory()

    def peak_bytes(self) -> int | None:
        return max(0, mx.get_peak_memory() - self._active_before)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))


def _default_caches(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def build_candidates(
    model: Any,
    tiers: Sequence[str],
    peers: Sequence[str],
    calibration: str | None = None,
    registry: Mapping[str, Tier] | None = None,
) -> tuple[list[Candidate], list[dict[str, str]]]:
    """Baseline, then the chosen tiers, then the chosen peers, each checked against the model;
    and ``{"name", "kind", "reason"}`` for each chosen peer that cannot run here
    (:class:`~palu_mlx.peers.PeerUnavailable`: not installed, or it refuses the model).

    With ``calibration`` (a ``palu-mlx calibrate`` file for this model) every tier with a
    calibrated twin in :data:`palu_mlx.tiers.CALIBRATED_TIERS` (those with a bit budget) also
    runs calibrated, as ``<tier>+cal``, right after it. ``registry``: name -> :class:`Tier` to take
    the tiers and their twins from (default :func:`palu_mlx.tiers.tier`, the package's; a benchmark
    passes one holding its study configurations too).
    Raises CompareError (one line) when palu cannot serve the model.
    """
    head_dim, n_kv = model_kv_dims(model)
    if head_dim is None:
        raise CompareError("--model: cannot read the head dim from the model's args; palu needs it")
    dtype = str(_kv_dtype(model)).replace("mlx.core.", "")
    out = [
        Candidate(
            "baseline",
            "baseline",
            f"mlx-lm KVCache, uncompressed ({dtype})",
            lambda: _default_caches(model),
            {},
        )
    ]

    def named(name: str) -> Tier:
        if registry is None:
            return tier(name)
        if name not in registry:
            raise KVConfigError(f"tier={name!r} is not a palu tier; allowed: {', '.join(registry)}")
        return registry[name]

    for name in tiers:
        entry = named(name)
        config = entry.sized(head_dim)
        try:
            KVCacheBuilder.for_model(model, config)  # validate now, not after the baseline ran
        except KVConfigError as err:
            raise CompareError(f"--model: palu cannot serve this model with tier {name!r}: {err}") from None
        out.append(
            Candidate(
                name,
                "tier",
                entry.description,
                lambda config=config: KVCacheBuilder.for_model(model, config),
                config.keywords(),
            )
        )
        twin = (CALIBRATED_TIERS if registry is None else registry).get(name + CALIBRATED_SUFFIX)
        if calibration is not None and twin is not None:
            cal = twin.sized(head_dim, calibration)
            try:
                KVCacheBuilder.for_model(model, cal)
            except KVConfigError as err:
                raise CompareError(f"--calibration: {err}") from None
            out.append(
                Candidate(
                    twin.name,
                    "tier",
                    twin.with_calibration(calibration).description,
                    lambda cal=cal: KVCacheBuilder.for_model(model, cal),
                    cal.keywords(),
                )
            )
    absent: list[dict[str, str]] = []
    for name in peers:
        candidate = peer_candidate(model, name)
        if isinstance(candidate, str):
            absent.append({"name": name, "kind": "peer", "reason": candidate})
        else:
            out.append(candidate)
    return out, absent


def peer_candidate(model: Any, name: str) -> Candidate | str:
    """The candidate of peer ``name`` (:data:`palu_mlx.peers.PEERS`) for ``model``, or the
    reason it cannot run here (its caches are built once now, so a refusal shows before the
    baseline runs rather than in the middle of the measurements)."""
    chosen = peer(name)
    try:
        chosen.make(model)
        record = chosen.record_for(model)
    except PeerUnavailable as err:
        return err.reason
    if chosen.accounted is None:
        return Candidate(name, "peer", chosen.description, lambda: chosen.make(model), record)
    accounted = chosen.accounted
    # the caches of the first window, whose bytes are the row's kv_bytes: the peer's own account
    # is read from the same caches at the same point, not from a later (shorter) speed run
    first: list[Any] = []

    def make() -> list[Any]:
        caches = chosen.make(model)
        if not first:
            first.append(caches)
        return caches

    def details() -> dict[str, Any]:
        if not first:
            return {}
        out = accounted(model, list(first[0]))
        first.clear()
        return {**out, "accounted_after": "the first window"}

    return Candidate(name, "peer", chosen.description, make, record, details=details)


def _kv_dtype(model: Any) -> Any:
    """The dtype of the K/V the model caches: :func:`load_model`'s record, else its weights'."""
    recorded = getattr(model, "kv_dtype", None)
    if recorded is not None:
        return recorded
    weights = tree_flatten(model.parameters())
    return weights[0][1].dtype if weights else None


class PaluHarness:
    """palu-mlx's part of ``kvbench.cli.run_compare``: mlx-lm models, palu tiers, MLX peers."""

    tool = "palu-mlx compare"
    packages = (
        "palu-mlx",
        "kvbench",
        "kvcache-spec",
        "mlx",
        "mlx-lm",
        "numpy",
        "transformers",
        "veloxquant-mlx",
    )
    dtypes = tuple(_DTYPES)

    def tiers(self) -> Mapping[str, str]:
        offered = TIERS if self.registry is None else self.registry
        return {name: t.description for name, t in offered.items() if t.calibration is None}

    def peers(self) -> Mapping[str, str]:
        return {name: p.description for name, p in PEERS.items()}

    def __init__(self, registry: Mapping[str, Tier] | None = None) -> None:
        self._calibration: str | None = None
        #: the tiers offered, with their twins: None for the package's; a benchmark passes a registry
        #: holding its study configurations too
        self.registry = registry

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--compute-dtype",
            default="same",
            choices=("same", "float32"),
            help="same (default): the model computes in --dtype; float32: weights and activations in "
            "float32, keys and values rounded to --dtype before they are cached (faster where MLX "
            "multiplies float32 through an optimized BLAS and bfloat16 without one, as on Linux)",
        )
        parser.add_argument(
            "--calibration",
            default=None,
            metavar="FILE",
            help="a `palu-mlx calibrate` file for --model: every tier with a bit budget also runs "
            "calibrated, as <tier>+cal",
        )

    def load(self, args: argparse.Namespace) -> Loaded:
        self._calibration = args.calibration
        model, tokenizer, info = load_model(args.model, args.dtype, args.compute_dtype)
        max_positions = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        return Loaded.with_tokenizer(MLXRunner(model, tokenizer), tokenizer, info, max_positions, model)

    def candidates(self, loaded: Loaded, tiers: Sequence[str], peers: Sequence[str]):
        return build_candidates(loaded.handle, tiers, peers, self._calibration, self.registry)

    def noise_floor(self, loaded: Loaded) -> Candidate:
        return noise_floor_candidate(loaded.handle)


def noise_floor_candidate(model: Any) -> Candidate:
    """mlx-lm's uncompressed cache with ``model`` computing and caching in float32 during this
    candidate's runs: how far the run's 16-bit rounding alone moves the distributions."""
    rounded = {  # the classes round_kv_outputs made (an MLX module's children are its dict items)
        type(child)
        for layer in model.layers
        for child in dict(getattr(layer, "self_attn", None) or {}).values()
        if getattr(type(child), "_rounds_to", None) is not None
    }

    @contextlib.contextmanager
    def in_float32() -> Iterator[None]:
        if rounded:  # float32 compute already: only the K/V rounding to turn off
            before = {cls: cls._rounds_to for cls in rounded}
            for cls in rounded:
                cls._rounds_to = mx.float32
        else:
            dtype = _kv_dtype(model)
            model.set_dtype(mx.float32)  # 16-bit -> float32 -> 16-bit is exact
        try:
            yield
        finally:
            if rounded:
                for cls, dtype in before.items():
                    cls._rounds_to = dtype
            else:
                model.set_dtype(dtype)

    return Candidate(
        "noise-floor-fp32",
        "reference",
        "mlx-lm KVCache, uncompressed, the model computed and cached in float32: the rounding noise of "
        "the 16-bit run, not a cache to choose",
        lambda: _default_caches(model),
        {"class": "mlx_lm.models.cache.KVCache", "compute_dtype": "float32"},
        context=in_float32,
    )


def main(argv: Sequence[str] | None = None, *, registry: Mapping[str, Tier] | None = None) -> int:
    """Entry point of ``palu-mlx compare`` / ``python -m palu_mlx.compare``; returns the exit code.
    ``registry``: the tiers offered, with their ``+cal`` twins (default the package's,
    :data:`~palu_mlx.tiers.TIERS`; a benchmark passes one holding its study configurations too)."""
    return run_cli(lambda a: run_compare(PaluHarness(registry), a), argv)


if __name__ == "__main__":
    sys.exit(main())
