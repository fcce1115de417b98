"""``--kv-memory``: the tier a memory budget buys (palu_mlx.memory_plan) and its command-line options."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from palu_mlx.builder import KVCacheBuilder
from palu_mlx.generate import _parser as generate_parser
from palu_mlx.generate import generate_main
from palu_mlx.memory_plan import CANDIDATES, default_context, measure, parse_size, plan
from palu_mlx.serving import check_palu_arguments, palu_config
from palu_mlx.tiers import TIERS

MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
needs_model = pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")

CONTEXT = 600


def test_sizes():
    assert parse_size("1048576") == 1024**2
    assert parse_size("512M") == parse_size("512MiB") == parse_size("512mb") == 512 * 1024**2
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size(" 64 K ") == 64 * 1024
    for bad, why in (
        ("0", "zero"),
        ("0.0001K", "zero"),
        ("-1G", "negative"),
        ("lots", "not a size"),
        ("2X", "not a size"),
        ("", "not a size"),
    ):
        with pytest.raises(KVConfigError, match=why):
            parse_size(bad)


def test_more_memory_picks_a_tier_no_worse(tiny_model):
    need = {name: measure(tiny_model, TIERS[name].for_head_dim(32)).nbytes(CONTEXT) for name in CANDIDATES}
    smallest = min(need.values())
    chosen = []
    for memory in sorted({smallest, *need.values(), 4 * max(need.values())}):
        made = plan(tiny_model, memory, CONTEXT, 1)
        assert made.predicted_bytes <= memory
        assert made.predicted_bytes == need[made.tier]
        chosen.append(CANDIDATES.index(made.tier))
    assert chosen == sorted(chosen, reverse=True)  # a larger budget never picks a later tier
    assert chosen[0] == CANDIDATES.index(min(need, key=need.get)) and chosen[-1] == 0


def test_users_multiply_the_prediction(tiny_model):
    one = plan(tiny_model, 10**9, CONTEXT, 1)
    three = plan(tiny_model, 10**9, CONTEXT, 3)
    assert (three.tier, three.users) == (one.tier, 3)
    assert three.predicted_bytes == 3 * one.predicted_bytes
    assert three.uncompressed_bytes == 3 * one.uncompressed_bytes == 3 * 2 * 2 * 4 * 32 * 2 * CONTEXT
    assert one.summary() == (
        f"KV memory plan: {one.tier} for 1 x {CONTEXT} tokens: {one.predicted_bytes / 2**20:.1f} MiB of "
        f"{10**9 / 2**20:.1f} MiB (uncompressed: {one.uncompressed_bytes / 2**20:.1f} MiB)"
    )
    assert one.description == TIERS[one.tier].description


@pytest.mark.parametrize("name", CANDIDATES)
def test_the_prediction_is_what_a_prefill_holds(tiny_model, name):
    made = plan(tiny_model, 10**9, CONTEXT, 1, candidates=(name,))
    caches = KVCacheBuilder.for_model(tiny_model, made.config)
    tokens = mx.random.randint(0, 256, (1, CONTEXT), key=mx.random.key(3))  # the vocabulary is 256
    mx.eval(tiny_model(tokens, cache=caches))
    held = sum(c.nbytes for c in caches)
    assert abs(made.predicted_bytes - held) <= 0.15 * held, (made.predicted_bytes, held)


def test_too_little_memory_says_what_would_fit(tiny_model):
    need = {name: measure(tiny_model, TIERS[name].for_head_dim(32)).nbytes(CONTEXT) for name in CANDIDATES}
    smallest = min(need, key=need.get)
    with pytest.raises(KVConfigError) as caught:
        plan(tiny_model, 2 * need[smallest] - 1, CONTEXT, 2)
    message = str(caught.value)
    assert f"smallest tier, {smallest}, needs {2 * need[smallest] / 2**20:.1f} MiB" in message
    most = int(re.search(r"fits at most (\d+) tokens per sequence for 2 sequences", message).group(1))
    assert 0 < most < CONTEXT
    plan(tiny_model, 2 * need[smallest] - 1, most, 2)  # the context it names does fit
    with pytest.raises(KVConfigError, match="not even one token"):
        plan(tiny_model, 1000, CONTEXT, 1)
    for bad in (dict(memory_bytes=0), dict(context_tokens=0), dict(users=0), dict(users=True)):
        with pytest.raises(KVConfigError, match="must be an integer >= 1"):
            plan(tiny_model, **{"memory_bytes": 10**9, "context_tokens": CONTEXT, "users": 1, **bad})


def test_palu_config_plans_and_reports(tiny_model):
    args = argparse.Namespace(kv_memory=10**9, kv_context=None, kv_users=2, palu_tier=None, calibration=None)
    lines = []
    config = palu_config(tiny_model, args, report=lines.append)
    assert default_context(tiny_model) == 4096
    assert lines and lines[0].startswith(f"KV memory plan: {CANDIDATES[0]} for 2 x 4096 tokens: ")
    assert config == TIERS[CANDIDATES[0]].for_head_dim(32)


def _parse_error(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    return capsys.readouterr().err


def test_the_command_line_refuses_bad_values(capsys):
    parser = generate_parser()
    assert parser.parse_args(["--kv-memory", "1.5GiB", "--kv-context", "2048"]).kv_memory == 3 * 2**30 // 2
    for argv, said in (
        (["--kv-memory", "0"], "zero bytes"),
        (["--kv-memory=-2G"], "negative"),
        (["--kv-memory", "plenty"], "not a size"),
        (["--kv-memory", "1G", "--kv-context", "0"], "at least 1"),
        (["--kv-memory", "1G", "--kv-context", "many"], "not a whole number of tokens"),
        (["--kv-memory", "1G", "--palu-tier", "rotation-4bit"], "not allowed with"),
        (["--kv-memory", "1G", "--palu-bits", "3"], "not allowed with"),
    ):
        assert said in _parse_error(parser, argv, capsys), argv
    assert "--kv-users" in _parse_error(parser, ["--kv-memory", "1G", "--kv-users", "2"], capsys)

    from palu_mlx.server import server_parser

    server = server_parser()
    assert server.parse_args(["--kv-memory", "2G", "--kv-users", "4"]).kv_users == 4
    assert "at least 1" in _parse_error(server, ["--kv-memory", "2G", "--kv-users", "0"], capsys)

    with pytest.raises(KVConfigError, match="--kv-context and --kv-users plan the KV memory of --kv-memory"):
        check_palu_arguments(server.parse_args(["--kv-context", "8", "--kv-users", "2"]))
    with pytest.raises(KVConfigError, match="no calibrated twin"):
        check_palu_arguments(server.parse_args(["--kv-memory", "2G", "--calibration", "c.safetensors"]))


def test_generate_refuses_before_loading(capsys):
    # no such model: the option error comes first, so nothing was loaded
    assert generate_main(["--model", "/no/such/model", "--kv-context", "100", "--prompt", "x"]) == 1
    assert "--kv-context plans the KV memory of --kv-memory" in capsys.readouterr().err


@needs_model
def test_generate_runs_on_a_memory_plan(capsys):
    argv = ["--model", MODEL, "--max-tokens", "4", "--kv-memory", "64M", "--kv-context", "512"]
    assert generate_main([*argv, "--prompt", "The json module encodes Python objects as"]) == 0
    err = capsys.readouterr().err
    line = re.search(
        r"KV memory plan: (\S+) for 1 x 512 tokens: ([\d.]+) MiB of 64.0 MiB \(uncompressed: ", err
    )
    assert line and line.group(1) == CANDIDATES[0], err

    assert generate_main([*argv[:4], "--kv-memory", "1K", "--prompt", "x"]) == 1
    assert "too little KV memory" in capsys.readouterr().err


@needs_model
def test_the_server_logs_the_plan_for_the_model_it_loads(caplog):
    import logging

    from palu_mlx.server import PaluModelProvider, server_parser

    argv = ["--model", MODEL, "--kv-memory", "256M", "--kv-context", "1024", "--kv-users", "3"]
    provider = PaluModelProvider(server_parser().parse_args(argv))
    with caplog.at_level(logging.INFO, logger="palu_mlx.server"):
        provider.load_default()
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV memory plan: ")]
    assert len(plans) == 1 and f"{CANDIDATES[0]} for 3 x 1024 tokens: " in plans[0]
    assert provider.palu_config.method == TIERS[CANDIDATES[0]].config.method
