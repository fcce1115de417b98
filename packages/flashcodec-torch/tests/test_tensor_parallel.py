"""Tensor parallel: two ranks under torchrun (gloo, CPU) give one process's greedy tokens.

transformers' ``tp_plan="auto"`` shards the attention heads across ranks, so each rank's
:class:`~flashcodec.hf.FlashCodecCache` caches only its own KV heads. Every flashcodec codec is
head-local, so the tokens must not change. :data:`TP_TIERS` names the tiers checked (add a tier
there to check it too); each runs with the materialized view and with codec attention.

The slow test really starts ``torch.distributed.run`` with two processes on localhost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_qwen3  # noqa: E402
from flashcodec.hf import FlashCodecCache, apply_codec_attention, remove_codec_attention  # noqa: E402
from flashcodec.tiers import TIERS  # noqa: E402
from tp_worker import PROMPT as TP_PROMPT  # noqa: E402
from tp_worker import case_names, tier_tokens  # noqa: E402

#: the tiers the two-rank test checks: the lossless tier and the default lossy candidate
TP_TIERS = ("png-keep1", "kivi64r-k4v4-w64i8-s8")
NEW_TOKENS = 80  # the prompt (~40 tokens) + 80 spans two 64-token blocks and a window per layer
WORKER = Path(__file__).with_name("tp_worker.py")


def test_tp_tiers_are_registry_tiers():
    assert all(name in TIERS for name in TP_TIERS)
    assert case_names(["a"]) == ["a+codes", "a+materialized"]


def _tiny(seed: int = 0):
    return tiny_qwen3(seed, max_positions=256)


class _GlobalShapeLinear(torch.nn.Module):
    """A projection whose ``weight`` reports twice its output rows, as a column-sharded DTensor
    reports the global shape on one rank, while its forward gives the local rows."""

    def __init__(self, inner: torch.nn.Linear):
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:
        w = self.inner.weight
        return w.new_empty(2 * w.shape[0], w.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_the_step_mask_takes_the_head_count_from_the_query():
    """A per-head mask ``[B, Hq, s, S]`` is served on the coded path even when the projection's
    weight reports more heads than the query has (the global shape under tensor parallel)."""
    model = _tiny()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    attn = model.model.layers[0].self_attn
    heads = model.config.num_attention_heads
    reference_cache = FlashCodecCache.from_config(model.config, mode="png", keep_ratio=1.0)
    with torch.no_grad():
        expected = model(ids, cache=reference_cache).logits
    for layer in model.model.layers:
        layer.self_attn.q_proj = _GlobalShapeLinear(layer.self_attn.q_proj)
    stats = apply_codec_attention(model, backend="torch")
    try:
        causal = torch.ones(12, 12, dtype=torch.bool).tril()
        mask = causal[None, None].expand(1, heads, 12, 12).contiguous()
        cache = FlashCodecCache.from_config(model.config, mode="png", keep_ratio=1.0)
        hidden = model.model.embed_tokens(ids)
        pos = torch.arange(12)[None]
        emb = model.model.rotary_emb(hidden, pos)
        with torch.no_grad():
            out, _ = attn(hidden, position_embeddings=emb, attention_mask=mask, cache=cache)
        assert stats.chunked == 1, stats
        assert not stats.fallbacks, stats
        assert out.shape == hidden.shape
        # and a whole forward with the model's own masks gives the plain model's logits
        cache = FlashCodecCache.from_config(model.config, mode="png", keep_ratio=1.0)
        with torch.no_grad():
            got = model(ids, cache=cache).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    finally:
        remove_codec_attention(model)


def _torchrun_ready() -> str | None:
    """Why the two-rank run cannot start here, or None."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with gloo is not available"
    if importlib.util.find_spec("accelerate") is None:
        return "transformers' tp_plan needs accelerate"
    return None


@pytest.mark.slow
def test_two_ranks_give_one_process_greedy_tokens(embedded_model, tmp_path):
    """torchrun --nproc_per_node 2 with tp_plan="auto": every case's greedy tokens equal one
    process's, each rank caches half the KV heads and holds half the bytes, and the codec-attention
    cases serve every step on the codes (no fallback)."""
    why = _torchrun_ready()
    if why:
        pytest.skip(why)
    from kvbench.models import embedded_model_path

    model, tokenizer = embedded_model
    ids = tokenizer(TP_PROMPT, return_tensors="pt").input_ids
    out = tmp_path / "tp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        "--model",
        str(embedded_model_path()),
        "--tiers",
        ",".join(TP_TIERS),
        "--new-tokens",
        str(NEW_TOKENS),
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    assert list(ranks[0]["tiers"]) == case_names(list(TP_TIERS))
    with torch.no_grad():
        for case in case_names(list(TP_TIERS)):
            single = tier_tokens(model, ids, case, NEW_TOKENS)
            for rank in ranks:
                got = rank["tiers"][case]
                assert got["tokens"] == single["tokens"], case
                assert 2 * got["kv_heads"] == single["kv_heads"], case
                assert got["fallbacks"] == {}, case
                if case.endswith("+codes"):
                    assert got["coded_steps"] == single["coded_steps"] > 0, case
            assert (
                ranks[0]["tiers"][case]["held_bytes"] + ranks[1]["tiers"][case]["held_bytes"]
                == (single["held_bytes"])
            ), case
