"""PaluKVCache: an mlx-lm cache layer that stores keys and values as low-rank latent codes.

Its projections and coders come from a **projection source** (:mod:`palu_mlx.projection_source`):
fitted at the prefill (:class:`~palu_mlx.projection_source.FitAtPrefill`, the life below), or
fixed from the first token by a calibration file
(:class:`~palu_mlx.projection_source.FromCalibration`: :class:`~palu_mlx.calibrated.CalibratedKVCache`
is this class with that source). Everything after the projections exist is the same code.

Life of a layer's cache fitted at the prefill:

1. **Exact phase.** Tokens are kept exactly (input dtype, ``[B, H, S, D]``) until
   ``palu_min_fit_tokens`` have arrived (default: the head dim ``D``). A one-token or
   short prompt therefore never fixes a degenerate projection.
2. **Fit.** On the call that reaches that count, group-head projections are
   fitted on every token held (keys and values separately), all held tokens are
   projected and coded (with a bit budget: water-filled widths and fixed Gaussian-step
   quantizers, :mod:`palu_mlx.coders.fixed`; with the reference's hi/lo split: the
   mixed-bit coder of :mod:`palu_mlx.mixed_bit`), and the exact buffers are dropped. This happens once:
   later prefill chunks (``S > 1``) and decode steps are projected into the
   stored projections, never refit.
3. **Latent phase.** The cache holds packed latent codes ``[B, H, S, ·]``, the
   projections and means, and the first ``palu_sink_tokens`` and newest
   ``palu_recent_tokens`` tokens exactly (:mod:`palu_mlx.sinks`). Full K/V are reconstructed (``L V_gᵀ + μ_g``) for
   each attention call and not kept.

Buffers grow in steps of :attr:`step` tokens (as mlx-lm's ``KVCache``): one
O(S) copy per ``step`` tokens, none per decoded token.

**Pre-RoPE keys.** Given a :class:`~palu_mlx.rope.Rotary` (``KVCacheBuilder.for_model``
passes one for the architectures that support it), the cache takes the rotated keys it
receives back to before RoPE (at their positions ``offset + i``), fits and codes those, and
rotates the reconstructed keys at positions ``0 .. offset-1`` for attention. Before the fit the
exact rotated keys are held as given. Positions are the token indices of the cache, so
chunked prefill, ``trim`` and save / load keep them right.

The class deliberately has no ``bits`` attribute: mlx-lm sends any cache with
one to its quantized attention, which expects ``mx.quantize`` tuples.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import mlx.core as mx
from kvspec import KVConfigError, KVDataError

from .attention import LatentStore, PackedRows
from .coders.base import Fitted, LatentCoder
from .coders.fixed import FixedQuantCoder
from .config import KVCacheConfig
from .distributed import HeadShard
from .layer import CacheLayer, detached, write_rows
from .lowrank import GroupProjection, PackedProjection, as_projection, project, reconstruct
from .mixed_bit import BitAllocationPolicy
from .projection_source import CODED_WITH, FitAtPrefill, ProjectionSource, SavedState
from .rope import Rotary
from .sinks import ExactPrefix, RecentWindow, read_recent
from .state_checks import StateArrays, parse_meta_state, read_config, read_runtime, split_state, with_meta

__all__ = ["PaluKVCache", "CODED_WITH"]

PREFIXES = ("key", "value")


class PaluKVCache(CacheLayer):
    """One attention layer's palu cache (mlx-lm cache interface and :class:`kvspec.KVCacheLayer`).

    Args:
        config: a :class:`KVCacheConfig` with ``method="palu"``.
        allocation_policy: None (the default): the config's coder (``config.coder_choice``,
            :mod:`palu_mlx.coders`) fits and codes the latents. A
            :class:`~palu_mlx.mixed_bit.BitAllocationPolicy` instead: the mixed-bit coder with the
            widths it allocates. Value latents stay unquantized when ``palu_quantize_values`` is False.
        rotary: the layer's RoPE as a :class:`~palu_mlx.rope.Rotary`: keys arrive rotated at
            positions ``offset + i`` and are coded before RoPE (the pre-RoPE path). None codes
            the keys as given.
        shard: under tensor parallel, this rank's :class:`~palu_mlx.distributed.HeadShard`: the fit
            decides what spans heads (water-filling widths, an energy rank, a policy's allocation)
            on every rank's statistics, so the codec is one process's. None: a whole model.

    These build the projection source :class:`~palu_mlx.projection_source.FitAtPrefill`
    (:attr:`source`); :class:`~palu_mlx.calibrated.CalibratedKVCache` builds the same cache on a
    calibration's. ``trim`` keeps the projections: trimming back below the fit point does not refit.
    """

    #: the source whose state layout :meth:`from_state` reads (a subclass names its own)
    _source_type: type = FitAtPrefill

    def __init__(
        self,
        config: KVCacheConfig,
        allocation_policy: BitAllocationPolicy | None = None,
        rotary: Rotary | None = None,
        shard: HeadShard | None = None,
    ):
        self._check_config(config)
        self._setup(config, FitAtPrefill(config, allocation_policy, shard), rotary)

    @staticmethod
    def _check_config(config: KVCacheConfig) -> None:
        if not isinstance(config, KVCacheConfig):
            raise KVConfigError(f"config must be a KVCacheConfig; got {type(config).__name__}")
        if config.method != "palu":
            raise KVConfigError(f"PaluKVCache needs config.method='palu'; got {config.method!r}")

    def _setup(self, config: KVCacheConfig, source: ProjectionSource, rotary: Rotary | None) -> None:
        """The one initialiser behind every constructor: ``config`` already checked, ``source`` built."""
        if rotary is not None and not isinstance(rotary, Rotary):
            raise KVConfigError(f"rotary must be a palu_mlx.rope.Rotary or None; got {type(rotary).__name__}")
        super().__init__()
        self.config = config
        self.source = source
        self.rotary = rotary
        self.shard = getattr(source, "shard", None)
        self.allocation_policy = getattr(source, "allocation_policy", None)
        self._exact_keys: mx.array | None = None
        self._exact_values: mx.array | None = None
        initial = source.initial()
        (self._key_proj, self._key_coder), (self._value_proj, self._value_coder) = initial or (
            (None, None),
            (None, None),
        )
        self._key_codes: dict[str, mx.array] | None = None
        self._value_codes: dict[str, mx.array] | None = None
        self._sinks = ExactPrefix(config.palu_sink_tokens)
        self._recent = RecentWindow(config.palu_recent_tokens, bits=config.palu_recent_bits)

    # ------------------------------------------------------------------ validation
    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped."""
        n = super().trim(n)
        self._recent = self._recent.cut(self.offset)  # no stale exact rows held
        return n

    def _check_dims(self, h: int, d: int, dv: int) -> None:
        self.source.check_dims(h, d, dv, self.rotary)

    # ------------------------------------------------------------------ update
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]`` (fp16 / bf16 / fp32).

        Returns the keys ``[B, H, offset, D]`` and values ``[B, H, offset, Dv]`` held
        so far in the input dtype: exact before the fit, reconstructed from the
        latent codes after it. A call that raises leaves the cache unchanged.
        """
        b, h, _, d, dv = self._validate(keys, values, self.config.palu_check_finite)
        prev = self.offset
        end = prev + keys.shape[2]
        if self._key_proj is None:
            exact_keys = write_rows(self._exact_keys, keys, prev, self.step)
            exact_values = write_rows(self._exact_values, values, prev, self.step)
            if end >= self.source.fit_tokens(d):
                self._fit(self._pre_rope(exact_keys[..., :end, :], 0), exact_values[..., :end, :], keys.dtype)
                self._sinks = ExactPrefix(self.config.palu_sink_tokens).write(
                    exact_keys[..., :end, :], exact_values[..., :end, :], 0
                )
                self._recent = RecentWindow(
                    self.config.palu_recent_tokens, bits=self.config.palu_recent_bits
                ).write(exact_keys[..., :end, :], exact_values[..., :end, :], 0)
                self._exact_keys = self._exact_values = None
            else:
                self._exact_keys, self._exact_values = exact_keys, exact_values
        else:
            # both written before either is kept: a failure on the values leaves the keys as they were
            key_codes = self._append_codes(
                self._key_codes, self._key_coder, self._key_proj, self._pre_rope(keys, prev), prev
            )
            value_codes = self._append_codes(
                self._value_codes, self._value_coder, self._value_proj, values, prev
            )
            sinks = self._sinks.write(keys, values, prev)
            recent = self._recent.write(keys, values, prev)
            self._key_codes, self._value_codes = key_codes, value_codes
            self._sinks, self._recent = sinks, recent
        self._shape, self._dtype = (b, h, d, dv), keys.dtype
        self.offset = end
        return self._fetch()

    def _pre_rope(self, keys: mx.array, offset: int) -> mx.array:
        """Keys rotated at ``offset + i`` -> the keys before RoPE (float32); as given without a rotary."""
        return keys if self.rotary is None else self.rotary.unrotate(keys, offset)

    def _append_codes(
        self,
        buffers: dict[str, mx.array] | None,
        coder: LatentCoder,
        projection: GroupProjection | PackedProjection,
        x: mx.array,
        prev: int,
    ) -> dict[str, mx.array]:
        coded = coder.encode_fields(project(x, projection))
        held = buffers or {}
        return {name: write_rows(held.get(name), arr, prev, self.step) for name, arr in coded.items()}

    def _fit(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> None:
        """Fit projections on every held token, code them all, and switch to the latent phase."""
        (key_proj, key_coder), (value_proj, value_coder) = self.source.fit(keys, values, dtype)
        key_codes = self._append_codes(None, key_coder, key_proj, keys, 0)
        value_codes = self._append_codes(None, value_coder, value_proj, values, 0)
        self._key_codes, self._value_codes = key_codes, value_codes
        self._key_proj, self._value_proj = key_proj, value_proj
        self._key_coder, self._value_coder = key_coder, value_coder

    def _fetch(self) -> tuple[mx.array, mx.array]:
        n = self.offset
        if self._key_proj is None:
            # copies: a view of the exact buffers would let a caller's write change the cache
            return detached(self._exact_keys[..., :n, :]), detached(self._exact_values[..., :n, :])
        if self.rotary is None:
            keys = self._reconstruct(self._key_codes, self._key_coder, self._key_proj, n)
        else:
            latents = self._key_coder.decode_fields(
                {name: buf[..., :n, :] for name, buf in self._key_codes.items()}
            )
            keys = self.rotary.rotate(reconstruct(latents, self._key_proj, mx.float32), 0).astype(self._dtype)
        values = self._reconstruct(self._value_codes, self._value_coder, self._value_proj, n)
        sinks, m = self._sinks, self._sinks.count(n)
        keys = self._recent.overlay(sinks.overlay(keys, sinks.keys, n), 0, n, m)
        values = self._recent.overlay(sinks.overlay(values, sinks.values, n), 1, n, m)
        return keys, values

    def latent_store(self) -> LatentStore | None:
        """The latent codes for :func:`~palu_mlx.attention.latent_attention`; None before the first code."""
        if self._key_codes is None:
            return None

        def latents(buffers: dict[str, mx.array], coder: LatentCoder) -> Callable[[int, int], mx.array]:
            return lambda start, stop: coder.decode_fields(
                {k: b[..., start:stop, :] for k, b in buffers.items()}
            )

        m = self._sinks.count(self.offset)
        lo, hi = self._recent.span(self.offset, m)
        recent = self._recent.rows(lo, hi) if lo < hi else (None, None)
        return LatentStore(
            heads=self._shape[1],
            length=self.offset,
            key_latents=latents(self._key_codes, self._key_coder),
            key_projection=as_projection(self._key_proj),
            rotary=self.rotary,
            value_latents=latents(self._value_codes, self._value_coder),
            value_projection=as_projection(self._value_proj),
            exact_keys=self._sinks.keys[..., :m, :] if m else None,
            exact_values=self._sinks.values[..., :m, :] if m else None,
            recent_keys=recent[0],
            recent_values=recent[1],
            recent_start=lo if lo < hi else None,
            packed_keys=_packed_rows(self._key_codes, self._key_coder),
            packed_values=_packed_rows(self._value_codes, self._value_coder),
        )

    def _reconstruct(
        self, buffers, coder: LatentCoder, projection: GroupProjection | PackedProjection, n: int
    ) -> mx.array:
        latents = coder.decode_fields({name: buf[..., :n, :] for name, buf in buffers.items()})
        return reconstruct(latents, projection, self._dtype)

    # ------------------------------------------------------------------ state
    @property
    def fitted(self) -> bool:
        """Whether the projections exist (the cache holds latents, not exact tokens): from the first
        token with a calibration, from the fit otherwise."""
        return self._key_proj is not None

    @property
    def state(self) -> dict[str, mx.array]:
        """Every array needed to rebuild the cache, cut to ``offset`` tokens, and ``meta_state``
        (the :attr:`meta_state` and a checksum, as one ``uint8`` array: :func:`from_state` needs nothing
        else, which is how mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache`` round-trip it).

        Before the fit: ``exact_keys``, ``exact_values``. After: ``key.basis``,
        ``key.mean``, ``key.singular_values`` and the codes: ``key.seg<i>.<field>`` (mixed-bit
        coder) or ``key.codes`` and ``key.steps`` (fixed quantizers); likewise ``value.*``.
        With ``palu_sink_tokens`` (after the fit) also ``sink.keys`` / ``sink.values``, the first
        ``min(palu_sink_tokens, offset)`` tokens as given.
        On the pre-RoPE path also ``rope.inv_freq`` (even when empty). Copies: writing into
        them (or into numpy views of them) cannot change the cache.
        """
        return with_meta(type(self).__name__, self._state_arrays(), self.meta_state)

    def _state_arrays(self) -> dict[str, mx.array]:
        n = self.offset
        rope = {} if self.rotary is None else {"rope.inv_freq": self.rotary.inv_freq}
        if self._key_proj is None:
            out = dict(rope)
            if self._shape is not None:
                out["exact_keys"] = self._exact_keys[..., :n, :]
                out["exact_values"] = self._exact_values[..., :n, :]
            return {k: detached(v) for k, v in out.items()}
        consts, codes = {}, {}
        for prefix, proj, coder, buffers in self._tensors():
            consts[prefix] = {f"{prefix}.{k}": a for k, a in self.source.saved_arrays(proj, coder).items()}
            codes[prefix] = {f"{prefix}.{k}": a[..., :n, :] for k, a in (buffers or {}).items()}
        if self.source.per_model:
            # the model's constants first, then the sequence's codes (the calibrated layout)
            out = {**consts["key"], **consts["value"], **rope, **codes["key"], **codes["value"]}
        else:
            out = {**rope, **consts["key"], **codes["key"], **consts["value"], **codes["value"]}
        m = self._sinks.count(n)
        if m:
            out["sink.keys"] = self._sinks.keys[..., :m, :]
            out["sink.values"] = self._sinks.values[..., :m, :]
        out.update(self._recent.state(n)[0])
        return {k: detached(v) for k, v in out.items()}

    def _fitted(self) -> tuple[Fitted, Fitted]:
        return (self._key_proj, self._key_coder), (self._value_proj, self._value_coder)

    def _tensors(
        self,
    ) -> tuple[tuple[str, GroupProjection | PackedProjection, LatentCoder, dict[str, mx.array] | None], ...]:
        return (
            ("key", self._key_proj, self._key_coder, self._key_codes),
            ("value", self._value_proj, self._value_coder, self._value_codes),
        )

    @property
    def meta_state(self) -> tuple[str, str]:
        """``(config JSON, runtime JSON)``: offset, shape, dtype, the RoPE and the source's coder
        fields: fitted at the prefill, the segment layouts and, once fitted, the config fields the
        codes were made with (``coded_with``, checked by :meth:`from_state`); calibrated, the widths."""
        runtime = {
            **self._runtime(),
            **self.source.meta(self._key_coder, self._value_coder),
            "rope": None if self.rotary is None else self.rotary.to_meta(),
        }
        if self._key_proj is not None and self.config.palu_recent_tokens:
            runtime["recent_start"] = self._recent.state(self.offset)[1]
        return self.config.to_json(), json.dumps(runtime, sort_keys=True)

    @classmethod
    def from_state(
        cls,
        state: dict[str, mx.array],
        meta_state: tuple[str, str] | list[str] | None = None,
        allocation_policy: BitAllocationPolicy | None = None,
    ) -> PaluKVCache:
        """Rebuild a cache from :attr:`state` and :attr:`meta_state` (bitwise the same arrays).

        ``meta_state=None`` (mlx-lm's ``load_prompt_cache`` passes only the state) reads it from the
        state's ``meta_state`` array and checks the state against its checksum.

        Every metadata field and every array is checked first (segment layouts or widths, offset,
        names, shapes, dtypes, finite values, positive steps): a mismatch raises ``KVDataError``
        naming it. The config must name every field, and a fitted state's config must agree with
        ``coded_with`` on every field its codes depend on (:data:`CODED_WITH`): a config edited
        after the fit would read the codes as something they are not.
        """
        owner = f"{cls.__name__}.from_state"
        state, meta_state = split_state(state, meta_state, cls.__name__, owner)
        settings, runtime = parse_meta_state(meta_state, owner)
        offset, shape, dtype = read_runtime(runtime, cls.__name__, owner)
        config = read_config(settings, owner)
        saved = SavedState(config, runtime, StateArrays(state, owner), shape, dtype, owner)
        read = cls._source_type.read_state(saved, allocation_policy)
        arrays = saved.arrays
        cache = cls.__new__(cls)
        try:
            cls._check_config(config)
            cache._setup(config, read.source, read.rotary)
        except KVConfigError as exc:
            raise KVDataError(f"{owner}: meta_state config: {exc}") from None
        if shape is None:
            arrays.finish()
            return cache
        b, h, d, dv = shape
        if read.fitted is None:
            exact = [
                arrays.take(f"exact_{p}", (b, h, offset, w), dtype) for p, w in (("keys", d), ("values", dv))
            ]
            arrays.finish()
            cache._exact_keys, cache._exact_values = (write_rows(None, x, 0, cls.step) for x in exact)
        else:
            codes = [
                {
                    name: arrays.take(f"{prefix}.{name}", (b, h, offset, width), field_dtype)
                    for name, (width, field_dtype) in coder.field_widths().items()
                }
                for prefix, (_, coder) in zip(PREFIXES, read.fitted, strict=True)
            ]
            m = min(config.palu_sink_tokens, offset)
            sink = (
                [arrays.take(f"sink.{p}", (b, h, m, w), dtype) for p, w in (("keys", d), ("values", dv))]
                if m
                else None
            )
            recent = read_recent(
                arrays,
                runtime,
                config.palu_recent_tokens,
                shape,
                offset,
                dtype,
                owner,
                config.palu_recent_bits,
            )
            arrays.finish()
            cache._recent = recent
            if sink is not None:
                cache._sinks = cache._sinks.write(detached(sink[0]), detached(sink[1]), 0)
            (cache._key_proj, cache._key_coder), (cache._value_proj, cache._value_coder) = read.fitted
            cache._key_codes, cache._value_codes = (
                {k: write_rows(None, v, 0, cls.step) for k, v in held.items()} for held in codes
            )
        cache._shape, cache._dtype, cache.offset = shape, dtype, offset
        return cache

    # ------------------------------------------------------------------ measured storage
    def _held(self, which: str) -> list[mx.array]:
        """The arrays held for keys or values: exact tokens or codes, and the projections unless they
        are the model's (``constant_nbytes``)."""
        exact, proj, coder, codes = (
            (self._exact_keys, self._key_proj, self._key_coder, self._key_codes)
            if which == "key"
            else (self._exact_values, self._value_proj, self._value_coder, self._value_codes)
        )
        out = [] if exact is None else [exact]
        own = not self.source.per_model
        if own and which == "key" and self.rotary is not None and self._shape is not None:
            out.append(self.rotary.inv_freq)
        if proj is not None:
            if own:
                out += list(proj.arrays().values())
                out += list(coder.constants().values())
            out += self._sinks.tensor_arrays(which) + self._recent.tensor_arrays(which)
        out += list((codes or {}).values())
        return out

    def held_arrays(self) -> list[mx.array]:
        """Every per-sequence array the cache holds (buffers at their full grown capacity); ``nbytes``
        sums these. A calibration's projections are the model's: :attr:`constant_nbytes`."""
        return self._held("key") + self._held("value")

    @property
    def compressed_key_bytes(self) -> int:
        """Bytes held for keys: codes, scales, biases (or exact pre-fit keys), basis, mean, singular values."""
        return sum(a.nbytes for a in self._held("key"))

    @property
    def compressed_value_bytes(self) -> int:
        """Bytes held for values, counted like :attr:`compressed_key_bytes`."""
        return sum(a.nbytes for a in self._held("value"))

    @property
    def nbytes(self) -> int:
        """Bytes of every per-sequence array held (buffers at their full grown capacity)."""
        return sum(a.nbytes for a in self.held_arrays())

    @property
    def constant_nbytes(self) -> int:
        """Bytes of the model's constants this layer codes with (a calibration's bases, means, steps),
        shared by every sequence; 0 when the projections are fitted per sequence (in ``nbytes``)."""
        if not self.source.per_model:
            return 0
        return sum(
            a.nbytes
            for _, proj, coder, _ in self._tensors()
            for a in self.source.saved_arrays(proj, coder).values()
        )

    @property
    def fp16_key_bytes(self) -> int:
        """Bytes the same keys would take as fp16 (``B*H*offset*D*2``, a formula)."""
        return 2 * self._elements()[0]

    @property
    def fp16_value_bytes(self) -> int:
        """Bytes the same values would take as fp16 (``B*H*offset*Dv*2``, a formula)."""
        return 2 * self._elements()[1]

    @property
    def key_rank(self) -> int | None:
        return None if self._key_proj is None else self._key_proj.rank

    @property
    def value_rank(self) -> int | None:
        return None if self._value_proj is None else self._value_proj.rank

    @property
    def assigned_avg_bits(self) -> float:
        """Assigned code bits per original element, the larger of keys and values (a formula).

        ``(r / D) * mean assigned bits per latent channel`` per tensor, without
        scale/bias or projection overhead (``storage_stats().bits_per_element``
        is the measured rate). Before the fit: the input dtype's bit width.
        """
        if self._shape is None:
            return float("nan")
        if self._key_proj is None:
            return float(8 * self._dtype.size)
        _, _, d, dv = self._shape
        key_rate = self._key_coder.rank / d * self._key_coder.assigned_avg_bits
        value_rate = self._value_coder.rank / dv * self._value_coder.assigned_avg_bits
        return max(key_rate, value_rate)

    def __repr__(self) -> str:
        fitted = None if self._key_proj is None else self._fitted()
        ranks = self.source.describe(fitted)
        rope = ", pre-RoPE keys" if self.rotary is not None else ""
        return f"{type(self).__name__}(offset={self.offset}, {ranks}{rope})"


def _packed_rows(buffers: dict[str, mx.array], coder: LatentCoder) -> PackedRows | None:
    """The codes of fixed quantizers as attention unpacks them itself; None for other coders."""
    if not isinstance(coder, FixedQuantCoder):
        return None
    return PackedRows(buffers["codes"], coder.widths, coder.steps, coder.token_scale, coder.scale_bits)
