"""One palu cache, two projection sources: a calibrated cache is a PaluKVCache on a calibration's
projections, its states keep their own layout, and states saved before later config fields
existed still load."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cache_snapshots import D, array_bytes, build, kv, snapshot
from kvspec import KVConfigError, KVDataError, KVShapeError
from palu_mlx import CalibratedKVCache, KVCacheConfig, PaluKVCache
from palu_mlx.projection_source import FitAtPrefill, FromCalibration
from palu_mlx.state_checks import LATER_CONFIG_FIELDS


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


@pytest.mark.parametrize("kind", ["palu-fixed", "palu-exact", "calibrated"])
@pytest.mark.parametrize("dropped", [tuple(LATER_CONFIG_FIELDS), ("palu_relative_error",)])
def test_a_state_saved_before_later_config_fields_loads_with_their_defaults(kind, dropped):
    cache = build(kind)
    settings, runtime = cache.meta_state
    # the state as a version before those fields coded it: with the values they read as (the
    # weighing's default, automatic now, was squared error then)
    as_then = {**json.loads(settings), **{k: LATER_CONFIG_FIELDS[k] for k in dropped}}
    cache = type(cache).from_state(cache.state, (json.dumps(as_then), runtime))
    settings, runtime = cache.meta_state
    earlier = {k: v for k, v in json.loads(settings).items() if k not in dropped}
    restored = type(cache).from_state(cache.state, (json.dumps(earlier), runtime))
    assert restored.config == cache.config
    assert state_bytes(restored) == state_bytes(cache)
    # a field that was always saved is still required
    del earlier["palu_sink_tokens"]
    with pytest.raises(KVDataError, match=r"lacks the fields \['palu_sink_tokens'\]"):
        type(cache).from_state(cache.state, (json.dumps(earlier), runtime))


#: the KVCacheConfig fields every saved state has named since states were first saved
FIRST_SAVED_FIELDS = frozenset(
    {
        "method",
        "head_dim",
        "palu_rank",
        "palu_energy_threshold",
        "palu_n_head_groups",
        "palu_hi_bit",
        "palu_lo_bit",
        "palu_hi_fraction",
        "palu_group_size",
        "palu_quantize_values",
        "palu_bits",
        "palu_calibration",
        "palu_min_fit_tokens",
        "palu_check_finite",
        "palu_pre_rope",
        "palu_token_scale",
        "palu_sink_tokens",
        "palu_recent_tokens",
        "naive_bits",
        "naive_group_size",
    }
)


def test_every_config_field_added_later_has_the_value_earlier_states_read():
    """A KVCacheConfig field added after states were first saved needs an entry in
    state_checks.LATER_CONFIG_FIELDS (the value that codes as before), or earlier states stop loading."""
    later = {f.name for f in dataclasses.fields(KVCacheConfig)} - FIRST_SAVED_FIELDS
    assert later == set(LATER_CONFIG_FIELDS)
    defaults = KVCacheConfig()
    # the weighing's default became automatic (relative error at the prefill) after states saved
    # without the field were coded by squared error: those read it as False, not as the default
    assert LATER_CONFIG_FIELDS["palu_relative_error"] is False and defaults.palu_relative_error is None
    assert all(
        getattr(defaults, name) == value
        for name, value in LATER_CONFIG_FIELDS.items()
        if name != "palu_relative_error"
    )
