"""``flashcodec compare``: every flashcodec tier beside transformers' own caches, on one model, in one run.

    flashcodec compare                                  # the repository's embedded model, all tiers
    python -m flashcodec.compare --model Qwen/Qwen3-0.6B --device cuda --text notes.txt
    flashcodec compare --tiers jpeg-k8-int8 --peers none --json out.json --plot out.png
    flashcodec compare --tiers png-keep1,jpeg-k2 --attention codes   # both attending on their codes

Needs the ``compare`` extra (``pip install "flashcodec-kv[compare]"``: kvbench and transformers).
Candidates:

* ``baseline``: transformers' ``DynamicCache`` (uncompressed, the model's dtype);
* tiers: :data:`flashcodec.tiers.TIERS` (same names) as a :class:`flashcodec.hf.FlashCodecCache`
  on every full-attention layer, each with its own :attr:`~flashcodec.tiers.Tier.attention` or the
  one ``--attention`` chooses for all. With ``codes`` the model attends on the stored codes for
  decode steps and over the archive in chunks for multi-token steps
  (:func:`flashcodec.hf.attending_on`, undone after each of its runs; its details count both kinds
  of step and any fallback); with ``materialized`` on a decoded view;
* peers: transformers' ``QuantizedCache`` with each backend that works here (``hqq`` 8 and 4
  bits, ``quanto`` 4 and 2 bits: optional packages; ``fp8``: built in). A backend that cannot be
  built is listed under ``absent`` with the exact error. And TurboQuant (MSE variant, 4 and 3 bits:
  :mod:`flashcodec.codecs.turboquant`, a reference built to its paper) as a
  :class:`flashcodec.hf.FlashCodecCache` with attention on its codes.

The protocol, options, JSON layout, table and chart are kvbench's, shared with ``palu-mlx
compare``; this module is the torch runner and the candidates.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvbench.cli import Loaded, run_cli, run_compare
from kvbench.models import model_names, resolve_model
from kvbench.protocol import Candidate, KVBytes
from kvbench.results import CompareError, weights_digest
from kvspec import KVSpecError

from .codecs import BlockCodec, TurboQuantCodec
from .tiers import ATTENTIONS, RETIRED_ATTENTION_SUFFIX, TIERS, Tier, check_attention
from .tiers import tier as tier_named

__all__ = [
    "PEERS",
    "CODEC_PEERS",
    "ATTENTION_CHOICES",
    "load_model",
    "TorchRunner",
    "RSSPeak",
    "build_candidates",
    "reject_attention_in_names",
    "FlashCodecHarness",
    "main",
]

#: peer name -> (QuantizedCache backend, nbits or None)
PEERS: dict[str, tuple[str, int | None]] = {
    "hf-hqq-q8": ("hqq", 8),
    "hf-hqq-q4": ("hqq", 4),
    "hf-quanto-q4": ("quanto", 4),
    "hf-quanto-q2": ("quanto", 2),
    "hf-fp8": ("fp8", None),
}

#: peers that are other methods' quantizers run as flashcodec codecs: name -> codec. Tokens are coded
#: independently, so the block is short (the incomplete one waits raw, as QuantizedCache's residual)
CODEC_PEERS: dict[str, BlockCodec] = {
    "turboquant-4": TurboQuantCodec(block_size=16, bits=4),
    "turboquant-3": TurboQuantCodec(block_size=16, bits=3),
}

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- model
def load_model(model: str | None, device: str, dtype: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)`` for a named model (None: kvbench's default, the real model), a
    local directory or a hub id.

    ``dtype``: float32 / bfloat16 / float16. Raises CompareError with one line when the path is not a model or it cannot be loaded.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise CompareError('flashcodec compare needs transformers: pip install "flashcodec-kv[hf]"') from None
    if model is None or model in model_names():
        try:
            source: str = resolve_model(model)
        except FileNotFoundError as err:
            raise CompareError(f"--model {model or 'default'}: {err}") from None
        local = True
    else:
        path = Path(model).expanduser()
        local = path.exists()
        if local and not (path / "config.json").is_file():
            raise CompareError(f"--model {model!r} is not a model directory (it has no config.json)")
        if not local and not _HUB_ID.match(model):
            raise CompareError(f"--model {model!r} is neither a local directory nor a hub id like org/name")
        source = str(path) if local else model
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CompareError(f"--device {device!r}: CUDA is not available here; use --device cpu")
    torch_dtype = _DTYPES[dtype]
    try:
        loaded = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=local)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except Exception as err:  # ValueError (unknown architecture), OSError (files), hub errors: one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CompareError(
            f"--model {source!r}: transformers cannot load it ({type(err).__name__}: {first})"
        ) from None
    loaded = loaded.to(device).eval()
    # the held-out text is tokenized whole, then cut into windows; the length warning does not apply
    tokenizer.model_max_length = int(1e12)
    text = loaded.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    info = {
        "name": Path(source).name if local else source,
        "source": source,
        "architecture": text.model_type,
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": head_dim,
        "dtype": str(torch_dtype).replace("torch.", ""),
        "weights_bytes": sum(p.nbytes for p in loaded.parameters()),
        "weights_sha256": weights_digest(source) if local else None,
        "framework": f"torch {torch.__version__}",
    }
    return loaded, tokenizer, info


# --------------------------------------------------------------------------- memory
class RSSPeak:
    """Peak resident memory of this process above its level at :meth:`reset` (Linux).

    Linux keeps the high-water mark ``VmHWM`` and lets a process reset it to the current RSS by
    writing ``5`` to ``/proc/self/clear_refs``. Freed heap is first handed back (``malloc_trim``)
    so a candidate measured after another does not reuse the earlier one's pages unseen.
    ``available`` is False elsewhere (then ``peak`` is None).
    """

    label = (
        "process resident memory (Linux VmHWM) high-water mark during the candidate's run, above the "
        "resident memory at its start (after malloc_trim): cache, activations, logits and allocator slack"
    )

    def __init__(self) -> None:
        self._start = 0
        self._libc = None
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            pass
        self.available = Path("/proc/self/clear_refs").exists()

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def reset(self) -> None:
        self.restart()
        if self.available:
            self._start = self._status("VmRSS")

    def restart(self) -> None:
        """Hand freed heap back, then reset the high-water mark to the current RSS; keep the start level.

        Without the trim, memory a prefill freed but the allocator kept (glibc does not return
        most freed heap on its own) stays in RSS, and the decode peak would read the prefill's.
        """
        if self._libc is not None:
            self._libc.malloc_trim(0)
        if not self.available:
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.available = False

    def peak(self) -> int | None:
        if not self.available:
            return None
        return max(0, self._status("VmHWM") - self._start)


class TorchRunner:
    """Drives a transformers causal LM for :func:`kvbench.protocol.measure` (batch 1, greedy)."""

    def __init__(self, model: Any, tokenizer: Any, device: str):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._rss = RSSPeak()
        self._cuda_start = 0
        self.kv_itemsize = next(model.parameters()).element_size()
        # recent transformers 5.x name the forward's cache argument `cache` (`past_key_values` is deprecated)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if self._cuda:
            self.peak_label = (
                "torch.cuda.max_memory_allocated during the candidate's run minus memory allocated "
                "before it (weights): cache, activations and logits"
            )
        elif self._rss.available:
            self.peak_label = RSSPeak.label
        else:
            self.peak_label = "not measured: no CUDA and no Linux /proc/self/clear_refs on this machine"

    def _logits(self, cache: Any, ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
        return out.logits[0, -1].float().cpu().numpy()  # .cpu() waits for the device

    def prefill(self, cache: Any, tokens: Sequence[int]) -> np.ndarray:
        return self._logits(cache, list(tokens))

    def step(self, cache: Any, token: int) -> np.ndarray:
        return self._logits(cache, [int(token)])

    def kv_bytes(self, cache: Any) -> KVBytes:
        return cache_bytes(cache)

    def raw_bytes(self, cache: Any) -> int:
        # DynamicCache layers hold exactly the tokens seen (torch.cat), no spare capacity
        return cache_bytes(cache).held

    def reset_peak(self) -> None:
        gc.collect()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        else:
            self._rss.reset()

    def restart_peak(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._rss.restart()

    def peak_bytes(self) -> int | None:
        if self._cuda:
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._cuda_start)
        return self._rss.peak()

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (tensors, tuples, lists, dicts). Tensor subclasses that wrap
    packed data (optimum-quanto's QTensor) are counted by their inner tensors, not their logical size."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def cache_bytes(cache: Any) -> KVBytes:
    """Measured bytes of a transformers cache: FlashCodecCache (held = archive + raw tail, resident
    adds spare archive capacity and the memoized view), QuantizedCache (quantized states plus the
    full-precision residual), DynamicCache (keys and values)."""
    from .hf import FlashCodecCache

    if isinstance(cache, FlashCodecCache):
        storage = cache.storage_bytes()
        native = cache.native_nbytes()
        return KVBytes(held=storage.held + native, resident=storage.resident + native)
    held = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            held += tensor_bytes(getattr(layer, name, None))
        for name in ("conv_states", "recurrent_states"):
            held += tensor_bytes(getattr(layer, name, None))
    return KVBytes(held=held)


# --------------------------------------------------------------------------- candidates
def _peer_factory(model: Any, backend: str, nbits: int | None) -> Any:
    from transformers import QuantizedCache

    kwargs = {} if nbits is None else {"nbits": nbits}
    return lambda: QuantizedCache(backend=backend, config=model.config, **kwargs)


def build_candidates(
    model: Any,
    tiers: Sequence[str],
    peers: Sequence[str],
    *,
    tier_of: Callable[[str], Tier] = tier_named,
    attention: str | None = None,
) -> tuple[list[Candidate], list[dict]]:
    """Baseline, the chosen tiers and the chosen peers that work here; and the peers that do not.

    ``tier_of`` gives the :class:`~flashcodec.tiers.Tier` each name of ``tiers`` stands for
    (default :func:`flashcodec.tiers.tier`, the registry; a benchmark passes its own to run
    configurations outside it). ``attention`` (one of :data:`flashcodec.tiers.ATTENTIONS`) runs
    every tier with it; None keeps each tier's own. Raises CompareError (one line) when flashcodec
    cannot serve the model.
    """
    if attention is not None:
        check_attention(attention)
    from transformers import DynamicCache

    from .hf import FlashCodecCache

    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    out = [
        Candidate(
            "baseline",
            "baseline",
            f"transformers DynamicCache, uncompressed ({dtype})",
            lambda: DynamicCache(config=model.config),
        )
    ]
    for name in tiers:
        tier = tier_of(name)
        chosen = attention or tier.attention
        _probe_codec(model, name, tier.codec, "tier")
        context, details = _attention_scope(model, chosen)
        out.append(
            Candidate(
                name,
                "tier",
                f"{tier.description}; {ATTENTION_NOTES[chosen]}",
                lambda codec=tier.codec: FlashCodecCache.from_config(model.config, codec=codec),
                {"class": "flashcodec.hf.FlashCodecCache", "codec": repr(tier.codec), "attention": chosen},
                context=context,
                details=details,
            )
        )
    absent = []
    for name in peers:
        if name in CODEC_PEERS:
            out.append(_codec_peer(model, name, CODEC_PEERS[name]))
            continue
        backend, nbits = PEERS[name]
        make = _peer_factory(model, backend, nbits)
        try:
            make()
        except (
            Exception
        ) as err:  # ImportError (backend not installed), ValueError (model): recorded as absent
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            absent.append({"name": name, "kind": "peer", "reason": reason})
            continue
        bits = f"{nbits}-bit" if nbits else "per-tensor fp8"
        group = "" if nbits is None else ", q_group_size 64, residual_length 128"
        out.append(
            Candidate(
                name,
                "peer",
                f"transformers QuantizedCache(backend={backend!r}), {bits}{group}",
                make,
                {"class": "transformers.QuantizedCache", "backend": backend, "nbits": nbits},
            )
        )
    return out, absent


def _probe_codec(model: Any, name: str, codec: BlockCodec, kind: str) -> None:
    """CompareError (one line) unless a FlashCodecCache with ``codec`` codes some layer of ``model``."""
    from .hf import FlashCodecCache

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # "nothing is compressed" is an error here
            probe = FlashCodecCache.from_config(model.config, codec=codec)
    except (KVSpecError, UserWarning) as err:
        raise CompareError(
            f"--model: flashcodec cannot serve this model with {kind} {name!r}: {err}"
        ) from None
    if not probe.codec_layer_indices:
        raise CompareError(
            "--model: flashcodec cannot serve this model: it has no full-attention or sliding-window layer"
        )


def _codec_peer(model: Any, name: str, codec: TurboQuantCodec) -> Candidate:
    """A peer run as a flashcodec codec, with attention on its codes."""
    from .hf import FlashCodecCache

    _probe_codec(model, name, codec, "peer")
    context, details = _attention_scope(model, "codes")
    return Candidate(
        name,
        "peer",
        f"TurboQuant (Zandieh et al. 2025), MSE variant, reference implementation: per token and head "
        f"an fp16 norm and {codec.bits}-bit Lloyd-Max codes of the unit vector after a seeded random "
        f"rotation, keys and values; the newest tokens (under {codec.block_size}, an incomplete block) uncoded; "
        "attention on the codes (codebook values looked up per step, no decoded cache kept)",
        lambda: FlashCodecCache.from_config(model.config, codec=codec),
        {
            "class": "flashcodec.hf.FlashCodecCache",
            "codec": repr(codec),
            "attention": "codes",
            "variant": "mse (no QJL residual)",
        },
        context=context,
        details=details,
    )


#: what a tier's description gains for each attention
ATTENTION_NOTES = {
    "codes": "attention on the codes",
    "materialized": "attention on a decoded (materialized) view",
}


def _attention_scope(model: Any, attention: str) -> tuple[Any, Any]:
    """The candidate's ``(context, details)`` for ``attention``: none for a decoded view; for the
    codes, :func:`flashcodec.hf.attending_on` around each run and its counters in the row."""
    if attention == "materialized":
        return None, None
    from .hf.attention_choice import attending_on, attention_details

    stats: dict[str, Any] = {}

    @contextlib.contextmanager
    def on_codes() -> Iterator[None]:
        with attending_on(model, "codes", quiet=True) as counted:
            stats["stats"] = counted
            yield

    return on_codes, lambda: attention_details(stats["stats"])


#: ``--attention``: each tier's own (:attr:`flashcodec.tiers.Tier.attention`), or one for all
ATTENTION_CHOICES = ("tier", *ATTENTIONS)


def reject_attention_in_names(argv: Sequence[str]) -> None:
    """``KVConfigError`` for a ``--tiers`` name carrying the retired attention suffix: the message
    says to choose ``--attention`` instead (kvbench's own check would only call it unknown)."""
    args = list(argv)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--tiers" and i + 1 < len(args) else None
        if arg.startswith("--tiers="):
            value = arg.split("=", 1)[1]
        for name in (value or "").split(","):
            if name.strip().endswith(RETIRED_ATTENTION_SUFFIX):
                tier_named(name.strip())  # raises, naming the attention option


# --------------------------------------------------------------------------- command line
class FlashCodecHarness:
    """flashcodec's part of ``kvbench.cli.run_compare``: transformers models, flashcodec tiers,
    transformers' QuantizedCache peers."""

    tool = "flashcodec compare"
    #: ``--attention`` of the last :meth:`load` (the demo, which loads its own way, passes its own)
    attention = "tier"
    packages = (
        "flashcodec-kv", "kvbench", "kvcache-spec", "torch", "transformers", "numpy", "hqq", "optimum-quanto",
    )  # fmt: skip
    dtypes = tuple(_DTYPES)

    def __init__(self, registry: Mapping[str, Tier] | None = None):
        #: the tiers this harness offers: :data:`flashcodec.tiers.TIERS` unless a benchmark
        #: passes a registry of its own (configurations outside the package's)
        self.registry = TIERS if registry is None else registry

    def tier(self, name: str, attention: str | None = None) -> Tier:
        return tier_named(name, attention, registry=self.registry)

    def tiers(self) -> Mapping[str, str]:
        return {name: t.description for name, t in self.registry.items()}

    def peers(self) -> Mapping[str, str]:
        quantized = {
            name: f"transformers QuantizedCache(backend={backend!r}, nbits={nbits})"
            for name, (backend, nbits) in PEERS.items()
        }
        coded = {
            name: f"TurboQuant MSE variant, {codec.bits} bits (flashcodec reference codec, attention on the codes)"
            for name, codec in CODEC_PEERS.items()
        }
        return {**quantized, **coded}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)"
        )
        parser.add_argument(
            "--attention",
            choices=ATTENTION_CHOICES,
            default="tier",
            help="codes: every selected tier attends on its stored codes; materialized: every one on a "
            "decoded view; tier (default): each with the attention it is measured with",
        )

    def load(self, args: argparse.Namespace) -> Loaded:
        self.attention = getattr(args, "attention", self.attention)
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer, info = load_model(args.model, args.device, args.dtype)
        info["torch_threads"] = torch.get_num_threads()
        max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        return Loaded.with_tokenizer(
            TorchRunner(model, tokenizer, args.device), tokenizer, info, max_positions, model
        )

    def candidates(
        self, loaded: Loaded, tiers: Sequence[str], peers: Sequence[str], attention: str | None = None
    ):
        """Baseline, ``tiers`` and ``peers``; ``attention`` for every tier (None: ``--attention``
        as loaded, where ``tier`` keeps each tier's own)."""
        chosen = attention or (None if self.attention == "tier" else self.attention)
        return build_candidates(loaded.handle, tiers, peers, tier_of=self.tier, attention=chosen)

    def noise_floor(self, loaded: Loaded) -> Candidate:
        return noise_floor_candidate(loaded.handle)


def noise_floor_candidate(model: Any) -> Candidate:
    """The uncompressed cache with ``model`` computed in float32 during this candidate's runs:
    how far the 16-bit run's rounding alone moves the distributions."""
    from transformers import DynamicCache

    @contextlib.contextmanager
    def in_float32() -> Iterator[None]:
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        # buffers (rotary frequencies) are put back as they were, not cast twice
        buffers = {name: b for name, b in model.named_buffers()}
        model.float()
        try:
            yield
        finally:
            for name, param in model.named_parameters():
                param.data = param.data.to(dtypes[name])  # 16-bit -> float32 -> 16-bit is exact
            for name, buffer in buffers.items():
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = buffer

    return Candidate(
        "noise-floor-fp32",
        "reference",
        "transformers DynamicCache, uncompressed, the model computed in float32: the rounding noise of "
        "the 16-bit run, not a cache to choose",
        lambda: DynamicCache(config=model.config),
        {"class": "transformers.DynamicCache", "compute_dtype": "float32"},
        context=in_float32,
    )


def _compare_main(argv: Sequence[str] | None, registry: Mapping[str, Tier] | None = None) -> int:
    reject_attention_in_names(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        # transformers' deprecation notes on cache kwargs would interleave with the progress bar
        warnings.simplefilter("ignore", FutureWarning)
        return run_compare(FlashCodecHarness(registry), argv)


def main(argv: Sequence[str] | None = None, *, registry: Mapping[str, Tier] | None = None) -> int:
    """Entry point of ``flashcodec compare`` / ``python -m flashcodec.compare``; returns the exit
    code. ``registry``: the tiers offered (default :data:`flashcodec.tiers.TIERS`; a benchmark
    passes one holding its study configurations too)."""
    return run_cli(lambda args: _compare_main(args, registry), argv)


if __name__ == "__main__":
    sys.exit(main())
