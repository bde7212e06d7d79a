"""Memory estimate: hand-computed Llama-3-8B figures, and a measured tiny model."""

from __future__ import annotations

import pytest
import torch

from leansft.tools.memory import ModelShape, estimate_memory

LLAMA3_8B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False)


def test_llama3_8b_hand_computed():
    assert LLAMA3_8B.params == pytest.approx(8.03e9, rel=0.01)
    m = estimate_memory(LLAMA3_8B, 32768, chunked_loss=False)
    assert m["logits_full_bf16"] == 32768 * 128256 * 2 == pytest.approx(8.4e9, rel=0.01)
    assert m["logits_full_fp32"] == pytest.approx(16.8e9, rel=0.01)
    assert m["parts"]["weights"] == LLAMA3_8B.params * 2
    assert m["parts"]["optimizer"] == LLAMA3_8B.params * 12  # two fp32 moments + fp32 master
    assert m["dominant"] == "activations"
    ck = estimate_memory(LLAMA3_8B, 32768, gradient_checkpointing=True)
    assert ck["parts"]["activations"] < m["parts"]["activations"] / 10
    assert ck["parts"]["logits"] == 1024 * 128256 * 4 * 2
    lora = estimate_memory(LLAMA3_8B, 32768, method="lora", lora_r=16)
    assert lora["trainable_params"] == pytest.approx(42e6, rel=0.05)
    assert lora["parts"]["optimizer"] == lora["trainable_params"] * 8  # moments of the adapters only
    q = estimate_memory(LLAMA3_8B, 32768, method="qlora", lora_r=16)
    linear = 32 * LLAMA3_8B.linear_params_per_layer  # 6.98e9 weights of the decoder's linear layers
    assert q["parts"]["weights_4bit"] == linear // 2
    assert q["parts"]["quantisation_constants"] == pytest.approx(linear / 64, rel=0.02)
    base = q["parts"]["weights_4bit"] + q["parts"]["quantisation_constants"] + q["parts"]["weights"]
    assert base == pytest.approx(6.1e9, rel=0.05)  # 16 GB in bf16 -> about 6 GB: 7-8B fits one 24 GB GPU


def test_estimate_against_measured_tiny_model():
    """Activations + logits estimate vs. the peak of live CPU tensors in a real forward/backward.
    Tolerance: within a factor of 2 (the estimate ignores allocator slack and temporary buffers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from leansft.core.memtrack import TensorMemoryTracker

    cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.config._attn_implementation = "sdpa"
    tokens = 1024
    ids = torch.randint(0, 2000, (1, tokens))
    est = estimate_memory(ModelShape.from_config(cfg), tokens, precision="fp32", chunked_loss=False)
    with TensorMemoryTracker() as tr:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    measured = tr.peak
    predicted = est["parts"]["activations"] + est["parts"]["logits"] + est["parts"]["gradients"]
    assert predicted / 2 < measured < predicted * 2, (measured, predicted)


def test_tracker_counts_a_sparse_gradient():
    """A tied embedding's sparse gradient (``core/tied_embedding.py``) is counted by its indices and values."""
    from leansft.core.memtrack import TensorMemoryTracker

    weight = torch.nn.Parameter(torch.randn(1000, 64))
    with TensorMemoryTracker() as tr:
        torch.nn.functional.embedding(torch.arange(10), weight, sparse=True).sum().backward()
    assert weight.grad.is_sparse and 10 * 64 * 4 <= tr.peak < 1000 * 64 * 4
