"""benchmarks/results/flashcodec_reference_peer.json (written by benchmarks/flashcodec/reference_peer.py):
its shape, a row for every named setting, and the byte count the script applies to every cache.

Nothing here needs the network or the reference library's venv: the file is read as committed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kvbench.results import read_json

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "flashcodec"))

from reference_peer import REFERENCE_SETTINGS, REFERENCE_VERSION, RESULTS_FILE, SETTINGS, resident_bytes  # noqa: E402


@pytest.fixture(scope="module")
def result() -> dict:
    return read_json(ROOT / "benchmarks" / "results" / RESULTS_FILE)


def test_the_file_has_the_shape_of_the_other_results(result):
    assert result["schema"] == "kvbench.compare/2"
    for key in ("date", "machine", "versions"):
        assert key in result["stamp"] and key in result["stamp_reference_venv"]
    assert result["command"].startswith("hatch run bench:python benchmarks/flashcodec/reference_peer.py")
    assert {"windows", "context_tokens", "scored_tokens"} <= set(result["settings"])
    assert result["runs"][0]["rows"][0]["name"] == "baseline"
    assert result["notes"]


def test_the_reference_side_ran_the_released_library_in_its_own_venv(result):
    assert result["stamp_reference_venv"]["versions"]["flashcodec-kv"] == REFERENCE_VERSION
    imported = result["inputs_reference_venv"]["flashcodec_imported_from"]
    assert "site-packages" in imported and "packages/flashcodec-torch" not in imported
    assert "packages/flashcodec-torch" in result["inputs"]["flashcodec_imported_from"]
    assert result["reference_settings"] == REFERENCE_SETTINGS


def test_every_named_setting_has_one_row_measured_or_refused(result):
    names = [row["name"] for row in result["summary"]]
    for name in SETTINGS:
        assert names.count(name) == 1, name
    for row in result["summary"]:
        if row["status"] == "measured":
            assert row["kl_mean"] >= 0 and 0 <= row["top1_agreement"] <= 1
            assert row["resident_ratio_decode_mean"] > 0
        else:
            assert row["status"].startswith("refused: ") and len(row["status"]) > len("refused: ")


def test_both_processes_measured_the_same_uncompressed_model(result):
    agree = result["baselines_agree"]
    assert agree["same_raw_bytes"] and agree["same_nll"]


def test_resident_bytes_counts_each_storage_once_at_its_full_size():
    buffer = torch.zeros(4, 16)  # 256 bytes
    holder = type("Holder", (), {})()
    holder.view = buffer[:1]  # a slice keeps the whole storage alive
    holder.again = [buffer, {"same": buffer[2:]}]
    holder.other = torch.zeros(3, dtype=torch.int8)
    assert resident_bytes(holder) == 256 + 3
