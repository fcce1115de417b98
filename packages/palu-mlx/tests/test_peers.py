"""The peer registry of ``palu-mlx compare`` and the plain-MLX KIVI reference peer."""

from __future__ import annotations

import builtins
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from palu_helpers import make_tiny_qwen3, reachable_nbytes
from palu_mlx.peers import PEERS, PeerCaches, PeerUnavailable, peer, resident_nbytes
from palu_mlx.peers.kivi import (
    KIVICache,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)


def _kv(shape, seed=0, dtype=mx.float32):
    """Keys with a few large-magnitude channels (as real keys have) and plain values."""
    k = mx.random.normal(shape, key=mx.random.key(seed))
    boost = mx.ones((shape[-1],)).at[mx.array([3, 17])].multiply(12.0)
    v = mx.random.normal(shape, key=mx.random.key(seed + 1))
    return (k * boost).astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_decode_within_half_a_step(bits):
    k, v = _kv((1, 2, 64, 64))
    levels = (1 << bits) - 1
    packed, scale, zero = quantize_keys(k, bits, 32)
    assert packed.dtype == mx.uint8 and packed.shape == (1, 2, 64, 64 * bits // 8)
    assert scale.dtype == zero.dtype == mx.float16 and scale.shape == (1, 2, 2, 64)
    err = np.abs(np.array(dequantize_keys(packed, scale, zero, bits, 32) - k))
    # per channel and group of 32 tokens: half a step of its own range, plus float16 rounding of
    # the zero and of the step (times up to `levels` steps)
    groups = np.array(k).reshape(1, 2, 2, 32, 64)
    span = groups.max(axis=3) - groups.min(axis=3)
    bound = span / levels / 2 + np.abs(groups).max(axis=3) * 2e-3
    assert (err.reshape(1, 2, 2, 32, 64) <= bound[:, :, :, None] + 1e-6).all()

    packed, scale, zero = quantize_values(v, bits, 32)
    assert scale.shape == (1, 2, 64, 2)
    err = np.abs(np.array(dequantize_values(packed, scale, zero, bits, 32) - v)).reshape(1, 2, 64, 2, 32)
    groups = np.array(v).reshape(1, 2, 64, 2, 32)
    span = groups.max(axis=4) - groups.min(axis=4)
    bound = span / levels / 2 + np.abs(groups).max(axis=4) * 2e-3
    assert (err <= bound[..., None] + 1e-6).all()


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    # the reason KIVI quantizes keys per channel: a per-token group spanning an outlier channel
    # spends its levels on that channel
    k, _ = _kv((1, 2, 64, 64), seed=3)
    per_channel = dequantize_keys(*quantize_keys(k, 2, 32), 2, 32)
    per_token = dequantize_values(*quantize_values(k, 2, 32), 2, 32)
    plain = np.ones(64, dtype=bool)
    plain[[3, 17]] = False  # the ordinary channels, which per-token groups sacrifice
    channel_err = np.array((per_channel - k) ** 2)[..., plain].mean()
    token_err = np.array((per_token - k) ** 2)[..., plain].mean()
    assert channel_err < 0.5 * token_err


def test_window_and_codes_follow_the_residual_rule():
    cache = KIVICache(4, 4, group=32, residual=32)
    k, v = _kv((1, 2, 100, 64), dtype=mx.float16)
    cache.update_and_fetch(k[:, :, :40], v[:, :, :40])
    assert (cache.quantized_tokens, cache.window_tokens, cache.offset) == (32, 8, 40)
    for t in range(40, 100):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert keys.shape == values.shape == (1, 2, t + 1, 64) and keys.dtype == mx.float16
        assert cache.window_tokens < 32 and cache.quantized_tokens % 32 == 0
    assert (cache.quantized_tokens, cache.window_tokens) == (96, 4)
    # the window is exact; the coded tokens are close
    assert mx.array_equal(keys[:, :, 96:], k[:, :, 96:])
    rel = float(mx.linalg.norm((keys[:, :, :96] - k[:, :, :96]).astype(mx.float32))) / float(
        mx.linalg.norm(k[:, :, :96].astype(mx.float32))
    )
    assert 0 < rel < 0.1

    wider = KIVICache(2, 2, group=32, residual=64)
    wider.update_and_fetch(k, v)
    assert (wider.quantized_tokens, wider.window_tokens) == (64, 36)


@pytest.mark.parametrize("bits", [4, 2])
def test_bytes_held_are_codes_side_and_window(bits):
    B, H, D, N = 1, 3, 64, 300
    k, v = _kv((B, H, N, D), dtype=mx.bfloat16)
    cache, plain = KIVICache(bits, bits), KVCache()
    cache.update_and_fetch(k[:, :, :257], v[:, :, :257])
    plain.update_and_fetch(k[:, :, :257], v[:, :, :257])
    for t in range(257, N):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        plain.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    q, w = cache.quantized_tokens, cache.window_tokens
    assert (q, w) == (288, 12)
    codes = 2 * B * H * q * D * bits // 8
    key_side = 2 * 2 * B * H * (q // 32) * D  # scale + zero per channel and group, float16
    value_side = 2 * 2 * B * H * q * (D // 32)  # per token and group of channels
    window = 2 * 2 * B * H * w * D
    assert cache.nbytes == codes + key_side + value_side + window
    # nothing else is kept: no 16-bit copy of the history behind the codes
    assert reachable_nbytes(cache) == resident_nbytes(cache) == cache.nbytes
    raw = sum(a.nbytes for a in plain.keys_and_values())
    assert raw == 2 * 2 * B * H * N * D
    side = (key_side + value_side) / (2 * B * H * q * D * 2)  # side bits over 16 per coded element
    assert cache.nbytes / raw == pytest.approx(q / N * (bits / 16 + side) + w / N, rel=1e-9)
    assert cache.nbytes / raw < {4: 0.36, 2: 0.24}[bits]


def test_state_round_trip_and_bad_input():
    cache = KIVICache(2, 2)
    k, v = _kv((1, 2, 70, 64), dtype=mx.float16)
    keys, _ = cache.update_and_fetch(k, v)
    again = KIVICache.from_state(cache.state)
    again.meta_state = cache.meta_state
    assert again.offset == 70 and again.nbytes == cache.nbytes
    more, _ = again.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert mx.array_equal(more[:, :, :70], keys)
    with pytest.raises(ValueError, match="bits must be one of"):
        KIVICache(3, 3)
    with pytest.raises(ValueError, match="multiple of group"):
        KIVICache(4, 4, group=32, residual=48)
    with pytest.raises(ValueError, match="not a multiple of group"):
        KIVICache().update_and_fetch(mx.zeros((1, 1, 4, 48)), mx.zeros((1, 1, 4, 48)))
    with pytest.raises(ValueError, match="takes 0, 2 or 8"):
        KIVICache().state = [mx.zeros((1,))]
    assert not hasattr(KIVICache(), "bits")  # mlx-lm would send it to its quantized kernel


@pytest.fixture(scope="module")
def embedded(embedded_path):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(embedded_path))[:2]
    return model, tokenizer


def _greedy(model, cache, prompt, steps):
    logits = model(prompt[None], cache=cache)[0, -1]
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits))
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize(("name", "agree"), [("kivi-k4v4", 0.9), ("kivi-k2v2", 0.5)])
def test_kivi_greedy_tokens_follow_the_baseline(embedded, name, agree):
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = embedded
    text = (
        "The standard library offers modules for reading files, parsing arguments and formatting "
        "text. Each module documents its functions and classes, with examples of their use. "
    ) * 3
    prompt = mx.array(tokenizer.encode(text))
    assert prompt.shape[0] > 64  # codes and window both in play
    base = _greedy(model, make_prompt_cache(model), prompt, 24)
    caches = peer(name).make(model)
    assert all(isinstance(c, KIVICache) for c in caches)
    got = _greedy(model, caches, prompt, 24)
    assert np.mean(np.array(got) == np.array(base)) >= agree
    assert all(c.quantized_tokens > 0 for c in caches)


def test_generate_step_runs_on_kivi(embedded):
    from mlx_lm.generate import generate_step

    model, tokenizer = embedded
    caches = peer("kivi-k4v4").make(model)
    prompt = mx.array(tokenizer.encode("Modules and packages " * 20))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=40, prompt_cache=caches)]
    assert len(tokens) == 40
    assert caches[0].offset == prompt.shape[0] + 40  # generate_step computes one token ahead
    assert caches[0].window_tokens < 32


def test_registry_keeps_the_names_and_the_compat_import():
    from palu_mlx.compare import PEER_BITS, PaluHarness

    assert PEER_BITS == {"mlx-lm-q8": 8, "mlx-lm-q4": 4}
    for name in ("mlx-lm-q4", "mlx-lm-q8", "kivi-k4v4", "kivi-k2v2", "velox-kivi-2", "velox-palu"):
        assert name in PEERS and PaluHarness().peers()[name] == PEERS[name].description
    with pytest.raises(KeyError, match="unknown peer 'nope'"):
        peer("nope")


def test_unavailable_peers_become_absent_rows(monkeypatch):
    pytest.importorskip("kvbench")
    from palu_mlx.compare import build_candidates

    real_import = builtins.__import__

    def no_velox(name, *args, **kwargs):
        if name.startswith("veloxquant_mlx"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_velox)
    monkeypatch.setattr("importlib.import_module", lambda name, *a: no_velox(name))
    model = make_tiny_qwen3()
    candidates, absent = build_candidates(model, [], ["mlx-lm-q4", "velox-kivi-2", "kivi-k2v2", "velox-kvtc"])
    assert [c.name for c in candidates] == ["baseline", "mlx-lm-q4", "kivi-k2v2"]
    assert [a["name"] for a in absent] == ["velox-kivi-2", "velox-kvtc"]
    assert all(a["kind"] == "peer" and 'pip install "palu-mlx[peers]"' in a["reason"] for a in absent)
    assert candidates[1].config == {
        "class": "mlx_lm.models.cache.QuantizedKVCache",
        "bits": 4,
        "group_size": 32,
    }


def test_a_peer_that_refuses_the_model_is_absent_not_a_crash():
    pytest.importorskip("kvbench")
    from palu_mlx.compare import build_candidates

    # head dim 48: KIVI's value groups of 32 channels do not tile it, mlx-lm's quantize neither
    model = make_tiny_qwen3(head_dim=48)
    candidates, absent = build_candidates(model, [], ["kivi-k4v4", "mlx-lm-q8"])
    assert [c.name for c in candidates] == ["baseline"]
    assert {a["name"]: a["reason"] for a in absent} == {
        "kivi-k4v4": "head dim 48 is not a multiple of the value group 32",
        "mlx-lm-q8": "head dim 48 is not a multiple of 32 (mlx.core.quantize groups)",
    }
    with pytest.raises(PeerUnavailable):
        peer("kivi-k2v2").make(model)


def test_runner_counts_the_arrays_of_a_peer_that_estimates_its_bytes():
    pytest.importorskip("kvbench")
    from palu_mlx.compare import MLXRunner

    class Estimating(KVCache):
        @property
        def nbytes(self):  # a packed-size claim, not what the object keeps
            return 1

    caches = [Estimating(), Estimating()]
    k, v = _kv((1, 2, 10, 64), dtype=mx.float16)
    for c in caches:
        c.update_and_fetch(k, v)
    runner = MLXRunner.__new__(MLXRunner)
    assert runner.kv_bytes(caches).held == 2
    held = runner.kv_bytes(PeerCaches(caches)).held
    assert held == 2 * 2 * (2 * 256 * 64 * 2) and held == reachable_nbytes(caches)


def test_velox_peers_run_here_and_report_their_accounting():
    pytest.importorskip("veloxquant_mlx")
    pytest.importorskip("kvbench")
    from palu_mlx.compare import build_candidates

    model = make_tiny_qwen3(head_dim=64)
    candidates, absent = build_candidates(model, [], ["velox-kivi-4"])
    assert absent == [] and candidates[1].config["method"] == "kivi"
    cache = candidates[1].make_cache()
    assert isinstance(cache, PeerCaches)
    prompt = mx.arange(200)[None] % 100  # past its 128-token fp16 residual window
    model(prompt, cache=cache)
    details = candidates[1].details()
    assert details["accounted_from"] == [
        "compressed_key_bytes + compressed_value_bytes + residual_fp16_bytes"
    ]
    assert 4 < details["accounted_bits"] < 16
    # while it keeps buffers at least as large as 16-bit keys and values of every token
    assert resident_nbytes(list(cache)) >= 200 * 2 * 4 * 64 * 2 * len(cache)
    assert math.isfinite(details["accounted_bits"])


def test_a_peer_s_own_account_is_read_from_its_first_window_caches(monkeypatch):
    pytest.importorskip("kvbench")
    from palu_mlx import peers
    from palu_mlx.compare import peer_candidate
    from palu_mlx.peers import Peer

    def tokens(model, caches):
        return {"tokens": [c.offset for c in caches]}

    probe = Peer(
        "probe", "a KVCache that reports its tokens", lambda m: [KVCache()], {"x": 1}, accounted=tokens
    )
    monkeypatch.setitem(peers.PEERS, "probe", probe)
    candidate = peer_candidate(make_tiny_qwen3(), "probe")
    k, v = _kv((1, 2, 5, 32))
    first, later = candidate.make_cache(), candidate.make_cache()
    first[0].update_and_fetch(k, v)
    later[0].update_and_fetch(k[:, :, :2], v[:, :, :2])
    assert candidate.config == {"x": 1}
    assert candidate.details() == {"tokens": [5], "accounted_after": "the first window"}
