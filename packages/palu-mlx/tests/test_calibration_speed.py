"""Calibration's fast path: one forward pass per window that stops after the last recorded layer,
float32 moments folded in float64, the compute dtype (chosen, recorded, undone), the default
token count, the progress bar and the command's options."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kvspec import KVConfigError
from palu_helpers import make_tiny_qwen3
from palu_mlx.calibration import DEFAULT_MAX_TOKENS, Calibration, calibrate
from palu_mlx.calibration.fit import _eigh, _Moments, _window_moments
from palu_mlx.cli import main as cli_main
from palu_mlx.integrity import CHECKSUM_KEY, digest

TEXT = "calibration text for the speed tests, in bytes. " * 12  # 588 tokens


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class _Counting(nn.Module):
    """Wraps a module and counts its calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "calls", 0)

    def __call__(self, *args, **kwargs):
        object.__setattr__(self, "calls", self.calls + 1)
        return self.inner(*args, **kwargs)


class _Refuses(nn.Module):
    def __call__(self, *args, **kwargs):
        raise AssertionError("calibration ran a part of the model it does not need")


def test_one_forward_pass_per_window_stops_after_the_last_recorded_layer():
    model = make_tiny_qwen3()
    embed = _Counting(model.model.embed_tokens)  # called once per forward pass
    model.model.embed_tokens = embed
    model.layers[-1].mlp = _Refuses()  # after the last layer's cache: neither its MLP nor the logits run
    model.model.norm = _Refuses()
    result = calibrate(model, _ByteTokenizer(), TEXT, window=128, max_tokens=None, progress=False)
    assert embed.calls == 5 and result.tokens == len(TEXT)  # 588 tokens: 4 windows of 128 and one of 76
    assert result.keys[-1] is not None and result.values[-1] is not None


def test_window_moments_stay_exact_for_keys_far_from_zero():
    # channels with a mean 1000 times their spread: raw float32 second moments would lose the spread
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 3000, 8)) * np.linspace(0.01, 1.0, 8) + 1000.0
    m = _Moments()
    for start in range(0, 3000, 512):
        m.add(*_window_moments(mx.array(x[:, :, start : start + 512].astype(np.float32))))
    n, s1, s2 = m.stats
    x32 = x.astype(np.float32).astype(np.float64)[0]  # what the recorder was given
    centred = x32 - x32.mean(axis=1, keepdims=True)
    want = np.einsum("hnd,hne->hde", centred, centred) / n
    cov = s2 / n - np.einsum("hd,he->hde", s1 / n, s1 / n)
    assert n == 3000 and np.allclose(s1 / n, x32.mean(axis=1), rtol=1e-9)
    # float32 rounding of the centred products: far below the smallest channel's variance (1e-4)
    assert np.abs(cov - want).max() <= 1e-6 * np.abs(want).max()
    assert np.allclose(np.diagonal(cov, 0, 1, 2), np.diagonal(want, 0, 1, 2), rtol=1e-2)
    # against: float32 raw moments, which the smallest channel's variance (1e-4) drowns in
    raw = x32.astype(np.float32)
    naive = raw.transpose(0, 2, 1) @ raw / n - np.einsum("hd,he->hde", raw.mean(1), raw.mean(1))
    assert np.abs(naive - want)[:, 0, 0].max() > 1e-4, np.abs(naive - want)[:, 0, 0]


def test_eigh_matches_numpy():
    a = np.random.default_rng(1).normal(size=(3, 16, 16))
    a = a @ a.transpose(0, 2, 1)
    w, v = _eigh(a)
    want_w, _ = np.linalg.eigh(a)
    assert w.dtype == np.float64 and np.allclose(w, want_w, rtol=1e-10)
    assert np.allclose(v @ (w[..., None] * v.transpose(0, 2, 1)), a, atol=1e-9)


def test_float32_compute_is_recorded_and_the_model_gets_its_own_arrays_back(tmp_path):
    model = make_tiny_qwen3()
    model.set_dtype(mx.bfloat16)
    before = dict(_flat(model))
    result = calibrate(
        model, _ByteTokenizer(), TEXT, window=128, max_tokens=256, progress=False, dtype="float32"
    )
    after = dict(_flat(model))
    assert before.keys() == after.keys() and all(after[k] is before[k] for k in before)  # the very arrays
    assert result.compute_dtype == "float32"
    in_bf16 = calibrate(
        model, _ByteTokenizer(), TEXT, window=128, max_tokens=256, progress=False, dtype="model"
    )
    assert in_bf16.compute_dtype == "bfloat16"
    # the same statistics up to the 16-bit forward pass's rounding
    a, b = np.array(result.values[0].variance), np.array(in_bf16.values[0].variance)
    assert np.allclose(a[:, :4], b[:, :4], rtol=0.1)
    path = tmp_path / "c.safetensors"
    result.save(path)
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert meta["compute_dtype"] == "float32" and Calibration.load(path).compute_dtype == "float32"
    # files written before the field was recorded load with None
    older = {k: v for k, v in meta.items() if k not in (CHECKSUM_KEY, "compute_dtype")}
    older[CHECKSUM_KEY] = digest(arrays, older)
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, older)
    assert Calibration.load(tmp_path / "old.safetensors").compute_dtype is None


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_auto_keeps_a_float32_model_as_it_is_and_bad_dtypes_are_refused():
    model = make_tiny_qwen3()  # float32 already: nothing to cast
    before = dict(_flat(model))
    result = calibrate(model, _ByteTokenizer(), TEXT, window=128, max_tokens=128, progress=False)
    assert result.compute_dtype == "float32" and all(v is before[k] for k, v in _flat(model))
    with pytest.raises(KVConfigError, match="dtype='float16' must be one of 'auto', 'float32', 'model'"):
        calibrate(model, _ByteTokenizer(), TEXT, progress=False, dtype="float16")


def test_default_token_count_and_progress_bar(capsys):
    model = make_tiny_qwen3()
    result = calibrate(model, _ByteTokenizer(), window=512)  # the shipped text, default cap, progress on
    assert result.tokens == DEFAULT_MAX_TOKENS
    err = capsys.readouterr().err
    assert "palu-mlx calibrate: 100%" in err and f"{DEFAULT_MAX_TOKENS}/{DEFAULT_MAX_TOKENS}" in err
    assert "<00:00" in err  # tqdm's elapsed<remaining: the estimate of the time left
    calibrate(model, _ByteTokenizer(), TEXT, window=128, max_tokens=128, progress=False)
    assert capsys.readouterr().err == ""


def test_cli_calibrate_options_on_the_embedded_model(embedded_path, tmp_path, capsys):
    out = tmp_path / "e.safetensors"
    args = ["calibrate", "--model", str(embedded_path), "--out", str(out), "--window", "128", "--quiet"]
    assert cli_main([*args, "--max-tokens", "256", "--dtype", "model", "--weighting", "none"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress bar, no note
    assert "256 tokens" in captured.out and "weighting none, forward passes in float32" in captured.out
    loaded = Calibration.load(out)
    assert loaded.tokens == 256 and loaded.compute_dtype == "float32" and loaded.weighting == "none"
    text = tmp_path / "t.txt"
    text.write_text("a short text. " * 20, encoding="utf-8")
    assert cli_main([*args, "--text", str(text), "--max-tokens", "all"]) == 0
    assert Calibration.load(out).tokens < 256  # every token of the short text


def test_cli_calibrate_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["calibrate", "--model", "m", "--out", str(tmp_path / "c"), "--max-tokens", "many"])
    assert exc.value.code == 2 and "'many' is neither a number of tokens nor 'all'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["calibrate", "--model", "m", "--out", str(tmp_path / "c"), "--dtype", "int8"])
    assert "--dtype" in capsys.readouterr().err
    missing = str(tmp_path / "missing.txt")
    assert cli_main(["calibrate", "--model", "m", "--out", str(tmp_path / "c"), "--text", missing]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --text") and err.count("\n") == 1
