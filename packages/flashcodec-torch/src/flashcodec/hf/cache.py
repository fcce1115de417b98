"""FlashCodecCache: a transformers ``Cache`` whose attention layers are block-coded.

Pass it to ``model.generate(..., cache=cache)`` (``past_key_values=`` on older 5.x releases) or to
a forward call, like a ``DynamicCache``. Built with a model config (:meth:`FlashCodecCache.from_config`),
it gives a :class:`FlashCodecLayer` to every ``full_attention`` layer, a bounded
:class:`~flashcodec.hf.sliding_layer.FlashCodecSlidingLayer` to every ``sliding_attention`` layer,
and keeps transformers' own layer for every other layer type: linear attention (recurrent + conv
state, nothing to code along the sequence), chunked attention, hybrid and dummy layers. Without a
config every layer is a full-attention codec layer, created on its first ``update``.
"""

from __future__ import annotations

import inspect
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVConfigError, KVShapeError, KVTrimError
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, LinearAttentionCacheLayerMixin

from ..codecs import BlockCodec, keyword_codec, keyword_options
from ..storage import CodecStorage
from ..tiers import default_codec as default_tier_codec
from ..validate import batch_index, check_int
from .codes_step import codes_step_active
from .layer import FlashCodecLayer
from .options import check_per_layer, layer_options
from .sliding_layer import FlashCodecSlidingLayer, window_codec

__all__ = ["CODEC_LAYER_TYPES", "FlashCodecCache", "config_layer_types"]

#: the layer types that get a codec layer (sliding windows a bounded one); every other type keeps
#: transformers' native layer
CODEC_LAYER_TYPES = ("full_attention", "sliding_attention")


def config_layer_types(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The decoder's layer types and the keyword arguments of their native cache layers.

    ``config``: a transformers ``PreTrainedConfig`` (its decoder text config is used). Returns
    ``(layer_types, per_layer_kwargs)`` as ``DynamicCache(config=...)`` would build them.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_layers = getattr(text, "num_hidden_layers", None)
    if isinstance(n_layers, bool) or not isinstance(n_layers, numbers.Integral) or n_layers < 1:
        raise KVConfigError(
            "config must be a transformers model config with num_hidden_layers >= 1 "
            f"(e.g. model.config); got {type(config).__name__} with num_hidden_layers={n_layers!r}"
        )
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # releases before the helper: infer from layer_types / sliding_window
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        types, kwargs = get_layer_types_and_kwargs(text)
        return list(types), [dict(k) for k in kwargs]
    n = int(text.num_hidden_layers)
    types = list(getattr(text, "layer_types", None) or [])
    if not types:
        window = getattr(text, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * n
    kwargs = [{"sliding_window": text.sliding_window} if t == "sliding_attention" else {} for t in types]
    return types, kwargs


class FlashCodecCache(Cache):
    """A transformers 5.x ``Cache`` that stores full-attention K/V block-coded.

    Args:
        keyword_form, codec_options: the codec of every codec layer in the keyword form, as
            :class:`flashcodec.CodecKVCache` takes it (``mode``, ``block_size``, ``keep_freqs``,
            ``keep_ratio``, ``quant_bits`` by position or name, any other codec field by name;
            ``jpeg`` k=r when only other keywords are given). With neither this nor ``codec``,
            the default tier's codec (:data:`flashcodec.tiers.DEFAULT_TIER`); its figures are
            with attention on the codes (``apply_flash_codec(model)``), and a model that attends
            on a decoded view instead gets a warning once, since the view is kept beside the codes.
        codec: the same as a codec object, e.g. ``JPEGCodec(block_size=8, keep_freqs=2)``; giving
            it together with a keyword of the keyword form is a ``KVConfigError``.
        check_finite, initial_blocks: as :class:`flashcodec.CodecKVCache`.
        per_layer: ``{layer_idx: codec}`` or ``{layer_idx: {option: value}}`` overrides for the
            layers named. A codec object replaces the default codec; a dict of codec keywords is
            merged over the default (switching ``mode`` drops the other mode's options) and may
            also set ``check_finite`` / ``initial_blocks``. With a config, every index must name a
            codec layer of the model.
        config: the model's config. When given, layers are built from its ``layer_types``: codec
            layers for ``full_attention``, transformers' native layers for everything else.
        step_raw: True (the default): a multi-token step (prefill, chunked prefill, verification)
            attends its own tokens as given and the earlier ones as stored, as transformers'
            ``QuantizedCache`` does; the tokens are stored coded either way. False: it attends
            the stored form of every token, its own included.

    Every user error raises ``KVConfigError`` (a ``ValueError``) before anything is built.

    Example::

        cache = FlashCodecCache.from_config(model.config, codec=JPEGCodec(keep_freqs=2, quant_bits=8))
        out = model.generate(ids, max_new_tokens=64, cache=cache)
        print(cache.get_seq_length(), cache.storage_bytes().ratio)
    """

    def __init__(
        self,
        *keyword_form: Any,
        codec: BlockCodec | None = None,
        per_layer: dict[int, BlockCodec | dict[str, Any]] | None = None,
        config: Any = None,
        check_finite: bool = True,
        initial_blocks: int = 16,
        step_raw: bool = True,
        **codec_options: Any,
    ):
        if not isinstance(step_raw, bool):
            raise KVConfigError(f"step_raw must be True or False; got {step_raw!r}")
        #: whether a multi-token step attends its own tokens as given (:class:`FlashCodecLayer`)
        self.step_raw = step_raw
        #: warn once when a cache built with nothing chosen attends on a decoded view
        self._advise_codes = codec is None and not keyword_form and not codec_options
        if self._advise_codes:
            codec = default_tier_codec()  # nothing chosen: the measured default, not the reference's k=r
        default_codec = keyword_codec(*keyword_form, codec=codec, **codec_options)
        #: the ``CodecKVCache`` arguments of every codec layer ``per_layer`` does not name
        self.codec_defaults = layer_options(
            default_codec, check_finite=check_finite, initial_blocks=initial_blocks
        )
        # dict overrides merge over the keyword form as given, so unset keywords stay unset
        base_keywords = (
            default_codec.config() if codec is not None else keyword_options(keyword_form, codec_options)
        )
        if config is None:
            self.layer_types: list[str] | None = None
            self.per_layer = check_per_layer(per_layer, self.codec_defaults, base_keywords)
            # Layers are created on their first update (the layer count is unknown without a config).
            super().__init__(layers=[])
            return
        types, native_kwargs = config_layer_types(config)
        unknown = sorted(
            {t for t in types if t not in CODEC_LAYER_TYPES and t not in DYNAMIC_LAYER_TYPE_MAPPING}
        )
        if unknown:
            raise KVConfigError(
                f"config has layer type(s) {unknown} that transformers' DynamicCache does not know; "
                f"known: {sorted(set(DYNAMIC_LAYER_TYPE_MAPPING) | set(CODEC_LAYER_TYPES))}"
            )
        codec_idx = [i for i, t in enumerate(types) if t in CODEC_LAYER_TYPES]
        self._window_codecs: dict[tuple[int, int], Any] = {}
        self.layer_types = types
        self.per_layer = check_per_layer(
            per_layer, self.codec_defaults, base_keywords, codec_layers=codec_idx, num_layers=len(types)
        )
        layers = [
            self._codec_layer(i, t, kw) if t in CODEC_LAYER_TYPES else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw)
            for i, (t, kw) in enumerate(zip(types, native_kwargs, strict=True))
        ]
        if not codec_idx:
            warnings.warn(
                f"FlashCodecCache: the config has no attention layer to code (layer types {sorted(set(types))}), "
                "so nothing is compressed; every layer keeps transformers' native cache",
                stacklevel=3,
            )
        super().__init__(layers=layers)

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> FlashCodecCache:
        """A cache laid out for ``config``: codec layers on full attention, native layers elsewhere.

        ``options``: the constructor's ``codec`` (or codec keywords), ``per_layer``,
        ``check_finite``, ``initial_blocks`` and ``step_raw``.
        """
        if config is None:
            raise KVConfigError(
                "from_config needs a model config; got None (use FlashCodecCache(...) instead)"
            )
        return cls(config=config, **options)

    def _codec_layer(self, layer_idx: int, layer_type: str, native_kwargs: dict[str, Any]) -> FlashCodecLayer:
        options = dict(step_raw=self.step_raw, **self._options_for(layer_idx))
        if layer_type != "sliding_attention":
            return FlashCodecLayer(**options)
        window = native_kwargs["sliding_window"]
        # one codec object per (codec, window), shared by the layers as the full layers share theirs
        key = (id(options["codec"]), window)
        if key not in self._window_codecs:
            self._window_codecs[key] = window_codec(options["codec"], window)
        options["codec"] = self._window_codecs[key]
        return FlashCodecSlidingLayer(sliding_window=window, **options)

    def _options_for(self, layer_idx: int) -> dict[str, Any]:
        return self.per_layer.get(layer_idx, self.codec_defaults)

    # ------------------------------------------------------------------ the write/read meeting point
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states [B, H, s, D]`` / ``value_states [B, H, s, Dv]`` of layer ``layer_idx``.

        Returns that layer's full ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]`` in the input
        dtype. Without a config, codec layers up to ``layer_idx`` are created here, and dropped
        again when the update raises: a rejected call leaves the cache as it was.
        ``layer_idx``: an integer >= 0 (below the layer count when built from a config); a negative
        index is refused instead of counting from the end, which would store a layer's states in another.
        """
        self._check_layer_idx(layer_idx)
        before = len(self.layers)
        self.ensure_layers(layer_idx)
        layer = self.layers[layer_idx]
        # transformers' own layers (hybrid caches) validate nothing first; their update assigns new
        # tensors instead of writing into the old ones (DynamicLayer, DynamicSlidingWindowLayer), so
        # their attributes as they were are their state as it was
        native = None if isinstance(layer, FlashCodecLayer) else dict(vars(layer))
        if native is None and self._advise_codes and not codes_step_active():
            self._advise_codes = False
            warnings.warn(
                "FlashCodecCache: the model attends on a decoded view of the codes, which this cache keeps "
                "beside them (several times a plain cache's bytes for the default tier); call "
                "flashcodec.apply_flash_codec(model) (or apply_codec_attention(model)) to attend on the codes",
                stacklevel=3,
            )
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            del self.layers[before:]  # only layers this call created, still empty
            if native is not None:
                vars(layer).clear()
                vars(layer).update(native)
            raise

    def _check_layer_idx(self, layer_idx: object) -> int:
        high = None if self.layer_types is None else len(self.layers) - 1
        return check_int("layer_idx", layer_idx, low=0, high=high)

    def ensure_layers(self, layer_idx: int) -> None:
        """Without a config, create the codec layers up to ``layer_idx`` (as :meth:`update` does);
        with one, every layer exists already and nothing changes."""
        layer_idx = self._check_layer_idx(layer_idx)
        if self.layer_types is None:
            while len(self.layers) <= layer_idx:
                self.layers.append(
                    FlashCodecLayer(step_raw=self.step_raw, **self._options_for(len(self.layers)))
                )

    # ------------------------------------------------------------------ description
    @property
    def codec_layer_indices(self) -> list[int]:
        """Indices of the layers that carry a codec."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, FlashCodecLayer)]

    @property
    def native_layer_indices(self) -> list[int]:
        """Indices of the layers that keep transformers' own cache layer."""
        return [i for i, layer in enumerate(self.layers) if not isinstance(layer, FlashCodecLayer)]

    def __repr__(self) -> str:
        return f"FlashCodecCache(codec_layers={len(self.codec_layer_indices)}/{len(self.layers)}, seq_len={self.get_seq_length()})"

    # ------------------------------------------------------------------ bytes
    def storage_bytes(self, layer_idx: int | None = None) -> CodecStorage:
        """Measured bytes of one codec layer, or summed over all codec layers (``layer_idx=None``).

        ``.held`` is the compressed representation (archive + raw tail), ``.raw`` what a plain
        cache would hold for the same tokens, ``.ratio`` their quotient; see :class:`CodecStorage`.
        Native layers are not included (see :meth:`native_nbytes`).
        """
        if layer_idx is None:
            total = CodecStorage()
            for i in self.codec_layer_indices:
                total = total + self.layers[i].storage_bytes()
            return total
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral):
            raise KVConfigError(f"layer_idx must be an integer or None; got {layer_idx!r}")
        if layer_idx < 0 or layer_idx not in self.codec_layer_indices:
            raise KVConfigError(
                f"layer_idx={layer_idx} is not a codec layer; codec layers: {self.codec_layer_indices}"
            )
        return self.layers[layer_idx].storage_bytes()

    def native_nbytes(self) -> int:
        """Bytes of every tensor held by the native layers (K/V, conv and recurrent states), measured."""
        total = 0
        for i in self.native_layer_indices:
            layer = self.layers[i]
            tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            for name in ("conv_states", "recurrent_states"):
                tensors.extend((getattr(layer, name, None) or {}).values())
            total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        return total

    # ------------------------------------------------------------------ edits
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Let native sliding and linear-attention layers keep what a later :meth:`crop` needs.

        Codec layers can always be cropped. ``recurrent_states_to_keep``: how many intermediate
        recurrent states a multi-token step of a linear-attention layer records (transformers
        5.25 and newer); a later crop of ``n`` tokens after such a step needs at least ``n + 1``.
        ``None`` (the default) records none within a step (one state per step is still kept),
        where transformers' own ``DynamicCache`` leaves the model to fail on ``None``. Releases
        whose layers record no recurrent states take no value: giving one there is refused.
        """
        keep = (
            0
            if recurrent_states_to_keep is None
            else check_int("recurrent_states_to_keep", recurrent_states_to_keep, low=0)
        )
        targets = []  # (layer index, its activate_past_recording, whether it takes the count)
        for i in self.native_layer_indices:
            activate = getattr(self.layers[i], "activate_past_recording", None)
            if activate is not None:
                takes = "recurrent_states_to_keep" in inspect.signature(activate).parameters
                targets.append((i, activate, takes))
        # checked before any layer changes, so a refused call leaves recording as it was
        for i, _, takes in targets:
            if recurrent_states_to_keep is not None and not takes and self._is_linear(i):
                raise KVConfigError(
                    f"recurrent_states_to_keep={recurrent_states_to_keep!r}: this transformers release's "
                    f"{type(self.layers[i]).__name__} records no recurrent states (5.25 and newer do); "
                    "call activate_past_recording() without it"
                )
        for _, activate, takes in targets:
            if takes:
                activate(recurrent_states_to_keep=keep)
            else:
                activate()

    def _is_linear(self, layer_idx: int) -> bool:
        return isinstance(self.layers[layer_idx], LinearAttentionCacheLayerMixin)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last ``n`` tokens of every layer (transformers 5.x convention).

        ``crop(0)`` leaves codec layers alone (native sliding / linear layers shrink back to their
        working size, as in ``DynamicCache``). A positive value is the older absolute form: keep
        the first ``tokens_to_remove`` tokens. Checked before any layer changes: a native layer
        that cannot roll back (past recording off) raises ``KVTrimError`` and nothing is cropped.
        """
        # named as transformers names crop's argument, which is what callers pass it as
        n = check_int("max_length", tokens_to_remove, error=KVTrimError)
        if n > 0:  # absolute length -> a count to remove, so native layers get the form they accept
            n = -max(0, self.get_seq_length() - n)
        for i in self.native_layer_indices:
            layer = self.layers[i]
            if getattr(layer, "record_past", True) or not getattr(layer, "is_initialized", True):
                continue
            window = getattr(layer, "sliding_window", None)
            past_window = window is not None and layer.get_seq_length() >= window
            if isinstance(layer, LinearAttentionCacheLayerMixin) or past_window:
                raise KVTrimError(
                    f"crop({tokens_to_remove}): layer {i} ({type(layer).__name__}) cannot roll back without past "
                    "recording (call cache.activate_past_recording() before the tokens to undo); nothing was cropped"
                )
        self._check_recurrent_history(tokens_to_remove, -n)
        self._edit_layers(lambda layer: layer.plan_crop(n), lambda layer: layer.crop(n))

    def _check_recurrent_history(self, tokens_to_remove: int, n: int) -> None:
        """Refuse a crop of ``n`` tokens that a linear layer's recorded recurrent states cannot undo
        (transformers would fail half-way, with some layers cropped)."""
        if n == 0:
            return
        for i in self.native_layer_indices:
            layer = self.layers[i]
            history = getattr(layer, "recurrent_states_history", None)
            if not self._is_linear(i) or not getattr(layer, "record_past", False) or history is None:
                continue
            for state_idx, states in history.items():
                initialized = getattr(layer, "is_recurrent_states_initialized", {}).get(state_idx, False)
                if initialized and len(states) < n:
                    raise KVTrimError(
                        f"crop({tokens_to_remove}): layer {i} ({type(layer).__name__}) recorded {len(states)} "
                        f"recurrent state(s), fewer than the {n} tokens to remove; call "
                        f"cache.activate_past_recording(recurrent_states_to_keep={n + 1}) (or more) before "
                        "the tokens to undo; nothing was cropped"
                    )

    # ------------------------------------------------------------------ batch edits
    # Checked once against the batch before any layer changes, so a bad argument never leaves some
    # layers reordered and others not; negative indices are resolved here, because transformers'
    # own layers take them in batch_select_indices (tensor indexing) but not in reorder_cache
    # (index_select).
    # Codec layers are prepared first (everything they allocate), then the native layers edited,
    # then the codec layers committed, so an error (out of memory included) in a codec layer
    # leaves every layer as it was.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Gather the batch rows ``beam_idx`` of every layer (beam search); see :meth:`FlashCodecLayer.reorder_cache`."""
        idx = self._batch_index(beam_idx, "beam_idx", allow_mask=False)
        self._edit_layers(
            lambda layer: layer.plan_gather(idx, "beam_idx", allow_mask=False),
            lambda layer: layer.reorder_cache(idx),
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` in every layer: integers (negative from the end) or a boolean mask."""
        idx = self._batch_index(indices, "indices", allow_mask=True)
        self._edit_layers(
            lambda layer: layer.plan_gather(idx, "indices", allow_mask=True),
            lambda layer: layer.batch_select_indices(idx),
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (an integer >= 1) in every layer."""
        repeats = check_int("repeats", repeats, low=1, error=KVShapeError)
        self._edit_layers(
            lambda layer: layer.plan_repeat(repeats), lambda layer: layer.batch_repeat_interleave(repeats)
        )

    def _edit_layers(
        self,
        plan_codec: Callable[[FlashCodecLayer], Callable[[], None]],
        edit_native: Callable[[Any], None],
    ) -> None:
        commits = [plan_codec(self.layers[i]) for i in self.codec_layer_indices]
        for i in self.native_layer_indices:
            edit_native(self.layers[i])
        for commit in commits:
            commit()

    def _batch_index(self, indices: object, name: str, *, allow_mask: bool) -> object:
        """``indices`` checked and resolved against the batch of the first filled codec layer
        (as given when none is filled: there is no batch to check against yet)."""
        for i in self.codec_layer_indices:
            stream = self.layers[i].codec_cache.keys
            if stream is not None and self.layers[i].get_seq_length():
                return batch_index(name, indices, stream.batch, allow_mask=allow_mask, device=stream.device)
        return indices
