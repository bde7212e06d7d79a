"""Every decoder family transformers ships that builds from a tiny config: exact, exact through the
unpacked fallback, or refused with a clear message. Never silently wrong.

For each architecture the verdict is the one training takes (``verify_model`` + ``choose_strategy``),
and it is then checked independently against the plain Hugging Face model:
- packed: each segment's hidden states in a packed row equal the segment alone (1e-5, fp32), the
  gradient of one segment's loss with respect to the other's embeddings is exactly zero, and the
  chunked loss equals the model's own loss (1e-5);
- fallback (sorted, padded batches): packed really is inexact, and the padded rows' hidden states and
  loss equal the model alone;
- refused: the error names the architecture.

The support table in docs/packing.md is generated from these verdicts: ``python tests/test_architectures.py``
rewrites it, and ``test_readme_support_table_is_current`` fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from leansft.core.errors import ModelError
from leansft.core.model.attention import FLEX, VARLEN, decoder_of, plain_attention, use_packed_attention
from leansft.core.model.forward import hidden_states, loss_of
from leansft.core.model.verify import (
    _packed_batch,
    _padded_batch,
    check_position_table,
    choose_strategy,
    position_capacity,
    probe_segments,
    verify_model,
)

README = Path(__file__).parents[1] / "docs" / "packing.md"
VOCAB = 256
ROW_TOKENS = 200  # packed micro-batches of this size: the far-in-the-row check (within max_position_embeddings)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=256, head_dim=16, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
# model_type -> what its tiny config needs besides SMALL (families of the same code share a row).
ARCHITECTURES: dict[str, dict] = {
    "llama": {}, "llama4_text": {"intermediate_size_mlp": 128, **MOE, "attention_chunk_size": 16,
                    "layer_types": ["chunked_attention", "full_attention"]}, "mistral": {}, "ministral": {},
    "mixtral": MOE, "qwen2": {}, "qwen2_moe": MOE, "qwen3": {}, "qwen3_moe": MOE,
    "qwen3_next": {**MOE, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]},
    "gemma": {}, "gemma2": {"sliding_window": 8}, "gemma3_text": {"sliding_window": 8}, "vaultgemma": {},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64, "attention_window_size": 16},
    "cohere": {}, "cohere2": {}, "granite": {}, "granitemoe": MOE, "granitemoeshared": MOE,
    "phi": {}, "phi3": {}, "phimoe": MOE, "olmo": {}, "olmo2": {}, "olmo3": {}, "olmoe": MOE,
    "gpt_neox": {}, "gpt2": {}, "gpt_bigcode": {}, "starcoder2": {}, "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "biogpt": {}, "ctrl": {"dff": 128}, "helium": {}, "internlm3": {}, "persimmon": {}, "seed_oss": {},
    "exaone4": {}, "ernie4_5": {}, "jetmoe": {"kv_channels": 16, **MOE}, "hunyuan_v1_dense": {}, "arcee": {},
    "apertus": {}, "bitnet": {}, "diffllama": {}, "doge": {}, "glm": {}, "glm4": {}, "smollm3": {},
    "gpt_oss": {**MOE, "sliding_window": 8},
    "bloom": {}, "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8, "n_ctx": 256}, "mpt": {},
    "xglm": {"ffn_dim": 128}, "openai-gpt": {}, "nemotron": {}, "stablelm": {}, "falcon": {"head_dim": None},
    "mamba": {"state_size": 8}, "falcon_mamba": {"state_size": 8}, "jamba": {**MOE, "attn_layer_period": 2,
                                                                             "attn_layer_offset": 1},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8},
    "minimax": MOE, "nemotron_h": {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 32,
                                    "ssm_state_size": 8, "n_groups": 1},
    "rwkv": {"attention_hidden_size": 64}, "lfm2": {"layer_types": ["conv", "full_attention"]},
}
FAMILY_NOTES = {
    "fallback": "attention or a convolution/state layer ignores the packed boundaries (ALiBi, own attention "
                "code, state-space and recurrent layers): trained with `sorted` (unpacked) batches, exact",
}


def tiny(model_type: str, **extra):
    kw = {k: v for k, v in {**SMALL, **ARCHITECTURES[model_type], **extra}.items() if v is not None}  # None: leave out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    use_packed_attention(model, VARLEN)
    return model


@cache
def verdict(model_type: str) -> tuple[str, str]:
    """("packed" | "fallback" | "refused", detail) as training decides it."""
    model = tiny(model_type)
    v = verify_model(model, probe_segments(None, VOCAB), row_tokens=ROW_TOKENS)
    try:
        chosen = choose_strategy(v, "bfd", "fallback")
    except ModelError as err:
        return "refused", str(err)
    return ("packed" if chosen == "bfd" else "fallback"), v.summary()


def _alone(model, seg: np.ndarray):
    ids = torch.as_tensor(seg)[None]
    with plain_attention(model):
        hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
        loss = float(model(input_ids=ids, labels=ids, use_cache=False).loss) * (len(seg) - 1)
    return hidden, loss


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_exact_or_refused(model_type):
    kind, detail = verdict(model_type)
    model = tiny(model_type)
    segs = probe_segments(None, VOCAB)
    with torch.no_grad():
        alone = [_alone(model, s) for s in segs]
    ref_loss = sum(loss for _, loss in alone)
    if kind == "refused":
        assert model_type in detail and "cannot train exactly" in detail
        return
    if kind == "fallback":
        with pytest.raises(ModelError, match=re.escape(type(model).__name__)):
            choose_strategy(verify_model(model, segs), "bfd", "refuse")  # refused when fallback is not allowed
        batch = _padded_batch(segs, 0, torch.device("cpu"))
        with torch.no_grad(), plain_attention(model):
            hidden = hidden_states(model, batch)
            loss = float(loss_of(model, batch, hidden, 8)[0])
        rows = [hidden[r, : len(s)] for r, s in enumerate(segs)]
    else:
        batch = _packed_batch(segs, torch.device("cpu"))
        grabbed = []

        def grab(module, inputs, output):  # keep the embeddings' output and its gradient
            output.retain_grad()
            grabbed.append(output)

        hook = model.get_input_embeddings().register_forward_hook(grab)
        hidden = hidden_states(model, batch)
        hook.remove()
        a = len(segs[0])
        rows = [hidden[0, :a].detach(), hidden[0, a:].detach()]
        second = batch.labels.clone()
        second[0, :a] = -100
        loss_second, _ = loss_of(model, dataclasses.replace(batch, labels=second), hidden, 8)
        loss_second.backward()
        assert torch.count_nonzero(grabbed[0].grad[0, :a]) == 0, "the second example's loss reaches the first one"
        with torch.no_grad():
            loss = float(loss_of(model, batch, hidden_states(model, batch), 8)[0])
    for ours, (ref, _) in zip(rows, alone):
        assert _close(ours, ref), f"{model_type}: hidden states differ from the example alone"
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{model_type}: chunked loss {loss} vs the model's {ref_loss}"


# torch deprecates flex_attention's return_lse (sinks need the log-sum-exp): a FutureWarning fails the test
@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2", "llama4_text"])
def test_flex_backend_is_exact_too(model_type):
    """flex_attention (block-diagonal mask) with attention sinks (gpt-oss), soft-capping (Gemma 2) and Llama 4's
    chunked layers (16-token chunks here: the probe's examples span two)."""
    model = tiny(model_type)
    use_packed_attention(model, FLEX)
    assert verify_model(model, probe_segments(None, VOCAB), ("packed",)).ok("packed")


def support_table() -> str:
    groups: dict[str, list[str]] = {"packed": [], "fallback": [], "refused": []}
    for model_type in sorted(ARCHITECTURES):
        groups[verdict(model_type)[0]].append(f"`{model_type}`")
    return "\n".join([
        "| how leansft trains it | architectures (`model_type`) |", "| --- | --- |",
        f"| packed, varlen attention, exact ({len(groups['packed'])}) | {', '.join(groups['packed'])} |",
        f"| fallback: {FAMILY_NOTES['fallback']} ({len(groups['fallback'])}) | {', '.join(groups['fallback'])} |",
        f"| refused before step 1: no exact path ({len(groups['refused'])}) | {', '.join(groups['refused']) or '-'} |",
    ])


START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"


def test_a_router_load_balancing_loss_is_refused_with_the_setting_that_drops_it():
    """A MoE config with output_router_logits: true makes the model's own loss add the router's auxiliary loss,
    which leansft does not compute: refused before step 1 naming the setting, not an unexplained loss mismatch."""
    model = tiny("mixtral")
    model.config.output_router_logits = True
    v = verify_model(model, probe_segments(None, VOCAB))
    with pytest.raises(ModelError, match="output_router_logits: true"):
        choose_strategy(v, "bfd", "fallback")


def test_a_model_reading_the_index_in_the_row_is_checked_far_in_a_full_micro_batch():
    """Llama 4 scales the queries of its layers without rotary embeddings by log(1 + floor((i + 1) / floor_scale)),
    i the token's index in the row, not its position id (8,192 in the real models; 64 here): the two short probe
    segments pass, the first one again at the end of a packed micro-batch does not, and training takes padded
    batches, where a row's index is the example's position."""
    model = tiny("llama4_text", no_rope_layers=[1, 0], floor_scale=64)
    segments = probe_segments(None, VOCAB)
    assert verify_model(model, segments).ok("packed")  # the short probe alone sees nothing
    v = verify_model(model, segments, row_tokens=ROW_TOKENS)
    assert not v.ok("packed") and "index in the row" in v.checks["packed"].reason and v.ok("padded")
    assert choose_strategy(v, "bfd", "fallback") == "sorted"


def test_a_full_micro_batch_that_fails_is_a_failed_check_not_a_crash():
    """GPT-2's 256 positions and a 300-token filler example: the far check reports the error as its reason and the
    run takes padded batches, as for any packed path that fails (a run's data is checked against the table first)."""
    model = tiny("gpt2")
    v = verify_model(model, probe_segments(None, VOCAB), row_tokens=324)
    assert not v.ok("packed") and "IndexError" in v.checks["packed"].reason and v.ok("padded")


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_a_fixed_size_position_table_is_known_before_step_1(model_type):
    """Past its 64 positions each model either still runs as shipped, or its position capacity is known, so
    training refuses longer examples before step 1 (an IndexError mid-run otherwise: CTRL's, GPT-J's and
    CodeGen's tables are precomputed buffers, not embeddings)."""
    model = tiny(model_type, max_position_embeddings=64, n_positions=64, n_ctx=64)
    ids = torch.randint(3, VOCAB, (1, 100), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), plain_attention(model):
            model(input_ids=ids, use_cache=False)
    except (IndexError, RuntimeError):
        assert position_capacity(model) == 64
    else:
        assert position_capacity(model) is None


def test_examples_past_a_rotary_models_context_train_with_a_warning(caplog):
    """Rotary positions run past max_position_embeddings (as the plain model does), but never silently."""
    model = tiny("llama", max_position_embeddings=64)
    with caplog.at_level("WARNING", logger="leansft"):
        check_position_table(model, 64)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # (the model's set-up may log INFO)
        check_position_table(model, 100)
    assert "examples of 100 tokens, longer than" in caplog.text and "context of 64 positions" in caplog.text


def test_readme_support_table_is_current():
    text = README.read_text()
    block = text[text.index(START) + len(START): text.index(END)].strip()
    assert block == support_table(), "docs/packing.md support table is stale: run `python tests/test_architectures.py`"


if __name__ == "__main__":  # regenerate the docs/packing.md table from the verdicts
    text = README.read_text()
    new = text[: text.index(START) + len(START)] + "\n" + support_table() + "\n" + text[text.index(END):]
    README.write_text(new)
    print(support_table())
    sys.exit(0)
