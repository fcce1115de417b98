"""Calibration: fit, file round trip, model identity, the fixed-quantizer coder and calibrated caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVShapeError
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from palu_helpers import make_tiny_qwen3
from palu_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache
from palu_mlx.calibrated import CalibratedKVCache, allocate_widths
from palu_mlx.calibration import Calibration, calibrate, default_calibration_text
from palu_mlx.cli import main as cli_main
from palu_mlx.coders.fixed import GAUSSIAN_STEP, FixedQuantCoder

HEAD_DIM = 32


class _ByteTokenizer:
    """Bytes of the text mod 256 (the tiny model's vocabulary)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    model = make_tiny_qwen3()
    result = calibrate(model, _ByteTokenizer(), window=128, max_tokens=512, progress=False)
    path = tmp_path_factory.mktemp("calib") / "tiny.safetensors"
    result.save(path)
    return str(path), result


def greedy(model, prompt, steps, caches) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches)]


def test_shipped_text_is_not_kvbench_heldout_text():
    text = default_calibration_text()
    assert len(text) > 50_000
    try:
        from kvbench.models import default_text_path
    except ImportError:
        pytest.skip("kvbench not installed")
    heldout = default_text_path().read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if len(p) > 80]
    assert not [p for p in paragraphs if p in heldout]


def test_calibration_fits_invertible_per_head_transforms(calibration_file):
    _, result = calibration_file
    assert result.pre_rope and result.tokens == 512 and len(result.keys) == 2
    k = result.keys[0]
    assert k.basis.shape == (4, HEAD_DIM, HEAD_DIM) and k.mean.shape == (4, HEAD_DIM)
    assert result.weighting == "attention" and k.decoder is not None  # the default: whitened, own decoder
    gram = np.array(k.decoder.transpose(0, 2, 1) @ k.basis)  # at full rank the decoder undoes the encoder
    assert np.allclose(gram, np.eye(HEAD_DIM)[None], atol=1e-3)
    variance = np.array(k.variance)
    assert np.all(np.diff(variance, axis=1) <= 1e-6) and variance.min() >= 0


def test_file_round_trips_and_identifies_the_model(calibration_file):
    path, result = calibration_file
    loaded = Calibration.load(path)
    assert loaded.model == result.model and loaded.text_sha256 == result.text_sha256
    for a, b in zip(loaded.keys + loaded.values, result.keys + result.values, strict=True):
        assert all(
            mx.array_equal(x, y).item() for x, y in zip(a.arrays().values(), b.arrays().values(), strict=True)
        )
    loaded.check_model(make_tiny_qwen3())  # same seed: same weights
    half = make_tiny_qwen3()
    half.set_dtype(mx.bfloat16)
    loaded.check_model(half)  # the same weights in 16 bits
    with pytest.raises(KVConfigError, match="another model.*kv_weights"):
        loaded.check_model(make_tiny_qwen3(seed=1))
    with pytest.raises(KVConfigError, match="another model.*n_layers"):
        loaded.check_model(make_tiny_qwen3(num_hidden_layers=3))


def test_for_model_rejects_a_calibration_for_another_model(calibration_file, tmp_path):
    path, _ = calibration_file
    with pytest.raises(KVConfigError, match="another model"):
        KVCacheBuilder.for_model(
            make_tiny_qwen3(seed=2), KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=path)
        )
    other = tmp_path / "x.safetensors"
    mx.save_safetensors(str(other), {"x": mx.zeros(2)})
    with pytest.raises(KVConfigError, match="not a palu-mlx calibration file"):
        KVCacheBuilder.for_model(
            make_tiny_qwen3(), KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=str(other))
        )
    with pytest.raises(KVConfigError, match="cannot be read"):
        KVCacheBuilder.for_model(
            make_tiny_qwen3(), KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=str(tmp_path / "missing"))
        )


@pytest.mark.parametrize("widths", [(1,), (8, 8), (3, 5, 7, 1, 2), (4,) * 9], ids=str)
def test_fixed_coder_packs_whole_bytes_and_quantizes_within_half_a_step(widths):
    steps = mx.full((2, len(widths)), 0.1)
    coder = FixedQuantCoder(widths, steps)
    levels = np.array([1 << w for w in widths])
    x = mx.array(np.random.default_rng(0).uniform(-0.05, 0.05, (1, 2, 7, len(widths))) * levels).astype(
        mx.float32
    )
    packed = coder.encode(x)
    assert packed.dtype == mx.uint8 and packed.shape == (1, 2, 7, -(-sum(widths) // 8))
    assert float(mx.abs(coder.decode(packed) - x).max()) <= 0.05 + 1e-6
    assert mx.array_equal(coder.encode(coder.decode(packed)), packed).item()


def test_widths_spend_the_budget_across_layers_keys_and_values(calibration_file):
    _, result = calibration_file
    widths = allocate_widths(result, 1.5)
    assert sum(int(w.sum()) for pair in widths for w in pair) == round(1.5 * 2 * 2 * HEAD_DIM)
    assert GAUSSIAN_STEP[1] == pytest.approx(1.596)


def test_calibrated_caches_generate_save_and_load(calibration_file, tmp_path):
    path, _ = calibration_file
    model = make_tiny_qwen3()
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=path, palu_bits=8)
    )
    assert all(isinstance(c, CalibratedKVCache) and c.rotary is not None for c in caches)
    assert not hasattr(caches[0], "bits")  # mlx-lm would send it to its quantized attention
    prompt = list(range(3, 40))
    tokens = greedy(model, prompt, 8, caches)
    assert greedy(model, prompt, 8, [KVCache() for _ in model.layers]) == tokens  # 8 bits: near exact
    stats = caches[0].storage_stats()
    assert caches[0].constant_nbytes > 0 and stats.nbytes == sum(a.nbytes for a in caches[0].held_arrays())
    file = str(tmp_path / "cache.safetensors")
    save_prompt_cache(file, caches)
    loaded = load_prompt_cache(file)
    assert all(
        type(c) is CalibratedKVCache and c.offset == d.offset for c, d in zip(loaded, caches, strict=True)
    )
    assert greedy(model, [7], 6, loaded) == greedy(model, [7], 6, caches)


def test_calibrated_cache_at_low_bits_is_small_and_checks_shapes(calibration_file):
    path, _ = calibration_file
    model = make_tiny_qwen3()
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=path, palu_bits=1.5)
    )
    model(mx.array([list(range(3, 67))]), cache=caches)
    stats = [c.storage_stats() for c in caches]
    bits = 8 * sum(s.nbytes for s in stats) / sum(s.elements for s in stats)
    # capacity + byte padding + a 2-byte token scale per row of keys and of values, plus the 4
    # first and 32 newest tokens exact (float32)
    row = -(-1.5 * 2 * HEAD_DIM // 8) + 2 + 2 * 2
    sinks = (4 + 32) * 2 * HEAD_DIM * 4
    assert bits <= 8 * (256 * row + sinks) / (64 * 2 * HEAD_DIM)
    k = mx.zeros((1, 4, 1, 16))
    with pytest.raises(KVShapeError, match="fixed by the first update"):
        caches[0].update_and_fetch(k, k)
    assert caches[0].offset == 64
    fresh = KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=path))[0]
    with pytest.raises(KVShapeError, match="calibration"):
        fresh.update_and_fetch(k, k)
    assert fresh.offset == 0 and fresh.empty()


def test_pre_rope_calibration_needs_the_pre_rope_path(calibration_file):
    path, _ = calibration_file
    with pytest.raises(KVConfigError, match="pre-RoPE"):
        KVCacheBuilder.for_model(
            make_tiny_qwen3(), KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=path, palu_pre_rope=False)
        )


def test_cli_calibrate_reports_a_bad_model(capsys, tmp_path):
    assert cli_main(["calibrate", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "c")]) == 1
    assert "--model" in capsys.readouterr().err


def test_config_checks_palu_calibration():
    with pytest.raises(KVConfigError, match="palu_calibration"):
        KVCacheConfig(palu_calibration=3)
    from palu_mlx import PaluKVCache

    with pytest.raises(KVConfigError, match="for_model"):
        PaluKVCache(KVCacheConfig(palu_calibration="x.safetensors"))


def test_compare_adds_a_calibrated_candidate_per_bit_budget_tier(calibration_file):
    pytest.importorskip("kvbench")
    from palu_mlx.compare import build_candidates

    path, _ = calibration_file
    model = make_tiny_qwen3()
    candidates, absent = build_candidates(
        model, ["reference-default", "palu-2bit-scaled"], [], calibration=path
    )
    assert absent == []
    assert [c.name for c in candidates] == [
        "baseline",
        "reference-default",
        "palu-2bit-scaled",
        "palu-2bit-scaled+cal",
    ]
    assert all(isinstance(c, CalibratedKVCache) for c in candidates[-1].make_cache())
    from kvbench.results import CompareError

    with pytest.raises(CompareError, match="--calibration: .*another model"):
        build_candidates(make_tiny_qwen3(seed=4), ["palu-2bit-scaled"], [], calibration=path)
