"""Checks of a saved cache (``from_state``'s arrays and ``meta_state``) before anything is built.

A state may come from a file, another process or a hand-edited dict. ``from_state`` reads it
through these helpers: every metadata field is checked against its allowed range and every
array against the name, shape, dtype and finiteness the metadata implies, and arrays nobody
asked for are refused. A tampered or truncated state therefore raises :class:`kvspec.KVDataError`
naming the field or array, what it holds and what was expected, instead of failing deep inside
the next ``update_and_fetch`` or silently returning other values.

**Self-describing states.** mlx-lm's own ``save_prompt_cache`` writes only each layer's ``state``
(and its class name), and its ``load_prompt_cache`` calls ``from_state(state)`` with nothing
else. So every palu-mlx ``state`` also carries its ``meta_state`` as one ``uint8`` array,
:data:`STATE_META` (UTF-8 JSON: format, class, meta_state and a sha256 checksum of the other
arrays and the meta_state; :func:`with_meta`), and ``from_state`` called without a meta_state
reads it from there and verifies the checksum (:func:`split_state`).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVDataError, KVSpecError
from mlx.utils import tree_flatten

from .config import KEYWORDS, KVCacheConfig
from .integrity import digest
from .json_text import parse_json_text
from .layer import SUPPORTED_DTYPES, dtype_from_name, dtype_name
from .mixed_bit import Segment, validate_segments

__all__ = [
    "STATE_META",
    "with_meta",
    "split_state",
    "StateArrays",
    "parse_meta_state",
    "read_config",
    "read_field",
    "read_runtime",
    "read_segments",
    "read_widths",
    "read_rope",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: name of the array in ``state`` that carries the layer's meta_state (no dot: mlx-lm's loader
#: nests names at their dots)
STATE_META = "meta_state"
_STATE_FORMAT = "palu-mlx.layer-state.v1"


def _meta_texts(meta_state: tuple[str, str] | list[str]) -> dict[str, str]:
    return {"settings": meta_state[0], "runtime": meta_state[1]}


def with_meta(cls_name: str, arrays: dict[str, mx.array], meta_state: tuple[str, str]) -> dict[str, mx.array]:
    """``arrays`` plus :data:`STATE_META`: the meta_state and a checksum of the arrays and it.

    The checksum reads every array once (one device sync), which ``state`` callers pay anyway:
    mlx-lm evaluates ``state`` right after each prefill chunk.
    """
    record = {
        "format": _STATE_FORMAT,
        "class": cls_name,
        "meta_state": list(meta_state),
        "checksum": digest(arrays, _meta_texts(meta_state)),
    }
    text = json.dumps(record, sort_keys=True).encode("utf-8")
    return {**arrays, STATE_META: mx.array(np.frombuffer(text, dtype=np.uint8))}


def split_state(state: Any, meta_state: Any, cls_name: str, owner: str) -> tuple[Any, Any]:
    """``(arrays, meta_state)`` for ``from_state``: names un-nested, :data:`STATE_META` taken out.

    A meta_state given by the caller is used as given (the embedded one is dropped). Without one,
    the embedded record must be there, name ``cls_name`` and match its checksum, else
    ``KVDataError``. A state that is not a mapping is returned as is (``StateArrays`` reports it).
    """
    if not isinstance(state, Mapping):
        return state, meta_state
    if any(isinstance(v, (Mapping, list, tuple)) for v in state.values()):
        # mlx-lm's load_prompt_cache rebuilds "key.basis" as {"key": {"basis": ...}}
        state = dict(tree_flatten(dict(state)))
    state = dict(state)
    embedded = state.pop(STATE_META, None)
    if meta_state is not None:
        return state, meta_state
    if embedded is None:
        raise KVDataError(
            f"{owner}: no meta_state was given and the state holds no {STATE_META!r} array; pass the "
            "meta_state the state was saved with, or a state written by palu-mlx's state property"
        )
    if not isinstance(embedded, mx.array) or embedded.dtype != mx.uint8 or embedded.ndim != 1:
        raise KVDataError(f"{owner}: state array {STATE_META!r} must be a 1-D uint8 array of UTF-8 JSON")
    try:
        record = json.loads(bytes(np.array(embedded)).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVDataError(f"{owner}: state array {STATE_META!r} is not UTF-8 JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != _STATE_FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise KVDataError(
            f"{owner}: state array {STATE_META!r} has format {got!r}; expected {_STATE_FORMAT!r}"
        )
    if record.get("class") != cls_name:
        raise KVDataError(
            f"{owner}: the state was written by class {record.get('class')!r}; expected {cls_name!r}"
        )
    meta = record.get("meta_state")
    if not (isinstance(meta, list) and len(meta) == 2 and all(isinstance(t, str) for t in meta)):
        raise KVDataError(f"{owner}: state array {STATE_META!r} must hold meta_state as two strings")
    if any(not isinstance(k, str) or not isinstance(v, mx.array) for k, v in state.items()):
        return state, tuple(meta)  # StateArrays names the bad entry
    if record.get("checksum") != digest(state, _meta_texts(meta)):
        raise KVDataError(
            f"{owner}: checksum mismatch: the state's arrays or meta_state changed after it was written "
            "(a corrupt or edited file); it cannot be loaded"
        )
    return state, tuple(meta)


def parse_meta_state(meta_state: Any, owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(settings JSON, runtime JSON)`` -> two dicts; KVDataError naming what is malformed."""
    if not isinstance(meta_state, (tuple, list)) or len(meta_state) != 2:
        got = (
            f"{len(meta_state)} items" if isinstance(meta_state, (tuple, list)) else type(meta_state).__name__
        )
        raise KVDataError(
            f"{owner}: meta_state must be (settings JSON, runtime JSON), two strings; got {got}"
        )
    out = []
    for i, what in enumerate(("settings", "runtime")):
        out.append(parse_json_text(meta_state[i], dict, f"{owner}: meta_state[{i}] ({what})", KVDataError))
    return out[0], out[1]


def read_config(settings: dict[str, Any], owner: str) -> KVCacheConfig:
    """The :class:`KVCacheConfig` saved in meta_state; it must name every keyword (a state written by
    :attr:`meta_state` does), so a keyword dropped from it cannot silently take its default."""
    if isinstance(settings, dict):
        missing = sorted(set(KEYWORDS) - set(settings))
        if missing:
            raise KVDataError(
                f"{owner}: meta_state config lacks the keywords {missing}; a saved state names every "
                "KVCacheConfig keyword"
            )
    try:
        return KVCacheConfig.from_json(json.dumps(settings))
    except KVSpecError as exc:
        raise KVDataError(f"{owner}: meta_state config: {exc}") from None


def read_field(runtime: dict[str, Any], name: str, owner: str) -> Any:
    """``runtime[name]``; KVDataError when the field is missing."""
    if name not in runtime:
        raise KVDataError(f"{owner}: meta_state runtime is missing field {name!r}")
    return runtime[name]


def read_runtime(
    runtime: dict[str, Any], cls_name: str, owner: str
) -> tuple[int, tuple[int, int, int, int] | None, mx.Dtype | None]:
    """The fields every cache layer writes: class, offset, shape ``(B, H, D, Dv)`` and dtype.

    An empty cache has shape and dtype None and offset 0; a used one a shape of four positive
    ints and one of the supported dtypes. The offset is an int >= 0 (not a bool or float).
    """
    saved_class = read_field(runtime, "class", owner)
    if saved_class != cls_name:
        raise KVDataError(f"{owner}: meta_state was written by class {saved_class!r}; expected {cls_name!r}")
    offset = read_field(runtime, "offset", owner)
    if not _is_int(offset) or offset < 0:
        raise KVDataError(f"{owner}: meta_state offset={offset!r} must be an int >= 0 (the token count)")
    shape, saved_dtype = read_field(runtime, "shape", owner), read_field(runtime, "dtype", owner)
    if shape is None or saved_dtype is None:
        if shape is not None or saved_dtype is not None or offset != 0:
            raise KVDataError(
                f"{owner}: meta_state of an empty cache needs shape=None, dtype=None and offset=0; "
                f"got shape={shape!r}, dtype={saved_dtype!r}, offset={offset!r}"
            )
        return 0, None, None
    if not isinstance(shape, list) or len(shape) != 4 or not all(_is_int(x) and x >= 1 for x in shape):
        raise KVDataError(f"{owner}: meta_state shape={shape!r} must be four positive ints (B, H, D, Dv)")
    if not isinstance(saved_dtype, str):
        raise KVDataError(f"{owner}: meta_state dtype={saved_dtype!r} must be float16, bfloat16 or float32")
    try:
        dtype = dtype_from_name(saved_dtype)
    except KVSpecError:
        raise KVDataError(
            f"{owner}: meta_state dtype={saved_dtype!r} is not one of float16, bfloat16, float32"
        ) from None
    return int(offset), tuple(int(x) for x in shape), dtype


def read_segments(value: Any, name: str, owner: str) -> tuple[Segment, ...]:
    """A segment layout ``[[start, stop, bits], ...]``: contiguous from 0, widths >= 1, coder bits."""
    if not isinstance(value, list) or not value:
        raise KVDataError(
            f"{owner}: meta_state {name}={value!r} must be a non-empty list of [start, stop, bits]"
        )
    segments = []
    for s in value:
        if not isinstance(s, list) or len(s) != 3 or not all(_is_int(x) for x in s):
            raise KVDataError(
                f"{owner}: meta_state {name} entry {s!r} must be [start, stop, bits] (three ints)"
            )
        segments.append(Segment(*(int(x) for x in s)))
    try:
        validate_segments(tuple(segments))
    except KVSpecError as exc:
        raise KVDataError(f"{owner}: meta_state {name}: {exc}") from None
    return tuple(segments)


def read_widths(value: Any, name: str, owner: str) -> tuple[int, ...]:
    """Fixed-quantizer widths: a non-empty list of ints in [1, 8]."""
    if not isinstance(value, list) or not value or not all(_is_int(w) and 1 <= w <= 8 for w in value):
        raise KVDataError(f"{owner}: meta_state {name}={value!r} must be a non-empty list of ints in [1, 8]")
    return tuple(int(w) for w in value)


def read_rope(value: Any, head_dim: int | None, owner: str) -> tuple[int, bool] | None:
    """The rotary's JSON half: None, or ``{"dims": even int in [2, D], "traditional": bool}``."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"dims", "traditional"}:
        raise KVDataError(
            f"{owner}: meta_state rope={value!r} must be null or {{'dims': int, 'traditional': bool}}"
        )
    dims, traditional = value["dims"], value["traditional"]
    limit = "" if head_dim is None else f" and <= the key head dim {head_dim}"
    if not _is_int(dims) or dims < 2 or dims % 2 or (head_dim is not None and dims > head_dim):
        raise KVDataError(f"{owner}: meta_state rope dims={dims!r} must be an even int >= 2{limit}")
    if not isinstance(traditional, bool):
        raise KVDataError(f"{owner}: meta_state rope traditional={traditional!r} must be true or false")
    return int(dims), traditional


class StateArrays:
    """The arrays of one ``from_state`` call, read by name against an expected shape and dtype.

    :meth:`take` checks one array; :meth:`finish` refuses arrays nobody took and checks that
    every floating array taken is finite (one device sync for all of them).
    """

    def __init__(self, state: Any, owner: str):
        if not isinstance(state, Mapping):
            raise KVDataError(
                f"{owner}: state must be a dict of name -> mlx.core.array; got {type(state).__name__}"
            )
        for key, arr in state.items():
            if not isinstance(key, str) or not isinstance(arr, mx.array):
                raise KVDataError(
                    f"{owner}: state entry {key!r} must map a str name to an mlx.core.array; "
                    f"got {type(arr).__name__}"
                )
        self._state = state
        self._owner = owner
        self._taken: dict[str, mx.array] = {}
        self._positive: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of array ``name`` before it is taken (None when there is none): for layouts whose
        sizes are read from an array."""
        return tuple(self._state[name].shape) if name in self._state else None

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: mx.Dtype | tuple[mx.Dtype, ...],
        positive: bool = False,
    ) -> mx.array:
        """The array ``name`` after checking its shape and dtype (``dtype`` may list several).

        ``positive``: :meth:`finish` also requires every element > 0 (quantizer steps).
        """
        if name not in self._state:
            raise KVDataError(f"{self._owner}: state is missing array {name!r} needed by meta_state")
        arr = self._state[name]
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tuple(arr.shape) != tuple(shape):
            raise KVDataError(
                f"{self._owner}: state array {name!r} has shape {tuple(arr.shape)}; meta_state needs {tuple(shape)}"
            )
        if arr.dtype not in allowed:
            names = " or ".join(dtype_name(d) for d in allowed)
            raise KVDataError(
                f"{self._owner}: state array {name!r} has dtype {dtype_name(arr.dtype)}; meta_state needs {names}"
            )
        self._taken[name] = arr
        if positive:
            self._positive.append(name)
        return arr

    def finish(self) -> None:
        """Refuse unexpected arrays; refuse NaN / infinity in any floating array taken."""
        extra = sorted(set(self._state) - set(self._taken))
        if extra:
            raise KVDataError(
                f"{self._owner}: state holds arrays {extra} that meta_state does not describe; "
                f"expected exactly {sorted(self._taken)}"
            )
        floats = [(n, a) for n, a in self._taken.items() if a.dtype in SUPPORTED_DTYPES and a.size]
        positive = [(n, self._taken[n]) for n in self._positive if self._taken[n].size]
        if not floats and not positive:
            return
        # one device sync for every check
        flags = mx.stack([mx.all(mx.isfinite(a)) for _, a in floats] + [mx.all(a > 0) for _, a in positive])
        flags = flags.tolist()
        bad = [n for (n, _), ok in zip(floats, flags[: len(floats)], strict=True) if not ok]
        if bad:
            raise KVDataError(
                f"{self._owner}: state arrays {bad} contain NaN or infinity; a saved cache holds finite values"
            )
        bad = [n for (n, _), ok in zip(positive, flags[len(floats) :], strict=True) if not ok]
        if bad:
            raise KVDataError(f"{self._owner}: state arrays {bad} must be > 0 everywhere (quantizer steps)")
