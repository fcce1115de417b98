"""Wiring palu caches into mlx-lm models, and saving / loading prompt caches.

``KVCacheBuilder.for_model(model, config)`` returns one cache per layer, ready for
``generate(..., prompt_cache=caches)``, ``stream_generate`` or ``generate_step``.
``KVCacheBuilder.install(model, config)`` sets ``model.make_cache`` so every
mlx-lm call that builds its own cache gets fresh palu caches; ``KVCacheBuilder.uninstall``
puts the model's own ``make_cache`` back.

With ``config.palu_pre_rope`` (the default) each palu cache gets its layer's RoPE, so keys are
coded before RoPE, where probing the layers shows the mechanism palu can undo
(:func:`palu_mlx.rope.model_rotaries`); other models fall back to post-RoPE keys with a
:class:`~palu_mlx.rope.PreRopeFallbackWarning`. No module of the model is changed either way.

**Prompt-cache files.** mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache`` (and so
``mlx_lm.generate --prompt-cache-file`` and ``mlx_lm.cache_prompt``) work with palu caches once
:func:`register_with_mlx_lm` has run in the process: every palu-mlx ``state`` carries its
``meta_state`` and a checksum (:mod:`palu_mlx.state_checks`), and registering adds the palu-mlx
cache classes' names to ``mlx_lm.models.cache``, where mlx-lm's loader looks a saved class name
up. Constructing any palu cache registers them, so a process that made a
cache can load its file; a fresh process that only loads calls it first. Importing palu_mlx
changes nothing of mlx-lm, and nothing of mlx-lm is ever replaced: only names it lacks are added.

This module also has its own :func:`save_prompt_cache` / :func:`load_prompt_cache`, whose file
is a ``.safetensors`` with each layer's ``state`` arrays under ``"<layer>.<name>"`` and, in the
metadata, each layer's class and ``meta_state`` plus a checksum of the whole file, written
atomically. Layers that are mlx-lm caches (e.g. a model mixing rotating and full attention) are
stored through their own ``state`` / ``from_state`` the way mlx-lm does it.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from kvspec import KVConfigError, KVDataError, KVSpecError
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from .attention import route_attention, unroute_attention
from .baseline import NaiveQuantKVCache
from .budgets import SensitivityProfile
from .cache import PaluKVCache
from .calibrated import CalibratedKVCache, calibrated_caches
from .calibration.file import Calibration
from .config import KVCacheConfig
from .distributed import HeadShard, head_shard
from .integrity import CHECKSUM_KEY, digest
from .json_text import parse_json_text
from .layer import register_cache_classes
from .mixed_bit import BitAllocationPolicy, check_policy
from .models import check_model, default_caches, model_kv_dims, original_make_cache
from .rope import Rotary, model_rotaries
from .rotating import RotatingPaluKVCache
from .rotation_code import RotationKVCache, fits_window, rotation_cache, window_config
from .state_checks import STATE_META
from .tiers import CALIBRATED_SUFFIX, CALIBRATED_TIERS, TIERS, tier

__all__ = [
    "KVCacheBuilder",
    "model_kv_dims",
    "save_prompt_cache",
    "load_prompt_cache",
    "register_with_mlx_lm",
]

_NO_ROTARIES: list[Rotary | None] = []

_OURS: dict[str, type] = {
    "PaluKVCache": PaluKVCache,
    "NaiveQuantKVCache": NaiveQuantKVCache,
    "CalibratedKVCache": CalibratedKVCache,
    "RotatingPaluKVCache": RotatingPaluKVCache,
    "RotationKVCache": RotationKVCache,
}
_OUR_CLASSES = tuple(_OURS.values())
_FORMAT = "palu-mlx.prompt-cache.v1"


def register_with_mlx_lm() -> None:
    """Make mlx-lm's ``load_prompt_cache`` find palu-mlx's cache classes.

    mlx-lm rebuilds each saved layer with ``globals()[class_name].from_state(state)`` inside
    ``mlx_lm.models.cache`` (``CacheList`` does the same for its members), so the classes must be
    names of that module. This adds :class:`PaluKVCache`, :class:`CalibratedKVCache`,
    :class:`NaiveQuantKVCache`, :class:`~palu_mlx.rotating.RotatingPaluKVCache` and
    :class:`~palu_mlx.batch.BatchedLayerCache` there; constructing any
    palu cache runs it, a process that only loads a file calls it, and it is idempotent. A name
    mlx-lm already uses for something else is never overwritten (``KVConfigError``).
    """
    # the classes the builder saves and builds, too, whether or not their module marks them
    register_cache_classes(strict=True, extra=_OUR_CLASSES)


def _check_config(config: Any) -> None:
    if not isinstance(config, KVCacheConfig):
        raise KVConfigError(f"config must be a KVCacheConfig; got {type(config).__name__}")


class KVCacheBuilder:
    """Builds per-layer palu (or naive baseline) caches for an mlx-lm model."""

    @staticmethod
    def make_layer_cache(
        config: KVCacheConfig,
        allocation_policy: BitAllocationPolicy | None = None,
        rotary: Rotary | None = None,
        shard: HeadShard | None = None,
    ) -> PaluKVCache | NaiveQuantKVCache:
        """One layer's cache for ``config``; ``rotary``: pre-RoPE keys;
        ``shard``: this rank's heads under tensor parallel (:mod:`palu_mlx.distributed`)."""
        _check_config(config)
        check_policy(allocation_policy)
        if config.method == "naive":
            return NaiveQuantKVCache(config.naive_bits, config.naive_group_size, config.palu_check_finite)
        if config.method == "rotation":
            if shard is not None:
                raise KVConfigError(
                    "method='rotation' under tensor parallel: each rank would rotate its own heads; "
                    "allowed here: method='palu'"
                )
            return rotation_cache(config, rotary=rotary)  # built from the first update
        return PaluKVCache(config, allocation_policy, rotary, shard)

    @staticmethod
    def config_for(
        model: nn.Module, choice: KVCacheConfig | str | None = None, calibration: str | None = None
    ) -> KVCacheConfig:
        """The config ``choice`` means for ``model``: the one rule every entry point (``for_model``,
        ``install``, ``palu-mlx compare`` / ``generate`` / ``server``, the benchmarks) applies.

        ``choice``: None, ``KVCacheConfig()`` (the default tier, :data:`~palu_mlx.tiers.DEFAULT_TIER`;
        with ``calibration``, the fitted cache's default calibrated);
        a tier name (:data:`~palu_mlx.tiers.TIERS`, its ``+cal`` / ``+sens`` twins), sized for the
        model by :meth:`~palu_mlx.tiers.Tier.sized`; or a :class:`KVCacheConfig`, taking the model's
        head dim where it leaves it None. ``calibration``: the model's ``palu-mlx calibrate`` file
        (or sensitivity profile) for a tier that needs one; given to a tier that takes none, the
        tier's calibrated twin ``<tier>+cal`` runs. Raises ``KVConfigError`` naming what is allowed.
        """
        head_dim, _ = model_kv_dims(model)
        if choice is None:  # the default tier; with a file, the fitted cache's default calibrated
            choice = KVCacheConfig(palu_calibration=calibration)
            calibration = None
        if isinstance(choice, KVCacheConfig):
            if calibration is not None:
                choice = choice.replace(palu_calibration=calibration)
            return choice.for_head_dim(head_dim)
        if not isinstance(choice, str):
            raise KVConfigError(
                f"config must be a KVCacheConfig, a tier name or None; got {choice!r} (tiers: {', '.join(TIERS)})"
            )
        named = tier(choice)
        if calibration is not None and named.calibration is None:
            twin = CALIBRATED_TIERS.get(choice + CALIBRATED_SUFFIX)
            if twin is None:
                allowed = ", ".join(name.removesuffix(CALIBRATED_SUFFIX) for name in CALIBRATED_TIERS)
                raise KVConfigError(
                    f"tier {choice!r} with --calibration {calibration!r}: the tier has no calibrated twin; "
                    f"allowed: {allowed}"
                )
            named = twin
        if head_dim is None:
            raise KVConfigError(f"tier {choice!r}: the model's head dim cannot be read from its args")
        return named.sized(head_dim, calibration)

    @staticmethod
    def for_model(
        model: nn.Module,
        config: KVCacheConfig | str | None = None,
        allocation_policy: BitAllocationPolicy | None = None,
        max_kv_size: int | None = None,
        calibration: str | None = None,
    ) -> list[Any]:
        """One cache per layer of ``model``, for ``config``: None (the default tier), a tier name or
        a :class:`KVCacheConfig`, with ``calibration`` where a tier takes one (:meth:`config_for`).

        Layers whose default cache is mlx-lm's plain ``KVCache`` get a palu cache; layers whose
        default is a ``RotatingKVCache`` (sliding windows) get a
        :class:`~palu_mlx.rotating.RotatingPaluKVCache` of the same ``max_size`` and ``keep``
        (with ``method="palu"``; the naive baseline leaves them to mlx-lm); other layer caches
        (SSM state) are kept. ``max_kv_size``: the full-attention layers are bounded too, as
        mlx-lm's ``make_prompt_cache(model, max_kv_size)`` bounds them (a rotating cache of
        ``max_kv_size`` tokens keeping the first 4); ``method="palu"`` only.
        With ``config.palu_pre_rope`` each palu cache codes its layer's keys before RoPE
        where probing the layers shows the mechanism palu can undo (else a
        ``PreRopeFallbackWarning``).
        What ``config`` leaves to the model (``head_dim`` None, the default) is taken from it
        (:meth:`KVCacheConfig.for_head_dim`), so ``KVCacheConfig()`` fits any model.
        Raises ``KVConfigError`` when a ``config.head_dim`` given differs from the model's
        head dim or its KV head count is not divisible by ``palu_n_head_groups`` (the
        default, None, takes one group per KV head and fits every model).
        """
        config = KVCacheBuilder.config_for(model, config, calibration)  # checks the model first
        caches = KVCacheBuilder._build(model, config, allocation_policy, None, max_kv_size)
        route_attention(model)
        return caches

    @staticmethod
    def _build(
        model: nn.Module,
        config: KVCacheConfig,
        allocation_policy: BitAllocationPolicy | None,
        rotaries: list[Rotary | None] | None,
        max_kv_size: int | None = None,
    ) -> list[Any]:
        _check_config(config)
        check_policy(allocation_policy)
        if max_kv_size is not None and (
            isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size <= _MAX_KV_KEEP
        ):
            raise KVConfigError(
                f"max_kv_size={max_kv_size!r} must be None or an int above {_MAX_KV_KEEP} (the first "
                f"{_MAX_KV_KEEP} tokens are always kept, as mlx-lm keeps them)"
            )
        if max_kv_size is not None and config.method == "naive":
            raise KVConfigError(
                "max_kv_size needs method='palu' or 'rotation'; the 'naive' cache does not rotate"
            )
        register_with_mlx_lm()  # so mlx-lm's load_prompt_cache can rebuild what this process saves
        head_dim, n_kv = model_kv_dims(model)
        config = config.for_head_dim(head_dim)
        if config.method == "palu" and n_kv is not None and n_kv % config.head_groups(n_kv):
            raise KVConfigError(
                f"palu_n_head_groups={config.palu_n_head_groups} must divide the model's "
                f"{n_kv} key/value heads; allowed: a divisor of {n_kv}"
            )
        # a tensor-parallel shard: the fits decide what spans heads on every rank's statistics
        shard = head_shard(model, n_kv) if config.method == "palu" else None
        if shard is not None and config.palu_n_head_groups is not None:
            raise KVConfigError(
                f"palu_n_head_groups={config.palu_n_head_groups} under tensor parallel (this rank computes "
                f"{n_kv} of {shard.total} KV heads): each rank fits its own heads; allowed: None (one "
                "group per KV head)"
            )
        if rotaries is None:
            rotaries = _rotaries(model, config, head_dim)
        defaults = default_caches(model)
        replaceable = (mlx_cache.KVCache, *_OUR_CLASSES)
        if config.method == "rotation":
            # the codes are built from each layer's first update: its heads and dims are the layer's own
            made = [
                rotation_cache(config, rotary=_at(rotaries, i))
                if type(c) in replaceable or type(c) is mlx_cache.RotatingKVCache
                else None
                for i, c in enumerate(defaults)
            ]
        elif config.method == "palu" and config.palu_calibration is not None:
            calibration = load_calibration(config.palu_calibration)
            _check_calibration(calibration, model, shard)
            heads = None if shard is None else shard.head_slice
            calibrated = calibrated_caches(config, calibration, rotaries or None, heads)
            made = [calibrated[i] for i in range(len(defaults))]
        else:
            configs = _layer_configs(model, config, len(defaults))
            made = [
                KVCacheBuilder.make_layer_cache(configs[i], allocation_policy, _at(rotaries, i), shard)
                if type(c) in replaceable
                or (config.method == "palu" and type(c) is mlx_cache.RotatingKVCache)
                else None
                for i, c in enumerate(defaults)
            ]
        short = _short_window_code(config, head_dim)
        caches = [
            _placed(
                c, palu, max_kv_size, None if short is None else functools.partial(short, _at(rotaries, i))
            )
            for i, (c, palu) in enumerate(zip(defaults, made, strict=True))
        ]
        if not any(isinstance(c, _OUR_CLASSES) for c in caches):
            raise KVConfigError(
                "the model has no KVCache or RotatingKVCache layer a palu cache could replace"
            )
        return caches

    @staticmethod
    def install(
        model: nn.Module,
        config: KVCacheConfig | str | None = None,
        allocation_policy: BitAllocationPolicy | None = None,
        calibration: str | None = None,
    ) -> Callable[[], list[Any]]:
        """Set ``model.make_cache`` to build fresh palu caches on every call; returns that factory.

        ``config`` and ``calibration`` as in :meth:`for_model` (:meth:`config_for`). Validates the
        config against the model first; the pre-RoPE decision (and its warning) is taken once,
        here. Nothing but ``make_cache`` changes; :meth:`uninstall` undoes it.
        """
        config = KVCacheBuilder.config_for(model, config, calibration)  # checks the model first
        rotaries = _rotaries(model, config, model_kv_dims(model)[0])
        KVCacheBuilder._build(model, config, allocation_policy, rotaries)
        route_attention(model)

        def make_cache(*_args: Any, **_kwargs: Any) -> list[Any]:
            return KVCacheBuilder._build(model, config, allocation_policy, rotaries)

        # Re-installing keeps the first install's record of what the model had.
        had_own = model.make_cache._palu_had_own if _installed(model) else "make_cache" in vars(model)
        make_cache._palu_original = original_make_cache(model)  # type: ignore[attr-defined]
        make_cache._palu_had_own = had_own  # type: ignore[attr-defined]
        model.make_cache = make_cache
        return make_cache

    @staticmethod
    def uninstall(model: nn.Module) -> bool:
        """Undo :meth:`install`: the model's own ``make_cache`` again. Returns False if none was installed."""
        if not _installed(model):
            return False
        unroute_attention(model)
        current = model.make_cache
        if current._palu_had_own:
            model.make_cache = current._palu_original
        else:
            del model.make_cache
        return True


_CALIBRATIONS: dict[tuple[str, float], Calibration] = {}
_PROFILES: dict[tuple[str, float], SensitivityProfile] = {}


def _remembered(path: str, field: str, load: Callable[[str], Any], memo: dict[tuple[str, float], Any]) -> Any:
    """``load(path)``, remembered in ``memo`` per (path, modification time): caches are built often,
    and an edited file is read again. ``field`` names the config field in the error."""
    try:
        key = (os.path.abspath(path), os.path.getmtime(path))
    except OSError as exc:
        raise KVConfigError(f"{field}={path!r} cannot be read: {exc}") from None
    if key not in memo:
        memo[key] = load(path)
    return memo[key]


def load_profile(path: str) -> SensitivityProfile:
    """:meth:`SensitivityProfile.load`, remembered per (path, modification time)."""
    return _remembered(path, "palu_sensitivity", SensitivityProfile.load, _PROFILES)


def _layer_configs(model: nn.Module, config: KVCacheConfig, n_layers: int) -> list[KVCacheConfig]:
    """Each layer's config: ``config`` itself, or with ``palu_sensitivity`` the layer's share of the
    bits and its key / value weights from the model's profile (:meth:`SensitivityProfile.allocate`)."""
    if config.method != "palu" or config.palu_sensitivity is None:
        return [config] * n_layers
    profile = load_profile(config.palu_sensitivity)
    profile.check_model(model)
    coders = profile.allocate(config.coder_bits, config.palu_token_scale)
    return [
        config.replace(
            palu_sensitivity=None,
            palu_bits=coder.bits,
            palu_key_weight=coder.key_weight,
            palu_value_weight=coder.value_weight,
            # the profile's weighing, stated: a layer whose weights come out 1 and 1 must not turn
            # the automatic relative-error weighing on once palu_sensitivity is gone
            palu_relative_error=config.relative_error,
        )
        for coder in coders
    ]


def load_calibration(path: str) -> Calibration:
    """:meth:`Calibration.load`, remembered per (path, modification time)."""
    return _remembered(path, "palu_calibration", Calibration.load, _CALIBRATIONS)


# (model, calibration) pairs already checked: install checks once, and the caches built for each
# request after it do not repeat the fingerprint (a collective under tensor parallel)
# (an mlx Module is a dict: not hashable, so it is keyed by id and held weakly)
_CHECKED: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}


def _check_calibration(calibration: Calibration, model: nn.Module, shard: HeadShard | None) -> None:
    key = (id(model), id(calibration))
    refs = _CHECKED.get(key)
    if refs is not None and refs[0]() is model and refs[1]() is calibration:
        return
    calibration.check_model(model, shard=shard)
    for k in [k for k, (m, c) in _CHECKED.items() if m() is None or c() is None]:
        del _CHECKED[k]
    _CHECKED[key] = (weakref.ref(model), weakref.ref(calibration))


def _installed(model: nn.Module) -> bool:
    check_model(model)  # install and uninstall ask this first: a non-model fails here, clearly
    return hasattr(getattr(model, "make_cache", None), "_palu_original")


def _rotaries(model: nn.Module, config: KVCacheConfig, head_dim: int | None) -> list[Rotary | None]:
    # install's first call: its model and config are checked here, before anything is built
    check_model(model)
    _check_config(config)
    if config.method not in ("palu", "rotation") or not config.palu_pre_rope:
        return _NO_ROTARIES
    return model_rotaries(model, head_dim) or _NO_ROTARIES


def _short_window_code(
    config: KVCacheConfig, head_dim: int | None
) -> Callable[[Rotary | None, int, int], Any] | None:
    """``(rotary, window, keep) -> cache`` for the windows too short to pay for a fitted projection
    (a ``method="palu"`` config on a model of known ``head_dim``) and every window of a
    ``method="rotation"`` config; None for the naive method."""
    if config.method not in ("palu", "rotation"):
        return None

    def make(rotary: Rotary | None, window: int, keep: int) -> Any:
        if config.method == "palu" and (head_dim is None or fits_window(window, head_dim)):
            return None
        # the codes are built from the window's first update: its heads and dims are the layer's own
        return rotation_cache(window_config(config, window, keep), rotary=rotary)

    return make


#: first tokens a ``max_kv_size`` rotating cache always keeps (mlx-lm's ``make_prompt_cache``)
_MAX_KV_KEEP = 4


def _placed(
    default: Any, palu: Any, max_kv_size: int | None, short_window: Callable[[int, int], Any] | None = None
) -> Any:
    """The cache a layer gets: ``palu`` (None: none was made) in place of the model's ``default``,
    rotating where the default rotates or ``max_kv_size`` bounds the layer; else ``default``.
    ``short_window(max_size, keep)``: the code for a window too short to pay for a fitted
    projection (:func:`~palu_mlx.rotation_code.fits_window`), or None to keep ``palu``'s."""
    rotates = type(default) in (mlx_cache.RotatingKVCache, RotatingPaluKVCache)
    if rotates:
        window, keep = default.max_size, default.keep
    elif max_kv_size is not None and isinstance(palu, PaluKVCache):
        window, keep = max_kv_size, _MAX_KV_KEEP
    else:
        window = keep = None
    if window is not None and short_window is not None:
        palu = short_window(window, keep) or palu
    if palu is None or not (
        rotates or type(default) is mlx_cache.KVCache or isinstance(default, _OUR_CLASSES)
    ):
        return default
    return palu if window is None else RotatingPaluKVCache(palu, window, keep)


def _at(rotaries: list[Rotary | None], i: int) -> Rotary | None:
    return rotaries[i] if i < len(rotaries) else None


# --------------------------------------------------------------------------- persistence
def _check_file_name(file_name: Any) -> str:
    if isinstance(file_name, os.PathLike):
        file_name = os.fspath(file_name)
    if not isinstance(file_name, str) or not file_name:
        raise KVConfigError(f"file_name={file_name!r} must be a non-empty path (str or os.PathLike)")
    return file_name


def _cache_file(file_name: Any) -> str:
    """The file a prompt cache is saved to and loaded from: ``file_name``, with ``.safetensors``
    appended when it lacks it (as ``mx.save_safetensors`` and so mlx-lm's own save do), so that
    loading the name a cache was saved under reads it. A directory is refused."""
    file_name = _check_file_name(file_name)
    final = file_name if file_name.endswith(".safetensors") else file_name + ".safetensors"
    for name in dict.fromkeys((file_name, final)):
        if os.path.isdir(name):
            raise KVConfigError(
                f"file_name={file_name!r}: {name!r} is a directory; allowed: a file path "
                "(.safetensors is appended to a name without it)"
            )
    return final


def _mlx_cache_class(name: str) -> type | None:
    # only mlx-lm's cache classes, not any attribute of its module (a function, an import)
    cls = getattr(mlx_cache, name, None)
    base = getattr(mlx_cache, "_BaseCache", object)
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def save_prompt_cache(file_name: str, cache: list[Any], metadata: dict[str, str] | None = None) -> None:
    """Save a prompt cache (palu, naive and mlx-lm layers) to a ``.safetensors`` file.

    As with ``mx.save_safetensors`` (and mlx-lm's ``save_prompt_cache``), ``.safetensors`` is
    appended to a name without it; :func:`load_prompt_cache` resolves the name the same way. A
    directory raises ``KVConfigError``. The file's metadata carries a sha256 checksum of its arrays and layer metadata, which
    :func:`load_prompt_cache` verifies. The file is written under a temporary name and then
    renamed, so a failed save leaves any earlier file of that name as it was.
    """
    final = _cache_file(file_name)
    if not isinstance(cache, (list, tuple)):
        raise KVConfigError(f"cache must be a list of layer caches; got {type(cache).__name__}")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise KVConfigError(f"metadata must be None or a dict of str -> str; got {metadata!r:.200}")
    arrays: dict[str, mx.array] = {}
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(cache):
        name = type(layer).__name__
        if isinstance(layer, _OUR_CLASSES) and type(layer) is _OURS.get(name):
            for key, arr in layer.state.items():
                if key != STATE_META:  # this format keeps meta_state in the file's metadata
                    arrays[f"{i}.{key}"] = arr
            layers.append({"class": name, "meta_state": list(layer.meta_state)})
            continue
        if _mlx_cache_class(name) is not type(layer):
            raise KVConfigError(f"layer {i}: cannot save a {name}; not a palu-mlx or mlx-lm cache")
        scalars: dict[str, Any] = {}
        for key, value in tree_flatten(layer.state):
            if isinstance(value, mx.array):
                arrays[f"{i}.{key}"] = value
            elif value is None or isinstance(value, (bool, int, float, str)):
                scalars[key] = value
            else:
                raise KVConfigError(f"layer {i} ({name}): state entry {key!r} is not serializable")
        layers.append({"class": name, "scalars": scalars})
    meta = {"format": _FORMAT, "layers": json.dumps(layers), "metadata": json.dumps(metadata or {})}
    meta[CHECKSUM_KEY] = digest(arrays, {"layers": meta["layers"], "metadata": meta["metadata"]})
    tmp = f"{final}.{os.getpid()}.tmp.safetensors"
    try:
        mx.save_safetensors(tmp, arrays, meta)
        os.replace(tmp, final)
    except (OSError, RuntimeError, ValueError) as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise KVDataError(f"{final}: the prompt cache cannot be written: {exc}") from None


def load_prompt_cache(file_name: str, return_metadata: bool = False) -> Any:
    """Load a prompt cache written by :func:`save_prompt_cache` under ``file_name``
    (``.safetensors`` appended to a name without it, as on saving).

    Returns the list of layer caches, or ``(caches, metadata)`` when ``return_metadata``.
    Raises ``KVDataError`` naming the file when it cannot be read, has no checksum or its
    checksum does not match (corrupt bytes), or a layer's state does not match its metadata;
    ``KVConfigError`` when it is not a palu-mlx prompt cache.
    """
    file_name = _cache_file(file_name)
    if not isinstance(return_metadata, bool):
        raise KVConfigError(f"return_metadata={return_metadata!r} must be True or False")
    try:
        arrays, meta = mx.load(file_name, return_metadata=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise KVDataError(f"{file_name}: cannot be read as a safetensors prompt cache: {exc}") from None
    if not isinstance(arrays, dict):
        raise KVConfigError(
            f"{file_name} is not a palu-mlx prompt cache (not a safetensors file of named arrays)"
        )
    if meta.get("format") != _FORMAT:
        raise KVConfigError(
            f"{file_name} is not a palu-mlx prompt cache (format {meta.get('format')!r}); "
            "use mlx_lm.models.cache.load_prompt_cache for mlx-lm's own files"
        )
    for field in ("layers", "metadata"):
        if not isinstance(meta.get(field), str):
            raise KVDataError(
                f"{file_name}: the metadata has no {field!r} entry; the file is truncated or corrupt"
            )
    if not isinstance(meta.get(CHECKSUM_KEY), str):
        raise KVDataError(
            f"{file_name}: the metadata has no {CHECKSUM_KEY!r} entry (save_prompt_cache writes one); "
            "the file cannot be verified, so it is not loaded"
        )
    if meta[CHECKSUM_KEY] != digest(arrays, {"layers": meta["layers"], "metadata": meta["metadata"]}):
        raise KVDataError(
            f"{file_name}: checksum mismatch: the file's arrays or metadata changed after it was written "
            "(corrupt bytes); it cannot be loaded"
        )
    layers, user_meta = (
        _parse_json(file_name, meta, "layers", list),
        _parse_json(file_name, meta, "metadata", dict),
    )
    per_layer: list[dict[str, mx.array]] = [{} for _ in layers]
    for key, arr in arrays.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or not name or int(index) >= len(layers):
            raise KVDataError(
                f"{file_name}: array {key!r} is not '<layer>.<name>' with a layer index below {len(layers)}"
            )
        per_layer[int(index)][name] = arr
    caches = [
        _load_layer(file_name, i, entry, state)
        for i, (entry, state) in enumerate(zip(layers, per_layer, strict=True))
    ]
    if return_metadata:
        return caches, user_meta
    return caches


def _parse_json(file_name: str, meta: dict[str, str], field: str, kind: type) -> Any:
    return parse_json_text(meta[field], kind, f"{file_name}: metadata {field!r}", KVDataError)


def _load_layer(file_name: str, i: int, entry: Any, state: dict[str, mx.array]) -> Any:
    where = f"{file_name}: layer {i}"
    if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
        raise KVDataError(f"{where}: its metadata must be an object with a 'class' name; got {entry!r:.200}")
    cls_name = entry["class"]
    if cls_name in _OURS:
        meta_state = entry.get("meta_state")
        if not isinstance(meta_state, list):
            raise KVDataError(f"{where} ({cls_name}): its metadata has no meta_state list")
        try:
            return _OURS[cls_name].from_state(state, tuple(meta_state))
        except KVSpecError as exc:
            raise KVDataError(f"{where}: {exc}") from None
    cls = _mlx_cache_class(cls_name)
    scalars = entry.get("scalars")
    if cls is None or not isinstance(scalars, dict):
        raise KVDataError(
            f"{where}: class {cls_name!r} is neither a palu-mlx nor an mlx-lm cache (with scalars)"
        )
    flat = list(state.items()) + list(scalars.items())
    flat.sort(key=lambda kv: _flat_key_order(kv[0]))
    try:
        return cls.from_state(tree_unflatten(flat))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # mlx-lm's caches do not check their state; what they raise is all there is to report
        raise KVDataError(f"{where} ({cls_name}): mlx-lm cannot rebuild it from the file: {exc!r}") from None


def _flat_key_order(key: str) -> tuple:
    # tree_unflatten rebuilds lists from "0", "1", ...; sort numerically so "10" follows "9".
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in key.split("."))
