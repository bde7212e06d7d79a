"""The engine's speed features keep training what it trained before: bf16 autocast where the hardware has
bf16 units, regionally compiled decoder layers, the fused AdamW, one host sync a step."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import losses, run_config

from leansft.core.errors import ConfigError


def test_precision_auto_follows_the_hardware(monkeypatch, caplog):
    from leansft.recipe import builders

    cpu = torch.device("cpu")
    monkeypatch.setattr(builders, "cpu_has_bf16_units", lambda: True)
    assert builders.autocast_dtype("auto", cpu) is torch.bfloat16
    assert builders.autocast_dtype("fp32", cpu) is None
    monkeypatch.setattr(builders, "cpu_has_bf16_units", lambda: False)
    assert builders.autocast_dtype("auto", cpu) is None
    with caplog.at_level(logging.WARNING, logger="leansft"):
        assert builders.autocast_dtype("bf16", cpu) is torch.bfloat16  # asked for: emulated, said so
    assert "without bf16 matrix units" in caplog.text


def test_compile_setting_is_resolved_or_refused(monkeypatch):
    from leansft.core.model import compile as comp

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not comp.wants_compile("auto", cpu, "ddp", 1)
    assert comp.wants_compile("auto", cuda, "ddp", 1) and not comp.wants_compile("auto", cuda, "fsdp", 2)
    assert comp.wants_compile(True, cpu, "ddp", 1) and not comp.wants_compile(False, cuda, "ddp", 1)
    with pytest.raises(ConfigError, match="fsdp"):
        comp.wants_compile(True, cuda, "fsdp", 2)
    monkeypatch.setattr(comp.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        comp.wants_compile(True, cpu, "ddp", 1)


@pytest.mark.slow
def test_compiled_layers_train_the_same_losses(tmp_path, tiny_run_assets, caplog, monkeypatch):
    """8 steps with the decoder layers compiled (verify-before-train on the compiled path) give the eager run's
    losses within fp32 rounding (the compile is most of this test's CPU, not the steps). Inductor's C++ kernels
    are vectorised for AVX2 here, not for the widest ISA the host has: gcc builds AVX-512's in ~1.4x the CPU
    (a cold cache: 31 s of gcc against 25 s), and the ISA is inductor's choice per host anyway (scalar where
    the host has neither, as on other architectures)."""
    import torch._inductor.config

    from leansft.recipe.train import train

    monkeypatch.setattr(torch._inductor.config.cpp, "simdlen", 256)
    runs = {}
    for setting in ("false", "true"):
        cfg = run_config(tmp_path / setting, tiny_run_assets, f"training.compile={setting}", "training.max_steps=8")
        with caplog.at_level(logging.INFO, logger="leansft"):
            train(cfg)
        runs[setting] = losses(cfg.output_dir)
    assert "decoder layers compiled" in caplog.text and "packed: exact" in caplog.text
    assert len(runs["true"]) == 8
    for step, loss in runs["false"].items():
        assert runs["true"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_bf16_autocast_on_the_cpu_trains_close_to_fp32(tmp_path, tiny_run_assets, caplog):
    from leansft.recipe.train import train

    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = run_config(tmp_path / precision, tiny_run_assets, f"training.precision={precision}")
        with caplog.at_level(logging.INFO, logger="leansft"):
            train(cfg)
        runs[precision] = losses(cfg.output_dir)
    assert "bf16 autocast" in caplog.text
    assert runs["bf16"][6] < runs["bf16"][1]
    for step, loss in runs["fp32"].items():
        assert runs["bf16"][step] == pytest.approx(loss, rel=2e-2), step


def test_flops_count_no_weight_gradient_for_a_frozen_base():
    """MFU's numerator: 6 FLOPs per trained parameter and token, 4 per frozen one (LoRA's base gets
    forward and input gradient only); the output layer counts per target token."""
    from helpers import tiny_model

    from leansft.core.config import LoraConfig
    from leansft.core.metrics.flops import token_flops
    from leansft.core.model.loading import apply_lora

    model = tiny_model("llama")
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - emb.numel() - head.numel()
    assert token_flops(model) == (6.0 * body, 6.0 * head.numel())
    lora = apply_lora(model, LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < adapters < body
    assert token_flops(lora) == (4.0 * body + 6.0 * adapters, 4.0 * head.numel())


def test_a_4bit_weight_counts_its_real_elements():
    """bitsandbytes packs two 4-bit values a byte; the FLOP count uses the quantised weight's own shape."""
    from types import SimpleNamespace

    from leansft.core.metrics.flops import _numel

    packed = torch.zeros(8 * 16 // 2, 1, dtype=torch.uint8)
    packed.quant_state = SimpleNamespace(shape=torch.Size([8, 16]))
    assert _numel(packed) == 128 and _numel(torch.zeros(8, 16)) == 128


def test_logged_rates_count_the_time_inside_steps_only():
    """Step 0's eval and samples, and checkpoints between log lines, are not training time: a window's
    rates are its tokens over the seconds its steps took, whatever else ran in between."""
    import time

    import numpy as np
    from helpers import tiny_model

    from leansft.core.batching.collate import collate_packed
    from leansft.core.data.dataset import TokenizedDataset
    from leansft.recipe.throughput import ThroughputWindow

    ids = np.arange(1, 21, dtype=np.int32)
    data = TokenizedDataset.from_arrays(ids, ids.copy(), np.array([0, 12, 20]))
    batch = collate_packed(data, np.array([0, 1]), np.zeros(2, np.int64), data.lengths)
    window = ThroughputWindow(tiny_model("llama"), torch.device("cpu"), None, 1)
    time.sleep(0.2)  # "evaluation" before the first step
    window.add(window.count([batch]))
    window.add_time(0.5)
    rec = window.record()
    assert rec["real_tokens_per_s"] == pytest.approx(20 / 0.5)
    assert rec["target_tokens_per_s"] == pytest.approx(batch.target_tokens / 0.5)


def test_lora_under_autocast_skips_peft_input_casts_bit_for_bit():
    """Plain LoRA layers keep a bf16 input bf16 for their adapter (peft would cast it to fp32 and autocast
    straight back): the loss and every adapter gradient are bitwise what peft's own casting gives."""
    from helpers import tiny_model

    from leansft.core.config import LoraConfig
    from leansft.core.model.loading import apply_lora

    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for keep_casts in (True, False):
        model = apply_lora(tiny_model("llama"), LoraConfig(r=4, target_modules="all-linear", init="gaussian"))
        layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
        assert layers and not any(m.cast_input_dtype_enabled for m in layers)  # what apply_lora sets
        for m in layers:
            m.cast_input_dtype_enabled = keep_casts
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (peft_loss, peft_grads), (loss, grads) = results
    assert torch.equal(peft_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(peft_grads, grads, strict=True))


def test_lora_with_dropout_or_dora_keeps_peft_casts():
    from helpers import tiny_model

    from leansft.core.config import LoraConfig
    from leansft.core.model.loading import apply_lora

    for cfg in (LoraConfig(r=4, target_modules="all-linear", dropout=0.1),
                LoraConfig(r=4, target_modules="all-linear", use_dora=True)):
        model = apply_lora(tiny_model("llama"), cfg)
        assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "lora_A"))


def _padded(ids: torch.Tensor, labels: torch.Tensor):
    import numpy as np

    from leansft.core.batching.collate import PaddedBatch

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    return PaddedBatch(ids, labels, torch.ones_like(ids), pos, np.arange(len(ids)))



def _dense_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch's varlen kernel (CUDA only) as dense masked SDPA in traceable ops: the GPU's compiled path on the CPU."""
    import torch.nn.functional as F

    pos = torch.arange(q.shape[0], device=q.device)
    example = torch.searchsorted(cu_q.long(), pos, right=True)  # the example of each token (+1)
    mask = (example[:, None] == example[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None].float() for x in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=enable_gqa)
    return out[0].transpose(0, 1).to(q.dtype)


def test_compiled_layers_with_the_gpus_varlen_path_compile_once_for_all_layers(monkeypatch):
    """The GPU's packed path (torch's varlen kernel, traced inside each compiled layer) compiles one graph for every
    layer and every batch: nothing a guard sees differs between layers (``chunk_size`` read each layer's
    ``layer_idx`` and recompiled per layer until dynamo's limit, then ran the rest eagerly), and another batch's
    lengths are dynamic. Its output is the per-segment SDPA path's."""
    import numpy as np
    import torch.nn.attention.varlen as varlen
    from helpers import tiny_model
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed
    from leansft.core.model import attention
    from leansft.core.model.compile import compile_counts

    monkeypatch.setattr(varlen, "varlen_attn", _dense_varlen)
    model = tiny_model("qwen2", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    data = dataset([list(range(5, 40)), list(range(60, 90)), list(range(100, 135)), list(range(7, 99))])
    batches = [collate_packed(data, np.array(ex), np.zeros(len(ex), np.int64), data.lengths[ex])
               for ex in ([0, 1], [2, 3, 1], [3], [1, 0, 2])]
    attention.use_packed_attention(model, attention.VARLEN)
    with torch.no_grad():
        reference = [attention.packed_forward(model, b.to("cpu")) for b in batches]
    attention.use_packed_attention(model, attention.TORCH_VARLEN)
    torch._dynamo.reset()
    for layer in attention.decoder_of(model).layers:
        layer.compile(backend="eager", dynamic=True)
    before = compile_counts()
    with torch.no_grad():
        for b, ref in zip(batches, reference):
            out = attention.packed_forward(model, b.to("cpu"))
            torch.testing.assert_close(out, ref, rtol=0, atol=5e-2)  # the kernel computes in bf16
            if b is batches[0]:
                first = compile_counts()
    after = compile_counts()
    assert first["frames"] - before["frames"] == 1, (before, first)  # one graph for the four layers
    assert after == first, (first, after)  # no recompile and no graph break for any later batch
    assert after["graph_breaks"] == before["graph_breaks"]
    torch._dynamo.reset()


def test_batches_prepared_ahead_come_in_order_and_carry_errors_and_stop():
    """``Prefetched`` gives the steps of the iterator it runs ahead, in order with their positions; an error raised
    while preparing one comes out of ``next`` in the training loop; closing stops its thread."""
    import threading

    from leansft.recipe.batches import Prefetched

    def steps(fail_at=None):
        for i in range(10):
            if i == fail_at:
                raise ValueError(f"row {i} is bad")
            yield [f"batch {i}"], i

    with Prefetched(steps(), depth=2) as ahead:
        assert list(ahead) == [([f"batch {i}"], i) for i in range(10)]
    ahead = Prefetched(steps(fail_at=3), depth=2)
    assert [next(ahead)[1] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="row 3 is bad"):
        next(ahead)
    endless = Prefetched(iter(lambda: ([1], 0), None), depth=2)  # never ends: close must stop it
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "leansft-batches" and t.is_alive()]
