"""LoRA's frozen base stored in bf16 under bf16 autocast (``core/model/bf16_base.py``): the same run bit for bit, a third
of the memory, refused where the model's forward would change."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch
from helpers import losses, run_config, tiny_model
from safetensors.torch import load_file

from leansft.core.config import LoraConfig
from leansft.core.model.bf16_base import frozen_linears, holds_bf16_base, store_base_in_bf16
from leansft.core.model.loading import apply_lora
from leansft.recipe.train import train


def lora_model():
    return apply_lora(tiny_model("llama"), LoraConfig(r=4, alpha=8, target_modules="all-linear"))


def probe_of(model, ids):
    def probe():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, use_cache=False).logits

    return probe


def test_the_frozen_linear_layers_go_to_bf16_and_compute_the_same():
    model = lora_model()
    ids = torch.randint(0, 512, (1, 48))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(input_ids=ids).logits
    assert store_base_in_bf16(model, probe_of(model, ids)) == 2 * 7  # q k v o gate up down, two layers
    assert holds_bf16_base(model)
    assert all(m.weight.dtype == torch.bfloat16 for m in model.base_model.model.model.layers[0].modules()
               if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n or "norm" in n
               or "embed" in n or "lm_head" in n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_model_that_uses_a_weight_outside_autocast_keeps_its_fp32_base(caplog):
    """A forward that uses a weight outside autocast's matmuls (as DoRA's weight norm does) would change: the
    fp32 weights are put back."""
    model = lora_model()
    mlp = model.base_model.model.model.layers[1].mlp
    shipped = type(mlp).forward

    def forward(self, x):
        return shipped(self, x) * self.down_proj.base_layer.weight.norm(dim=1).mean()

    mlp.forward = types.MethodType(forward, mlp)
    weights = [m.weight for m in frozen_linears(model)]
    with caplog.at_level(logging.WARNING, logger="leansft"):
        assert store_base_in_bf16(model, probe_of(model, torch.randint(0, 512, (1, 48)))) == 0
    assert "kept in fp32" in caplog.text and not holds_bf16_base(model)
    assert [m.weight for m in frozen_linears(model)] == weights  # the very fp32 tensors, back in place
    assert all(w.dtype == torch.float32 for w in weights)


@pytest.mark.slow
def test_a_lora_bf16_run_is_bitwise_the_fp32_base_run(tmp_path, tiny_run_assets, caplog):
    runs = {}
    for bf16_base in (True, False):
        cfg = run_config(tmp_path / str(bf16_base), tiny_run_assets, "training.method=lora", "training.lora.r=4",
                         "training.precision=bf16", f"training.lora.bf16_base={bf16_base}", "training.max_steps=3",
                         "checkpoint.export=true", "data.eval_split=0.1",
                         "eval.eval_every=3", "eval.samples_every=3", "eval.num_samples=1", "eval.max_new_tokens=4")
        with caplog.at_level(logging.INFO, logger="leansft"):
            train(cfg)
        assert ("linear layers stored in bf16" in caplog.text) == bf16_base
        caplog.clear()
        runs[bf16_base] = Path(cfg.output_dir)
    assert losses(runs[True]) == losses(runs[False])  # training, eval at step 3: every bit
    # the export merges into the fp32 base as loaded, not into the bf16 copy
    ours, theirs = (load_file(runs[b] / "final" / "model.safetensors") for b in (True, False))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert {t.dtype for t in ours.values()} == {torch.float32}


@pytest.mark.slow
def test_a_base_saved_in_bf16_is_read_in_bf16_and_trains_as_the_fp32_read(tmp_path, tiny_run_assets, caplog,
                                                                            monkeypatch):
    """On CUDA a LoRA run reads a model saved in bf16 in bf16 (``reads_base_in_bf16``; forced here on the CPU):
    the decoder's linear weights never exist in fp32, the rest is upcast. Verify-before-train passes under bf16
    autocast, and the run trains as the one that reads fp32 and stores the base in bf16 before step 1: the same
    step-1 loss (B starts at zero), the same losses within bf16-init noise (peft rounds the adapters' first draw
    to the base's dtype)."""
    import shutil

    import transformers as tf

    from leansft.core.model.bf16_base import saved_in_bf16
    from leansft.recipe import builders

    src, saved = Path(tiny_run_assets["model"]), tmp_path / "bf16-model"
    shutil.copytree(src, saved, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tf.AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).save_pretrained(saved)
    assert saved_in_bf16(str(saved)) and not saved_in_bf16(str(src))
    runs, held = {}, {}
    real_build = builders.build_model

    def build(*a, **k):
        model, backend = real_build(*a, **k)
        held[direct] = {m.weight.dtype for m in model.base_model.model.model.layers.modules()
                        if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        return model, backend

    monkeypatch.setattr("leansft.recipe.train.build_model", build)
    for direct in (True, False):
        monkeypatch.setattr(builders, "reads_base_in_bf16", lambda cfg, device, spec, d=direct: d)
        cfg = run_config(tmp_path / str(direct), tiny_run_assets, f"model={saved}", "training.method=lora",
                         "training.lora.r=4", "training.precision=bf16", "training.max_steps=3")
        with caplog.at_level(logging.INFO, logger="leansft"):
            train(cfg)
        assert ("frozen base read in bf16" in caplog.text) == direct
        assert "packed: exact" in caplog.text
        caplog.clear()
        runs[direct] = losses(cfg.output_dir)
    assert held[True] == {torch.bfloat16} and held[False] == {torch.float32}  # as built, before step 1
    assert runs[True][1] == runs[False][1]
    assert all(runs[True][s] == pytest.approx(runs[False][s], rel=2e-3) for s in runs[False])


def test_a_base_read_in_bf16_whose_forward_changes_is_upcast(caplog):
    """``confirm_bf16_base``: the first layer's weights as fp32 and as bf16 must give the same forward; a model
    that uses a weight outside autocast gets every decoder linear weight back in fp32, with a warning."""
    from leansft.core.model.bf16_base import confirm_bf16_base, load_base_in_bf16

    for changes in (False, True):
        model = apply_lora(tiny_model("llama").to(torch.bfloat16), LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        assert load_base_in_bf16(model) == 2 * 7
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n or "norm" in n} == {torch.float32}
        if changes:
            mlp = model.base_model.model.model.layers[0].mlp
            shipped = type(mlp).forward
            mlp.forward = types.MethodType(
                lambda self, x: shipped(self, x) * self.down_proj.base_layer.weight.norm(dim=1).mean(), mlp)
        with caplog.at_level(logging.WARNING, logger="leansft"):
            kept = confirm_bf16_base(model, probe_of(model, torch.randint(0, 512, (1, 48))))
        assert kept == (0 if changes else 14) and holds_bf16_base(model) == (not changes)
        assert ("upcast to fp32" in caplog.text) == changes
