"""Calibration weighting: ``none`` is today's fit, ``attention`` weighs channels by queries / o_proj."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from palu_helpers import make_tiny_qwen3
from palu_mlx import KVCacheBuilder, KVCacheConfig
from palu_mlx.calibrated import CalibratedKVCache, _tensor_code, allocate_widths
from palu_mlx.calibration import Calibration, calibrate
from palu_mlx.calibration.fit import _fit, _output_metric, _query_metric
from palu_mlx.cli import main as cli_main
from palu_mlx.integrity import CHECKSUM_KEY, digest
from palu_mlx.lowrank import project, reconstruct
from palu_mlx.rope import Rotary, model_rotaries

HEAD_DIM = 32


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _moments(x: np.ndarray) -> list:
    """``[H, N, D]`` samples -> the recorder's ``[count, sum, sum of outer products]``."""
    return [x.shape[1], x.sum(axis=1), x.transpose(0, 2, 1) @ x]


def _arrays_equal(a: Calibration, b: Calibration) -> bool:
    return all(
        mx.array_equal(x, y).item()
        for s, t in zip(a.keys + a.values, b.keys + b.values, strict=True)
        for x, y in zip(s.arrays().values(), t.arrays().values(), strict=True)
    )


def test_none_is_the_unweighted_eigenbasis_of_the_recorded_keys_and_values():
    model = make_tiny_qwen3()
    text = "calibration text for the weighting test, in bytes. " * 8
    default = calibrate(model, _ByteTokenizer(), text, window=128, max_tokens=256, progress=False)
    none = calibrate(
        model, _ByteTokenizer(), text, window=128, max_tokens=256, progress=False, weighting="none"
    )
    assert default.weighting == "attention" and none.weighting == "none"  # weighted by default
    assert all(t.decoder is None for t in none.keys + none.values if t is not None)
    # the reference, computed apart: run the windows through mlx-lm's own caches, un-rotate the keys
    rotaries = model_rotaries(model, HEAD_DIM)
    tokens = list(text.encode("utf-8"))[:256]
    per_layer: list[dict[str, list]] = [{"key": [], "value": []} for _ in model.layers]
    for start in (0, 128):
        caches = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array(tokens[start : start + 128])[None], cache=caches))
        for i, cache in enumerate(caches):
            keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
            per_layer[i]["key"].append(np.array(rotaries[i].unrotate(keys, 0)[0], dtype=np.float64))
            per_layer[i]["value"].append(np.array(values[0].astype(mx.float32), dtype=np.float64))
    for i in range(len(model.layers)):
        for name, fitted in (("key", none.keys[i]), ("value", none.values[i])):
            x = np.concatenate(per_layer[i][name], axis=1)  # [H, N, D]
            mean = x.mean(axis=1)
            cov = np.einsum("hnd,hne->hde", x - mean[:, None], x - mean[:, None]) / x.shape[1]
            eigenvalues, vectors = np.linalg.eigh(cov)
            assert np.allclose(np.array(fitted.mean), mean, atol=1e-4)
            assert np.allclose(np.array(fitted.variance), eigenvalues[:, ::-1], rtol=1e-3, atol=1e-6)
            # leading directions up to sign (well separated on this data)
            top = np.abs(
                np.einsum("hdi,hdi->hi", np.array(fitted.basis)[:, :, :2], vectors[:, :, ::-1][:, :, :2])
            )
            assert np.all(top > 0.99)


def test_attention_calibration_restores_the_model_and_drives_calibrated_caches(tmp_path):
    model = make_tiny_qwen3()
    ropes = [layer.self_attn.rope for layer in model.layers]
    prompt = list(range(3, 30))
    before = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
    result = calibrate(
        model, _ByteTokenizer(), window=128, max_tokens=256, progress=False, weighting="attention"
    )
    assert all(
        layer.self_attn.rope is rope for layer, rope in zip(model.layers, ropes, strict=True)
    )  # taps gone
    assert [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)] == before
    assert result.weighting == "attention" and result.pre_rope
    path = tmp_path / "attention.safetensors"
    result.save(path)
    loaded = Calibration.load(path)
    assert loaded.weighting == "attention" and _arrays_equal(loaded, result)
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(head_dim=HEAD_DIM, palu_calibration=str(path), palu_bits=8)
    )
    assert all(isinstance(c, CalibratedKVCache) for c in caches)
    coded = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=caches)]
    assert coded == before  # 8 bits per element: the weighting moves bits, it does not break the coder


def _rotations(rotary: Rotary, d: int, count: int) -> np.ndarray:
    """``[count, D, D]``: ``R_p`` with ``rotary.rotate`` of a row vector ``x`` at position ``p`` equal to ``x R_p``."""
    eye = mx.broadcast_to(mx.eye(d)[None, :, None, :], (1, d, count, d))  # e_i at every position
    return np.array(rotary.rotate(eye, 0)[0], dtype=np.float64).transpose(1, 0, 2)


@pytest.mark.parametrize("traditional", [True, False])
def test_pre_rope_query_metric_is_the_query_energy_averaged_over_relative_rotations(traditional):
    rng = np.random.default_rng(0)
    d, dims, h_q, n_kv = 8, 6, 4, 2  # channels 6, 7 pass unrotated
    mix = rng.normal(size=(h_q, d, d))
    q = rng.normal(size=(h_q, 4000, d)) @ mix  # correlated, unequal channels
    stats = _moments(q)
    rotary = Rotary(mx.array([1.0, 0.37, 0.113], dtype=mx.float32), dims, traditional)
    metric = _query_metric(stats, n_kv, rotary)
    # a key error e at relative position delta moves the score by q . (R_delta e): average R qq^T R^T
    second = (q.transpose(0, 2, 1) @ q / q.shape[1]).reshape(n_kv, 2, d, d).sum(axis=1)
    # query at position i, key error at j <= i: q R_i . e R_j = q R_(i-j) e^T, so the cost of e is
    # e (R_delta^T E[q^T q] R_delta) e^T, averaged over the relative positions delta
    r = _rotations(rotary, d, 3000)
    want = np.einsum("pji,hjk,pkl->hil", r, second, r) / r.shape[0]
    scale = np.abs(second).max()
    assert np.abs(metric - want).max() < 0.02 * scale
    assert np.allclose(metric[:, 6:, 6:], second[:, 6:, 6:])  # the unrotated block is kept whole
    assert _query_metric(stats, n_kv, None) == pytest.approx(second)  # post-RoPE keys: E[qq^T] itself


def test_output_metric_sums_the_o_proj_slices_of_the_heads_sharing_a_kv_head():
    rng = np.random.default_rng(1)
    hidden, h_q, n_kv, dv = 64, 8, 2, 16
    linear = nn.Linear(h_q * dv, hidden, bias=False)
    linear.weight = mx.array(rng.normal(size=(hidden, h_q * dv)).astype(np.float32))
    w = np.array(linear.weight, dtype=np.float64)
    metric = _output_metric(linear, n_kv, dv)
    for j in range(n_kv):
        heads = range(j * h_q // n_kv, (j + 1) * h_q // n_kv)  # mlx: query head h reads KV head h // 4
        want = sum(w[:, h * dv : (h + 1) * dv].T @ w[:, h * dv : (h + 1) * dv] for h in heads)
        assert np.allclose(metric[j], want, rtol=1e-6)
    quantized = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=8)
    assert np.abs(_output_metric(quantized, n_kv, dv) - metric).max() < 0.02 * np.abs(metric).max()
    with pytest.raises(KVConfigError, match="multiple of the value head dim"):
        _output_metric(linear, n_kv, 24)


def _weighted_key_error(cal: Calibration, x: np.ndarray, metric: np.ndarray, bits: float) -> float:
    """Code ``x [H, N, D]`` as the calibrated cache does at ``bits``; mean ``eᵀ M e`` of the key error."""
    widths = allocate_widths(cal, bits)[0][0]
    code = _tensor_code(cal.keys[0], widths)
    keys = mx.array(x[None].astype(np.float32))
    rebuilt = reconstruct(
        code.coder.decode(code.coder.encode(project(keys, code.projection))), code.projection, mx.float32
    )
    e = np.array(rebuilt[0], dtype=np.float64) - x
    return float(np.einsum("hnd,hde,hne->", e, metric, e) / (x.shape[0] * x.shape[1]))


def test_attention_weighting_whitens_the_metric_and_cuts_the_error_the_queries_see():
    rng = np.random.default_rng(2)
    h, d, n = 2, 16, 6000
    # keys: loud on channels 0-3, quieter on 4-7, nearly silent elsewhere; the queries probe 4-7 only
    scales = np.array([3.0] * 4 + [1.0] * 4 + [0.05] * 8)
    rotation = np.linalg.qr(rng.normal(size=(d, d)))[0]
    keys = (rng.normal(size=(h, n, d)) * scales) @ rotation.T + 0.3
    probe = np.zeros((d, d))
    probe[4:8, 4:8] = np.eye(4)
    metric = np.broadcast_to(rotation @ probe @ rotation.T + 1e-3 * np.eye(d), (h, d, d)).copy()
    values = rng.normal(size=(h, n, d)) * 0.2  # quiet: the budget goes to the keys
    stats_k, stats_v = _moments(keys), _moments(values)
    cals = {}
    for weighting, key_metric in (("none", None), ("attention", metric)):
        cals[weighting] = Calibration(
            model={"n_layers": 1, "n_kv_heads": h, "head_dim": d},
            keys=[_fit(stats_k, key_metric)],
            values=[_fit(stats_v)],
            pre_rope=False,
            tokens=n,
            text_sha256="",
            weighting=weighting,
        )
    fit = cals["attention"].keys[0]
    basis, decoder = (np.array(a, dtype=np.float64) for a in (fit.basis, fit.decoder))
    assert cals["none"].keys[0].decoder is None  # unweighted: orthonormal, the basis rebuilds
    assert np.allclose(decoder.transpose(0, 2, 1) @ basis, np.eye(d)[None], atol=1e-4)  # full rank rebuilds x
    variance = np.array(fit.variance, dtype=np.float64)
    assert np.all(np.diff(variance, axis=-1) <= 1e-6)  # descending: water-filling keeps a prefix
    centred = keys - keys.mean(axis=1, keepdims=True)
    latent_cov = np.einsum("hdi,hnd,hne,hej->hij", basis, centred, centred, basis) / n
    # the latents are uncorrelated with the recorded variances, so per-channel quantizers fit them
    assert np.allclose(latent_cov, variance[:, :, None] * np.eye(d)[None], atol=1e-3 * variance.max())
    for bits in (0.25, 0.5):
        none = _weighted_key_error(cals["none"], keys, metric, bits)
        weighted = _weighted_key_error(cals["attention"], keys, metric, bits)
        assert weighted < 0.5 * none, (bits, weighted, none)


def _synthetic_calibration(weighting: str) -> Calibration:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 500, 8))
    fit = _fit(
        _moments(x), np.broadcast_to(np.diag(np.arange(1.0, 9.0)), (2, 8, 8)) if weighting != "none" else None
    )
    return Calibration(
        {"n_layers": 1, "n_kv_heads": 2, "head_dim": 8}, [fit], [fit], True, 500, "abc", weighting
    )


def test_header_records_the_weighting_and_files_without_it_read_as_none(tmp_path):
    path = tmp_path / "w.safetensors"
    _synthetic_calibration("attention").save(path)
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert meta["weighting"] == "attention"
    assert Calibration.load(path).weighting == "attention"

    def rewrite(meta_update: dict[str, str | None]) -> str:
        new = {k: v for k, v in meta.items() if k != CHECKSUM_KEY}
        for k, v in meta_update.items():
            if v is None:
                new.pop(k)
            else:
                new[k] = v
        new[CHECKSUM_KEY] = digest(arrays, new)
        out = str(tmp_path / f"rewritten-{len(list(tmp_path.iterdir()))}.safetensors")
        mx.save_safetensors(out, arrays, new)
        return out

    assert Calibration.load(rewrite({"weighting": None})).weighting == "none"  # written before the option
    with pytest.raises(KVDataError, match="weighting='queries'"):
        Calibration.load(rewrite({"weighting": "queries"}))
    assert json.loads(meta["pre_rope"]) is True


def test_bad_weighting_values_get_a_clear_error(tmp_path, capsys):
    with pytest.raises(KVConfigError, match="weighting='keys' must be one of 'none', 'attention'"):
        calibrate(make_tiny_qwen3(), _ByteTokenizer(), "abc" * 10, progress=False, weighting="keys")
    with pytest.raises(KVConfigError, match="weighting=None must be one of"):
        _synthetic_calibration("none").__class__(
            **{**_synthetic_calibration("none").__dict__, "weighting": None}
        )
    with pytest.raises(SystemExit) as exc:
        cli_main(["calibrate", "--model", "m", "--out", str(tmp_path / "c"), "--weighting", "query"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--weighting" in err and "'none', 'attention'" in err


def test_attention_weighting_refuses_a_model_whose_queries_it_cannot_see():
    model = make_tiny_qwen3()
    first = model.layers[0].self_attn.rope
    model.layers[1].self_attn.rope = lambda x, offset=0: x  # not a RoPE module palu can stand in for
    with pytest.raises(KVConfigError, match="weighting='attention' needs .*layer 1"):
        calibrate(model, _ByteTokenizer(), "abc" * 10, progress=False, weighting="attention")
    assert model.layers[0].self_attn.rope is first  # the tap put on layer 0 was taken off again
