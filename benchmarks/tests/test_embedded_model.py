"""The embedded model: a small real qwen3 with GQA, loads in both frameworks, and they agree.

Parity tolerance: both frameworks run float32 on CPU; their next-token logits must agree within
``LOGIT_ATOL`` absolute (the logits span roughly +-20, so this is ~1e-5 relative), and greedy
decoding must pick the same 32 tokens.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

LOGIT_ATOL = 2e-4
PROMPT = "Return a new dictionary initialized from"
GREEDY_STEPS = 32


@pytest.fixture(scope="module")
def mlx_model(model_path):
    mlx_lm = pytest.importorskip("mlx_lm")
    return mlx_lm.load(str(model_path))


def test_config_is_a_small_real_qwen3(model_path):
    cfg = json.loads((model_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] >= 4
    assert cfg["head_dim"] == 64
    assert cfg["num_key_value_heads"] >= 4
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]
    assert cfg["max_position_embeddings"] >= 2048
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (model_path / name).is_file(), name
    total = sum(f.stat().st_size for f in model_path.iterdir())
    assert total < 31 * 2**20


def test_training_record_beats_unigram_widely(training_record, model_path):
    """The model must have learned real structure: held-out perplexity at least 4x below unigram's.

    The record describes the committed weights (the training run continued an earlier model, so
    its loss curve starts low; it must still fall)."""
    from kvbench.results import weights_digest

    record = training_record
    held = record["heldout"]
    assert math.isclose(held["perplexity"], math.exp(held["loss_nats"]), rel_tol=1e-3)
    assert held["unigram_add_one_perplexity"] / held["perplexity"] > 4.0
    assert record["loss_curve"][-1]["train_loss"] < record["loss_curve"][0]["train_loss"]
    assert record["args"]["seq_len"] >= 1024
    assert record["weights_sha256"] == weights_digest(model_path)


def test_the_model_uses_its_context(model_path):
    """Held-out perplexity falls with the position in a 2,048-token window (the same targets in every
    bucket; a plateau within 0.5% counts as not rising), ends clearly below where it starts, and the
    model beats the earlier 256-token model on the same targets (``benchmarks/model/evaluate.py``)."""
    from kvbench.results import weights_digest

    evaluation = json.loads((model_path.parents[1] / "results" / "tiny_model_eval.json").read_text())
    ours, before = evaluation["model"], evaluation["baseline"]
    assert ours["weights_sha256"] == weights_digest(model_path)
    buckets = [b["perplexity"] for b in ours["by_position_2048_windows"]["buckets"]]
    assert [b["positions"] for b in ours["by_position_2048_windows"]["buckets"]] == [
        [0, 256],
        [256, 512],
        [512, 1024],
        [1024, 2048],
    ]
    assert all(later <= earlier * 1.005 for earlier, later in itertools.pairwise(buckets)), buckets
    assert buckets[-1] < 0.97 * buckets[0], buckets
    earlier_model = [b["perplexity"] for b in before["by_position_2048_windows"]["buckets"]]
    assert all(o < e for o, e in zip(buckets, earlier_model, strict=True))
    assert ours["perplexity_256_windows"] < before["perplexity_256_windows"]
    assert ours["targets_256_windows"] == before["targets_256_windows"]


def test_transformers_loads_and_tokenizer_round_trips(torch_model, hf_tokenizer):
    assert type(torch_model).__name__ == "Qwen3ForCausalLM"
    ids = hf_tokenizer(PROMPT).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == PROMPT


def test_mlx_lm_loads_with_the_same_tokenizer(mlx_model, hf_tokenizer, model_path):
    model, tokenizer = mlx_model
    cfg = json.loads((model_path / "config.json").read_text())
    assert len(model.layers) == cfg["num_hidden_layers"]
    assert tokenizer.encode(PROMPT) == hf_tokenizer(PROMPT).input_ids
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id


def test_next_token_logits_match_across_frameworks(torch_model, hf_tokenizer, mlx_model):
    import mlx.core as mx
    import torch

    ids = hf_tokenizer(PROMPT).input_ids
    with torch.no_grad():
        torch_logits = torch_model(torch.tensor([ids])).logits[0].float().numpy()
    mlx_logits = np.array(mlx_model[0](mx.array([ids]))[0].astype(mx.float32))
    assert mlx_logits.shape == torch_logits.shape == (len(ids), torch_model.config.vocab_size)
    np.testing.assert_allclose(mlx_logits, torch_logits, atol=LOGIT_ATOL, rtol=0)
    assert int(mlx_logits[-1].argmax()) == int(torch_logits[-1].argmax())


def test_greedy_tokens_match_for_32_steps(torch_model, hf_tokenizer, mlx_model):
    import mlx.core as mx
    import torch
    from mlx_lm.generate import generate_step

    ids = hf_tokenizer(PROMPT).input_ids
    with torch.no_grad():
        # min_new_tokens keeps EOS from ending one side early: exactly 32 steps on both
        out = torch_model.generate(
            torch.tensor([ids]),
            max_new_tokens=GREEDY_STEPS,
            min_new_tokens=GREEDY_STEPS,
            do_sample=False,
            pad_token_id=hf_tokenizer.pad_token_id,
        )
    torch_tokens = out[0, len(ids) :].tolist()
    mlx_tokens = [int(tok) for tok, _ in generate_step(mx.array(ids), mlx_model[0], max_tokens=GREEDY_STEPS)]
    assert len(torch_tokens) == len(mlx_tokens) == GREEDY_STEPS
    assert mlx_tokens == torch_tokens
