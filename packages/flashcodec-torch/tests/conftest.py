"""Shared fixtures: small seeded signals, one thread (the CI box has 2 shared cores)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def random_walk(b=2, h=3, s=64, d=16, *, seed=0, dtype=torch.float32, step=0.1) -> torch.Tensor:
    """Autocorrelated signal along the sequence axis: ``x_t = x_{t-1} + step * noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, 1, d, generator=g) + step * torch.randn(b, h, s, d, generator=g).cumsum(2)
    return x.to(dtype)


def gaussian(b=2, h=3, s=64, d=16, *, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(dtype)


@pytest.fixture
def walk():
    return random_walk()


#: every tier the issue names, as CodecKVCache keywords (r = 8)
TIERS = {
    "png-keep1": dict(mode="png", block_size=8, keep_ratio=1.0),
    "png-keep0.5": dict(mode="png", block_size=8, keep_ratio=0.5),
    "jpeg-k8": dict(mode="jpeg", block_size=8, keep_freqs=8),
    "jpeg-k8-int8": dict(mode="jpeg", block_size=8, keep_freqs=8, quant_bits=8),
    "jpeg-k4": dict(mode="jpeg", block_size=8, keep_freqs=4),
    "jpeg-k2": dict(mode="jpeg", block_size=8, keep_freqs=2),
    "jpeg-k2-int8": dict(mode="jpeg", block_size=8, keep_freqs=2, quant_bits=8),
}
