"""palu caches under tensor parallel: each rank caches its own KV heads (mlx_lm's sharded_load)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from palu_helpers import make_tiny_qwen3
from palu_mlx import HiLoSplit, KVCacheBuilder, PaluKVCache, WaterFilling, model_kv_dims
from palu_mlx.coders import FitSettings
from palu_mlx.tiers import UNQUANTIZED, palu_config

MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
WORKER = Path(__file__).resolve().parent / "tp_worker.py"


def test_model_kv_dims_reads_the_heads_a_shard_computes():
    model = make_tiny_qwen3()
    assert model_kv_dims(model) == (32, 4)
    for layer in model.layers:  # what sharded_load's shard() does on each of 2 ranks
        layer.self_attn.n_kv_heads //= 2
    assert model_kv_dims(model) == (32, 2)
    # pre-RoPE off: this stand-in shard divides the head count but not k_proj, so no layer can run
    config = dataclasses.replace(
        palu_config(palu_rank=8, palu_hi_bit=4, palu_lo_bit=4), head_dim=32, palu_pre_rope=False
    )
    caches = KVCacheBuilder.for_model(model, config)
    assert all(isinstance(c, PaluKVCache) for c in caches)
    KVCacheBuilder.uninstall(model)


@pytest.mark.parametrize(
    "fields",
    [dict(palu_rank=8, palu_hi_bit=4, palu_lo_bit=4), dict(palu_rank=16, **UNQUANTIZED)],
    ids=["rank-8-4bit", "rank-16-unquantized"],
)
def test_fixed_split_configs_per_head_code_each_head_on_its_own(fields):
    """A rank holding half the heads holds exactly what one process holds for them."""
    config = dataclasses.replace(palu_config(**fields), head_dim=64, palu_n_head_groups=None)
    keys = mx.random.normal((1, 4, 100, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal((1, 4, 100, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    whole = PaluKVCache(config).update_and_fetch(keys, values)
    halves = [
        PaluKVCache(config).update_and_fetch(keys[:, h], values[:, h]) for h in (slice(0, 2), slice(2, 4))
    ]
    for i in (0, 1):
        assert mx.array_equal(whole[i], mx.concatenate([p[i] for p in halves], axis=1)).item()


@pytest.mark.parametrize(
    "coder",
    [WaterFilling(bits=2.5), WaterFilling(bits=3.0, token_scale=False), HiLoSplit(4, 2, 0.25)],
    ids=["water-filling-2.5", "water-filling-3", "hi-lo-energy-rank"],
)
def test_a_half_of_the_heads_fitted_with_every_heads_statistics_codes_them_as_one_process(coder):
    """What a rank's fit does under tensor parallel, in one process: given every head's statistics
    (what HeadShard.gather returns), half of the heads get the widths, rank and steps the whole fit
    gives them; without them (each rank on its own heads) the widths differ."""
    # heads of other scales (the water-filling level) and, in the second half, nearly rank 8 (the
    # energy rank is the smallest over the heads)
    low = mx.concatenate([mx.ones((8,)), mx.full((56,), 0.02)])
    shape = mx.stack([mx.ones((64,)), mx.ones((64,)) * 3.0, low * 0.3, low * 1.5])[None, :, None, :]
    keys = mx.random.normal((1, 4, 96, 64), key=mx.random.key(3)) * shape
    values = mx.random.normal((1, 4, 96, 64), key=mx.random.key(4)) * shape[:, ::-1]
    settings = FitSettings(
        groups=4, rank=None, energy_threshold=0.9, group_size=32, quantize_values=True, dtype=mx.float32
    )
    seen: list[np.ndarray] = []

    def record(stats):  # the whole model's statistics, in the order the fit asks for them
        seen.append(np.array(stats))
        return stats

    whole = coder.fit(keys, values, dataclasses.replace(settings, gather=record))
    for half in (slice(0, 2), slice(2, 4)):
        asked = iter(seen)

        def gather(stats, half=half, asked=asked):
            every = next(asked)
            assert np.array_equal(np.asarray(stats, dtype=every.dtype), every[half])  # this rank's rows
            return every

        part = coder.fit(
            keys[:, half], values[:, half], dataclasses.replace(settings, groups=2, gather=gather)
        )
        for (w_proj, w_coder), (p_proj, p_coder) in zip(whole, part, strict=True):
            assert p_coder.segments == w_coder.segments and p_proj.rank == w_proj.rank
            assert mx.array_equal(p_proj.basis, w_proj.basis[half]).item()
            for name, arr in w_coder.constants().items():  # the quantizer steps per head
                assert mx.array_equal(p_coder.constants()[name], arr[half]).item()
    alone = [
        coder.fit(keys[:, h], values[:, h], dataclasses.replace(settings, groups=2))
        for h in (slice(0, 2), slice(2, 4))
    ]
    assert any(a[i][1].segments != whole[i][1].segments for a in alone for i in (0, 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, tiers: str, *extra: str) -> tuple[dict, dict]:
    """The worker's record in one process and on two ring ranks (localhost)."""
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    if not os.path.exists(launch):
        pytest.skip("mlx.launch is not installed")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(WORKER), MODEL, tiers, str(one), *extra], check=True, timeout=300)
    cmd = [launch, "--backend", "ring", "-n", "2", "--starting-port", str(_free_port())]
    subprocess.run(
        [*cmd, sys.executable, str(WORKER), MODEL, tiers, str(two), *extra], check=True, timeout=300
    )
    single, ranks = json.loads(one.read_text()), json.loads(two.read_text())
    assert (single["world"], ranks["world"]) == (1, 2)
    return single, ranks


def _same_codec(ranks: list, single: list, tier: str) -> None:
    """Every layer: the same widths on every head (one water-filling level, one allocation), and each
    head's quantizer steps one process's: bitwise in the first layer, whose keys and values come
    straight from the embeddings; deeper layers see the sharded model's own activations, which its
    all_sums round differently from one process's (by hand: under 2% on tiny-qwen3)."""
    assert len(ranks) == len(single) > 0, tier
    for i, (a, b) in enumerate(zip(ranks, single, strict=True)):
        assert sorted(a) == sorted(b), tier
        for k in (k for k in a if "widths" in k):
            assert a[k] == b[k], (tier, i, k)
        for k in (k for k in a if "steps" in k):
            if i == 0:
                assert a[k] == b[k], (tier, i, k)
            np.testing.assert_allclose(a[k], b[k], rtol=0.05, err_msg=f"{tier} layer {i} {k}")


#: water-filling: the widths are decided on every head's variances, gathered from the ranks at the
#: fit; the rotation code: nothing is decided across heads
TP_TIERS = ("palu-2.25bit-scaled+rel", "rotation-3.5bit")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")
def test_two_ring_ranks_give_one_process_greedy_tokens_and_codec(tmp_path):
    single, ranks = _launch(tmp_path, ",".join(TP_TIERS))
    for tier in TP_TIERS:
        one, two = single["tiers"][tier], ranks["tiers"][tier]
        assert one["kv_heads"] == [4] and two["kv_heads"] == [2], tier  # each rank caches its half
        assert two["tokens"] == one["tokens"], tier
        _same_codec(two["codec"], one["codec"], tier)
        # the ranks hold what one process holds, split (the per-token scales and exact sinks too)
        assert len(two["kv_bytes"]) == 2 and sum(two["kv_bytes"]) == pytest.approx(
            one["kv_bytes"][0], rel=0.03
        )


def _calibrations(tmp_path) -> tuple[str, str]:
    """A whole-model calibration of the embedded model, and one of the same shapes with other key
    weights (its k_proj scaled): the fingerprint check must refuse the second."""
    import mlx_lm
    from palu_mlx import calibrate

    paths = []
    for name, scale in (("own", 1.0), ("other", 1.5)):
        model, tokenizer = mlx_lm.load(MODEL)
        for layer in model.layers:
            layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * scale
        path = str(tmp_path / f"{name}.safetensors")
        calibrate(model, tokenizer, window=128, max_tokens=256, progress=False).save(path)
        paths.append(path)
    return paths[0], paths[1]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")
def test_two_ring_ranks_slice_a_whole_model_calibration_file(tmp_path):
    own, other = _calibrations(tmp_path)
    tiers = "palu-2bit-scaled+cal0,palu-2bit-scaled+cal1"
    single, ranks = _launch(tmp_path, tiers, own, other)
    one, two = single["tiers"]["palu-2bit-scaled+cal0"], ranks["tiers"]["palu-2bit-scaled+cal0"]
    assert "error" not in two, two.get("error")
    assert one["kv_heads"] == [4] and two["kv_heads"] == [2]
    assert two["tokens"] == one["tokens"]
    # each rank holds its heads' slices of the file: the same widths, the file's steps bitwise
    assert two["codec"] == one["codec"] and len(two["codec"]) > 0
    assert sum(two["kv_bytes"]) == pytest.approx(one["kv_bytes"][0], rel=0.03)
    # a file of another model is still refused, on every rank and in one process
    for record in (single, ranks):
        assert "made for another model" in record["tiers"]["palu-2bit-scaled+cal1"]["error"]
        assert "kv_weights" in record["tiers"]["palu-2bit-scaled+cal1"]["error"]
