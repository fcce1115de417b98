"""Token match and latency figures of a turn."""

from __future__ import annotations

import pytest

from demo.stats import SideStats, median_ms, token_match


def side(steps: tuple[float, ...]) -> SideStats:
    return SideStats("native", 5, len(steps) + 1, 100, None, None, None, 0.01, steps)


def test_identical_replies_match_everywhere():
    m = token_match([1, 2, 3], [1, 2, 3])
    assert (m.same, m.total, m.first_divergence, m.share) == (3, 3, None, 1.0)


def test_first_divergence_is_the_first_differing_position():
    m = token_match([1, 2, 3, 4], [1, 9, 3, 4])
    assert (m.same, m.total, m.first_divergence) == (3, 4, 1)


def test_a_reply_that_stopped_early_mismatches_the_rest():
    m = token_match([1, 2, 3, 4], [1, 2])
    assert (m.same, m.total, m.first_divergence) == (2, 4, 2)
    assert token_match([1], [1, 5, 6]).first_divergence == 1


def test_empty_replies_have_no_share():
    assert token_match([], []).share is None


def test_latency_is_the_median_in_ms():
    assert median_ms([0.010, 0.002, 0.003]) == pytest.approx(3.0)
    assert median_ms([]) is None
    assert side((0.004, 0.1, 0.005)).ms_per_token == pytest.approx(5.0)
    assert side(()).ms_per_token is None
