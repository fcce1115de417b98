"""The page's tables and sentences from measured values."""

from __future__ import annotations

from demo.formatting import (
    COMPARISON_HEADERS,
    STATS_HEADERS,
    comparison_rows,
    details_line,
    fmt_ms,
    fmt_ratio,
    fmt_share,
    match_line,
    stats_rows,
)
from demo.stats import SideStats, token_match


def test_units():
    assert fmt_ms(12.345) == "12.35 ms"
    assert fmt_ratio(0.53125) == "0.531x"
    assert fmt_share(0.91666) == "91.7%"
    assert fmt_ms(None) == fmt_ratio(None) == fmt_share(None) == "n/a"


def test_stats_rows_show_measured_values_and_na_for_unmeasured():
    native = SideStats("native", 9, 4, 2048, None, 10 * 2**20, 3 * 2**20, 0.125, (0.002, 0.004, 0.003))
    compressed = SideStats("jpeg-k8-int8", 9, 4, 1024, 4096, None, None, 0.25, (0.005,))
    rows = stats_rows(native, compressed, token_match([1, 2, 3, 4], [1, 2, 7, 4]))
    assert [len(r) for r in rows] == [len(STATS_HEADERS)] * 2
    first, second = (dict(zip(STATS_HEADERS, r, strict=True)) for r in rows)
    assert first["KV held"] == "2.0 KiB" and first["KV resident"] == "2.0 KiB"  # resident = held when unknown
    assert first["peak memory"] == "10.0 MiB" and first["steady memory"] == "3.0 MiB"
    assert first["prefill"] == "125.00 ms" and first["per token (median)"] == "3.00 ms"
    assert first["context + new tokens"] == "9 + 4" and first["token match"] == "reference"
    assert second["held vs native"] == "0.500x" and second["KV resident"] == "4.0 KiB"
    assert second["peak memory"] == "n/a" and second["steady memory"] == "n/a"
    assert second["token match"] == "3/4 (75.0%)"


def test_match_line():
    assert match_line(token_match([1, 2], [1, 2])) == "The replies agree on all 2 tokens."
    assert "first differ at token 2" in match_line(token_match([1, 2], [1, 3]))


def test_comparison_rows_follow_the_protocol_fields():
    row = {
        "name": "palu-3bit",
        "kind": "tier",
        "kv_bytes": 3072,
        "kv_ratio": 0.25,
        "resident_ratio": 0.3,
        "peak_decode_bytes": None,
        "decode_tokens_per_s": 123.456,
        "decode_speed_ratio": 0.9,
        "nll": 1.23456,
        "ppl_delta": 0.5,
        "kl_mean": 0.00123,
        "top1_agreement": 0.975,
        "token_match": 1.0,
    }
    (cells,) = comparison_rows([row])
    shown = dict(zip(COMPARISON_HEADERS, cells, strict=True))
    assert shown["KV held"] == "3.0 KiB" and shown["held x"] == "0.250x" and shown["peak decode"] == "n/a"
    assert shown["decode tok/s"] == "123.5" and shown["NLL"] == "1.235" and shown["d ppl"] == "+0.500"
    assert shown["KL"] == "1.23e-03" and shown["top-1"] == "97.5%" and shown["token match"] == "100.0%"


def test_details_line():
    assert details_line(None) == ""
    assert (
        details_line({"decode_steps_on_codes": 11, "fallbacks": {}})
        == "decode steps on codes: 11; fallbacks: none"
    )
    assert details_line({"fallbacks": {"mask": 2}}) == "fallbacks: mask 2"
