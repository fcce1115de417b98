"""The two compare commands on the embedded model: JSON fields are real figures of that run;
user mistakes give one line and exit code 2; docs/benchmarks.md matches the committed results."""

from __future__ import annotations

import json
import math

import pytest
from kvbench.protocol import MEASURES
from kvbench.results import SCHEMA, run_of

# 64 context tokens: palu fits its projections once it holds head_dim (64) tokens; a small
# long-context run (320 tokens) still exercises the memory curve
SMALL = [
    *("--model", "tiny-qwen3"),
    *("--windows", "2", "--context-tokens", "64", "--scored-tokens", "8", "--new-tokens", "4"),
    *("--prompt-count", "1", "--speed-rounds", "1", "--speed-steps", "4", "--quiet"),
    *("--long-context", "320", "--long-windows", "1", "--long-scored-tokens", "16"),
]
PROMPT = ["--prompt", "The json module encodes"]

#: (module, one tier, one peer)
CLIS = [
    ("palu_mlx.compare", "reference-default", "mlx-lm-q4"),
    ("flashcodec.compare", "jpeg-k8-int8", "hf-fp8"),
]


def _main(module: str):
    import importlib

    return importlib.import_module(module).main


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module", params=CLIS, ids=[c[0].split(".")[0] for c in CLIS])
def run(request, tmp_path_factory):
    module, tier, peer = request.param
    out = tmp_path_factory.mktemp(module) / "result.json"
    code = _main(module)([*SMALL, *PROMPT, "--tiers", tier, "--peers", peer, "--json", str(out)])
    assert code == 0
    return module, tier, peer, json.loads(out.read_text())


def test_json_has_every_field_as_a_measured_number(run, model_path):
    module, tier, peer, result = run
    assert result["schema"] == SCHEMA
    assert [r["name"] for r in result["runs"]] == ["short", "long"]
    assert set(MEASURES) <= set(result["measures"])
    assert result["inputs"]["prompt_texts"] == [PROMPT[1]] and result["inputs"]["dtype"] == "bfloat16"
    assert result["model"]["dtype"] == "bfloat16"
    assert result["stamp"]["machine"]["cpu_count"] >= 1 and result["stamp"]["versions"]["kvbench"]
    short, long = run_of(result, "short"), run_of(result, "long")
    assert short["settings"]["prompts"] == 1
    for run_ in (short, long):
        assert [r["name"] for r in run_["rows"]] == ["baseline", tier, peer]
        if module == "flashcodec.compare":  # the tier's own attention (the codes), counted in its row
            row = run_["rows"][1]
            assert row["config"]["attention"] == "codes" and row["details"]["decode_steps_on_codes"] > 0
        for row in run_["rows"]:
            for key in (
                "kv_bytes", "kv_raw_bytes", "kv_ratio", "resident_ratio", "bits_per_element", "kl_mean",
                "kl_p99", "top1_agreement", "nll", "perplexity", "ppl_delta", "token_match",
                "first_divergence", "decode_tokens_per_s", "decode_speed_ratio", "prefill_seconds",
                "prefill_time_ratio", "quality_seconds",
            ):  # fmt: skip
                assert _finite(row[key]), (row["name"], key, row[key])
            assert row["kv_bytes"] > 0 and row["nll"] > 0 and row["decode_tokens_per_s"] > 0
            assert 0 <= row["token_match"] <= 1 and 0 <= row["top1_agreement"] <= 1 and row["kl_mean"] >= 0
            assert isinstance(row["sample"], str)
            for key in ("peak_prefill_bytes", "peak_decode_bytes"):
                assert row[key] is None or row[key] >= 0
        base, ours, theirs = run_["rows"]
        assert base["token_match"] == 1 and base["ppl_delta"] == 0 and base["decode_speed_ratio"] == 1
        assert base["kl_mean"] == 0 and base["top1_agreement"] == 1
        # the lossy tier and the peer really ran: their distributions are their own
        assert ours["kl_mean"] > 0 and theirs["kl_mean"] > 0
        assert ours["positions_scored"] == run_["settings"]["windows"] * run_["settings"]["scored_tokens"]
        # the tier against the peer on the same positions; the baseline and the peer get no such field
        pair = ours["ppl_vs_peers"][peer]
        assert (
            list(ours["ppl_vs_peers"]) == [peer]
            and "ppl_vs_peers" not in base
            and "ppl_vs_peers" not in theirs
        )
        assert pair["ppl_delta"] == pytest.approx(ours["perplexity"] - theirs["perplexity"])
        assert pair["ci95"][0] <= pair["ppl_delta"] <= pair["ci95"][1]
    base, ours, theirs = short["rows"]
    # raw bytes checked against the model's shape, independently of any cache: 72 bf16 tokens
    m = result["model"]
    tokens = 64 + 8
    assert base["kv_tokens"] == tokens
    assert base["kv_raw_bytes"] == m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * tokens * 2
    assert base["bits_per_element"] >= 16  # mlx-lm's KVCache reserves 256-token steps
    assert ours["kv_ratio"] == pytest.approx(ours["kv_bytes"] / base["kv_raw_bytes"])
    assert theirs["kv_bytes"] < base["kv_bytes"]  # a 4-bit / fp8 peer holds fewer bytes
    curve = long["rows"][0]["memory_curve"]
    assert [p["tokens"] for p in curve] == [256, 320] and curve[1]["held"] > curve[0]["held"] * 0.99


def test_flashcodec_compare_refuses_an_attention_suffix_and_names_the_option(capsys):
    from flashcodec.tiers import RETIRED_ATTENTION_SUFFIX as SUFFIX

    main = _main("flashcodec.compare")
    for argv in (["--tiers", f"png-keep1,jpeg-k2-int8{SUFFIX}"], [f"--tiers=kivi64r-k4v4-w64i8-s8{SUFFIX}"]):
        assert main([*argv, "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no longer part of a tier's name" in err[0] and "--attention codes" in err[0]
    assert main(["--attention", "mf", "--quiet"]) == 2
    assert "invalid choice: 'mf' (choose from 'tier', 'codes', 'materialized')" in capsys.readouterr().err


@pytest.mark.parametrize("module", [c[0] for c in CLIS])
def test_user_mistakes_are_one_line(module, tmp_path, capsys):
    main = _main(module)
    not_model = tmp_path / "plain"
    not_model.mkdir()
    unknown_arch = tmp_path / "arch"
    unknown_arch.mkdir()
    (unknown_arch / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    cases = [
        (["--model", str(not_model)], "is not a model directory"),
        (["--model", "not/a/hub/id/at/all"], "neither a local directory nor a hub id"),
        (["--tiers", "no-such-tier"], "--tiers='no-such-tier': unknown name"),
        (["--peers", "nope"], "--peers='nope': unknown name"),
        (["--model", str(unknown_arch)], "cannot load it"),
        (["--text", str(tmp_path / "missing.txt")], "--text"),
        (["--windows", "0"], "--windows=0"),
        (["--windows", "abc"], "argument --windows: invalid int value: 'abc'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ]
    for argv, expected in cases:
        assert main([*argv, "--quiet"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (argv, err)


def test_reading_names_the_paired_perplexity_verdict():
    from make_docs import reading

    def row(name, kind, kl, resident, **extra):
        return {
            "name": name, "kind": kind, "kl_mean": kl, "resident_ratio_decode_mean": resident, "kv_ratio": resident,
            "top1_agreement": 0.99, "bits_per_element": 16 * resident, "decode_speed_ratio": 1.0,
            "decode_tokens_per_s": 10.0, "resident_ratio": resident, **extra,
        }  # fmt: skip

    base = row("baseline", "baseline", 0.0, 1.0)
    peer = row("peer", "peer", 2e-4, 0.31)
    for ci, verdict in (([-0.02, 0.1], "not told apart"), ([0.01, 0.1], "higher"), ([-0.1, -0.01], "lower")):
        tier = row("tier", "tier", 1e-4, 0.30, ppl_vs_peers={"peer": {"ppl_delta": 0.04, "ci95": ci}})
        line = next(x for x in reading([base, tier, peer]) if x.startswith("`tier`"))
        assert (
            "beats `peer`" in line
            and f"+0.040 (95% interval {ci[0]:+.3f} to {ci[1]:+.3f}: {verdict})" in line
        )
    old = row("tier", "tier", 1e-4, 0.30)  # a result written before the field existed
    line = next(x for x in reading([base, old, peer]) if x.startswith("`tier`"))
    assert "beats `peer`" in line and "Perplexity" not in line


def test_the_readme_block_quotes_the_last_main_job_time():
    from make_docs import render_readme_block

    timing = {
        "stamp": {"date": "2026-12-02T03:52:00+00:00", "machine": {"cpu_count": 2, "machine": "x86_64"}},
        "load_average_at_start": [0.8, 1.1, 1.4],
        "steps_s": {"model and calibration": 3.0, "palu-mlx": 600.0, "flashcodec": 240.0},
        "total_s": 843.0,
    }
    block = render_readme_block({}, timing)
    assert (
        "took **14.1 min** (model and calibration 0.1, palu-mlx 10.0, flashcodec 4.0 min) on 2 cores "
        "(x86_64), load average 0.8 when it started, 2026-12-02." in block
    )
    assert "hatch run demo" not in render_readme_block({})


def test_docs_match_the_committed_results():
    from make_docs import main as make_docs

    assert make_docs(["--check"]) == 0, "run: python benchmarks/tools/make_docs.py"


@pytest.mark.parametrize(
    "cli, tiers, commands",
    [
        (
            "palu_mlx.cli",
            ["reference-default", "rotation-3.5bit"],
            "generate, server, compare, calibrate, sensitivity",
        ),
        ("flashcodec.cli", ["png-keep1", "jpeg-k2-int8"], "compare"),
    ],
)
def test_console_script_dispatch(cli, tiers, commands, capsys):
    import importlib

    main = importlib.import_module(cli).main
    assert main(["compare", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"tier  {t}" in listed for t in tiers)
    assert main(["bogus"]) == 2
    assert capsys.readouterr().err.strip() == f"error: unknown command 'bogus'; allowed: {commands}"
    assert main([]) == 2 and "usage:" in capsys.readouterr().out
