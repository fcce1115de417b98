"""One tier -> config path: what ``palu-mlx compare`` and ``palu-mlx generate`` / ``server`` run under a
tier's name is the registry's config, sized for the model by ``Tier.for_head_dim``."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from palu_mlx import KVCacheBuilder, PaluKVCache
from palu_mlx.compare import tier_config
from palu_mlx.rotation_code import RotationKVCache
from palu_mlx.serving import palu_config as serving_config
from palu_mlx.tiers import CALIBRATED_TIERS, SENSITIVITY_TIERS, TIERS, UNQUANTIZED, Tier, palu_config, tier

HEAD_DIM, N_KV = 32, 4  # the tiny qwen3's


def _args(**fields) -> argparse.Namespace:
    return argparse.Namespace(**{"palu_tier": None, "palu_bits": None, "calibration": None, **fields})


def _registered(name: str, calibration: str | None = None) -> dict:
    """The registry's fields with only what a model decides changed: its head dim, and a rank that
    is the whole head (full rank) or capped at it."""
    entry = tier(name) if calibration is None else tier(name).with_calibration(calibration)
    fields = json.loads(entry.config.to_json())
    rank = fields["palu_rank"]
    if rank is not None:
        fields["palu_rank"] = HEAD_DIM if entry.full_rank else min(rank, HEAD_DIM)
    return {**fields, "head_dim": HEAD_DIM}


@pytest.mark.parametrize("name", list(TIERS))
def test_compare_and_serving_run_the_registry_s_config_with_one_projection_per_kv_head(name, tiny_model):
    compared = tier_config(name, HEAD_DIM, N_KV)
    assert json.loads(compared.to_json()) == _registered(name)
    assert compared == tier(name).for_head_dim(HEAD_DIM)
    assert serving_config(tiny_model, _args(palu_tier=name)) == compared
    # the caches compare builds hold that config and fit one projection per KV head
    caches = KVCacheBuilder.for_model(tiny_model, compared)
    tiny_model(mx.arange(3, 3 + 2 * HEAD_DIM)[None], cache=caches)
    # the rotation tiers' code is built for the model's heads (RotationKVCache), nothing fitted
    expected = RotationKVCache if compared.method == "rotation" else PaluKVCache
    for cache in caches:
        assert type(cache) is expected and cache.config == compared and cache.fitted
        assert cache._key_proj.n_groups == cache._value_proj.n_groups == N_KV


@pytest.mark.parametrize("name", [*CALIBRATED_TIERS, *SENSITIVITY_TIERS])
def test_calibrated_tiers_are_sized_the_same_way(name):
    assert json.loads(tier_config(name, HEAD_DIM, N_KV, "f").to_json()) == _registered(name, "f")


def test_serving_takes_a_tier_s_calibrated_twin_and_refuses_a_tier_without_one(tiny_model, tmp_path):
    path = tmp_path / "model.palu-calibration.safetensors"
    path.write_bytes(b"")  # only its existence is read here
    twin = serving_config(tiny_model, _args(palu_tier="palu-2bit-scaled", calibration=str(path)))
    assert twin == tier_config("palu-2bit-scaled+cal", HEAD_DIM, N_KV, str(path))
    with pytest.raises(
        KVConfigError, match=r"'palu-2.25bit-scaled\+rel' with --calibration.*allowed: palu-2bit-scaled"
    ):
        serving_config(tiny_model, _args(palu_tier="palu-2.25bit-scaled+rel", calibration=str(path)))


def test_a_full_rank_tier_takes_the_model_s_whole_head():
    full = Tier("full", "full rank", palu_config(palu_rank=64, **UNQUANTIZED), full_rank=True)
    rank16 = Tier("r16", "rank 16", palu_config(palu_rank=16, **UNQUANTIZED))
    assert full.for_head_dim(128).palu_rank == 128
    assert rank16.for_head_dim(8).palu_rank == 8
    assert rank16.for_head_dim(128).palu_rank == 16


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None, "64"])
def test_for_head_dim_refuses_what_is_not_a_head_dim(bad):
    entry = tier("reference-default")
    with pytest.raises(KVConfigError, match=rf"head_dim={bad!r} must be a positive integer"):
        entry.for_head_dim(bad)
    assert entry is tier("reference-default") and entry.config.head_dim is None


def test_an_unbound_calibrated_tier_cannot_be_sized():
    with pytest.raises(KVConfigError, match="needs a calibration file"):
        tier("palu-2bit-scaled+cal").for_head_dim(HEAD_DIM)
    with pytest.raises(KVConfigError, match="needs a sensitivity profile"):
        tier("palu-2bit-scaled+sens").for_head_dim(HEAD_DIM)
