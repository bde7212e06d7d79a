"""QLoRA (4-bit base through bitsandbytes' CPU backend + LoRA) and the LoRA family: DoRA, rsLoRA, LoRA+,
PiSSA/OLoRA init, modules_to_save, NEFTune. Each changes training the way its paper says; exports reload."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers as tf
from helpers import losses, run_config, train_crashing_after

from leansft.core.errors import ConfigError
from leansft.core.io import checkpoint_files as ckpt
from leansft.core.model.forward import LossModule
from leansft.recipe.builders import build_model, build_optimizer
from leansft.recipe.train import train

pytestmark = pytest.mark.slow  # trains tiny models end to end
pytest.importorskip("bitsandbytes")



@pytest.fixture(scope="module")
def qwen2_assets(tmp_path_factory, tiny_run_assets):
    folder = tmp_path_factory.mktemp("qwen2")
    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return {**tiny_run_assets, "model": str(folder)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_qlora_trains_verifies_and_exports_the_trained_function(tmp_path, tiny_run_assets, qwen2_assets, family,
                                                                  caplog):
    assets = tiny_run_assets if family == "llama" else qwen2_assets
    cfg = run_config(tmp_path, assets, "training.method=qlora", "training.max_steps=20", "training.learning_rate=1e-2",
                     "checkpoint.export=true", "checkpoint.save_every=20")
    with caplog.at_level("INFO", logger="leansft"):
        train(cfg)
    assert "verified in" in caplog.text and "sorted (unpacked) batches instead" not in caplog.text
    run = Path(cfg.output_dir)
    steps = losses(run)
    assert sum(list(steps.values())[-5:]) / 5 < sum(list(steps.values())[:5]) / 5  # the loss falls
    # the trained function: the 4-bit base + adapters, rebuilt from the checkpoint
    trained, _ = build_model(cfg, torch.device("cpu"), False, assets["model"])
    ckpt.load_weights(ckpt.list_checkpoints(run / "checkpoints")[-1], LossModule(trained))
    final = tf.AutoModelForCausalLM.from_pretrained(run / "final").eval()  # plain transformers, fp32
    assert not any("lora" in k for k in final.state_dict())
    x = torch.tensor([[1, 5, 9, 30, 200, 7]])
    with torch.no_grad():
        diff = (final(x).logits - trained.eval()(x).logits).abs().max()
    assert float(diff) < 1e-4
    card = (run / "final" / "README.md").read_text()
    assert "QLoRA" in card and "dequantised" in card
    if family == "llama":  # the checkpoint out as GGUF through `leansft export`: the same merged function
        from leansft.tools.cli import main

        assert main(["export", str(run), str(tmp_path / "q.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
        gg = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32).eval()
        with torch.no_grad():
            assert float((gg(x).logits - final(x).logits).abs().max()) < 1e-4


def test_qlora_resume_is_bitwise(tmp_path, tiny_run_assets, monkeypatch):
    """A crash after step 4, a resume from step 3: the same loss at every step as the uninterrupted run (NEFTune's
    noise included: its random state is part of the checkpoint)."""
    opts = ("training.method=qlora", "training.max_steps=6", "training.learning_rate=1e-2",
            "training.neftune_noise_alpha=5")
    full = run_config(tmp_path / "a", tiny_run_assets, *opts)
    train(full)
    cut = run_config(tmp_path / "b", tiny_run_assets, *opts, "checkpoint.save_every=3")
    train_crashing_after(monkeypatch, cut, 4)
    train(cut, resume="auto")
    assert losses(Path(cut.output_dir)) == losses(Path(full.output_dir))


def test_the_4bit_matmul_passes_gradients_after_eval_mode(tmp_path, tiny_run_assets):
    """bitsandbytes repacks CPU weights for inference on a first eval-mode call (verification does one) and then
    multiplies without an input gradient; leansft keeps the training layout, so gradients reach earlier layers."""
    from leansft.core.model.qlora import dequantised, quantised_layers

    model, _ = build_model(run_config(tmp_path, tiny_run_assets, "training.method=qlora"), torch.device("cpu"),
                           False, tiny_run_assets["model"])
    layer = next(iter(quantised_layers(model).values()))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer.eval()(x)  # what verification and evaluation do
    layer.train()
    x.requires_grad_(True)
    layer(x).sum().backward()
    expected = torch.ones(3, layer.out_features) @ dequantised(layer)
    assert torch.allclose(x.grad, expected, atol=1e-4)


def test_the_export_merges_into_the_4bit_base_one_dequantised_layer_at_a_time(tmp_path, tiny_run_assets,
                                                                             monkeypatch):
    """All layers dequantised at once would be 8x the 4-bit base in fp32, on the GPU QLoRA trained on (7B: ~26 GB on
    a 24 GB card): the merge takes them one at a time, each the weight of the plain model by name and shape."""
    import weakref

    from leansft.core.errors import ModelError
    from leansft.core.model import qlora as quant
    from leansft.core.model.loading import merged_plain_model

    cfg = run_config(tmp_path, tiny_run_assets, "training.method=qlora")
    model, _ = build_model(cfg, torch.device("cpu"), False, tiny_run_assets["model"])
    made, alive_at_each = [], []
    real = quant.dequantised

    def tracked(module):
        alive_at_each.append(sum(r() is not None for r in made))
        w = real(module)
        made.append(weakref.ref(w))
        return w

    monkeypatch.setattr(quant, "dequantised", tracked)
    plain = merged_plain_model(model, tiny_run_assets["model"], cfg.training.lora, base=quant.dequantised_base(model))
    layers = quant.quantised_layers(model)
    assert len(made) == len(layers) > 1 and max(alive_at_each) == 0
    first = next(iter(layers))  # the merged weight is the dequantised one plus the adapters' (zero-init B) product
    torch.testing.assert_close(plain.get_submodule(first).weight, real(layers[first]))
    with pytest.raises(ModelError, match=r"up_proj.weight \(1, 1\)"):
        merged_plain_model(model, tiny_run_assets["model"], cfg.training.lora,
                           base=[("model.layers.0.mlp.up_proj.weight", torch.zeros(1, 1))])


def test_weight_memory_per_base_parameter(tmp_path, tiny_run_assets):
    """NF4 + double quantisation: about 0.52 bytes per quantised parameter (4 bits + one 8-bit constant per 64
    weights + the constants' own constants and code books), against 4 bytes (fp32) for LoRA's frozen base and for
    full training. Layers of a realistic width (512): the per-layer code books (1 KB) would dominate tiny ones."""
    from leansft.core.model.qlora import weight_bytes

    folder = tmp_path / "wide"
    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                                       num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tok),
                                       max_position_embeddings=512)).save_pretrained(folder)
    assets = {**tiny_run_assets, "model": str(folder)}
    sizes = {}
    for extra in ([], ["training.qlora.double_quant=false"]):
        model, _ = build_model(run_config(tmp_path, assets, "training.method=qlora", *extra), torch.device("cpu"),
                               False, str(folder))
        sizes[bool(extra)] = weight_bytes(model)["quantised_bytes_per_param"]
    assert 0.5 <= sizes[False] <= 0.6, sizes
    assert sizes[True] > sizes[False]  # double quantisation saves (fp32 constants: 0.5 + 4/64)
    print(f"bytes per base parameter: qlora {sizes[False]:.3f} (single quantisation {sizes[True]:.3f}), "
          "lora 4 (fp32 base), full 4 + 4 (grad) + 8 (AdamW)")


def test_rslora_dora_and_init_reach_peft(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.r=4", "training.lora.alpha=8",
                     "training.lora.use_rslora=true")
    model, _ = build_model(cfg, torch.device("cpu"), False, tiny_run_assets["model"])
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(8 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r), not alpha / r
    dora, _ = build_model(run_config(tmp_path, tiny_run_assets, "training.method=qlora", "training.lora.use_dora=true"),
                          torch.device("cpu"), False, tiny_run_assets["model"])
    names = [n for n, p in dora.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)  # DoRA's trained magnitude, on the 4-bit base too
    gauss, _ = build_model(run_config(tmp_path, tiny_run_assets, "training.method=lora",
                                      "training.lora.init=gaussian"), torch.device("cpu"), False,
                           tiny_run_assets["model"])
    a = gauss.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert abs(float(a.std()) - 1 / 16) < 0.02  # gaussian init: A ~ N(0, 1/r) with the default r=16
    pissa, _ = build_model(run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.init=pissa"),
                           torch.device("cpu"), False, tiny_run_assets["model"])
    base = tf.AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"])
    w0 = base.model.layers[0].self_attn.q_proj.weight
    w = pissa.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(w, w0)  # PiSSA moves the principal part of W into the adapters


def test_dora_and_modules_to_save_export_reloads(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.use_dora=true",
                     "training.lora.modules_to_save=[lm_head]", "training.max_steps=3", "training.learning_rate=1e-2",
                     "checkpoint.export=true")
    train(cfg)
    final = tf.AutoModelForCausalLM.from_pretrained(Path(cfg.output_dir) / "final")
    base = tf.AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"])
    assert not torch.equal(final.lm_head.weight, base.lm_head.weight)  # trained in full, exported
    assert not any("lora" in k or "modules_to_save" in k for k in final.state_dict())


def test_lora_plus_gives_the_b_matrices_their_own_learning_rate(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.lr_ratio=16",
                     "training.learning_rate=1e-3")
    model, _ = build_model(cfg, torch.device("cpu"), False, tiny_run_assets["model"])
    opt = build_optimizer(cfg, model, torch.device("cpu"))
    b_ids = {id(p) for n, p in model.named_parameters() if "lora_B" in n}
    for group in opt.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids:
            assert group["lr"] == pytest.approx(1.6e-2 if ids <= b_ids else 1e-3) and (ids <= b_ids or not ids & b_ids)
    assert sum(len(g["params"]) for g in opt.param_groups if g["lr"] > 1e-3) == len(b_ids) > 0


def test_neftune_noise_in_training_only_scaled_by_each_examples_length(tiny_run_assets):
    from leansft.core.model.neftune import NEFTune

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"])
    emb = model.get_input_embeddings()
    neft = NEFTune(model, alpha=5.0)
    batch = type("B", (), {"cu_seqlens": torch.tensor([0, 4, 20], dtype=torch.int32),  # examples of 4 and 16
                           "input_ids": torch.zeros(1, 20, dtype=torch.long)})()
    neft.set_batch(batch)
    ids = torch.randint(0, emb.num_embeddings, (1, 20))
    clean = torch.nn.functional.embedding(ids, emb.weight)
    model.train()
    noisy = emb(ids)
    d = emb.embedding_dim
    delta = (noisy - clean).abs()
    bound_4, bound_16 = 5.0 / math.sqrt(4 * d), 5.0 / math.sqrt(16 * d)
    assert float(delta[0, :4].max()) <= bound_4 + 1e-6 and float(delta[0, :4].max()) > 0.8 * bound_4
    assert float(delta[0, 4:].max()) <= bound_16 + 1e-6 and float(delta[0, 4:].max()) > 0.8 * bound_16
    model.eval()
    assert torch.equal(emb(ids), clean)  # no noise outside training
    neft.remove()


def test_what_cannot_work_is_refused(tmp_path, tiny_run_assets):
    with pytest.raises(ConfigError, match="fsdp"):
        run_config(tmp_path, tiny_run_assets, "training.method=qlora", "distributed.strategy=fsdp")
    with pytest.raises(ConfigError, match="4-bit base cannot hold"):
        run_config(tmp_path, tiny_run_assets, "training.method=qlora", "training.lora.init=pissa")
