"""Calibrated per-layer budgets: choose each codec layer's codec under a byte budget, from measurements.

:func:`calibrate` automates what a hand-made per-layer schedule does:

1. **Damage per (layer, candidate).** For every codec layer and every candidate codec, the model
   runs the calibration texts with that layer coded by the candidate and every other codec layer
   by png keep=1.0 (exact, so the damage is that layer's alone). Each text is a prefill of its
   first half, then one multi-token step over the second half; the damage is the mean
   KL(baseline || candidate) of the next-token distributions over that second half, the baseline
   being the model with transformers' ``DynamicCache``.
2. **Allocation.** Every layer starts at its least damaging candidate (the cheaper one on a tie);
   while the schedule's bytes exceed the budget, the move to a cheaper candidate that adds the
   least damage per byte saved is taken (greedy on the damage / bytes trade-off).
3. **Re-measurement.** Damages are not additive (on real models they compound: each layer's
   error changes what the next layer sees), so the chosen schedule is run jointly and its KL is
   reported beside the sum of the single-layer damages.

The result, :class:`Calibration`, holds the schedule (``per_layer``, ready for
:class:`~flashcodec.hf.FlashCodecCache`), the measurements, and saves to / loads from JSON.

Bytes are the codecs' storage formulas (:meth:`flashcodec.BlockCodec.storage_ratio`, archive bytes
per raw byte in the model's dtype) weighted by each layer's raw K/V bytes per token; measured bytes
come from a cache afterwards (``cache.storage_bytes()``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvspec import KVConfigError, KVDataError

from ..codecs import BlockCodec, PNGCodec, make_codec
from ..tiers import TIERS
from .cache import FlashCodecCache

__all__ = ["Calibration", "calibrate", "default_candidates"]

_FORMAT = "flashcodec-calibration-1"
#: the file written by :meth:`Calibration.save`: the data plus a sha256 of it, checked by :meth:`Calibration.load`
_FILE_FORMAT = "flashcodec-calibration-file-1"


def default_candidates() -> dict[str, BlockCodec]:
    """The codecs of every tier of :data:`flashcodec.tiers.TIERS`."""
    return {name: t.codec for name, t in TIERS.items()}


@dataclass(frozen=True)
class Calibration:
    """A calibrated per-layer schedule and the measurements behind it.

    Attributes:
        schedule: ``{layer_idx: candidate name}`` for every codec layer.
        candidates: ``{name: codec}`` the schedule draws from.
        budget: the target, archive bytes / raw bytes over the codec layers.
        ratio: the schedule's bytes / raw bytes (formula, see the module docstring), <= ``budget``.
        damage: ``{layer_idx: {candidate name: mean KL}}`` measured one layer at a time.
        predicted_kl: sum of the chosen candidates' single-layer damages.
        measured_kl: the chosen schedule's mean KL, all layers coded at once.
        tokens: scored positions per measurement.
    """

    schedule: dict[int, str]
    candidates: dict[str, BlockCodec]
    budget: float
    ratio: float
    damage: dict[int, dict[str, float]] = field(default_factory=dict)
    predicted_kl: float = math.nan
    measured_kl: float = math.nan
    tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.candidates, Mapping) or not all(
            isinstance(n, str) and isinstance(c, BlockCodec) for n, c in self.candidates.items()
        ):
            raise KVConfigError(
                f"candidates must be a dict {{name: codec object}}; got {self.candidates!r:.200}"
            )
        if not isinstance(self.schedule, Mapping) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 and isinstance(n, str)
            for i, n in self.schedule.items()
        ):
            raise KVConfigError(
                f"schedule must be a dict {{layer_idx >= 0: candidate name}}; got {self.schedule!r:.200}"
            )
        unknown = sorted({n for n in self.schedule.values() if n not in self.candidates})
        if unknown:
            raise KVConfigError(
                f"schedule names candidates {unknown} that are not in candidates {sorted(self.candidates)}"
            )
        for name in ("budget", "ratio"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
            ):
                raise KVConfigError(
                    f"{name} must be a finite number >= 0 (bytes held / raw bytes); got {value!r}"
                )
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, numbers.Integral) or self.tokens < 0:
            raise KVConfigError(f"tokens must be an integer >= 0; got {self.tokens!r}")

    @property
    def per_layer(self) -> dict[int, BlockCodec]:
        """``{layer_idx: codec}``: pass as ``FlashCodecCache.from_config(config, per_layer=...)``."""
        return {idx: self.candidates[name] for idx, name in self.schedule.items()}

    def cache(self, config: Any, **options: Any) -> FlashCodecCache:
        """A :class:`FlashCodecCache` for ``config`` with this schedule on every codec layer."""
        return FlashCodecCache.from_config(config, per_layer=self.per_layer, **options)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; :meth:`from_dict` rebuilds an equal object."""
        return {
            "format": _FORMAT,
            "schedule": {str(k): v for k, v in self.schedule.items()},
            "candidates": {name: codec.config() for name, codec in self.candidates.items()},
            "budget": self.budget,
            "ratio": self.ratio,
            "damage": {str(k): v for k, v in self.damage.items()},
            "predicted_kl": self.predicted_kl,
            "measured_kl": self.measured_kl,
            "tokens": self.tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Rebuild from :meth:`to_dict`; ``KVConfigError`` naming what is wrong otherwise."""
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise KVConfigError(f"calibration data must be a dict with format={_FORMAT!r}; got {data!r:.200}")
        try:
            candidates = {name: make_codec(**dict(cfg)) for name, cfg in data["candidates"].items()}
            schedule = {int(k): str(v) for k, v in data["schedule"].items()}
            damage = {int(k): {str(n): float(x) for n, x in v.items()} for k, v in data["damage"].items()}
            return cls(
                schedule=schedule,
                candidates=candidates,
                budget=float(data["budget"]),
                ratio=float(data["ratio"]),
                damage=damage,
                predicted_kl=float(data["predicted_kl"]),
                measured_kl=float(data["measured_kl"]),
                tokens=int(data["tokens"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # KVConfigError is a ValueError
            raise KVConfigError(f"calibration data is missing or has a bad entry: {err}") from err

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``, with a sha256 of the data that :meth:`load` checks."""
        data = self.to_dict()
        doc = {"format": _FILE_FORMAT, "sha256": _digest(data), "calibration": data}
        Path(path).write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a file written by :meth:`save`.

        ``KVDataError`` naming the file when it cannot be read, is not JSON, fails its checksum
        (edited or damaged since it was saved) or does not hold a calibration.
        """
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise KVDataError(f"calibration file {str(path)!r} cannot be read as JSON: {err}") from err
        if not isinstance(doc, dict) or doc.get("format") != _FILE_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise KVDataError(
                f"calibration file {str(path)!r} is not a {_FILE_FORMAT!r} file (Calibration.save writes "
                f"them); got format {got!r}"
            )
        data = doc.get("calibration")
        if not isinstance(data, dict) or doc.get("sha256") != _digest(data):
            raise KVDataError(
                f"calibration file {str(path)!r} fails its sha256 check: it was changed or damaged "
                "after Calibration.save wrote it"
            )
        try:
            return cls.from_dict(data)
        except KVConfigError as err:
            raise KVDataError(f"calibration file {str(path)!r}: {err}") from err


def _digest(data: Mapping[str, Any]) -> str:
    """sha256 of ``data`` as canonical JSON (sorted keys), so the digest does not depend on layout."""
    text = json.dumps(data, sort_keys=True, allow_nan=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- measuring
def _token_texts(texts: object, tokenizer: Any, max_tokens: int, block_size: int) -> list[torch.Tensor]:
    if isinstance(texts, (str, torch.Tensor)) or not isinstance(texts, Sequence) or len(texts) == 0:
        raise KVConfigError(
            f"texts must be a non-empty list of strings or 1-D token id tensors; got {type(texts).__name__}"
        )
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise KVConfigError("texts holds strings: pass tokenizer= to turn them into token ids")
            ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)
        elif isinstance(text, torch.Tensor) and text.dim() == 1 and not text.is_floating_point():
            ids = text.long()
        else:
            raise KVConfigError(f"texts[{i}] must be a string or a 1-D integer tensor; got {text!r:.80}")
        ids = ids[:max_tokens]
        if ids.numel() < 4 * block_size:
            raise KVConfigError(
                f"texts[{i}] has {ids.numel()} tokens; calibration needs at least 4 blocks "
                f"({4 * block_size} tokens) per text, so its first half archives whole blocks"
            )
        out.append(ids)
    return out


def _log_probs(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Prefill the first half into ``cache``, then one multi-token step: log-probs of the second half."""
    half = ids.shape[0] // 2
    batch = ids[None].to(model.device)
    # recent transformers 5.x name the forward's cache argument `cache` (`past_key_values` is deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(batch[:, :half], use_cache=True, logits_to_keep=1, **{name: cache})
        logits = model(batch[:, half:], use_cache=True, **{name: cache}).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _mean_kl(reference: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for ref, cand in zip(reference, got, strict=True):
        total += float((ref.exp() * (ref - cand)).sum())
        count += ref.shape[0]
    return max(0.0, total / count)


@torch.no_grad()
def calibrate(
    model: Any,
    texts: Sequence[str] | Sequence[torch.Tensor],
    *,
    budget: float,
    tokenizer: Any = None,
    candidates: Mapping[str, BlockCodec] | None = None,
    max_tokens: int = 256,
) -> Calibration:
    """Choose a codec per codec layer of ``model`` so the schedule holds at most ``budget`` of the raw bytes.

    Args:
        model: a transformers causal LM in eval mode (its config lays out the codec layers).
        texts: calibration texts, strings (with ``tokenizer``) or 1-D token id tensors; each is cut
            to ``max_tokens`` and must hold at least 4 blocks.
        budget: archive bytes / raw bytes over the codec layers, in ``(0, inf)``; a budget below
            the cheapest schedule raises ``KVConfigError`` saying what the cheapest holds.
        tokenizer: turns string texts into ids.
        candidates: ``{name: codec}`` (default: :func:`default_candidates`, the tiers' codecs); all
            must share one block size.
        max_tokens: tokens used per text.

    Returns a :class:`Calibration`. Runs ``1 + layers * len(candidates) + 1`` passes over the texts.
    """
    if (
        isinstance(budget, bool)
        or not isinstance(budget, numbers.Real)
        or not math.isfinite(budget)
        or budget <= 0
    ):
        raise KVConfigError(f"budget must be a finite number > 0 (bytes held / raw bytes); got {budget!r}")
    cands = dict(default_candidates() if candidates is None else candidates)
    if not cands or not all(isinstance(c, BlockCodec) for c in cands.values()):
        raise KVConfigError(f"candidates must be a non-empty dict of codec objects; got {candidates!r}")
    sizes = {c.block_size for c in cands.values()}
    if len(sizes) != 1:
        raise KVConfigError(f"candidates must share one block size; got block sizes {sorted(sizes)}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
        raise KVConfigError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    block = sizes.pop()
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise KVConfigError(
            f"model must be a transformers causal LM (a torch.nn.Module with .config); got {type(model).__name__}"
        )
    ids = _token_texts(texts, tokenizer, int(max_tokens), block)
    config = model.config
    exact = PNGCodec(block, keep_ratio=1.0)
    layers = FlashCodecCache.from_config(config, codec=exact).codec_layer_indices
    if not layers:
        raise KVConfigError("the model has no full-attention layer: there is nothing to calibrate")
    text_config = config.get_text_config(decoder=True)
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    dtype = next(model.parameters()).dtype
    cost = {name: c.storage_ratio(head_dim, dtype) for name, c in cands.items()}

    from transformers import DynamicCache

    reference = [_log_probs(model, t, DynamicCache(config=config)) for t in ids]

    def run(per_layer: dict[int, BlockCodec]) -> float:
        got = [
            _log_probs(model, t, FlashCodecCache.from_config(config, codec=exact, per_layer=per_layer))
            for t in ids
        ]
        return _mean_kl(reference, got)

    damage = {idx: {name: run({idx: codec}) for name, codec in cands.items()} for idx in layers}

    # start from the least damaging candidate per layer (cheaper on ties), then trade damage for bytes
    order = sorted(cands, key=lambda n: cost[n])
    choice = {idx: min(order, key=lambda n: (damage[idx][n], cost[n])) for idx in layers}

    def ratio() -> float:
        return sum(cost[choice[i]] for i in layers) / len(layers)

    while ratio() > budget + 1e-12:
        best = None
        for idx in layers:
            here = choice[idx]
            for name in order:
                saved = cost[here] - cost[name]
                if saved <= 0:
                    continue
                rate = (damage[idx][name] - damage[idx][here]) / saved
                if best is None or rate < best[0]:
                    best = (rate, idx, name)
        if best is None:
            raise KVConfigError(
                f"budget={budget!r} cannot be met: the cheapest schedule holds {ratio():.4f} of the raw bytes "
                f"with these candidates ({', '.join(f'{n}: {cost[n]:.4f}' for n in order)})"
            )
        choice[best[1]] = best[2]

    schedule = dict(sorted(choice.items()))
    measured = run({idx: cands[name] for idx, name in schedule.items()})
    return Calibration(
        schedule=schedule,
        candidates=cands,
        budget=float(budget),
        ratio=ratio(),
        damage=damage,
        predicted_kl=sum(damage[i][schedule[i]] for i in layers),
        measured_kl=measured,
        tokens=sum(t.shape[0] - t.shape[0] // 2 for t in ids),
    )
