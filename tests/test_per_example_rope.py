"""Rotary embeddings that depend on the sequence length (longrope, dynamic NTK): every example of a packed or
padded batch gets the positions it has alone, in a freshly loaded model (``core/model/rope.py``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as tf

from leansft.core.model.attention import plain_attention, use_packed_attention
from leansft.core.model.forward import hidden_states
from leansft.core.model.rope import per_example_rope
from leansft.core.model.verify import _packed_batch, _padded_batch

SWITCH = 32  # where the tiny models' rotary frequencies change
LENGTHS = (40, 20, 50, 32, 33, 10)  # both sides of the switch, and on it


def _phi3_longrope():
    half = 8  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [4.0 + i for i in range(half)], "original_max_position_embeddings": SWITCH}
    return tf.Phi3ForCausalLM(tf.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=256, original_max_position_embeddings=SWITCH, rope_parameters=rope,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _llama_dynamic():
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=SWITCH, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                      "factor": 4.0}))


def _alone(model, segments) -> list[torch.Tensor]:
    """Each segment through its own fresh copy of the plain model: what it gets alone, as at inference."""
    return [copy.deepcopy(model)(torch.as_tensor(s)[None]).logits[0] for s in segments]


@pytest.mark.parametrize("build", [_phi3_longrope, _llama_dynamic], ids=["longrope", "dynamic"])
@torch.no_grad()
def test_each_example_gets_the_positions_it_has_alone(build):
    torch.manual_seed(0)
    model = build().eval()
    segments = [(np.arange(n) * 7 + i) % 300 for i, n in enumerate(LENGTHS)]
    ref = _alone(model, segments)
    shipped = copy.deepcopy(model)
    use_packed_attention(model, "leansft_sdpa_varlen")  # hidden_states, the forward of every run, wraps the rotary
    scale = max(float(r.abs().max()) for r in ref)
    starts = np.cumsum([0, *LENGTHS])
    packed = hidden_states(model, _packed_batch(segments, "cpu"))
    logits = model.lm_head(packed)[0]
    for r, a, b in zip(ref, starts[:-1], starts[1:]):
        assert float((logits[a:b] - r).abs().max()) < 1e-5 * scale
    with plain_attention(model):
        padded = model.lm_head(hidden_states(model, _padded_batch(segments, 0, "cpu")))
    for r, row, n in zip(ref, padded, LENGTHS):
        assert float((row[:n] - r).abs().max()) < 1e-5 * scale
    assert per_example_rope(model) == 1  # wrapped once, by the first forward
    # as transformers ships it, the longest example picks the frequencies of all: the short ones are off
    use_packed_attention(shipped, "leansft_sdpa_varlen")
    shipped._leansft_per_example_rope = 0  # hidden_states' wrapping skipped: the rotary module as shipped
    wrong = shipped.lm_head(hidden_states(shipped, _packed_batch(segments, "cpu")))[0]
    assert float((wrong[starts[1]:starts[2]] - ref[1]).abs().max()) > 1e-3 * scale
    # afterwards the model runs as a freshly loaded one (generation and the plain model see no leftover state)
    with plain_attention(model):
        assert torch.allclose(model(torch.as_tensor(segments[0])[None]).logits[0], ref[0], atol=1e-5 * scale)


def test_other_rotary_types_are_left_alone():
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    forward = model.model.rotary_emb.forward
    assert per_example_rope(model) == 0 and model.model.rotary_emb.forward == forward
