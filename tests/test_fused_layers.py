"""Fused RMSNorm, rotary embedding and LoRA linear (core/cpu/fused_layers.py): the plain modules' values to fp32
rounding, only where the code is recognised, the original code wherever a call does not fit."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import losses, run_config, tiny_model

from leansft.core.config import LoraConfig
from leansft.core.cpu.fused_layers import fuse_layers
from leansft.core.model.as_shipped import as_shipped
from leansft.core.model.loading import apply_lora


def _model(arch: str, lora: LoraConfig | None = None):
    model = tiny_model(arch)
    if lora is not None:
        model = apply_lora(model, lora)
        with torch.no_grad():  # B starts at zero: give the adapters something to add
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model.train()


def _loss_and_grads(model, ids, bf16: bool = False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
LORA = LoraConfig(r=4, alpha=8, target_modules="all-linear")


@pytest.mark.parametrize("arch,lora", [("llama", None), ("qwen2", LORA), ("qwen3", LORA)])
def test_fused_layers_give_the_plain_loss_and_gradients(arch, lora):
    model = _model(arch, lora)
    counts = fuse_layers(model)
    assert counts["rms_norm"] > 0 and counts["rotary"] == 1 and (counts["lora_linear"] > 0) == (lora is not None)
    loss, grads = _loss_and_grads(model, IDS)
    with as_shipped():
        ref_loss, ref_grads = _loss_and_grads(model, IDS)
    assert loss == pytest.approx(float(ref_loss), rel=1e-6)
    assert float((grads - ref_grads).norm() / ref_grads.norm()) < 1e-5


@pytest.mark.parametrize("lora", [None, LORA])
def test_fused_layers_under_bf16_autocast_are_as_close_to_fp32_as_the_plain_ones(lora):
    """Under CPU bf16 autocast the fused LoRA rounds once where peft rounds thrice: not bitwise peft's, but as
    close to the fp32 gradients."""
    model = _model("llama", lora)
    fuse_layers(model)
    with as_shipped():
        _, exact = _loss_and_grads(model, IDS)
        plain_loss, plain = _loss_and_grads(model, IDS, bf16=True)
    loss, fused = _loss_and_grads(model, IDS, bf16=True)
    assert loss == pytest.approx(float(plain_loss), rel=1e-3)
    plain_err, fused_err = (float((g - exact).norm() / exact.norm()) for g in (plain, fused))
    assert fused_err < 1.5 * plain_err + 1e-4, (fused_err, plain_err)


def test_a_frozen_base_weight_keeps_its_cast_until_it_changes():
    """Under bf16 autocast a frozen base weight is cast once and kept between steps, never stale: an in-place
    change (a merge, a load) casts it again; nothing is kept for trainable weights or when told not to."""
    from leansft.core.cpu import fused_layers

    model = _model("llama", LORA)
    fuse_layers(model)
    layer = next(m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))

    def kept():
        return fused_layers._frozen_weight(layer, torch.bfloat16)

    first = kept()
    assert first is not None and first is kept() and torch.equal(first, layer.base_layer.weight.bfloat16())
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
                m.base_layer.weight.mul_(1.5)
    assert torch.equal(kept(), layer.base_layer.weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=IDS, labels=IDS).loss
        with as_shipped():
            ref = model(input_ids=IDS, labels=IDS).loss
    assert float(loss) == pytest.approx(float(ref), rel=2e-2)
    layer.merge()  # peft writes through .data, which no version counter sees; a merged forward drops the copy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=IDS)
    layer.base_layer.weight.data.mul_(2.0)
    layer.unmerge()
    assert torch.equal(kept(), layer.base_layer.weight.bfloat16())
    layer.base_layer.weight.requires_grad_(True)
    assert kept() is None
    unkept = _model("llama", LORA)
    fuse_layers(unkept, keep_weight_casts=False)
    assert all(fused_layers._frozen_weight(m, torch.bfloat16) is None for m in unkept.modules() if hasattr(m, "lora_A"))


def test_only_recognised_code_is_replaced():
    gemma = _model("gemma", LoraConfig(r=4, target_modules="all-linear", dropout=0.1))
    assert fuse_layers(gemma)["rms_norm"] == 0  # Gemma's norm scales by (1 + weight): not Llama's
    assert fuse_layers(gemma)["lora_linear"] == 0  # dropout on the adapter's input
    dora = _model("llama", LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert fuse_layers(dora)["lora_linear"] == 0


def test_calls_that_do_not_fit_run_the_original_code():
    model = _model("llama", LORA)
    fuse_layers(model)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        x = torch.randn(3, layer.in_features)
        with model.disable_adapter():  # adapters disabled: the base layer's output, exactly
            assert torch.equal(layer(x), layer.base_layer(x))
        norm = model.base_model.model.model.norm
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        with as_shipped():
            ref = norm(x)
        assert torch.equal(norm(x), ref)  # a bf16 input: Llama's own code


@pytest.mark.slow
def test_a_trainable_base_layer_gets_its_gradient():
    """The fused LoRA trains the adapters only: a base weight or bias that takes gradients runs peft's code."""
    model = _model("llama", LORA)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    layer.base_layer.weight.requires_grad_(True)
    fuse_layers(model)
    _, grads = _loss_and_grads(model, IDS)
    with as_shipped():
        _, ref = _loss_and_grads(model, IDS)
    assert layer.base_layer.weight.grad is not None
    assert float((grads - ref).norm() / ref.norm()) < 1e-5


def test_fused_run_trains_the_plain_runs_losses(tmp_path, tiny_run_assets, caplog):
    """A packed LoRA run with fused layers (verify-before-train exact against the plain model) trains the
    unfused run's losses within fp32 rounding."""
    from leansft.recipe.train import train

    runs = {}
    for setting in ("false", "true"):
        cfg = run_config(tmp_path / setting, tiny_run_assets, f"cpu.fused_layers={setting}",
                         "training.method=lora", "training.lora.init=gaussian", "training.max_steps=6")
        with caplog.at_level(logging.INFO, logger="leansft"):
            train(cfg)
        runs[setting] = losses(cfg.output_dir)
    assert "fused layers: " in caplog.text and "lora_linear" in caplog.text and "packed: exact" in caplog.text
    for step, loss in runs["false"].items():
        assert runs["true"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_an_unfused_run_restores_transformers_rotary():
    """The rotary function is replaced module-wide: a later run with fused_layers false gets transformers' back."""
    from transformers.models.llama import modeling_llama

    from leansft.core.cpu.fused_layers import restore_rotary

    fuse_layers(_model("llama"))
    fused = modeling_llama.apply_rotary_pos_emb
    restore_rotary()
    assert modeling_llama.apply_rotary_pos_emb is fused.args[0]
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"

