"""Test helpers (uniquely named so other packages' conftest modules cannot shadow them):
seeded synthetic K/V, a tiny random-weight mlx-lm qwen3 built in memory, and a served palu-mlx server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from kvspec.conformance import relative_error
from mlx_lm.models import qwen3


def planted_lowrank(shape, rank: int, seed: int = 0, noise: float = 0.0, dtype=mx.float32) -> mx.array:
    """``[B, H, S, D]`` data that lies (up to ``noise``) in a shared rank-``rank`` subspace plus a mean."""
    b, h, s, d = shape
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    basis = mx.linalg.qr(mx.random.normal((d, rank), key=k1), stream=mx.cpu)[0]
    coeffs = mx.random.normal((b, h, s, rank), key=k2) * mx.linspace(3.0, 1.0, rank)
    mean = mx.random.normal((d,), key=k3)
    x = coeffs @ basis.T + mean + noise * mx.random.normal(shape, key=k4)
    return x.astype(dtype)


def gaussian(shape, seed: int = 0, dtype=mx.float32) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def rel_err(x_hat: mx.array, x: mx.array) -> float:
    """``||x_hat - x||_F / ||x||_F``: kvspec's measure, on mlx arrays of any float dtype."""
    return relative_error(np.array(x_hat.astype(mx.float32)), np.array(x.astype(mx.float32)))


TINY_ARGS = dict(
    model_type="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=8,
    rms_norm_eps=1e-6,
    vocab_size=256,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    head_dim=32,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)


def make_tiny_qwen3(seed: int = 0, **overrides) -> qwen3.Model:
    """A seeded random-weight qwen3 (GQA: 8 query heads, 4 KV heads, head_dim 32), float32."""
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs(**{**TINY_ARGS, **overrides}))
    mx.eval(model.parameters())
    return model


def reachable_nbytes(root: object) -> int:
    """Bytes of every MLX array reachable from ``root`` through attributes, lists, tuples and
    dicts, each array once: everything a cache keeps, derived tables included (a cache's own
    ``nbytes`` may count only its stored form)."""
    seen: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            total += obj.nbytes
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return total


@contextmanager
def palu_server(model: str, log: Path, *options: str, name: str = "palu-mlx server") -> Iterator[int]:
    """``palu-mlx server --model MODEL OPTIONS`` on a free localhost port, from when it answers its
    health check until the block ends; yields the port. Started and stopped by kvbench's process
    helpers (a test using it needs kvbench), its output in ``log``."""
    from kvbench.process import free_port, served

    port = free_port()
    cmd = [sys.executable, "-m", "palu_mlx.cli", "server", "--model", model, "--port", str(port), *options]
    health = f"http://127.0.0.1:{port}/health"
    with served(cmd, health, log, timeout_s=180, poll_s=0.5, stop_timeout_s=20, name=name, log_chars=3000):
        yield port
