"""mlx-lm's own prompt-cache files (``mlx_lm.models.cache.save_prompt_cache`` / ``load_prompt_cache``)
hold palu-mlx caches: every cache class in every phase round-trips bitwise, a fresh process continues
a saved cache with the greedy tokens of the uninterrupted one, and an edited file is refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cache_snapshots import KINDS, build, kv, snapshot
from kvspec import KVConfigError, KVDataError
from mlx_lm.models import cache as mlx_cache
from palu_mlx import CalibratedKVCache, KVCacheBuilder, NaiveQuantKVCache, PaluKVCache, register_with_mlx_lm
from palu_mlx.batch import BatchedLayerCache
from palu_mlx.state_checks import STATE_META

MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
needs_model = pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")


def test_registering_puts_its_classes_where_mlx_lm_looks_them_up_and_importing_does_not():
    fresh = "import palu_mlx; from mlx_lm.models import cache; print(hasattr(cache, 'PaluKVCache'))"
    out = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # importing palu_mlx leaves mlx-lm as it was
    register_with_mlx_lm()
    register_with_mlx_lm()  # idempotent
    for cls in (PaluKVCache, CalibratedKVCache, NaiveQuantKVCache, BatchedLayerCache):
        assert vars(mlx_cache)[cls.__name__] is cls
    assert mlx_cache.KVCache.__module__ == "mlx_lm.models.cache"  # nothing of mlx-lm replaced


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_round_trips_through_mlx_lms_files(tmp_path, kind):
    cache = build(kind)
    before = snapshot(cache)
    file = str(tmp_path / "cache.safetensors")
    # a mixed model: an mlx-lm layer beside the palu one, as mlx-lm saves any list of caches
    plain = mlx_cache.KVCache()
    plain.update_and_fetch(*kv(3, 5))
    mlx_cache.save_prompt_cache(file, [cache, plain], {"model": "m"})
    loaded, meta = mlx_cache.load_prompt_cache(file, return_metadata=True)
    assert meta == {"model": "m"}
    assert type(loaded[0]) is type(cache) and type(loaded[1]) is mlx_cache.KVCache
    assert snapshot(loaded[0]) == before  # offset, meta_state, every array's bytes, nbytes, next output
    assert mx.array_equal(loaded[1].state[0], plain.state[0]).item()


def test_a_state_carries_its_meta_state_and_from_state_needs_nothing_else():
    cache = build("palu-fixed")
    state = cache.state
    assert state[STATE_META].dtype == mx.uint8
    record = json.loads(bytes(np.array(state[STATE_META])).decode())
    assert record["class"] == "PaluKVCache" and tuple(record["meta_state"]) == cache.meta_state
    assert snapshot(PaluKVCache.from_state(state)) == snapshot(cache)
    # mlx-lm's loader hands the names back nested at their dots
    nested: dict = {}
    for name, arr in state.items():
        *path, last = name.split(".")
        node = nested
        for p in path:
            node = node.setdefault(p, {})
        node[last] = arr
    assert snapshot(PaluKVCache.from_state(nested)) == snapshot(cache)


def _rewrite(file: str, edit) -> None:
    arrays, meta = mx.load(file, return_metadata=True)
    edit(arrays)
    mx.save_safetensors(file, arrays, meta)


def _other_bits(record: dict) -> None:
    settings = json.loads(record["meta_state"][0])
    assert settings["palu_bits"] == 2.0
    record["meta_state"][0] = json.dumps({**settings, "palu_bits": 3.0})


def _edit_meta(arrays: dict, key: str, change) -> None:
    record = json.loads(bytes(np.array(arrays[key])).decode())
    change(record)
    arrays[key] = mx.array(np.frombuffer(json.dumps(record).encode(), dtype=np.uint8))


@pytest.mark.parametrize(
    "edit, message",
    [
        # one code byte changed: still finite, still the right shape
        (lambda a: a.__setitem__("0.key.codes", a["0.key.codes"] ^ 1), "checksum mismatch"),
        # the bit budget in the config edited (the codes were made with another)
        (lambda a: _edit_meta(a, f"0.{STATE_META}", _other_bits), "checksum mismatch"),
        # the record names another class than the one mlx-lm rebuilds
        (
            lambda a: _edit_meta(a, f"0.{STATE_META}", lambda r: r.__setitem__("class", "CalibratedKVCache")),
            "class",
        ),
        (lambda a: a.pop(f"0.{STATE_META}"), "no meta_state"),
        (lambda a: a.__setitem__(f"0.{STATE_META}", mx.array([1, 2, 3])), "uint8"),
    ],
    ids=["code-byte", "config", "class", "no-meta", "meta-dtype"],
)
def test_an_edited_file_is_refused_naming_what(tmp_path, edit, message):
    file = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(file, [build("palu-fixed")])
    _rewrite(file, edit)
    with pytest.raises(KVDataError, match=message):
        mlx_cache.load_prompt_cache(file)


def test_a_batch_cache_says_to_save_its_rows(tmp_path):
    batch = PaluKVCache.merge([build("palu-fixed"), build("palu-exact")])
    file = str(tmp_path / "batch.safetensors")
    mlx_cache.save_prompt_cache(file, [batch])
    with pytest.raises(KVConfigError, match=r"extract\(i\)"):
        mlx_cache.load_prompt_cache(file)
    rows = [batch.extract(i) for i in range(2)]
    mlx_cache.save_prompt_cache(file, rows)
    assert [c.offset for c in mlx_cache.load_prompt_cache(file)] == [12, 5]


def test_palus_own_files_still_round_trip_without_the_embedded_array(tmp_path):
    from palu_mlx import load_prompt_cache, save_prompt_cache

    cache = build("calibrated")
    file = str(tmp_path / "own.safetensors")
    save_prompt_cache(file, [cache])
    assert not any(k.endswith(STATE_META) for k in mx.load(file))
    assert snapshot(load_prompt_cache(file)[0]) == snapshot(cache)


# --------------------------------------------------------------------------- a fresh process
_CHILD = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import mlx_lm
    import palu_mlx

    palu_mlx.register_with_mlx_lm()  # a fresh process that only loads: mlx-lm must find the classes
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache
    from palu_mlx.attention import route_attention

    model_dir, file, last, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model, _ = mlx_lm.load(model_dir)
    route_attention(model)  # what KVCacheBuilder does for the model that made the cache
    cache = load_prompt_cache(file)
    out = [int(t) for t, _ in generate_step(mx.array([last]), model, prompt_cache=cache, max_tokens=n)]
    print(json.dumps({"tokens": out, "classes": sorted({type(c).__name__ for c in cache})}))
    """
)


def _prefill(model, tokenizer, kind: str, calibration: str | None = None):
    import dataclasses

    from palu_mlx import KVCacheConfig, model_kv_dims
    from palu_mlx.tiers import TIERS

    head_dim = model_kv_dims(model)[0]
    if kind == "naive":
        config = KVCacheConfig(method="naive", naive_bits=4, naive_group_size=32, head_dim=head_dim)
    else:
        config = dataclasses.replace(TIERS["palu-2bit-scaled"].config, head_dim=head_dim)
    if calibration is not None:
        config = dataclasses.replace(config, palu_calibration=calibration)
    cache = KVCacheBuilder.for_model(model, config)
    prompt = tokenizer.encode(
        "The json module encodes Python objects as JSON text and decodes them back. " * 4
    )
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache, prompt[-1]


@pytest.mark.slow
@needs_model
@pytest.mark.parametrize("tier", ["palu-2bit-scaled", "naive", "calibrated"])
def test_a_fresh_process_continues_an_mlx_lm_file_with_the_same_greedy_tokens(tmp_path, tier):
    import mlx_lm
    from mlx_lm.generate import generate_step
    from palu_mlx import calibrate

    model, tokenizer = mlx_lm.load(MODEL)
    calibration = None
    if tier == "calibrated":
        calibration = str(tmp_path / "cal.safetensors")
        calibrate(model, tokenizer, window=128, max_tokens=512, progress=False).save(calibration)
    cache, last = _prefill(model, tokenizer, tier, calibration)
    file = str(tmp_path / "prompt.safetensors")
    mlx_cache.save_prompt_cache(file, cache, {"model": MODEL, "tokenizer_config": "{}"})
    if calibration is not None:
        os.remove(calibration)  # the file must carry everything the cache needs
    n = 12
    expected = [int(t) for t, _ in generate_step(mx.array([last]), model, prompt_cache=cache, max_tokens=n)]
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, MODEL, file, str(last), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = {
        "palu-2bit-scaled": "PaluKVCache",
        "naive": "NaiveQuantKVCache",
        "calibrated": "CalibratedKVCache",
    }
    assert got["classes"] == [want[tier]]
    assert got["tokens"] == expected


# --------------------------------------------------------------------------- the two command lines
_MLX_LM_GENERATE = (
    "import palu_mlx; palu_mlx.register_with_mlx_lm(); from mlx_lm.generate import main; main()"
)


@pytest.mark.slow
@needs_model
def test_mlx_lm_generate_continues_a_palu_mlx_generate_conversation(tmp_path, capsys):
    from palu_mlx.generate import generate_main

    file = str(tmp_path / "conversation.safetensors")
    common = ["--max-tokens", "6", "--prompt-cache-file", file]
    assert generate_main(["--model", MODEL, *common, "--palu-bits", "2", "--prompt", "JSON encodes"]) == 0
    capsys.readouterr()
    assert {type(c).__name__ for c in mlx_cache.load_prompt_cache(file)} == {"PaluKVCache"}
    # plain mlx_lm.generate, in a process that imported palu_mlx: the model comes from the file
    run = subprocess.run(
        [sys.executable, "-c", _MLX_LM_GENERATE, *common, "--prompt", "and decodes"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"Prompt: \d+ tokens", run.stdout) and "Generation: " in run.stdout
    # without palu_mlx imported mlx-lm cannot find the class: what the docs tell users to avoid
    plain = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *common, "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode != 0 and "PaluKVCache" in plain.stderr


@pytest.mark.slow
@needs_model
def test_palu_mlx_generate_continues_a_file_mlx_lms_save_wrote(tmp_path, capsys):
    import mlx_lm
    from palu_mlx.generate import generate_main

    model, tokenizer = mlx_lm.load(MODEL)
    cache, _ = _prefill(model, tokenizer, "palu-2bit-scaled")
    held = cache[0].offset
    file = str(tmp_path / "prompt.safetensors")
    mlx_cache.save_prompt_cache(file, cache, {"model": MODEL, "tokenizer_config": "{}"})
    written = Path(file).read_bytes()
    assert generate_main(["--prompt-cache-file", file, "--max-tokens", "5", "--prompt", " More"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"held for (\d+) tokens", out).group(1))
    prompt = int(re.search(r"Prompt: (\d+) tokens", out).group(1))
    # the file's tokens, then the new ones and the reply: the cached prompt was not recomputed
    assert prompt < 5 and held + prompt < total <= held + prompt + 5
    assert Path(file).read_bytes() == written  # mlx-lm's file is read, not rewritten


@pytest.mark.slow
@needs_model
def test_a_conversation_in_palus_own_format_still_continues(tmp_path, capsys):
    from palu_mlx import save_prompt_cache
    from palu_mlx.generate import generate_main

    file = str(tmp_path / "conversation.safetensors")
    common = ["--model", MODEL, "--max-tokens", "6", "--prompt-cache-file", file, "--palu-bits", "2"]
    assert generate_main([*common, "--prompt", "JSON encodes"]) == 0
    cache, meta = mlx_cache.load_prompt_cache(file, return_metadata=True)
    save_prompt_cache(file, cache, meta)  # the format palu-mlx generate wrote before
    assert mx.load(file, return_metadata=True)[1].get("format") == "palu-mlx.prompt-cache.v1"
    capsys.readouterr()
    assert generate_main([*common, "--prompt", "and decodes"]) == 0
    out = capsys.readouterr().out
    assert int(re.search(r"Prompt: (\d+) tokens", out).group(1)) < int(
        re.search(r"held for (\d+) tokens", out).group(1)
    )
    # written back in mlx-lm's format, the conversation one turn longer
    again, meta2 = mlx_cache.load_prompt_cache(file, return_metadata=True)
    assert len(json.loads(meta2["palu_messages"])) == len(json.loads(meta["palu_messages"])) + 2
    assert again[0].offset > cache[0].offset
