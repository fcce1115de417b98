"""The Triton split-K kernel against its pure-torch reference (``kernels/naive.py``).

On the CPU the kernels run under Triton's interpreter, which triton only provides when
``TRITON_INTERPRET=1`` is set before its first import in the process. This module sets it when
it can (triton not imported yet, no GPU); when something imported triton earlier in the pytest
process (transformers does), the interpreter cases are re-run in a fresh subprocess by
``test_interpreter_cases_in_a_subprocess`` and skipped here, saying so. Shapes are tiny: the
interpreter runs every program in Python. With a GPU, the same cases and a larger one run on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_SUBPROCESS_FLAG = "FLASHCODEC_KERNEL_TESTS_CHILD"
if not HAS_CUDA and "triton" not in sys.modules:
    # triton builds its library functions in one mode at import and reads the switch again at
    # launch, so it stays on for this process (nothing else here runs triton)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from conftest import CODECS  # noqa: E402
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec  # noqa: E402
from flashcodec.attention import codec_decode_attention, coded_rows, materialized_decode_attention  # noqa: E402
from flashcodec.codecs import ChannelInt4Codec, KIVICodec, MixedJPEGCodec, ZeroPointJPEGCodec  # noqa: E402
from flashcodec.codecs.rotated import RotatedKIVICodec  # noqa: E402
from flashcodec.kernels import triton_attention as ta  # noqa: E402
from flashcodec.kernels.naive import combine_partials, decode_attention_partials  # noqa: E402

INTERPRETER = ta.interpreter_active()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="triton was imported before TRITON_INTERPRET=1 could be set in this process; "
    "these cases run in test_interpreter_cases_in_a_subprocess instead",
)
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device here: the compiled kernel is not exercised"
)

#: name -> (codec, B, Hkv, G, S, D, dtype, blocks_per_split, tile, padding)
CASES = {
    "jpeg-k2-fp32": (CODECS["jpeg-k2"], 2, 1, 3, 45, 24, torch.float32, 3, 2, False),
    "jpeg-k2-int8-masked": (CODECS["jpeg-k2-int8"], 2, 2, 2, 43, 16, torch.float32, 2, 2, True),
    "png-r4-fp64-deltas": (PNGCodec(4), 1, 2, 2, 26, 16, torch.float32, 3, 2, False),
    "jpeg-k4-bf16": (CODECS["jpeg-k4"], 1, 2, 2, 37, 16, torch.bfloat16, 2, 2, False),
    "tail-only": (CODECS["jpeg-k2-int8"], 2, 1, 2, 5, 16, torch.float32, 2, 2, False),
    "no-tail-default-split": (CODECS["jpeg-k2-int8"], 1, 1, 4, 48, 16, torch.float32, None, 16, False),
    "jpeg-k8-int8": (JPEGCodec(8, 8, quant_bits=8), 1, 1, 2, 21, 16, torch.float32, 1, 2, False),
    "jpeg-k4-int4-masked": (JPEGCodec(4, 4, quant_bits=4), 2, 1, 2, 19, 16, torch.float32, 2, 2, True),
    "jpeg-zp-int4-masked": (ZeroPointJPEGCodec(4), 2, 2, 2, 27, 16, torch.float32, 2, 2, True),
    "jpeg-zp-k2-bf16": (ZeroPointJPEGCodec(8, 2), 1, 1, 3, 29, 16, torch.bfloat16, 1, 2, False),
    # a raw window: the tail split reads 20-23 raw tokens, more than one block
    "jpeg-zp-window-masked": (
        ZeroPointJPEGCodec(4, raw_window=20),
        1,
        2,
        2,
        43,
        16,
        torch.float32,
        2,
        2,
        True,
    ),
    # per-channel int4 (chan4): scales and zero points per (block, channel), with an int8 window
    "chan4-masked": (ChannelInt4Codec(4), 2, 2, 2, 27, 16, torch.float32, 2, 2, True),
    "chan4-int8-window-bf16": (
        ChannelInt4Codec(4, raw_window=6, window_bits=8),
        1,
        2,
        2,
        31,
        16,
        torch.bfloat16,
        2,
        2,
        False,
    ),
    # the window stored in int8 (window_bits=8): the kernel reads the decoded bf16 tail
    "jpeg-zp-int8-window-bf16": (
        ZeroPointJPEGCodec(4, raw_window=12, window_bits=8),
        1,
        1,
        2,
        30,
        16,
        torch.bfloat16,
        2,
        2,
        False,
    ),
    "mixed-int8-int4": (MixedJPEGCodec(4, (4, 8, 0, 4)), 1, 2, 2, 22, 16, torch.float32, 2, 2, False),
    # kivi: keys per (block, channel) like chan4, values per token (a scale and zero point per row)
    "kivi-int4-masked": (KIVICodec(4, raw_window=6), 2, 2, 2, 29, 16, torch.float32, 2, 2, True),
    "kivi-int8-bf16": (KIVICodec(4, 8, 8, raw_window=5), 1, 2, 2, 27, 16, torch.bfloat16, 2, 2, False),
    # a value sink (the first tokens' values kept apart, int8): hidden from the kernel's splits,
    # attended in a split of their own; unrotated here (the kernel reads no rotation)
    "kivi-value-sink-masked": (
        RotatedKIVICodec(4, raw_window=6, rotate_keys=False, rotate_values=False, value_sink_tokens=1),
        2,
        2,
        2,
        29,
        16,
        torch.float32,
        2,
        2,
        True,
    ),
    "kivi-value-sink3-s8-bf16": (
        RotatedKIVICodec(
            4, side_bits=8, raw_window=5, rotate_keys=False, rotate_values=False, value_sink_tokens=3
        ),
        1,
        2,
        2,
        27,
        16,
        torch.bfloat16,
        2,
        2,
        False,
    ),
}


def build(case, device="cpu"):
    codec, b, h, g, s, d, dtype, per, tile, padding = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    keys = torch.randn(b, h, s, d, generator=gen).to(dtype)
    values = torch.randn(b, h, s, d, generator=gen).to(dtype)
    cache = CodecKVCache(codec=codec)
    cache.append(keys.to(device), values.to(device))
    query = torch.randn(b, h * g, d, generator=gen).to(dtype).to(device)
    mask = None
    if padding:
        mask = torch.zeros(b, s, device=device)
        mask[-1, :7] = float("-inf")  # the last sequence is left-padded
    return cache, query, mask, per, tile


def check_against_reference(case, device):
    cache, query, mask, per, tile = build(case, device)
    keys, values = coded_rows(cache.keys), coded_rows(cache.values)
    scale = query.shape[-1] ** -0.5
    got = ta.decode_attention_partials_triton(
        query, keys, values, scale=scale, key_mask=mask, blocks_per_split=per, tile=tile
    )
    per_used = per or ta.default_blocks_per_split(
        keys.n_blocks, query.shape[0] * keys.segments[0].shape[1], tile
    )
    want = decode_attention_partials(
        query, keys, values, scale=scale, key_mask=mask, blocks_per_split=per_used
    )
    for name, a, b in zip(("max", "sum", "acc"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max())
    out = ta.combine_partials_triton(*got, dtype=query.dtype)
    ref = combine_partials(*want, dtype=torch.float32)
    assert out.dtype == query.dtype
    tol = 2e-6 if query.dtype == torch.float32 else 2**-7  # one bf16 step (the interpreter may truncate)
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()
    return cache, query, mask, out


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_matches_reference(case):
    check_against_reference(case, "cpu")


@needs_interpreter
def test_interpreted_kernel_through_the_public_entry_point():
    cache, query, mask, _, _ = build("jpeg-k2-int8-masked")
    got = codec_decode_attention(query[:, :, None], cache.keys, cache.values, key_mask=mask, backend="triton")
    assert not cache.keys.has_view and not cache.values.has_view
    want = materialized_decode_attention(query[:, :, None], cache.keys, cache.values, key_mask=mask)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@needs_interpreter
def test_interpreted_kernel_with_a_rotated_value_sink():
    """The public entry point on a rotated archive with a value sink: the query, the tails and the
    sink turn into the rotated basis for the kernel; the output matches the torch path and the view."""
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(2, 2, 23, 16, generator=gen) for _ in range(2))
    values[:, :, 0] *= 8  # a large first value, as a sink's
    cache = CodecKVCache(codec=RotatedKIVICodec(4, side_bits=8, raw_window=6, value_sink_tokens=1))
    cache.append(keys, values)
    assert cache.values.sink_len == 1
    query = torch.randn(2, 4, 1, 16, generator=gen)
    mask = torch.zeros(2, 23)
    mask[-1, :3] = float("-inf")
    got = codec_decode_attention(query, cache.keys, cache.values, key_mask=mask, backend="triton")
    torch_path = codec_decode_attention(query, cache.keys, cache.values, key_mask=mask, backend="torch")
    want = materialized_decode_attention(query, cache.keys, cache.values, key_mask=mask)
    assert (got - torch_path).abs().max() <= 1e-5 * want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_interpreter_cases_in_a_subprocess():
    if INTERPRETER or HAS_CUDA:
        pytest.skip(
            "the interpreter cases already run in this process" if INTERPRETER else "CUDA cases run instead"
        )
    if os.environ.get(_SUBPROCESS_FLAG):
        pytest.fail("the child process could not enable the Triton interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", **{_SUBPROCESS_FLAG: "1"})
    here = Path(__file__).resolve()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-k", "interpreted"],
        cwd=here.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{len(CASES) + 2} passed" in result.stdout, result.stdout[-2000:]


def test_cpu_tensors_without_the_interpreter_are_refused():
    if INTERPRETER:
        pytest.skip("the interpreter is active in this process, so CPU tensors are served")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ta._check_device(torch.zeros(1))


@needs_cuda
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_reference(case):
    check_against_reference(case, "cuda")


@needs_cuda
@pytest.mark.parametrize(
    "tier",
    [
        "jpeg-k2-int8",
        "jpeg-k2",
        "jpeg-k8-int4z",
        "chan64-int4-w64i8",
        "kivi64-k4v4-w64i8",
        "kivi64-k8v8-w64i8",
        "kivi64r-k4v4-w64i8",
        "kivi64r-k3v2-w64i8",
        "kivi64r-k3v2-w0i8-s8z4-vs1",
        "png-keep1",
    ],
)
def test_cuda_kernel_matches_materialized_at_length(tier):
    gen = torch.Generator().manual_seed(0)
    b, h, g, s, d = 2, 8, 2, 4096 + 5, 128
    cache = CodecKVCache(codec=CODECS[tier])
    cache.append(torch.randn(b, h, s, d, generator=gen).cuda(), torch.randn(b, h, s, d, generator=gen).cuda())
    query = torch.randn(b, h * g, 1, d, generator=gen).cuda()
    got = codec_decode_attention(query, cache.keys, cache.values, backend="triton")
    torch_path = codec_decode_attention(query, cache.keys, cache.values, backend="torch")
    assert not cache.keys.has_view
    want = materialized_decode_attention(query, cache.keys, cache.values)
    assert (got - torch_path).abs().max() <= 2e-6 * want.abs().max()
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
