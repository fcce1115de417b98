"""The palu study configurations (benchmarks/studies/palu_tiers.py): every name a results file
recorded still means the configuration it recorded, and a study never takes a user's tier's place."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from kvspec import KVConfigError
from palu_mlx.tiers import CALIBRATED_TIERS, MAX_TIERS, SENSITIVITY_TIERS, TIERS

BENCH_DIR = Path(__file__).resolve().parents[1]
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from studies.palu_tiers import (  # noqa: E402
    ALL_TIERS,
    STUDY_CALIBRATED_TIERS,
    STUDY_SENSITIVITY_TIERS,
    STUDY_TIERS,
    tier,
    tier_config,
)

#: the real-model results whose rows are named by tier (benchmarks/palu/real_model.py)
RESULTS = (
    "palu_real_model.json",
    "palu_frontier.json",
    "palu_real_model_4w.json",
    "palu_real_model_long.json",
)
#: what a row records beside the config's fields (a sensitivity profile's reading of the model)
NOT_FIELDS = {"profile_sha256", "layer_bits", "layer_key_weights", "layer_value_weights"}


def _means(config, recorded: dict) -> bool:
    """Whether the flat keywords a row ``recorded`` say nothing ``config`` does not: applied to it they
    change nothing (a value its coder does not read, such as the hi/lo split's token scale, changes
    nothing), and the bits and weighing a row may have left automatic code as ``config`` codes."""
    from palu_mlx import KVCacheConfig

    fields = {k: v for k, v in recorded.items() if k not in NOT_FIELDS}
    automatic = {key: fields.pop(key) for key in ("palu_bits", "palu_relative_error") if key in fields}
    # a row recorded before the weighing had a keyword was weighed by squared error
    automatic.setdefault("palu_relative_error", False)
    return (
        config.replace(**fields) == config
        and KVCacheConfig(**fields, **automatic).coder_choice == config.coder_choice
    )


@pytest.mark.parametrize("results", RESULTS)
def test_every_recorded_tier_row_is_the_configuration_its_name_means(results):
    rows = json.loads((BENCH_DIR / "results" / results).read_text())["rows"]
    checked = 0
    for name, row in rows.items():
        if name not in ALL_TIERS:
            continue  # a peer, the baseline or an ablation the script builds from a tier
        recorded = row["config"]
        path = recorded.get("palu_calibration") or recorded.get("palu_sensitivity")
        assert _means(tier_config(name, recorded["head_dim"], path), recorded), name
        checked += 1
    assert checked  # the file names at least one tier


def test_study_names_are_apart_from_the_registry_s():
    package = {**TIERS, **CALIBRATED_TIERS, **SENSITIVITY_TIERS}
    studies = {**STUDY_TIERS, **STUDY_CALIBRATED_TIERS, **STUDY_SENSITIVITY_TIERS}
    assert not package.keys() & studies.keys()
    assert ALL_TIERS == {**package, **studies}
    assert all(len(registry) <= MAX_TIERS for registry in (TIERS, CALIBRATED_TIERS, SENSITIVITY_TIERS))
    # every name the registry gave up is still here for the studies that measured it
    assert {"full-rank-fp16", "palu-3bit", "palu-3.25bit-scaled+rel", "palu-1.7bit-compact-fill+sens"} <= set(
        studies
    )


def test_a_registry_name_resolves_to_the_registry_s_own_tier():
    for name, entry in TIERS.items():
        assert tier(name) is entry


def test_an_unknown_name_lists_the_registry_and_the_studies():
    with pytest.raises(
        KVConfigError, match=r"tier='palu-9bit'.*allowed: rotation-4bit.*study configuration: full-rank"
    ):
        tier("palu-9bit")
    with pytest.raises(KVConfigError, match="tier=None"):
        tier(None)


def test_every_study_name_of_the_package_s_snapshot_is_the_configuration_it_was_measured_as():
    # packages/palu-mlx/tests/tiers_as_measured.json: every tier's fields and coder as measured,
    # taken when the registry still held these names (one head group then, one per KV head now)
    snapshot = BENCH_DIR.parent / "packages" / "palu-mlx" / "tests" / "tiers_as_measured.json"
    as_measured = json.loads(snapshot.read_text())
    studied = [name for name in as_measured if name not in TIERS and name not in CALIBRATED_TIERS]
    assert "full-rank-fp16" in studied and "palu-1bit" in studied
    for name in studied:
        config = tier(name).config
        assert _means(config, {**as_measured[name]["config"], "palu_n_head_groups": None}), name
        coder = dict(as_measured[name]["coder"])
        assert type(config.coder_choice).__name__ == coder.pop("class"), name
        assert dataclasses.asdict(config.coder_choice) == coder, name


def test_compare_runs_a_study_configuration_and_its_calibrated_twin(model_path):
    # what benchmarks/palu/calibration_weighting.py runs: compare offering the studies too
    from palu_mlx.builder import model_kv_dims
    from palu_mlx.compare import PaluHarness, build_candidates, load_model

    calibration = BENCH_DIR / "model" / "tiny-qwen3.palu-calibration.safetensors"
    model, _, _ = load_model(str(model_path), "float32")
    assert "palu-2bit" in PaluHarness(ALL_TIERS).tiers() and "palu-2bit" not in PaluHarness().tiers()
    assert "palu-2bit+cal" not in PaluHarness(ALL_TIERS).tiers()  # runs only beside its tier
    candidates, _ = build_candidates(model, ["palu-2bit"], [], str(calibration), registry=ALL_TIERS)
    assert [c.name for c in candidates] == ["baseline", "palu-2bit", "palu-2bit+cal"]
    assert candidates[1].config == tier_config("palu-2bit", model_kv_dims(model)[0]).keywords()
    with pytest.raises(KVConfigError, match="'palu-2bit' is not a palu tier"):
        build_candidates(model, ["palu-2bit"], [])  # the package's registry alone
