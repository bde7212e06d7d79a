"""`leansft train` against the plainest loop that trains the same rows: the Hugging Face model run on each
example alone, its own code (no fused layers, no packing, no chunked loss), the token-mean loss of the step,
torch's clip_grad_norm_ and a textbook AdamW. Every piece of leansft's step has its own test; this one holds
the whole step (packing, varlen attention, the chunked loss, the tied embedding's sparse gradient, the CPU
gradient norm, the fused AdamW and its weight-decay groups, accumulation) to the model as its authors ship it."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import transformers as tf
from helpers import run_config

import leansft.recipe.train as recipe
from leansft.core.model.as_shipped import as_shipped
from leansft.core.model.loading import trainable_parameters

pytestmark = pytest.mark.slow  # trains a tiny model end to end


def record_steps(monkeypatch) -> dict:
    """Each step's micro-batches, target count, loss and gradient norm, and the trained weights before step 1
    and after the last step, as the recipe's ``train_step`` sees them."""
    seen: dict = {"steps": []}
    real = recipe.train_step

    def spy(engine, batches, counts, step, stop=None):
        model = engine.loss_module.model
        if not seen["steps"]:
            seen["before"] = {n: p.detach().clone() for n, p in trainable_parameters(model)}
        rows = [examples_of(b) for b in batches]
        out = real(engine, batches, counts, step, stop)
        seen["steps"].append((rows, out.counts.weight, out.loss, out.grad_norm, out.lr))
        seen["after"] = {n: p.detach().clone() for n, p in trainable_parameters(model)}
        return out

    monkeypatch.setattr(recipe, "train_step", spy)
    return seen


def examples_of(batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A micro-batch's examples as (input ids, labels), each alone: packed pieces or padded rows unpadded."""
    if hasattr(batch, "cu_seqlens"):
        return [(batch.input_ids[:, a:b].clone(), batch.labels[:, a:b].clone())
                for a, b in pairwise(batch.cu_seqlens.tolist())]
    return [(ids[None, :n].clone(), labels[None, :n].clone())
            for ids, labels, n in zip(batch.input_ids, batch.labels, batch.attention_mask.sum(1).tolist(), strict=True)]


def reference_run(model, seen: dict, weight_decay: float, max_grad_norm: float) -> list[tuple[float, float]]:
    """The recorded steps again on ``model``: (loss, gradient norm) per step; ``model`` ends trained."""
    params = dict(trainable_parameters(model))
    with torch.no_grad():
        for name, value in seen["before"].items():
            params[name].copy_(value)
    # Hugging Face Trainer's rule: no weight decay on biases and normalisation weights.
    decay = [p for n, p in params.items() if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in params.items() if not (p.ndim >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=seen["steps"][0][4], foreach=False, fused=False)
    out = []
    model.train()
    for rows, step_targets, *_ in seen["steps"]:
        total = 0.0
        for ids, labels in (example for micro_batch in rows for example in micro_batch):
            with as_shipped():
                logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum")
            (loss / step_targets).backward()
            total += float(loss)
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((total / step_targets, float(norm)))
    return out


def tied_tiny_llama(dest, source: str) -> str:
    """The fixture's tiny Llama with one weight for the input embedding and the output layer."""
    model = tf.AutoModelForCausalLM.from_pretrained(source)
    cfg = model.config
    cfg.tie_word_embeddings = True
    torch.manual_seed(1)
    tied = tf.LlamaForCausalLM(cfg)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    tied.save_pretrained(dest)
    tf.AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return str(dest)


@pytest.mark.parametrize(("method", "strategy"), [("full-tied", "bfd"), ("lora", "bfd"), ("full-tied", "sorted")])
def test_training_equals_the_plain_model_trained_example_by_example(tmp_path, tiny_run_assets, monkeypatch, method,
                                                                    strategy):
    assets = dict(tiny_run_assets)
    if method == "full-tied":
        assets["model"] = tied_tiny_llama(tmp_path / "tied", tiny_run_assets["model"])
    over = ["training.max_steps=3", "training.schedule=constant", "training.warmup_steps=0",
            "training.weight_decay=0.1", "training.max_grad_norm=0.15", f"batching.strategy={strategy}"]
    if method == "lora":
        over += ["training.method=lora", "training.lora.r=4", "training.lora.alpha=8"]
    cfg = run_config(tmp_path, assets, *over, f"checkpoint.export={strategy == 'bfd'}")
    seen = record_steps(monkeypatch)
    recipe.train(cfg)
    assert all(len(micro_batch) > 1 for rows, *_ in seen["steps"] for micro_batch in rows)  # several examples each

    plain = tf.AutoModelForCausalLM.from_pretrained(assets["model"], attn_implementation="eager",
                                                    dtype=torch.float32)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        plain = get_peft_model(plain, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    ref = reference_run(plain, seen, weight_decay=0.1, max_grad_norm=0.15)

    for (_, _, loss, norm, _), (ref_loss, ref_norm) in zip(seen["steps"], ref, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert any(norm > 0.15 for *_, norm, _ in seen["steps"])  # clipping was active
    trained = dict(trainable_parameters(plain))
    assert set(trained) == set(seen["after"])
    moved = torch.cat([(seen["after"][n] - seen["before"][n]).flatten() for n in trained])
    ref_moved = torch.cat([(trained[n].detach() - seen["before"][n]).flatten() for n in trained])
    assert ref_moved.norm() > 0
    assert float((moved - ref_moved).norm() / ref_moved.norm()) < 1e-4

    if cfg.checkpoint.export:  # the folder a user ships computes what the reference model computes
        exported = tf.AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/final", dtype=torch.float32).eval()
        reference = (plain.merge_and_unload() if method == "lora" else plain).eval()
        ids = torch.cat([ids for rows, *_ in seen["steps"][:1] for ids, _ in rows[0]], dim=1)[:, :128]
        with torch.no_grad(), as_shipped():
            want, got = reference(input_ids=ids).logits, exported(input_ids=ids).logits
        assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
