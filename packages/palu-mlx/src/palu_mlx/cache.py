"""PaluKVCache: an mlx-lm cache layer that stores keys and values as low-rank latent codes.

Life of a layer's cache:

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
from kvspec import KVConfigError, KVDataError, KVShapeError

from .attention import LatentStore, PackedRows
from .coders.base import LatentCoder, compact_dtype, projection_dtype
from .coders.fixed import FixedQuantCoder
from .coders.hilo import fit_mixed_bit
from .config import KVCacheConfig
from .distributed import HeadShard
from .layer import CacheLayer, detached, write_rows
from .lowrank import GroupProjection, project, reconstruct
from .mixed_bit import BitAllocationPolicy, MixedBitCoder, check_policy
from .rope import Rotary
from .sinks import ExactPrefix, RecentWindow, read_recent
from .state_checks import (
    StateArrays,
    parse_meta_state,
    read_config,
    read_field,
    read_rope,
    read_runtime,
    read_segments,
    read_widths,
    split_state,
    with_meta,
)

__all__ = ["PaluKVCache"]


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

    ``trim`` keeps the fitted projections: trimming back below the fit point does not refit.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        allocation_policy: BitAllocationPolicy | None = None,
        rotary: Rotary | None = None,
        shard: HeadShard | None = None,
    ):
        if not isinstance(config, KVCacheConfig):
            raise KVConfigError(f"config must be a KVCacheConfig; got {type(config).__name__}")
        if config.method != "palu":
            raise KVConfigError(f"PaluKVCache needs config.method='palu'; got {config.method!r}")
        if config.palu_calibration is not None:
            raise KVConfigError(
                f"palu_calibration={config.palu_calibration!r}: calibrated caches are built per model "
                "by KVCacheBuilder.for_model (CalibratedKVCache), not by PaluKVCache"
            )
        check_policy(allocation_policy)
        if rotary is not None and not isinstance(rotary, Rotary):
            raise KVConfigError(f"rotary must be a palu_mlx.rope.Rotary or None; got {type(rotary).__name__}")
        if shard is not None and not isinstance(shard, HeadShard):
            raise KVConfigError(
                f"shard must be a palu_mlx.distributed.HeadShard or None; got {type(shard).__name__}"
            )
        if shard is not None and config.palu_n_head_groups is not None:
            raise KVConfigError(
                f"palu_n_head_groups={config.palu_n_head_groups} under tensor parallel: each rank fits its "
                "own heads; allowed: None (one group per KV head)"
            )
        super().__init__()
        self.config = config
        self.rotary = rotary
        self.shard = shard
        self.allocation_policy = allocation_policy
        self._exact_keys: mx.array | None = None
        self._exact_values: mx.array | None = None
        self._key_proj: GroupProjection | None = None
        self._value_proj: GroupProjection | None = None
        self._key_coder: LatentCoder | None = None
        self._value_coder: LatentCoder | None = None
        self._key_codes: dict[str, mx.array] | None = None
        self._value_codes: dict[str, mx.array] | None = None
        self._sinks = ExactPrefix(config.palu_sink_tokens)
        self._recent = RecentWindow(config.palu_recent_tokens)

    # ------------------------------------------------------------------ validation
    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped."""
        n = super().trim(n)
        self._recent = self._recent.cut(self.offset)  # no stale exact rows held
        return n

    def _check_dims(self, h: int, d: int, dv: int) -> None:
        if self.config.head_dim is not None and d != self.config.head_dim:
            raise KVShapeError(f"keys head dim {d} does not match config head_dim={self.config.head_dim}")
        if self.shard is not None and h != self.shard.heads:
            raise KVShapeError(f"keys have {h} heads; this rank's shard holds {self.shard.heads}")
        if h % self.config.head_groups(h) != 0:
            raise KVConfigError(
                f"palu_n_head_groups={self.config.palu_n_head_groups} must divide the key/value head "
                f"count {h}; allowed: a divisor of {h}"
            )
        if self.rotary is not None and self.rotary.dims > d:
            raise KVShapeError(f"keys head dim {d} is smaller than the RoPE dims {self.rotary.dims}")
        if self.config.palu_rank is not None and self.config.palu_rank > min(d, dv):
            raise KVConfigError(
                f"palu_rank={self.config.palu_rank} exceeds the head dims (keys {d}, values {dv}); "
                f"allowed: 1..{min(d, dv)}"
            )

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
            if end >= self.config.min_fit_tokens(d):
                self._fit(self._pre_rope(exact_keys[..., :end, :], 0), exact_values[..., :end, :], keys.dtype)
                self._sinks = ExactPrefix(self.config.palu_sink_tokens).write(
                    exact_keys[..., :end, :], exact_values[..., :end, :], 0
                )
                self._recent = RecentWindow(self.config.palu_recent_tokens).write(
                    exact_keys[..., :end, :], exact_values[..., :end, :], 0
                )
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
        projection: GroupProjection,
        x: mx.array,
        prev: int,
    ) -> dict[str, mx.array]:
        coded = coder.encode_fields(project(x, projection))
        held = buffers or {}
        return {name: write_rows(held.get(name), arr, prev, self.step) for name, arr in coded.items()}

    def _fit(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> None:
        """Fit projections on every held token, code them all, and switch to the latent phase."""
        cfg = self.config
        knobs = dict(
            groups=cfg.head_groups(keys.shape[1]),
            rank=cfg.palu_rank,
            energy_threshold=cfg.energy_threshold,
            group_size=cfg.palu_group_size,
            quantize_values=cfg.palu_quantize_values,
            dtype=dtype,
            gather=None if self.shard is None else self.shard.gather,
        )
        if self.allocation_policy is None:
            (key_proj, key_coder), (value_proj, value_coder) = cfg.coder_choice.fit(keys, values, **knobs)
        else:
            (key_proj, key_coder), (value_proj, value_coder) = fit_mixed_bit(
                keys, values, self.allocation_policy, **knobs
            )
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
        """The latent codes for :func:`~palu_mlx.attention.latent_attention`; None before the fit."""
        if self._key_proj is None:
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
            key_projection=self._key_proj,
            rotary=self.rotary,
            value_latents=latents(self._value_codes, self._value_coder),
            value_projection=self._value_proj,
            exact_keys=self._sinks.keys[..., :m, :] if m else None,
            exact_values=self._sinks.values[..., :m, :] if m else None,
            recent_keys=recent[0],
            recent_values=recent[1],
            recent_start=lo if lo < hi else None,
            packed_keys=_packed_rows(self._key_codes, self._key_coder),
            packed_values=_packed_rows(self._value_codes, self._value_coder),
        )

    def _reconstruct(self, buffers, coder: LatentCoder, projection: GroupProjection, n: int) -> mx.array:
        latents = coder.decode_fields({name: buf[..., :n, :] for name, buf in buffers.items()})
        return reconstruct(latents, projection, self._dtype)

    # ------------------------------------------------------------------ state
    @property
    def fitted(self) -> bool:
        """Whether the projections have been fitted (the cache holds latents, not exact tokens)."""
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
        out: dict[str, mx.array] = {}
        if self.rotary is not None:
            out["rope.inv_freq"] = self.rotary.inv_freq
        if self._shape is None:
            return {k: detached(v) for k, v in out.items()}
        if self._key_proj is None:
            out["exact_keys"] = self._exact_keys[..., :n, :]
            out["exact_values"] = self._exact_values[..., :n, :]
            return {k: detached(v) for k, v in out.items()}
        for prefix, proj, codes in (
            ("key", self._key_proj, self._key_codes),
            ("value", self._value_proj, self._value_codes),
        ):
            for name, arr in proj.arrays().items():
                out[f"{prefix}.{name}"] = arr
            coder = self._key_coder if prefix == "key" else self._value_coder
            for name, arr in coder.constants().items():
                out[f"{prefix}.{name}"] = arr
            for name, arr in codes.items():
                out[f"{prefix}.{name}"] = arr[..., :n, :]
        m = self._sinks.count(n)
        if m:
            out["sink.keys"] = self._sinks.keys[..., :m, :]
            out["sink.values"] = self._sinks.values[..., :m, :]
        out.update(self._recent.state(n)[0])
        return {k: detached(v) for k, v in out.items()}

    @property
    def meta_state(self) -> tuple[str, str]:
        """``(config JSON, runtime JSON)``: offset, shape, dtype, the segment layouts and, once fitted,
        the config fields the codes were made with (``coded_with``, checked by :meth:`from_state`)."""
        runtime = {
            **self._runtime(),
            "key_segments": _segments_to_list(self._key_coder),
            "value_segments": _segments_to_list(self._value_coder),
            "key_fixed_widths": _fixed_widths(self._key_coder),
            "value_fixed_widths": _fixed_widths(self._value_coder),
            "rope": None if self.rotary is None else self.rotary.to_meta(),
            "coded_with": None if self._key_proj is None else _coded_with(self.config),
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

        Every metadata field and every array is checked first (segment layouts, offset, names,
        shapes, dtypes, finite values): a mismatch raises ``KVDataError`` naming it. The config must
        name every field, and a fitted state's config must agree with ``coded_with`` on every
        field its codes depend on (:data:`CODED_WITH`): a config edited after the fit would read
        the codes as something they are not.
        """
        owner = f"{cls.__name__}.from_state"
        state, meta_state = split_state(state, meta_state, cls.__name__, owner)
        settings, runtime = parse_meta_state(meta_state, owner)
        offset, shape, dtype = read_runtime(runtime, cls.__name__, owner)
        config = read_config(settings, owner)
        if allocation_policy is not None and not isinstance(allocation_policy, BitAllocationPolicy):
            raise KVConfigError(
                f"allocation_policy must be a BitAllocationPolicy (with .allocate) or None; "
                f"got {type(allocation_policy).__name__}"
            )
        arrays = StateArrays(state, owner)
        layout = {
            name: read_field(runtime, name, owner)
            for name in ("rope", "key_segments", "value_segments", "key_fixed_widths", "value_fixed_widths")
        }
        rope = read_rope(layout["rope"], shape[2] if shape else config.head_dim, owner)
        rotary = None
        if rope is not None:
            inv_freq = arrays.take("rope.inv_freq", (rope[0] // 2,), mx.float32)
            rotary = Rotary(detached(inv_freq), *rope)
        try:
            cache = cls(config, allocation_policy, rotary)
        except KVConfigError as exc:
            raise KVDataError(f"{owner}: meta_state config: {exc}") from None
        fitted = layout["key_segments"] is not None
        if shape is None and any(layout[k] is not None for k in layout if k != "rope"):
            raise KVDataError(
                f"{owner}: meta_state of an empty cache must have null segments and fixed widths"
            )
        if fitted != (layout["value_segments"] is not None) or (
            not fitted
            and (layout["key_fixed_widths"] is not None or layout["value_fixed_widths"] is not None)
        ):
            raise KVDataError(
                f"{owner}: meta_state key_segments and value_segments must be both null (before the fit) or both "
                "set, and fixed widths need segments"
            )
        _check_coded_with(read_field(runtime, "coded_with", owner), config, fitted, owner)
        if shape is None:
            arrays.finish()
            return cache
        b, h, d, dv = shape
        try:
            cache._check_dims(h, d, dv)
        except (KVConfigError, KVShapeError) as exc:
            raise KVDataError(f"{owner}: meta_state shape {list(shape)}: {exc}") from None
        if not fitted:
            exact = [
                arrays.take(f"exact_{p}", (b, h, offset, w), dtype) for p, w in (("keys", d), ("values", dv))
            ]
            arrays.finish()
            cache._exact_keys, cache._exact_values = (write_rows(None, x, 0, cls.step) for x in exact)
        else:
            parts = {}
            for prefix, dim in (("key", d), ("value", dv)):
                segments = read_segments(layout[f"{prefix}_segments"], f"{prefix}_segments", owner)
                fixed = layout[f"{prefix}_fixed_widths"]
                if fixed is not None:
                    widths = read_widths(fixed, f"{prefix}_fixed_widths", owner)
                    steps = arrays.take(f"{prefix}.steps", (h, len(widths)), mx.float32, positive=True)
                    coder = FixedQuantCoder(widths, detached(steps), config.palu_token_scale)
                    if coder.segments != segments:
                        raise KVDataError(
                            f"{owner}: meta_state {prefix}_segments {layout[f'{prefix}_segments']} do not match "
                            f"{prefix}_fixed_widths {list(widths)}"
                        )
                else:
                    coder = MixedBitCoder(segments, config.palu_group_size, dtype, compact_dtype(dtype))
                proj_dtype = projection_dtype(coder, dtype)
                g, r = config.head_groups(h), coder.rank
                if r > dim:
                    raise KVDataError(f"{owner}: meta_state {prefix} rank {r} exceeds the head dim {dim}")
                proj = GroupProjection(
                    basis=arrays.take(f"{prefix}.basis", (g, dim, r), proj_dtype),
                    mean=arrays.take(f"{prefix}.mean", (g, dim), proj_dtype),
                    singular_values=arrays.take(f"{prefix}.singular_values", (g, r), proj_dtype),
                )
                codes = {
                    name: arrays.take(f"{prefix}.{name}", (b, h, offset, width), field_dtype)
                    for name, (width, field_dtype) in coder.field_widths().items()
                }
                parts[prefix] = (proj, coder, codes)
            m = min(config.palu_sink_tokens, offset)
            sink = (
                [arrays.take(f"sink.{p}", (b, h, m, w), dtype) for p, w in (("keys", d), ("values", dv))]
                if m
                else None
            )
            recent = read_recent(
                arrays, runtime, config.palu_recent_tokens, (b, h, d, dv), offset, dtype, owner
            )
            arrays.finish()
            cache._recent = recent
            if sink is not None:
                cache._sinks = ExactPrefix(config.palu_sink_tokens).write(
                    detached(sink[0]), detached(sink[1]), 0
                )
            for prefix, (proj, coder, codes) in parts.items():
                proj = GroupProjection(**{k: detached(v) for k, v in proj.arrays().items()})
                setattr(cache, f"_{prefix}_proj", proj)
                setattr(cache, f"_{prefix}_coder", coder)
                setattr(
                    cache, f"_{prefix}_codes", {k: write_rows(None, v, 0, cls.step) for k, v in codes.items()}
                )
        cache._shape, cache._dtype, cache.offset = shape, dtype, offset
        return cache

    # ------------------------------------------------------------------ measured storage
    def _held(self, which: str) -> list[mx.array]:
        exact, proj, codes = (
            (self._exact_keys, self._key_proj, self._key_codes)
            if which == "key"
            else (self._exact_values, self._value_proj, self._value_codes)
        )
        out = [] if exact is None else [exact]
        if which == "key" and self.rotary is not None and self._shape is not None:
            out.append(self.rotary.inv_freq)
        if proj is not None:
            out += list(proj.arrays().values())
            coder = self._key_coder if which == "key" else self._value_coder
            out += list(coder.constants().values())
            for extra in (self._sinks.arrays(), self._recent.arrays()):
                out += extra[:1] if which == "key" else extra[1:]
        out += list((codes or {}).values())
        return out

    def held_arrays(self) -> list[mx.array]:
        """Every array the cache holds (buffers at their full grown capacity); ``nbytes`` sums these."""
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
        """Bytes of every array held (buffers at their full grown capacity)."""
        return sum(a.nbytes for a in self.held_arrays())

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
        phase = f"fitted r_k={self.key_rank} r_v={self.value_rank}" if self.fitted else "exact"
        rope = ", pre-RoPE keys" if self.rotary is not None else ""
        return f"PaluKVCache(offset={self.offset}, {phase}{rope})"


#: the config fields a fitted cache's arrays depend on: how latents were projected and coded, and
#: which tokens are held exactly; a fitted state records them (``coded_with``) so that a config
#: edited afterwards cannot reinterpret its codes
CODED_WITH: tuple[str, ...] = (
    "palu_bits",
    "palu_rank",
    "palu_energy_threshold",
    "palu_hi_bit",
    "palu_lo_bit",
    "palu_hi_fraction",
    "palu_group_size",
    "palu_quantize_values",
    "palu_token_scale",
    "palu_n_head_groups",
    "palu_sink_tokens",
    "palu_recent_tokens",
)


def _coded_with(config: KVCacheConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in CODED_WITH}


def _check_coded_with(coded: object, config: KVCacheConfig, fitted: bool, owner: str) -> None:
    """KVDataError unless ``coded`` is None before the fit and, after it, names the fields of
    :data:`CODED_WITH` with the values ``config`` has."""
    if not fitted:
        if coded is not None:
            raise KVDataError(f"{owner}: meta_state coded_with={coded!r} must be null before the fit")
        return
    if not isinstance(coded, dict) or set(coded) != set(CODED_WITH):
        raise KVDataError(
            f"{owner}: meta_state coded_with={coded!r:.200} must be an object of the fields {list(CODED_WITH)}"
        )
    for name in CODED_WITH:
        if coded[name] != getattr(config, name):
            raise KVDataError(
                f"{owner}: meta_state config {name}={getattr(config, name)!r}, but the state's codes were made "
                f"with {name}={coded[name]!r}; allowed: {coded[name]!r} (a fitted cache keeps how it coded)"
            )


def _packed_rows(buffers: dict[str, mx.array], coder: LatentCoder) -> PackedRows | None:
    """The codes of fixed quantizers as attention unpacks them itself; None for other coders."""
    if not isinstance(coder, FixedQuantCoder):
        return None
    return PackedRows(buffers["codes"], coder.widths, coder.steps, coder.token_scale)


def _fixed_widths(coder: LatentCoder | None) -> list[int] | None:
    widths = None if coder is None else coder.fixed_widths
    return None if widths is None else list(widths)


def _segments_to_list(coder: LatentCoder | None) -> list[list[int]] | None:
    if coder is None:
        return None
    return [[s.start, s.stop, s.bits] for s in coder.segments]
