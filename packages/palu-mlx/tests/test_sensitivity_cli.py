"""``palu-mlx sensitivity``: the per-model profile of the ``+sens`` budgets, from the command line."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from kvspec import KVConfigError
from palu_mlx import KVCacheBuilder, KVCacheConfig
from palu_mlx.budgets import SensitivityProfile, measure_sensitivity, profile_path, spread_windows
from palu_mlx.cli import main as cli_main

#: fast settings: one short window
FAST = ["--context", "48", "--scored", "8", "--windows", "1", "--quiet"]


def test_spread_windows_spreads_evenly_and_refuses_short_text():
    tokens = list(range(100))
    assert spread_windows(tokens, 1, 10) == [list(range(10))]
    windows = spread_windows(tokens, 3, 10)
    assert [w[0] for w in windows] == [0, 45, 90] and all(len(w) == 10 for w in windows)
    with pytest.raises(KVConfigError, match="100 tokens; 3 window"):
        spread_windows(tokens, 3, 40)
    with pytest.raises(KVConfigError, match="windows=0"):
        spread_windows(tokens, 0, 10)


def test_kv_dtype_rounds_what_every_layer_caches(tiny_model):
    windows = [list(range(3, 43))]
    plain = measure_sensitivity(tiny_model, windows, scored=8)
    same = measure_sensitivity(tiny_model, windows, scored=8, kv_dtype=mx.float32)
    rounded = measure_sensitivity(tiny_model, windows, scored=8, kv_dtype=mx.bfloat16)
    assert same.key_kl == plain.key_kl and same.value_variances == plain.value_variances
    assert rounded.key_variances != plain.key_variances  # bfloat16 K/V, not the float32 ones
    assert all(k >= 0 for k in rounded.key_kl + rounded.value_kl)


def test_the_command_writes_the_profile_beside_the_model(embedded_path, tmp_path, capsys):
    # a link to the model directory, so the profile lands in tmp_path, not in the repository
    model_dir = tmp_path / "tiny-qwen3"
    model_dir.symlink_to(embedded_path, target_is_directory=True)
    assert cli_main(["sensitivity", "--model", str(model_dir), *FAST]) == 0
    captured = capsys.readouterr()
    written = profile_path(model_dir)
    assert written == tmp_path / "tiny-qwen3.palu-sensitivity.json" and written.is_file()
    assert captured.err == ""  # --quiet: no progress bar, no note
    assert f"wrote {written}" in captured.out and "palu_sensitivity=" in captured.out
    profile = SensitivityProfile.load(written)
    model, _ = mlx_lm.load(str(model_dir))
    assert profile.n_layers == len(model.layers) and profile.bits == 2.0
    assert all(k > 0 for k in profile.key_kl + profile.value_kl)
    # the +sens budgets read it
    head_dim = profile.model["head_dim"]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=head_dim, palu_sensitivity=str(written)))
    assert len(caches) == len(model.layers)
    assert sum(c.config.palu_bits for c in caches) == pytest.approx(
        KVCacheConfig(method="palu").coder_bits * len(caches)
    )
    # --out and --bits
    out = tmp_path / "elsewhere.json"
    assert cli_main(["sensitivity", "--model", str(model_dir), "--out", str(out), "--bits", "3", *FAST]) == 0
    assert SensitivityProfile.load(out).bits == 3.0


def test_the_command_shows_progress_with_the_time_left(embedded_path, tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["sensitivity", "--model", str(embedded_path), "--out", str(out), *FAST[:-1]]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert "palu-mlx sensitivity" in err and "probe" in err and "<" in err  # tqdm: elapsed<left
    assert "layer 0 keys: KL" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bits", "9"], "'9' is not a number of code bits per element in (0, 8]"),
        (["--bits", "many"], "'many' is not a number of code bits"),
        (["--windows", "0"], "'0' is not a positive whole number"),
        (["--context", "-3"], "'-3' is not a positive whole number"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_options_are_refused_by_name(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["sensitivity", "--model", "m", "--out", str(tmp_path / "p.json"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_errors_are_one_line(embedded_path, tmp_path, capsys):
    def run(*args: str) -> str:
        assert cli_main(["sensitivity", *args, "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
        return err

    assert "pass --out FILE" in run("--model", "someone/some-model")
    assert "existing directory" in run(
        "--model", str(embedded_path), "--out", str(tmp_path / "no" / "p.json")
    )
    assert "must be a file" in run("--model", str(embedded_path), "--out", str(tmp_path))
    assert "--text" in run(
        "--model", str(embedded_path), "--out", str(tmp_path / "p"), "--text", "missing.txt"
    )
    short = tmp_path / "short.txt"
    short.write_text("a few words only.", encoding="utf-8")
    err = run("--model", str(embedded_path), "--out", str(tmp_path / "p"), "--text", str(short))
    assert "give a longer text" in err
    assert "cannot be loaded" in run("--model", str(tmp_path), "--out", str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()
