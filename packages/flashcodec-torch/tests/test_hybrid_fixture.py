"""The hybrid fixture builds a qwen3_5 model with both layer kinds, deterministically, and generates."""

from __future__ import annotations

import pytest
import torch
from hybrid_fixture import HYBRID_LAYER_TYPES, make_tiny_hybrid_config, make_tiny_hybrid_model


@pytest.fixture(scope="module")
def hybrid():
    return make_tiny_hybrid_model(seed=0)


def test_has_linear_and_full_attention_layers(hybrid):
    assert hybrid.config.model_type.startswith("qwen3_5")
    assert list(hybrid.config.layer_types) == list(HYBRID_LAYER_TYPES)
    assert {"linear_attention", "full_attention"} <= set(hybrid.config.layer_types)


def test_forward_fills_kv_only_for_full_attention_layers(hybrid):
    ids = torch.arange(1, 13).unsqueeze(0)
    with torch.no_grad():
        cache = hybrid(input_ids=ids, use_cache=True).past_key_values
    for kind, layer in zip(hybrid.config.layer_types, cache.layers, strict=True):
        if kind == "full_attention":
            assert tuple(layer.keys.shape) == (1, 2, 12, 32)
        else:
            assert getattr(layer, "keys", None) is None or layer.keys.numel() == 0


def test_generates(hybrid):
    ids = torch.tensor([[1, 5, 7, 9]])
    out = hybrid.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    assert torch.equal(out[:, :4], ids)


def test_same_seed_same_weights_and_rng_untouched(hybrid):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    again = make_tiny_hybrid_model(seed=0)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is not consumed
    other = make_tiny_hybrid_model(seed=1)
    for (name, a), b, _c in zip(
        hybrid.state_dict().items(), again.state_dict().values(), other.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert any(
        not torch.equal(a, c)
        for a, c in zip(hybrid.state_dict().values(), other.state_dict().values(), strict=True)
    )


def test_rejects_layer_types_without_both_kinds():
    with pytest.raises(ValueError, match="layer_types"):
        make_tiny_hybrid_config(("full_attention", "full_attention"))
