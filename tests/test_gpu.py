"""GPU-only checks (skipped without CUDA): bf16 isolation with the backend really chosen, chunked loss
on the device against full logits, a few bf16 training steps, and the model read straight onto the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_packed_isolation_bf16_on_gpu():
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed
    from leansft.core.model.attention import choose_backend, packed_forward, use_packed_attention

    device = torch.device("cuda")
    model = tiny_model("qwen2").to(device)
    use_packed_attention(model, choose_backend(device))
    data = dataset([list(range(5, 40)), list(range(60, 90)), list(range(100, 135))])
    z = np.zeros(2, np.int64)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        pack = packed_forward(model, collate_packed(data, np.array([0, 1]), z, data.lengths[[0, 1]]).to(device))
        other = packed_forward(model, collate_packed(data, np.array([2, 1]), z, data.lengths[[2, 1]]).to(device))
        alone = packed_forward(model, collate_packed(data, np.array([1]), z[:1], data.lengths[[1]]).to(device))
    assert torch.equal(pack[0, 35:], other[0, 35:])
    assert (pack[0, 35:].float() - alone[0].float()).abs().max() < 5e-2


def test_chunked_loss_on_gpu_matches_full_logits():
    from leansft.core.model.loss import chunked_loss, full_logits_loss

    torch.manual_seed(0)
    h = torch.randn(1, 4096, 256, device="cuda", requires_grad=True)
    w = torch.randn(32000, 256, device="cuda", requires_grad=True)
    y = torch.randint(0, 32000, (1, 4096), device="cuda")
    a, _ = chunked_loss(h, w, y, 1000)
    a.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    b, _ = full_logits_loss(h, w, y)
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(gh, h.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-3, atol=1e-4)


def test_torch_varlen_kernel_isolates_examples_and_passes_verification():
    """PyTorch's own varlen kernel (auto's choice on CUDA without flash-attn): same output as per-segment
    SDPA in bf16, and verify-before-train accepts it."""
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed
    from leansft.core.model.attention import TORCH_VARLEN, VARLEN, packed_forward, use_packed_attention
    from leansft.core.model.verify import verify_model

    device = torch.device("cuda")
    model = tiny_model("qwen2").to(device)
    data = dataset([list(range(5, 40)), list(range(60, 90))])
    batch = collate_packed(data, np.array([0, 1]), np.zeros(2, np.int64), data.lengths[[0, 1]]).to(device)
    outs = {}
    for impl in (VARLEN, TORCH_VARLEN):
        use_packed_attention(model, impl)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            outs[impl] = packed_forward(model, batch).float()
    assert (outs[VARLEN] - outs[TORCH_VARLEN]).abs().max() < 5e-2
    v = verify_model(model, [np.arange(5, 29), np.arange(60, 76)], ("packed",))
    assert v.ok("packed"), v.summary()


def test_torch_varlen_cuts_llama4_chunked_layers_at_their_chunks():
    """Llama 4's chunked-attention layers (16-token chunks here; the probe's 24-token example spans two) through
    PyTorch's varlen kernel with per-layer boundaries: verify-before-train accepts it, far in the row too."""
    from test_architectures import VOCAB, tiny

    from leansft.core.model.attention import TORCH_VARLEN, use_packed_attention
    from leansft.core.model.verify import probe_segments, verify_model

    model = tiny("llama4_text").to("cuda")
    use_packed_attention(model, TORCH_VARLEN)
    v = verify_model(model, probe_segments(None, VOCAB), ("packed",), row_tokens=200)
    assert v.ok("packed"), v.summary()


def test_compiled_layers_train_like_eager_on_gpu():
    """Regional compile on CUDA: the first steps' losses equal the eager ones within bf16 noise."""
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed
    from leansft.core.model.attention import choose_backend, use_packed_attention
    from leansft.core.model.compile import compile_layers
    from leansft.core.model.forward import LossModule

    data = dataset([list(range(5, 40)), list(range(60, 90)), list(range(100, 135))])
    batch = collate_packed(data, np.array([0, 1, 2]), np.zeros(3, np.int64), data.lengths[[0, 1, 2]])
    losses = {}
    for comp in (False, True):
        model = tiny_model("qwen2").cuda().train()
        if comp:
            compile_layers(model)
        use_packed_attention(model, choose_backend(torch.device("cuda")))
        module, opt = LossModule(model), torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses[comp] = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = module(batch.to("cuda")) / batch.target_tokens
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[comp].append(float(loss))
    assert np.allclose(losses[False], losses[True], rtol=2e-2), losses


def test_eval_and_generate_commands_run_on_the_gpu(tmp_path, tiny_run_assets, monkeypatch, capsys):
    """`leansft eval` and `generate` put the model on the GPU (they ran on the CPU beside one)."""
    from leansft.core.inference import generation
    from leansft.core.inference import heldout_loss as evaluation
    from leansft.tools.cli import main

    seen = []
    for module, name in ((evaluation, "evaluate"), (generation, "generate")):
        real = getattr(module, name)

        def spy(model, *a, _real=real, **k):
            seen.append(next(model.parameters()).device.type)
            return _real(model, *a, **k)

        monkeypatch.setattr(module, name, spy)
    assert main(["eval", tiny_run_assets["model"], "--data", tiny_run_assets["data"], "--max-length", "128",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    assert main(["generate", tiny_run_assets["model"], "--prompt", "Hi", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert seen == ["cuda", "cuda"] and "perplexity" in capsys.readouterr().out


def test_a_model_is_read_straight_onto_the_gpu(tmp_path):
    """A GPU run's model never lies whole in host memory: read onto the device a tensor at a time."""
    import os
    import subprocess
    import sys

    from leansft.core.model.loading import load_model

    write = ("import sys, torch, transformers as tf\n"  # in another process: this one's host memory stays as it was
             "cfg = tf.Qwen2Config(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,"
             " num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True)\n"
             "tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", write, str(tmp_path / "m")], check=True)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.zeros(1, device="cuda")  # the CUDA context's own host memory first
    before = rss()
    model = load_model(str(tmp_path / "m"), device=torch.device("cuda"))
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())  # ~1.7 GB: fixed costs (the driver's staging
    # buffers, imports) stay well under a quarter of it
    assert all(p.is_cuda and p.dtype == torch.float32 for p in model.parameters())
    assert rss() - before < fp32_bytes / 4


def test_a_lora_run_reads_a_bf16_base_in_bf16_on_the_gpu(tmp_path, tiny_run_assets):
    """A LoRA run on a model saved in bf16 never holds an fp32 copy of its base on the GPU: building the model
    peaks at about 2 bytes a base parameter (an fp32 read: 4), the decoder's linear weights stay bf16, and the
    run's forward passes verify-before-train under bf16 autocast."""
    import subprocess
    import sys

    from leansft.core.config import load_config
    from leansft.core.data.prepare import prepare_data
    from leansft.core.data.tokenizer import pad_id
    from leansft.recipe.builders import build_model, pick_device, verified_strategy

    write = ("import sys, torch, transformers as tf\n"
             "cfg = tf.Qwen2Config(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,"
             " num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)\n"
             "tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", write, str(tmp_path / "m")], check=True)
    peaks = {}
    for low in (True, False):
        cfg = load_config(None, [f"model={tmp_path / 'm'}", f"tokenizer={tiny_run_assets['model']}",
                                 f"data.sources=[{tiny_run_assets['data']}]", f"data.cache_dir={tmp_path / 'c'}",
                                 "data.max_length=192", "training.method=lora", "training.lora.r=8",
                                 f"training.lora.bf16_base={low}", "training.precision=bf16", "training.compile=false"])
        device = pick_device()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, _ = build_model(cfg, device, True)
        peaks[low] = torch.cuda.max_memory_allocated() - base
        layers = model.base_model.model.model.layers
        held = {m.weight.dtype for m in layers.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        assert held == ({torch.bfloat16} if low else {torch.float32})
        if low:
            data = prepare_data(cfg.data, cfg.tokenizer, seed=0)
            assert verified_strategy(cfg, model, data.train, pad_id(data.tokenizer)) == "bfd"
        n = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)  # ~0.49B
        linear = sum(m.weight.numel() for m in layers.modules() if type(m) is torch.nn.Linear
                     and not m.weight.requires_grad)
        del model
    # the decoder's linear weights in bf16, the rest (here a large share: a 32k vocabulary twice) in fp32
    held = 2 * linear + 4 * (n - linear)
    assert peaks[False] >= 0.95 * 4 * n and peaks[True] < 1.2 * held, (peaks, n, linear)
    print(f"peak while building: bf16 read {peaks[True] / n:.2f} bytes/param ({held / n:.2f} held), "
          f"fp32 read {peaks[False] / n:.2f}")


def test_the_tensor_core_head_is_within_bf16_tolerance_of_fp64():
    """CUDA's default head (``TENSOR_CORES``: bf16 products, fp32 accumulation and results) at a real shape: its
    loss and gradients against an fp64 reference of the same inputs."""
    from leansft.core.model.loss import TENSOR_CORES, chunked_loss, full_logits_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(1, 2048, 896, device="cuda", generator=g) * 0.5).requires_grad_()
    w = (torch.randn(32768, 896, device="cuda", generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, 32768, (1, 2048), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = chunked_loss(h, w, y, 1024, precision=TENSOR_CORES)
    loss.backward()
    hd, wd = (x.detach().double().requires_grad_() for x in (h, w))
    ref, _ = full_logits_loss(hd, wd, y)
    ref.backward()
    assert abs(float(loss) - float(ref)) / abs(float(ref)) < 1e-2
    for got, want in ((h.grad, hd.grad), (w.grad, wd.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 2e-2


def test_a_recipe_step_syncs_the_host_once(tmp_path, tiny_run_assets, monkeypatch):
    """``torch.cuda.set_sync_debug_mode`` over the steps after the first: the only synchronising operations are the
    step's one read-back (``figures.tolist()`` in ``train_step``), whatever else the recipe does between steps."""
    import warnings

    import leansft.recipe.train as recipe
    from helpers import run_config

    real, found = recipe.train_step, []

    def spy(engine, batches, counts, step, stop=None):
        if step == 1:
            return real(engine, batches, counts, step, stop)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = real(engine, batches, counts, step, stop)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found.extend((w.filename.rsplit("/", 1)[-1], w.lineno, str(w.message)[:80]) for w in caught
                     if "synchroniz" in str(w.message))
        return out

    monkeypatch.setattr(recipe, "train_step", spy)
    recipe.train(run_config(tmp_path, tiny_run_assets, "training.max_steps=4", "training.precision=bf16",
                            "training.compile=false"))
    sites = {(f, n) for f, n, _ in found}
    assert len(sites) == 1 and next(iter(sites))[0] == "train.py", found
    assert len(found) == 3, found  # steps 2, 3 and 4: one each


def test_an_async_checkpoint_on_cuda_holds_the_state_of_its_step(tmp_path):
    """checkpoint.async on CUDA: the weights and Adam state are copied into pinned host buffers on the current
    stream, and the step after the save (which changes them on the device) does not reach the files: they hold the
    values of the saved step, and the buffers are reused by the next save."""
    from safetensors.torch import load_file

    from leansft.core.config import load_config
    from leansft.recipe.checkpointer import Checkpointer, TrainState

    torch.manual_seed(0)
    model = tiny_model("qwen2").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = load_config(None, ["model=unused", f"output_dir={tmp_path}", "data.sources=[unused.jsonl]",
                             "checkpoint.keep_last=3", "checkpoint.keep_best=0"])
    ckpt = Checkpointer(cfg, tmp_path, model, opt, sched)
    assert ckpt.background is not None
    ids = torch.randint(0, model.config.vocab_size, (1, 256), device="cuda")
    saved = {}
    with ckpt:
        for step in (1, 2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            saved[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            ckpt.save(TrainState(step=step), {}, last=step == 2)
            model(input_ids=ids, labels=ids).loss.backward()  # the next step's work, while the save is written
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert any(t.is_pinned() for t in ckpt.buffers._held.values())
    for step in (1, 2):
        got = load_file(str(tmp_path / "checkpoints" / f"step-{step}" / "model.safetensors"))
        assert got and all(torch.equal(got[k], saved[step][k]) for k in got), step
