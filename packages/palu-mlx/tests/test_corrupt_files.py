"""Files the library reads (prompt caches, calibrations): corruption is detected and reported as
the library's error naming the file, never loaded silently or surfaced as a JSON / key / index
error."""

from __future__ import annotations

import functools
import json
import struct
import warnings

import mlx.core as mx
import pytest
from cache_snapshots import build, kv, snapshot, synthetic_calibration
from hypothesis import given
from hypothesis import strategies as st
from kvspec import KVConfigError, KVDataError, KVSpecError
from mlx_lm.models.cache import KVCache
from palu_mlx import load_prompt_cache, save_prompt_cache
from palu_mlx.calibration import Calibration
from palu_mlx.integrity import digest


def caches() -> list:
    mlx_layer = KVCache()
    mlx_layer.update_and_fetch(*kv(4, 2))
    return [build("palu-fitted"), build("naive"), build("palu-exact"), build("calibrated"), mlx_layer]


def data_start(path) -> int:
    """Offset of the first data byte of a safetensors file (after the 8-byte length and the header)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def flip(path, offset: int) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[offset] ^= 0x10
    open(path, "wb").write(bytes(raw))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "cache.safetensors")
    originals = caches()
    save_prompt_cache(path, originals, {"who": "test"})
    return path, originals


def test_round_trip_is_exact_and_verified(saved):
    path, originals = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified file loads without a warning
        loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"who": "test"}
    for a, b in zip(originals[:4], loaded[:4], strict=True):
        assert snapshot(a)[:3] == snapshot(b)[:3] and snapshot(a)[4] == snapshot(b)[4]
    assert loaded[4].offset == 4


@pytest.mark.parametrize("where", [0, 1, 17, -1], ids=["first", "second", "middle", "last"])
def test_flipped_data_byte_is_refused_naming_the_file(saved, where):
    path, _ = saved
    start = data_start(path)
    size = len(open(path, "rb").read()) - start
    flip(path, start + (where if where >= 0 else size + where) if where != 17 else start + size // 2)
    with pytest.raises(KVDataError, match=r"cache\.safetensors: checksum mismatch"):
        load_prompt_cache(path)


def test_file_without_checksum_is_refused_naming_the_file(saved, tmp_path):
    path, _ = saved
    arrays, meta = mx.load(path, return_metadata=True)
    del meta["checksum"]
    unchecked = str(tmp_path / "unchecked.safetensors")
    mx.save_safetensors(unchecked, arrays, meta)
    with pytest.raises(KVDataError, match=r"unchecked\.safetensors: the metadata has no 'checksum' entry"):
        load_prompt_cache(unchecked)


def prompt_cache_checksum(arrays, meta) -> str:
    return digest(arrays, {k: meta[k] for k in ("layers", "metadata") if k in meta})


def calibration_checksum(arrays, meta) -> str:
    return digest(arrays, meta)


def rewrite(path, out, change_meta=None, change_arrays=None, checksum=prompt_cache_checksum) -> str:
    """The file written to ``out`` with its metadata / arrays changed and its checksum recomputed
    over the changed content (``checksum(arrays, meta)``), so that the checks behind the checksum
    see the change; returns ``out``."""
    arrays, meta = mx.load(path, return_metadata=True)
    meta.pop("checksum")
    if change_meta:
        change_meta(meta)
    if change_arrays:
        change_arrays(arrays)
    meta["checksum"] = checksum(arrays, meta)
    mx.save_safetensors(str(out), arrays, meta)
    return str(out)


def times(name: str, factor: float):
    """An array edit: array ``name`` multiplied by ``factor`` (NaN or infinity: a non-finite array)."""
    return lambda a: a.update({name: a[name] * factor})


def _set(meta, key, value):
    meta[key] = value


def _layers(meta, edit):
    layers = json.loads(meta["layers"])
    edit(layers)
    meta["layers"] = json.dumps(layers)


def _meta_state(layer: int, part: int, edit):
    def change(meta):
        def inner(layers):
            runtime = json.loads(layers[layer]["meta_state"][part])
            edit(runtime)
            layers[layer]["meta_state"][part] = json.dumps(runtime)

        _layers(meta, inner)

    return change


CORRUPT_FILES = {
    "layers not JSON": (lambda m: _set(m, "layers", "[{"), None, "metadata 'layers' is not valid JSON"),
    "layers not a list": (lambda m: _set(m, "layers", "{}"), None, "'layers' must be a JSON list"),
    "metadata not JSON": (lambda m: _set(m, "metadata", "{"), None, "metadata 'metadata' is not valid JSON"),
    "layers entry missing": (lambda m: m.pop("layers"), None, "no 'layers' entry"),
    "layer without class": (lambda m: _layers(m, lambda ls: ls[0].pop("class")), None, "layer 0.*'class'"),
    "unknown class": (lambda m: _layers(m, lambda ls: ls[0].update({"class": "os"})), None, "neither"),
    "mlx-lm module function as class": (
        lambda m: _layers(m, lambda ls: ls[4].update({"class": "load_prompt_cache"})),
        None,
        "neither a palu-mlx nor an mlx-lm cache",
    ),
    "meta_state missing": (lambda m: _layers(m, lambda ls: ls[1].pop("meta_state")), None, "no meta_state"),
    "offset past the data": (
        _meta_state(0, 1, lambda r: r.update(offset=r["offset"] + 5)),
        None,
        "layer 0.*has shape",
    ),
    "negative offset": (_meta_state(1, 1, lambda r: r.update(offset=-1)), None, "offset=-1"),
    "fractional offset": (_meta_state(1, 1, lambda r: r.update(offset=6.5)), None, "offset=6.5"),
    "tampered segments": (
        _meta_state(0, 1, lambda r: r.update(key_segments=[[0, 3, 4], [4, 8, 2]])),
        None,
        "contiguous",
    ),
    "array of a layer that does not exist": (
        None,
        lambda a: a.update({"9.extra": mx.zeros(2)}),
        "'9.extra'.*layer index below 5",
    ),
    "array without a layer index": (None, lambda a: a.update({"extra": mx.zeros(2)}), "'extra'"),
    "missing array": (None, lambda a: a.pop("1.key.codes"), "layer 1.*missing array 'key.codes'"),
    "wrong dtype": (
        None,
        lambda a: a.update({"1.key.scales": a["1.key.scales"].astype(mx.float16)}),
        "dtype",
    ),
    "NaN in an array": (None, times("0.key.mean", float("nan")), "NaN or infinity"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_FILES))
def test_corrupt_content_is_a_data_error_naming_the_file(saved, tmp_path, case):
    path, _ = saved
    change_meta, change_arrays, message = CORRUPT_FILES[case]
    bad = rewrite(path, tmp_path / "bad.safetensors", change_meta, change_arrays)
    assert_refused(load_prompt_cache, bad, "bad.safetensors", message)


def assert_refused(load, path: str, names_file: str, message: str) -> None:
    """``load(path)`` of a file rewritten with a matching checksum raises a KVDataError naming the
    file (``names_file``) and saying ``message``."""
    with pytest.raises(KVDataError, match=names_file) as info:
        load(path)
    assert info.match(message)


@pytest.mark.parametrize("cut", [0, 5, 60, -3], ids=["empty", "in-length", "in-header", "in-data"])
def test_truncated_file_is_a_data_error(saved, cut):
    path, _ = saved
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[:cut])
    with pytest.raises(KVDataError, match=r"cache\.safetensors"):
        load_prompt_cache(path)


def test_missing_file_and_foreign_files(tmp_path):
    with pytest.raises(KVDataError, match="nothing.safetensors: cannot be read"):
        load_prompt_cache(str(tmp_path / "nothing.safetensors"))
    foreign = str(tmp_path / "foreign.safetensors")
    mx.save_safetensors(foreign, {"x": mx.zeros(2)})
    with pytest.raises(KVConfigError, match="not a palu-mlx prompt cache"):
        load_prompt_cache(foreign)


def test_failed_save_keeps_the_earlier_file(saved):
    path, _ = saved
    before = open(path, "rb").read()
    with pytest.raises(KVConfigError, match="cannot save a dict"):
        save_prompt_cache(path, [build("naive"), {}])
    assert open(path, "rb").read() == before


def test_a_name_without_the_suffix_loads_under_the_name_it_was_saved_as(tmp_path):
    originals = caches()
    name = str(tmp_path / "session")
    save_prompt_cache(name, originals)
    # mlx-lm's save (through mx.save_safetensors) appends the suffix too; load resolves the same way
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.safetensors"]
    for loaded in (load_prompt_cache(name), load_prompt_cache(name + ".safetensors")):
        assert [snapshot(c) for c in loaded[:4]] == [snapshot(c) for c in originals[:4]]


def test_a_directory_is_refused_and_nothing_is_written(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    (tmp_path / "taken.safetensors").mkdir()
    for name in (target, tmp_path / "taken", tmp_path / "taken.safetensors"):
        with pytest.raises(KVConfigError, match=r"is a directory; allowed: a file path"):
            save_prompt_cache(str(name), caches())
        with pytest.raises(KVConfigError, match=r"is a directory"):
            load_prompt_cache(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "taken.safetensors"]
    assert list(target.iterdir()) == []


# ----------------------------------------------------------------------------- calibration files
@pytest.fixture
def calibration_path(tmp_path):
    path = str(tmp_path / "calib.safetensors")
    synthetic_calibration(2).save(path)
    return path


def test_calibration_round_trip(calibration_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verified: no warning
        loaded = Calibration.load(calibration_path)
    assert loaded.model["n_layers"] == 2 and loaded.keys[1].basis.shape == (2, 32, 32)


CORRUPT_CALIBRATIONS = {
    "model header not JSON": (lambda m: _set(m, "model", "{"), None, "corrupt"),
    "model header missing": (lambda m: m.pop("model"), None, "corrupt.*'model'"),
    "n_layers not an int": (
        lambda m: _set(m, "model", json.dumps({"n_layers": "2", "n_kv_heads": 2, "head_dim": 32})),
        None,
        "n_layers",
    ),
    "pre_rope not a bool": (lambda m: _set(m, "pre_rope", "3"), None, "pre_rope"),
    "tokens not a number": (lambda m: _set(m, "tokens", "many"), None, "corrupt"),
    "array name malformed": (None, lambda a: a.update({"0.key": mx.zeros(2)}), "'0.key'"),
    "layer index past n_layers": (
        None,
        lambda a: a.update({"7.key.mean": mx.zeros((2, 32))}),
        "'7.key.mean'",
    ),
    "variance missing": (
        None,
        lambda a: a.pop("1.value.variance"),
        "layer 1 value.*needs basis, mean, variance",
    ),
    "mean of the wrong shape": (None, lambda a: a.update({"0.key.mean": mx.zeros((2, 31))}), "mean"),
    "head count differs from header": (
        None,
        lambda a: a.update({k: v[:1] for k, v in a.items() if k.startswith("1.")}),
        "heads; the header says 2",
    ),
    "infinite basis": (None, times("0.key.basis", float("inf")), "NaN or infinity"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_CALIBRATIONS))
def test_corrupt_calibration_is_a_data_error_naming_the_file(calibration_path, case):
    change_meta, change_arrays, message = CORRUPT_CALIBRATIONS[case]
    rewrite(calibration_path, calibration_path, change_meta, change_arrays, calibration_checksum)
    assert_refused(
        Calibration.load,
        calibration_path,
        "palu_calibration='.*calib.safetensors' is corrupt",
        message,
    )


def test_calibration_with_a_flipped_data_byte_is_refused(calibration_path):
    start = data_start(calibration_path)
    flip(calibration_path, start + (len(open(calibration_path, "rb").read()) - start) // 2)
    with pytest.raises(KVDataError, match="calib.safetensors' is corrupt: checksum mismatch"):
        Calibration.load(calibration_path)


def test_calibration_without_checksum_is_refused(calibration_path):
    arrays, meta = mx.load(calibration_path, return_metadata=True)
    del meta["checksum"]
    mx.save_safetensors(calibration_path, arrays, meta)
    with pytest.raises(KVDataError, match="calib.safetensors' has no 'checksum' entry"):
        Calibration.load(calibration_path)


# ----------------------------------------------------------------------------- any flipped byte
@functools.cache
def _flip_source() -> tuple[bytes, list]:
    """One saved file (bytes) and the snapshots of what it holds, made once per session."""
    import tempfile

    originals = [build("palu-fitted"), build("naive"), build("calibrated")]
    with tempfile.TemporaryDirectory() as tmp:
        save_prompt_cache(f"{tmp}/c.safetensors", originals)
        raw = open(f"{tmp}/c.safetensors", "rb").read()
    return raw, [snapshot(c)[:3] for c in originals]


@given(position=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_flipped_byte_is_refused_or_harmless(tmp_path_factory, position, mask):
    # header, padding, checksum or data: the load raises the library's error, or (a flip the
    # format ignores, e.g. in JSON whitespace) returns exactly what was saved
    raw, want = _flip_source()
    damaged = bytearray(raw)
    damaged[int(position * len(raw))] ^= mask
    path = str(tmp_path_factory.mktemp("flip") / "c.safetensors")
    open(path, "wb").write(bytes(damaged))
    try:
        loaded = load_prompt_cache(path)
    except KVSpecError:
        return
    assert [snapshot(c)[:3] for c in loaded] == want
