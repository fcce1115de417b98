"""One palu cache, two projection sources: a calibrated cache is a PaluKVCache on a calibration's
projections, its states keep their own layout, and a state's config must name every field."""

from __future__ import annotations

import json

import pytest
from cache_snapshots import D, array_bytes, build, kv, snapshot
from kvspec import KVConfigError, KVDataError, KVShapeError
from palu_mlx import CalibratedKVCache, PaluKVCache
from palu_mlx.config import KEYWORDS
from palu_mlx.projection_source import FitAtPrefill, FromCalibration


def state_bytes(cache) -> dict:
    return {k: array_bytes(v) for k, v in cache.state.items()}


def test_a_calibrated_cache_is_a_palu_cache_on_a_calibration_source():
    cache = build("calibrated")
    assert isinstance(cache, PaluKVCache) and isinstance(cache.source, FromCalibration)
    assert isinstance(build("palu-fixed").source, FitAtPrefill)
    # codes from the first token: no exact phase, and the projections are the calibration's
    assert cache.fitted and cache._key_proj is cache.source.key.projection
    # the calibration's constants are the model's: out of nbytes, in constant_nbytes
    assert cache.constant_nbytes == sum(
        a.nbytes for t in (cache.source.key, cache.source.value) for a in t.arrays().values()
    )
    assert cache.nbytes == sum(a.nbytes for a in cache.held_arrays())
    assert build("palu-fixed").constant_nbytes == 0


def test_each_source_keeps_its_state_layout():
    calibrated = build("calibrated").state
    names = list(calibrated)
    # calibration constants first (no singular values), then the codes
    assert names[:4] == ["key.basis", "key.mean", "key.steps", "value.basis"]
    assert "key.singular_values" not in calibrated and names.index("key.codes") > names.index("value.steps")
    fitted = list(build("palu-fixed").state)
    assert fitted[:5] == ["key.basis", "key.mean", "key.singular_values", "key.steps", "key.codes"]
    runtime = json.loads(build("calibrated").meta_state[1])
    assert {"key_widths", "value_widths"} <= set(runtime) and "key_segments" not in runtime
    assert "key_segments" in json.loads(build("palu-fixed").meta_state[1])


@pytest.mark.parametrize("kind", ["calibrated", "calibrated-empty", "palu-fixed", "palu-exact"])
def test_each_class_reads_only_its_own_layout(kind):
    cache = build(kind)
    other = PaluKVCache if isinstance(cache, CalibratedKVCache) else CalibratedKVCache
    with pytest.raises(KVDataError, match="class"):
        other.from_state(cache.state)
    assert snapshot(type(cache).from_state(cache.state)) == snapshot(cache)


def test_the_calibration_source_checks_its_dims_and_arguments():
    cache = build("calibrated-empty")
    with pytest.raises(KVShapeError, match="do not match the calibration"):
        cache.update_and_fetch(*(x[..., : D // 2] for x in kv(1, 2)))
    with pytest.raises(KVConfigError, match="key must be a CalibratedTensor"):
        CalibratedKVCache(cache.config, "key", cache.source.value, None)
    with pytest.raises(KVConfigError, match="takes no allocation_policy"):
        CalibratedKVCache.from_state(cache.state, allocation_policy=object())


CONFIG_FIELDS = sorted(KEYWORDS)


@pytest.mark.parametrize("kind", ["palu-fixed", "palu-exact", "calibrated"])
@pytest.mark.parametrize("dropped", CONFIG_FIELDS)
def test_a_state_whose_config_lacks_a_field_is_refused_naming_it(kind, dropped):
    cache = build(kind)
    settings, runtime = cache.meta_state
    config = json.loads(settings)
    assert set(config) == set(CONFIG_FIELDS)  # meta_state names every keyword
    del config[dropped]
    with pytest.raises(KVDataError, match=rf"meta_state config lacks the keywords \['{dropped}'\]"):
        type(cache).from_state(cache.state, (json.dumps(config), runtime))
