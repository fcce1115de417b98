"""Calibrated per-layer budgets (flashcodec.hf.calibrate): a schedule within the budget, measured
damages, a joint re-measurement, save / reload, and clear errors for bad budgets or texts."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_model  # noqa: E402
from flashcodec import JPEGCodec, PNGCodec  # noqa: E402
from flashcodec.hf import Calibration, FlashCodecCache, calibrate  # noqa: E402
from kvspec import KVConfigError  # noqa: E402

CANDIDATES = {
    "int8": JPEGCodec(8, 8, quant_bits=8),
    "int4": JPEGCodec(8, 8, quant_bits=4),
    "k2-int8": JPEGCodec(8, 2, quant_bits=8),
}


def tiny(layers=3):
    return tiny_model(layers=layers)


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def texts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (80,), generator=g), torch.randint(3, 128, (64,), generator=g)]


@pytest.fixture(scope="module")
def result(model, texts):
    return calibrate(model, texts, budget=0.2, candidates=CANDIDATES)


def test_the_schedule_is_within_the_budget_and_measured(result):
    # fp32 model, head_dim 16: int8 0.3125, int4 0.1875, k2-int8 0.078 of the raw bytes
    assert sorted(result.schedule) == [0, 1, 2]
    assert result.ratio <= 0.2 == result.budget
    costs = {"int8": 0.3125, "int4": 0.1875, "k2-int8": 0.078125}
    assert result.ratio == pytest.approx(sum(costs[n] for n in result.schedule.values()) / 3)
    assert set(result.damage) == {0, 1, 2} and all(set(d) == set(CANDIDATES) for d in result.damage.values())
    assert all(v >= 0 and math.isfinite(v) for d in result.damage.values() for v in d.values())
    # more bits, less damage, layer by layer
    assert all(d["int8"] <= d["int4"] for d in result.damage.values())
    assert result.predicted_kl == pytest.approx(sum(result.damage[i][n] for i, n in result.schedule.items()))
    assert math.isfinite(result.measured_kl) and result.measured_kl > 0
    assert result.tokens == 40 + 32


def test_a_generous_budget_keeps_the_least_damaging_codec(model, texts):
    loose = calibrate(model, texts, budget=10.0, candidates=CANDIDATES)
    for idx, name in loose.schedule.items():
        assert loose.damage[idx][name] == min(loose.damage[idx].values())


def test_save_and_reload_give_the_same_schedule(result, tmp_path, model):
    path = tmp_path / "schedule.json"
    result.save(path)
    again = Calibration.load(path)
    assert again == result
    assert again.per_layer == {i: CANDIDATES[n] for i, n in result.schedule.items()}
    cache = again.cache(model.config)
    assert isinstance(cache, FlashCodecCache)
    assert {i: cache.layers[i].codec_cache.codec for i in cache.codec_layer_indices} == again.per_layer


def test_the_schedule_runs_in_a_cache(result, model, texts):
    cache = result.cache(model.config)
    with torch.no_grad():
        model(texts[0][None], cache=cache)
    held = cache.storage_bytes()
    assert held.used / (held.raw - held.tail) <= result.budget + 1e-9  # archived blocks only: the formula


@pytest.mark.parametrize("budget", [0, -1.0, float("nan"), True, "0.5", float("inf")])
def test_bad_budgets_raise(model, texts, budget):
    with pytest.raises(KVConfigError, match="budget"):
        calibrate(model, texts, budget=budget, candidates=CANDIDATES)


def test_an_unreachable_budget_says_what_the_cheapest_holds(model, texts):
    with pytest.raises(KVConfigError, match=r"cannot be met: the cheapest schedule holds 0\.0781"):
        calibrate(model, texts[:1], budget=0.05, candidates=CANDIDATES)


BAD_TEXTS = {
    "empty": ([], "non-empty list"),
    "one-string": ("abc", "non-empty list"),
    "float-ids": ([torch.zeros(64)], r"texts\[0\] must be"),
    "too-short": ([torch.arange(3, 20)], r"texts\[0\] has 17 tokens"),
    "strings-without-tokenizer": (["some text"], "tokenizer"),
}


@pytest.mark.parametrize("case", BAD_TEXTS)
def test_bad_texts_raise(model, case):
    texts, match = BAD_TEXTS[case]
    with pytest.raises(KVConfigError, match=match):
        calibrate(model, texts, budget=0.5, candidates=CANDIDATES)


def test_bad_candidates_and_data_raise(model, texts):
    with pytest.raises(KVConfigError, match="one block size"):
        calibrate(model, texts, budget=0.5, candidates={"a": JPEGCodec(8), "b": PNGCodec(4)})
    with pytest.raises(KVConfigError, match="candidates"):
        calibrate(model, texts, budget=0.5, candidates={"a": "jpeg"})
    with pytest.raises(KVConfigError, match="format"):
        Calibration.from_dict({"schedule": {}})
