"""The one-line hot patch: make every ``generate()`` of one model default to a FlashCodecCache.

``apply_flash_codec(model, ...)`` puts a wrapper in that instance's ``__dict__`` under
``generate``; it shadows the class method for this model only. Each call that would let
transformers build its default ``DynamicCache`` (no cache passed, ``use_cache`` not False, no
``cache_implementation`` chosen, no ``custom_generate``) gets a fresh
``FlashCodecCache.from_config(model.config, ...)`` instead; every other call passes through
untouched. ``remove_flash_codec(model)`` puts back exactly what the instance had before (usually:
nothing, so the class method is seen again). No class, module or global is modified, nothing
happens on import, and applying twice replaces the options instead of stacking wrappers.

Extension point: a :class:`FlashCodecPatch` keeps an undo list (:meth:`FlashCodecPatch.on_remove`),
so further per-instance changes (for example coefficient-domain attention wrappers) can join the
same patch and be undone by the same ``remove_flash_codec``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVConfigError

from ..codecs import BlockCodec, keyword_options
from ..tiers import check_attention
from .cache import FlashCodecCache

__all__ = ["FlashCodecPatch", "apply_flash_codec", "get_flash_codec_patch", "remove_flash_codec"]

_MISSING = object()
_PATCH_ATTR = "__flashcodec_patch__"


def _cache_kwarg() -> str:
    """The name ``generate`` takes a cache under: ``cache`` (recent 5.x) or ``past_key_values``."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclasses.dataclass(eq=False)
class FlashCodecPatch:
    """What :func:`apply_flash_codec` did to one model, and how to undo it.

    Attributes:
        options: the :class:`FlashCodecCache` arguments every new cache is built with, as passed
            to :func:`apply_flash_codec` (``codec`` or the codec keywords given, ``per_layer``,
            ``check_finite``, ``initial_blocks``).
        original_generate: what the instance's ``__dict__`` held under ``generate`` before
            (a sentinel when it held nothing, the usual case).
        last_cache: a weak reference to the cache of the latest patched ``generate`` call (weak,
            so the patch never keeps a finished generation's cache alive).
        caches_built: how many ``generate`` calls got a codec cache from this patch.
    """

    model_ref: weakref.ReferenceType
    options: dict[str, Any]
    original_generate: Any = _MISSING
    last_cache: weakref.ReferenceType | None = None
    caches_built: int = 0
    _undo: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def on_remove(self, undo: Callable[[], None]) -> None:
        """Register ``undo`` to run (last registered first) when the patch is removed."""
        self._undo.append(undo)

    def new_cache(self) -> FlashCodecCache:
        """A fresh cache for the patched model (``from_config`` when the model has a config)."""
        model = self.model_ref()
        config = getattr(model, "config", None)
        cache = (
            FlashCodecCache.from_config(config, **self.options)
            if config is not None
            else FlashCodecCache(**self.options)
        )
        self.last_cache = weakref.ref(cache)
        self.caches_built += 1
        return cache

    def remove(self) -> None:
        """Run every undo step, newest first."""
        while self._undo:
            self._undo.pop()()


def _check_model(model: object, what: str, *, needs_generate: bool = False) -> None:
    """``KVConfigError`` unless ``model`` is an object with an instance ``__dict__`` (where the
    patch lives) and, for ``needs_generate``, a callable ``generate``: a transformers model, or a
    stand-in for one. Checked up front so a wrong object never fails inside ``vars()``."""
    if not hasattr(model, "__dict__") or needs_generate and not callable(getattr(model, "generate", None)):
        raise KVConfigError(
            f"{what}: model must be a transformers model with generate(); got {type(model).__name__}"
        )


def get_flash_codec_patch(model: torch.nn.Module) -> FlashCodecPatch | None:
    """The patch applied to ``model`` by :func:`apply_flash_codec`, or None."""
    _check_model(model, "get_flash_codec_patch")
    return getattr(vars(model).get("generate"), _PATCH_ATTR, None)


def _wants_default_cache(model: Any, args: tuple, kwargs: dict, cache_kwarg: str) -> bool:
    """Whether this ``generate`` call would build transformers' default dynamic cache."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return False
    if kwargs.get("custom_generate") is not None:
        return False
    # Models that build their own cache (mamba, rwkv, ...) would break on an injected one.
    supports_default = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_default is not None and not supports_default():
        return False
    passed = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    configs = [c for c in (passed, getattr(model, "generation_config", None)) if c is not None]
    if kwargs.get("cache_implementation") is not None:
        return False
    if any(getattr(c, "cache_implementation", None) is not None for c in configs):
        return False
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = next((c.use_cache for c in configs if getattr(c, "use_cache", None) is not None), True)
    if not use_cache:
        return False
    config = getattr(model, "config", None)
    return not getattr(config, "is_encoder_decoder", False)


def apply_flash_codec(
    model: torch.nn.Module,
    *keyword_form: Any,
    codec: BlockCodec | None = None,
    per_layer: dict[int, BlockCodec | dict[str, Any]] | None = None,
    check_finite: bool = True,
    initial_blocks: int = 16,
    attention: str | None = None,
    materialization_free: bool | None = None,
    step_raw: bool = True,
    **codec_options: Any,
) -> torch.nn.Module:
    """Make every ``model.generate()`` of this one instance default to a :class:`FlashCodecCache`.

    Args:
        model: a transformers decoder-only model with ``generate`` (its ``config`` lays out the
            cache: codec layers on full attention, native layers elsewhere).
        keyword_form, codec_options, codec, per_layer, check_finite, initial_blocks, step_raw: as
            :class:`FlashCodecCache` (``codec=`` or the keyword form: ``mode``, ``block_size``,
            ``keep_freqs``, ``keep_ratio``, ``quant_bits`` by position or name, any other codec
            field by name).
        attention: what the model attends on. ``"codes"``: the stored codes (decode steps on
            the stored rows, prefill / multi-token steps on the archive a chunk at a time, never
            building the K/V view; :func:`flashcodec.hf.codec_attention.apply_codec_attention`,
            undone by remove). ``"materialized"``: a decoded K/V view, as transformers attends
            on any cache. None (the default): ``"codes"`` when no codec and no keyword of the
            keyword form is given (the default tier, whose measured figures are on the codes),
            ``"materialized"`` otherwise, as the reference's keyword form has it. A tier's
            :attr:`~flashcodec.tiers.Tier.attention` is the one it is measured with.
        materialization_free: the reference description's name for the same choice: True is
            ``attention="codes"``, False ``"materialized"``; giving both, in disagreement, is an error.

    ``apply_flash_codec(model)`` with nothing else uses :data:`flashcodec.tiers.DEFAULT_TIER`
    with attention on the codes.

    Returns ``model`` (patched in place). Calls that pass their own cache, ``use_cache=False``,
    a ``cache_implementation`` or ``custom_generate`` are not changed. Applying again replaces
    the options; a rejected call (``KVConfigError``) leaves the model as it was.
    """
    # the keyword form as given: FlashCodecCache merges per_layer dicts over exactly these
    options: dict[str, Any] = keyword_options(keyword_form, codec_options)
    if codec is not None:
        options["codec"] = codec
    options.update(
        per_layer=per_layer, check_finite=check_finite, initial_blocks=initial_blocks, step_raw=step_raw
    )
    attention = _chosen_attention(
        attention,
        materialization_free,
        nothing_chosen=codec is None and not keyword_form and not codec_options,
    )
    _check_model(model, "apply_flash_codec", needs_generate=True)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise KVConfigError(
            f"apply_flash_codec supports decoder-only models; {type(model).__name__} is an encoder-decoder"
        )
    # Build one cache now so every option (and per_layer against the real layer layout) is checked
    # before the model is touched.
    FlashCodecCache.from_config(config, **options) if config is not None else FlashCodecCache(**options)
    if attention == "codes":
        from .codec_attention import check_codec_attention

        check_codec_attention(model)

    if get_flash_codec_patch(model) is not None:
        remove_flash_codec(model)
    patch = FlashCodecPatch(model_ref=weakref.ref(model), options=options)
    _install_generate_hook(model, patch)
    if attention == "codes":
        from .codec_attention import apply_codec_attention, remove_codec_attention

        apply_codec_attention(model)
        patch.on_remove(lambda: remove_codec_attention(model))
    return model


def _chosen_attention(attention: object, materialization_free: object, *, nothing_chosen: bool) -> str:
    """``attention`` as given, or from the reference's ``materialization_free``, or the default
    (codes for the default tier, a decoded view for a chosen codec); ``KVConfigError`` for a
    bad value or for the two in disagreement."""
    if attention is not None:
        check_attention(attention)
    if materialization_free is not None and not isinstance(materialization_free, bool):
        raise KVConfigError(f"materialization_free must be True, False or None; got {materialization_free!r}")
    from_flag = (
        None if materialization_free is None else ("codes" if materialization_free else "materialized")
    )
    if attention is not None and from_flag is not None and attention != from_flag:
        raise KVConfigError(
            f"attention={attention!r} and materialization_free={materialization_free!r} disagree; pass one of them"
        )
    return attention or from_flag or ("codes" if nothing_chosen else "materialized")


def _install_generate_hook(model: torch.nn.Module, patch: FlashCodecPatch) -> None:
    """Shadow ``generate`` on this instance only; register the exact undo."""
    instance = vars(model)
    patch.original_generate = instance.get("generate", _MISSING)
    cache_kwarg = _cache_kwarg()
    model_ref = patch.model_ref
    class_generate = type(model).generate

    def inner_generate() -> Callable[..., Any]:
        original = patch.original_generate
        return (
            original if original is not _MISSING else class_generate.__get__(model_ref(), type(model_ref()))
        )

    @functools.wraps(class_generate)
    def generate(*args: Any, **kwargs: Any) -> Any:
        model = model_ref()
        if _wants_default_cache(model, args, kwargs, cache_kwarg):
            # An explicit None under either name means "no cache given": replace it, keep one name.
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            kwargs[cache_kwarg] = patch.new_cache()
        return inner_generate()(*args, **kwargs)

    # Report the bound signature (no `self`), as the class method seen through the instance does.
    generate.__signature__ = inspect.signature(inner_generate())
    setattr(generate, _PATCH_ATTR, patch)
    instance["generate"] = generate

    def undo() -> None:
        if patch.original_generate is _MISSING:
            instance.pop("generate", None)
        else:
            instance["generate"] = patch.original_generate

    patch.on_remove(undo)


def remove_flash_codec(model: torch.nn.Module) -> bool:
    """Undo :func:`apply_flash_codec` on ``model``: its ``generate`` is again exactly what it was.

    Returns True when a patch was removed, False when the model was not patched.
    """
    _check_model(model, "remove_flash_codec")
    patch = get_flash_codec_patch(model)
    if patch is None:
        return False
    patch.remove()
    return True
