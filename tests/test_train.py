"""`leansft train` end to end on CPU with a tiny model and real alpaca rows."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from helpers import after_each_step, losses, run_config, tiny_bloom, train_crashing_after

from leansft.core.config import load_config
from leansft.core.errors import ConfigError, LeanSFTError
from leansft.core.io import checkpoint_files as ckpt
from leansft.recipe.train import train

KEYS = {"step", "loss", "lr", "grad_norm", "real_tokens_per_s", "target_tokens_per_s", "padding_share",
        "tokens_seen", "examples_seen", "peak_memory_bytes", "mfu"}


pytestmark = pytest.mark.slow  # each test trains a model end to end



@pytest.mark.slow
def test_loss_decreases_and_export_loads(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=24", "checkpoint.export=true",
                     "data.eval_split=0.1", "eval.eval_every=12")
    last = train(cfg)
    assert KEYS <= set(last)
    run = Path(cfg.output_dir)
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5  # step 0, 12, 24
    tl = [r["loss"] for r in records if "loss" in r]
    assert sum(tl[-4:]) / 4 < sum(tl[:4]) / 4 - 0.5
    assert last["padding_share"] == 0.0 and last["mfu"] is None  # no known peak on a CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_resume_is_exact(tmp_path, tiny_run_assets, monkeypatch):
    full = run_config(tmp_path / "a", tiny_run_assets, "training.max_steps=6")
    train(full)
    reference = losses(Path(full.output_dir))

    cut = run_config(tmp_path / "b", tiny_run_assets, "training.max_steps=6", "checkpoint.save_every=3")
    train_crashing_after(monkeypatch, cut, 5)
    assert [p.name for p in ckpt.list_checkpoints(Path(cut.output_dir) / "checkpoints")] == ["step-3"]
    train(cut, resume="auto")
    resumed = losses(Path(cut.output_dir))
    assert resumed == reference  # bitwise: every step's loss, before and after the resume


def test_crash_during_checkpoint_write_keeps_the_last_good_one(tmp_path, tiny_run_assets, monkeypatch):
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=4", "checkpoint.save_every=2")
    real_save = ckpt.write_safetensors
    calls = {"n": 0}

    def flaky(tensors, path):
        calls["n"] += 1
        if calls["n"] == 5:  # second checkpoint, after its model file was written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path)

    monkeypatch.setattr(ckpt, "write_safetensors", flaky)
    with pytest.raises(LeanSFTError, match=r"cannot write checkpoint step-4: the disk is full \(about .* needed, "
                       r".* free\); kept: step-2 \(intact\)"):
        train(cfg)
    folder = Path(cfg.output_dir) / "checkpoints"
    good = ckpt.list_checkpoints(folder)
    assert [p.name for p in good] == ["step-2"]
    assert not list(folder.glob(".tmp-*"))
    state = json.loads((good[0] / "state.json").read_text())
    assert state["step"] == 2
    monkeypatch.setattr(ckpt, "write_safetensors", real_save)
    train(cfg, resume="auto")  # and it resumes from it
    assert sorted(losses(Path(cfg.output_dir))) == [1, 2, 3, 4]


def test_a_checkpoint_writes_the_state_from_where_it_lives(tmp_path):
    """Writing a checkpoint of a CPU run copies neither the weights (tied ones included) nor the Adam state
    (copies of both lifted the run's peak memory over training's: 9.9 GB of tensors against 8.0 for a 0.5B
    model), and the files read back as the state they were written from."""
    from helpers import tiny_model
    from safetensors.torch import load_file

    model = tiny_model("qwen2").train()  # tied input and output embeddings
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(2, 18)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights = ckpt._model_state(model)
    tensors, meta = ckpt._optimizer_state(model, opt)
    where = lambda ts: {t.untyped_storage().data_ptr() for t in ts}  # noqa: E731
    live_adam = where(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    assert where(tensors.values()) == live_adam  # written from where it lives
    assert where(weights.values()) == where(model.parameters()) and len(weights) == len(model.state_dict())
    ckpt.write_safetensors(weights, tmp_path / "model.safetensors")
    ckpt.write_safetensors(tensors, tmp_path / "optimizer.safetensors")
    back = load_file(tmp_path / "model.safetensors")
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    state = ckpt._optimizer_dict(load_file(tmp_path / "optimizer.safetensors"), meta)["state"]
    live = opt.state_dict()["state"]  # by position in model.parameters(), as the optimizer was given them
    names = [n for n, _ in model.named_parameters()]
    assert len(state) == len(live) and all(torch.equal(state[names[i]][k], st[k]) for i, st in live.items()
                                           for k in ("exp_avg", "exp_avg_sq"))


def test_safetensors_are_written_a_tensor_at_a_time_in_safetensors_own_format(tmp_path):
    """Every dtype a checkpoint holds, scalars, empty, strided and shared tensors read back through safetensors
    itself; and a tensor that must be copied to be written (as a GPU tensor is brought to the host) is copied one
    at a time: safetensors' save_file turned them all into host bytes first (a 7B full fine-tune's Adam state
    on the GPU: 56 GB of host memory at once)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from leansft.core.metrics.memtrack import TensorMemoryTracker

    base = torch.randn(6, 8)
    tensors = {"f32": base, "tied": base, "bf16": base.bfloat16(), "f16": base.half(), "step": torch.tensor(3.0),
               "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32), "mask": base > 0,
               "u8": torch.arange(7, dtype=torch.uint8), "empty": torch.zeros(0, 4), "strided": base.t()}
    ckpt.write_safetensors(tensors, tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert torch.equal(f.get_slice("f32")[2:4], base[2:4])

    n, bases = 8, [torch.randn(512, 256) for _ in range(8)]
    with TensorMemoryTracker(exclude=bases) as tracker:
        ckpt.write_safetensors({f"t{i}": b.t() for i, b in enumerate(bases)}, tmp_path / "b.safetensors")
    one = bases[0].numel() * 4
    assert one <= tracker.peak < 2 * one < n * one
    back = load_file(tmp_path / "b.safetensors")
    assert all(torch.equal(back[f"t{i}"], b.t()) for i, b in enumerate(bases))


def test_a_resume_reads_weights_and_optimizer_state_a_tensor_at_a_time(tmp_path, monkeypatch):
    """Resuming copies the checkpoint's weights and Adam state into the model's and the optimizer's own tensors
    one at a time: the Adam state read whole beside the state it replaced took a CPU run's resume to 1.8x its
    training's memory (0.5B: 14.4 GB, 8.0), and whole files held a GPU run's state in host memory at once."""
    from helpers import tiny_model

    def trained(steps: int):
        model = tiny_model("qwen2").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        for _ in range(steps):
            ids = torch.arange(2, 18)[None]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return model, opt, sched

    model, opt, sched = trained(2)
    path = ckpt.save_checkpoint(tmp_path, 2, model, opt, sched, {}, {})
    fresh, fresh_opt, fresh_sched = trained(0)
    read_whole = []
    real = ckpt.load_file
    monkeypatch.setattr(ckpt, "load_file", lambda f, *a, **k: read_whole.append(Path(f).name) or real(f, *a, **k))
    ckpt.load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert read_whole == ["rng.safetensors"]
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q) and all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in opt.state[p])


def test_checkpoint_weights_of_another_model_are_refused_by_name_or_shape(tmp_path):
    from helpers import tiny_model

    model = tiny_model("qwen2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, {}, {})
    with pytest.raises(LeanSFTError, match=r"checkpoint weights do not match the model \(e.g. '.*bias'\)"):
        ckpt.load_weights(path, tiny_model("llama"))  # no q/k/v biases
    with pytest.raises(LeanSFTError, match=r"weight '.*mlp.*' has shape \(\d+, \d+\) in the checkpoint and"):
        ckpt.load_weights(path, tiny_model("qwen2", intermediate_size=48))


def test_a_model_read_onto_its_device_is_the_model_read_to_the_host(tmp_path):
    """``load_model(device=...)`` (how a GPU run loads: straight onto the device, never whole in host memory) gives
    the same fp32 weights from a bf16 checkpoint, the tied head still tied, and no dispatch hooks on the model."""
    from helpers import tiny_model

    from leansft.core.model.loading import load_model

    tiny_model("qwen2").to(torch.bfloat16).save_pretrained(tmp_path / "m")
    host = load_model(str(tmp_path / "m"))
    placed = load_model(str(tmp_path / "m"), device=torch.device("cpu"))
    assert placed.get_output_embeddings().weight is placed.get_input_embeddings().weight
    assert not any(hasattr(m, "_hf_hook") for m in placed.modules())
    a, b = host.state_dict(), placed.state_dict()
    assert a.keys() == b.keys() and all(b[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
    a, b = dict(host.named_buffers()), dict(placed.named_buffers())  # the rotary frequencies too
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    placed.train().to("cpu")


def test_lora_saves_adapters_only_and_merges_on_export(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, "training.method=lora", "training.lora.r=4",
                     "training.max_steps=2", "checkpoint.export=true", "training.learning_rate=1e-2")
    train(cfg)
    run = Path(cfg.output_dir)
    from safetensors.torch import load_file

    saved = load_file(ckpt.list_checkpoints(run / "checkpoints")[-1] / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"])
    assert not any("lora" in k for k in merged.state_dict())
    diff = (merged.model.layers[0].self_attn.q_proj.weight - base.model.layers[0].self_attn.q_proj.weight).abs()
    assert diff.max() > 0  # the adapters were merged into the base weights


def test_lora_adapters_alone_export_loads_with_peft_and_stops_at_turn_end(tmp_path, tiny_run_assets):
    """merge_on_export: false: PEFT applies the adapters to the base they name and gets the trained model; the
    folder's generation_config stops at the template's end of turn, which the base's own does not name; leansft's
    own commands point to the run."""
    import shutil

    from peft import AutoPeftModelForCausalLM
    from transformers import GenerationConfig

    base = tmp_path / "base"  # a base that stops at <|endoftext|> (0); the ChatML turn ends with <|im_end|> (2)
    shutil.copytree(tiny_run_assets["model"], base)
    GenerationConfig(bos_token_id=1, eos_token_id=0).save_pretrained(base)
    cfg = run_config(tmp_path, {**tiny_run_assets, "model": str(base)}, "training.method=lora", "training.lora.r=4",
                     "training.max_steps=2", "checkpoint.export=true", "training.learning_rate=1e-2",
                     "training.lora.merge_on_export=false")
    train(cfg)
    run = Path(cfg.output_dir)

    from leansft.core.data.masking import stop_token_ids
    from leansft.recipe.export_run import load_source

    trained, tokenizer, template, _ = load_source(str(run))  # the newest checkpoint, LoRA merged
    adapted = AutoPeftModelForCausalLM.from_pretrained(run / "final").eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
    stops = stop_token_ids(tokenizer, template)
    assert adapted.generation_config.eos_token_id == 0 and 2 in stops  # PEFT keeps the base's: it would run on
    assert GenerationConfig.from_pretrained(run / "final").eos_token_id == stops
    with pytest.raises(LeanSFTError, match="LoRA adapters alone"):
        load_source(str(run / "final"))


def test_nan_loss_stops_naming_the_step(tmp_path, tiny_run_assets, monkeypatch):
    from leansft.core.model import forward as step_mod

    monkeypatch.setattr(step_mod.LossModule, "forward", lambda self, b: torch.tensor(float("nan"), requires_grad=True))
    with pytest.raises(LeanSFTError, match="at step 1"):
        train(run_config(tmp_path, tiny_run_assets))


def test_padded_and_sorted_strategies_train_and_report_padding(tmp_path, tiny_run_assets):
    for strategy in ("padded", "sorted"):
        cfg = run_config(tmp_path / strategy, tiny_run_assets, f"batching.strategy={strategy}",
                         "batching.batch_size=4", "training.max_steps=2")
        last = train(cfg)
        assert last["padding_share"] > 0



def test_missing_data_file_is_a_clear_error(tmp_path, tiny_run_assets):
    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{tmp_path / 'nope.jsonl'}]")
    with pytest.raises(LeanSFTError, match="nope.jsonl: file not found"):
        train(cfg)



def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, tiny_run_assets, monkeypatch):
    import os
    import signal

    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=6")

    def term(step, loss):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    after_each_step(monkeypatch, term)
    train(cfg)
    monkeypatch.undo()
    run = Path(cfg.output_dir)
    # sent after step 2's loss all-reduce (where ranks agree on a stop), so step 3 is the last
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step-3"]
    assert max(losses(run)) == 3 and not (run / "final").exists()
    train(cfg, resume="auto")
    assert max(losses(run)) == 6


@pytest.mark.filterwarnings("error::FutureWarning")  # transformers renamed gradient checkpointing; no old name
def test_checkpointing_and_offloading_give_the_same_losses(tmp_path, tiny_run_assets):
    plain = run_config(tmp_path / "a", tiny_run_assets, "training.max_steps=3")
    train(plain)
    lean = run_config(tmp_path / "b", tiny_run_assets, "training.max_steps=3", "training.gradient_checkpointing=true",
                      "training.activation_offloading=true")
    train(lean)
    assert losses(Path(lean.output_dir)) == pytest.approx(losses(Path(plain.output_dir)), rel=1e-5)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_every_method_trains_in_training_mode(tmp_path, tiny_run_assets, monkeypatch, method):
    """from_pretrained returns a model in eval mode; trained as it is, full fine-tuning silently ran without
    dropout, NEFTune's noise and gradient checkpointing (transformers checkpoints in training mode only).
    Here: all modules train, and under checkpointing a decoder layer's first norm runs twice a micro-batch
    (forward, then again in backward's recompute)."""
    import leansft.recipe.train as recipe

    real, seen = recipe.train_step, []

    def spy(engine, batches, counts, step, stop=None):
        layers = [m for m in engine.loss_module.modules() if type(m).__name__.endswith("DecoderLayer")]
        calls = [0]
        hook = layers[0].input_layernorm.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        try:
            out = real(engine, batches, counts, step, stop)
        finally:
            hook.remove()
        seen.append(({m.training for m in engine.loss_module.modules()}, calls[0] / len(batches)))
        return out

    monkeypatch.setattr(recipe, "train_step", spy)
    cfg = run_config(tmp_path, tiny_run_assets, f"training.method={method}", "training.max_steps=2",
                     "training.gradient_checkpointing=true")
    train(cfg)
    assert seen == [({True}, 2.0)] * 2


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, tiny_run_assets):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard installed")
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        train(run_config(tmp_path, tiny_run_assets, "logging.tensorboard=true"))


def test_a_split_example_is_counted_once(tmp_path, tiny_run_assets):
    """bfd_split spreads long examples over several rows; examples_seen counts each example once."""
    from leansft.core.data.prepare import prepare_data

    rows = Path(tiny_run_assets["data"]).read_text().splitlines()[:24]  # one whole epoch: keep it short
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    cfg = run_config(tmp_path, tiny_run_assets, f"data.sources=[{tmp_path / 'rows.jsonl'}]",
                     "batching.strategy=bfd_split", "data.max_length=64",
                     "batching.tokens_per_micro_batch=64", "batching.gradient_accumulation=1",
                     "training.max_steps=null", "training.epochs=1", "logging.log_every=1000")
    data = prepare_data(cfg.data, cfg.model, truncate=False).train
    assert (data.lengths > 64).any()  # some examples really are split
    last = train(cfg)
    assert last["examples_seen"] == len(data)
    assert last["tokens_seen"] == int(data.lengths.sum())


def test_an_architecture_that_cannot_pack_falls_back_or_is_refused(tmp_path, tiny_run_assets, tiny_bpe_path):
    bloom = tiny_bloom(tmp_path / "bloom", tiny_bpe_path)
    cfg = run_config(tmp_path / "a", tiny_run_assets, f"model={bloom}", "training.max_steps=2")
    last = train(cfg)
    saved = load_config(str(Path(cfg.output_dir) / "config.yaml"))
    assert saved.batching.strategy == "sorted" and last["padding_share"] > 0  # trained unpacked, exactly
    refuse = run_config(tmp_path / "b", tiny_run_assets, f"model={bloom}", "training.verify=refuse")
    with pytest.raises(LeanSFTError, match=r"BloomForCausalLM \(bloom\) cannot train exactly with packed") as err:
        train(refuse)
    assert "batching.strategy: sorted" in str(err.value)
    assert not (Path(refuse.output_dir) / "metrics.jsonl").exists()


def test_tokenizer_larger_than_the_model_is_a_clear_error(tmp_path, tiny_run_assets, qwen25_path):
    cfg = run_config(tmp_path, tiny_run_assets, f"tokenizer={qwen25_path}")
    with pytest.raises(LeanSFTError, match="embedding has .* rows: the tokenizer does not belong to this model"):
        train(cfg)


def test_flex_attention_cannot_train_on_the_cpu(tmp_path, tiny_run_assets):
    with pytest.raises(ConfigError, match="flex.*CPU"):
        train(run_config(tmp_path, tiny_run_assets, "training.attention=flex"))


def test_examples_past_a_learned_position_table_are_refused_before_step_1(tmp_path, tiny_run_assets, tiny_bpe_path):
    """GPT-2's 64-position table and examples of up to 192 tokens: refused naming max_length, not an IndexError
    in the middle of the run (a device assert on CUDA); within the table it trains."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tiny_bpe_path)
    folder = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tok), n_positions=64)
                       ).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = run_config(tmp_path / "a", tiny_run_assets, f"model={folder}", "training.max_steps=1")
    with pytest.raises(LeanSFTError, match="examples of 192 tokens .* position embeddings for 64 positions") as err:
        train(cfg)
    assert "data.max_length to 64" in str(err.value)
    assert not (Path(cfg.output_dir) / "metrics.jsonl").exists()
    assert train(run_config(tmp_path / "b", tiny_run_assets, f"model={folder}", "training.max_steps=1",
                            "data.max_length=64"))["step"] == 1


def test_a_non_finite_step_leaves_the_weights_as_they_were(tmp_path, tiny_run_assets, monkeypatch):
    """The update is queued before the host reads the step (``train_step``): a NaN gradient at step 2 makes the
    fused AdamW skip it (``found_inf``), so the run stops naming the step with the weights and AdamW's step count
    of step 1, exactly."""
    import leansft.recipe.train as recipe

    real, seen = recipe.train_step, {}

    def spy(engine, batches, counts, step, stop=None):
        if step == 2:
            seen["before"] = {n: p.detach().clone() for n, p in engine.loss_module.named_parameters()}
            seen["engine"] = engine
            grad = next(p for p in engine.params)
            grad.register_hook(lambda g: g * float("nan"))
        return real(engine, batches, counts, step, stop)

    monkeypatch.setattr(recipe, "train_step", spy)
    with pytest.raises(LeanSFTError, match="at step 2"):
        train(run_config(tmp_path, tiny_run_assets, "training.max_steps=3"))
    engine = seen["engine"]
    assert engine.optimizer.defaults["fused"]
    for n, p in engine.loss_module.named_parameters():
        assert torch.equal(p.detach(), seen["before"][n]), n
    assert {int(s["step"]) for s in engine.optimizer.state.values()} == {1}
