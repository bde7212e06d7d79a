"""Preparation at scale: a synthetic source of N conversations (~500 tokens each) is prepared, then a
20-step training run starts from it. Reports wall times and resident memory (RSS, summed over the
process and its workers, sampled every 0.2 s).

Targets (issue 17): at 1,000,000 conversations (~500M tokens) peak RSS under 3 GB while preparing and
under 2 GB added by the dataset in training; RSS at 250k vs 1M conversations within 25%.

    .venv/bin/python benchmarks/bench_scale.py --conversations 250000 [--workers N] [--dir /tmp/leansft-scale]

The data file and the cache stay in --dir (delete it afterwards: ~5 GB at 1M conversations).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil  # installed with the trackers extra (mlflow, wandb)

WORDS = ("the model learns to answer questions about data packing attention loss memory tokens while users "
         "bring long conversations with many turns and tools").split()


def write_data(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def say(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi))).capitalize() + "."

    tmp = path.with_suffix(".part")
    with tmp.open("w") as fh:
        for _ in range(n):
            turns = [m for _ in range(rng.randint(2, 4)) for m in (
                {"role": "user", "content": say(10, 40)}, {"role": "assistant", "content": say(80, 160)})]
            fh.write(json.dumps({"messages": turns}) + "\n")
    tmp.rename(path)


def run_measured(cmd: list[str]) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS and peak PSS of the process tree in bytes, stdout+stderr). RSS counts the
    pages forked workers share with their parent once per process; PSS splits them among the sharers."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = peak_pss = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_pss
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                infos = [p.memory_full_info() for p in (root, *root.children(recursive=True))]
                peak = max(peak, sum(i.rss for i in infos))
                peak_pss = max(peak_pss, sum(i.pss for i in infos))
            except psutil.Error:
                pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - t0, peak, peak_pss, out


PREPARE = """
import sys
from leansft.core.config import DataConfig
from leansft.core.data.prepare import prepare_data
cfg = DataConfig(sources=[sys.argv[1]], cache_dir=sys.argv[2], num_workers=int(sys.argv[3]) or None, max_length=1024)
prep = prepare_data(cfg, sys.argv[4], holdout=False)
print("examples", len(prep.train), "tokens", int(prep.train.lengths.sum()))
"""

DATASET_RSS = """
import sys, psutil
from leansft.core.config import BatchingConfig, DataConfig
from leansft.core.data.prepare import prepare_data
from leansft.core.data.tokenizer import load_tokenizer
from leansft.recipe.batches import Batcher
load_tokenizer(sys.argv[4])
before = psutil.Process().memory_info().rss
cfg = DataConfig(sources=[sys.argv[1]], cache_dir=sys.argv[2], max_length=1024)
prep = prepare_data(cfg, sys.argv[4], holdout=False)
batcher = Batcher(prep.train, BatchingConfig(tokens_per_micro_batch=4096), 1024, 0, 0)
batcher.epoch_plan(0)
print("dataset_rss_added", psutil.Process().memory_info().rss - before, "examples", len(prep.train))
"""


def tiny_model(folder: Path, tokenizer: str) -> None:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tokenizer)
    cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def tiny_run_config(root: Path, tok_dir: Path, data: dict, steps: int, **sections) -> Path:
    """``root/train.yaml``: the tiny Qwen2 (made once in ``root``) training ``steps`` steps on ``data`` (the config's
    data section; max_length 1024), 4,096 tokens a micro-batch, no export; ``sections`` merged on top."""
    model = root / "tiny-qwen2"
    if not (model / "config.json").exists():
        tiny_model(model, str(tok_dir))
    config = root / "train.yaml"
    config.write_text(json.dumps({
        "model": str(model), "output_dir": str(root / f"run-{time.time_ns()}"), "data": {"max_length": 1024, **data},
        "batching": {"tokens_per_micro_batch": 4096}, "training": {"max_steps": steps},
        "checkpoint": {"export": False}, **sections}))
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=250_000)
    ap.add_argument("--workers", type=int, default=0, help="0: every core")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/leansft-scale")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tokenize import qwen25_tokenizer

    tok_dir = root / "qwen25"
    if not (tok_dir / "tokenizer.json").exists():
        qwen25_tokenizer(tok_dir)
    data = root / f"chats-{args.conversations}.jsonl"
    if not data.exists():
        t0 = time.perf_counter()
        write_data(data, args.conversations)
        print(f"wrote {data} ({data.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    cache = root / f"cache-{args.conversations}"
    py = sys.executable
    cached = cache.exists()
    dt, peak, pss, out = run_measured([py, "-c", PREPARE, str(data), str(cache), str(args.workers), str(tok_dir)])
    print(f"prepare {args.conversations:,} conversations{' (cache hit)' if cached else ''}: {dt:.0f} s, peak RSS {peak / 1e9:.2f} GB summed over "
          f"the processes (PSS {pss / 1e9:.2f} GB)  ({out.strip().splitlines()[-1]})")
    _, _, _, out = run_measured([py, "-c", DATASET_RSS, str(data), str(cache), "0", str(tok_dir)])
    added = int(out.split("dataset_rss_added")[1].split()[0])
    print(f"dataset loaded from the cache and planned: RSS added {added / 1e9:.2f} GB")
    config = tiny_run_config(root, tok_dir, {"sources": [str(data)], "cache_dir": str(cache)}, args.steps)
    dt, peak, pss, out = run_measured([py, "-m", "leansft", "train", str(config)])
    print(f"train {args.steps} steps from the cache: {dt:.0f} s wall (model load, plan, verify, steps), "
          f"peak RSS {peak / 1e9:.2f} GB (PSS {pss / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
