"""Streaming at scale (issue 77): a mixture of three synthetic sources at 0.5 / 0.3 / 0.2 of the target tokens,
generated on the fly (never written whole), read through leansft's streaming pipeline (the cached path's shards,
workers and cleaning; the mix; windows deduplicated and packed as training packs them).

Each measurement runs in a fresh process, its peak RSS summed over the process and its workers (sampled every
0.2 s, as bench_scale.py does):

- ``--conversations N`` (default 1M and 10M): conversations/s and tokens/s through the pipeline, the shares
  measured against the asked ones, peak RSS at each size (the target: 10M within 25% of 1M);
- the plain batched tokenizer on the same kind of conversations, rendered beforehand (the pace a tokenizer sets);
- the cached path against streaming on one file of ``--file-conversations`` rows: ``prepare_data`` with a fresh
  cache against the stream read through (the target: streaming >= 0.9x cached);
- ``leansft train`` on that file streaming: seconds from launch to the first step, against the cached path's
  preparation of the whole file.

    .venv/bin/python benchmarks/bench_stream.py [--conversations 1000000,10000000] [--file-conversations 200000]
        [--dir /tmp/leansft-stream]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_scale import run_measured, tiny_run_config  # noqa: E402  (peak RSS of a process tree)
from bench_tokenize import WORDS, plain, qwen25_tokenizer  # noqa: E402

SHARES = (0.5, 0.3, 0.2)

STREAM = r"""
import json, random, sys, time
import numpy as np
from leansft.core.config import load_config
from leansft.core.data.masking import resolve_template
from leansft.core.data.shards import SHARD
from leansft.core.data.stream import Cursor, SourceStream, Stream
from leansft.core.data.tokenizer import load_tokenizer
from leansft.core.config import BatchingConfig
from leansft.recipe.batches import Batcher

total, tok_dir, stubs = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
WORDS = json.loads(sys.argv[4])
SHARES = (0.5, 0.3, 0.2)


class Synthetic(SourceStream):
    '''A source of n conversations made from (source, row) alone: rows come as the file reader's would.'''

    def __init__(self, index, src, cfg, encoder, n):
        self.index, self.src, self.cfg, self.truncate, self.n = index, src, cfg, True, n
        self.files, self.key, self.format = [], f"stream-{index}", "messages"
        self.job = {"src": src, "cfg": cfg, "encoder": encoder, "format": "messages"}
        from leansft.core.data.dataset import PrepReport
        self.report, self.bad_rows = PrepReport(), 0

    def _row(self, i):
        rng = random.Random(self.index * 1_000_003 + i)
        say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
        return json.dumps({"messages": [{"role": "user", "content": f"[{self.index}:{i}] " + say(rng.randint(5, 40))},
                                        {"role": "assistant", "content": say(rng.randint(20, 120))}]})

    def _shards(self, cursor):
        for start in range(cursor.offset, self.n, SHARD):
            yield (Cursor(cursor.lap, 0, start, start),
                   [(i + 1, self._row(i)) for i in range(start, min(start + SHARD, self.n))])


spec = ", ".join(f"{{path: {p}, weight: {w}, streaming: true}}" for p, w in zip(stubs, SHARES))
cfg = load_config(None, ["model=m", "training.max_steps=1", f"data.sources=[{spec}]", "data.mix.mode=interleave",
                         "data.mix.stop=first_exhausted", "data.max_length=1024"]).data
tok = load_tokenizer(tok_dir)
stream = Stream(cfg, tok, resolve_template(tok, None))
encoder = stream.sources[0].job["encoder"]
stream.sources = [Synthetic(i, s, cfg, encoder, int(total * w * 1.02) + 1) for i, (s, w) in
                  enumerate(zip(cfg.sources, SHARES))]
t0 = time.perf_counter()
amount, examples, tokens, first = np.zeros(3), 0, 0, None
for window in stream.windows(stream.start()):
    if first is None:
        first = time.perf_counter() - t0
    plan, groups = Batcher(window.data, BatchingConfig(tokens_per_micro_batch=8192), 1024, 0, 0).epoch_plan(0)
    amount += np.bincount(window.source, weights=window.data.target_counts, minlength=3)
    examples += len(window.data)
    tokens += int(window.data.lengths.sum())
    if examples >= total or window.end["epoch"] > 0:
        break
dt = time.perf_counter() - t0
stream.close()
print(json.dumps({"examples": examples, "tokens": tokens, "seconds": dt, "first_window_s": first,
                  "shares": (amount / amount.sum()).tolist()}))
"""

CACHED_VS_STREAM = r"""
import json, sys, time
from leansft.core.config import load_config
from leansft.core.data.masking import resolve_template
from leansft.core.data.prepare import prepare_data
from leansft.core.data.stream import Stream
from leansft.core.data.tokenizer import load_tokenizer

mode, data, tok_dir, cache = sys.argv[1:5]
t0 = time.perf_counter()
if mode == "cached":
    cfg = load_config(None, ["model=m", f"data.sources=[{data}]", f"data.cache_dir={cache}", "data.max_length=1024"])
    prep = prepare_data(cfg.data, tok_dir, holdout=False)
    n, tokens = len(prep.train), int(prep.train.lengths.sum())
else:
    cfg = load_config(None, ["model=m", "training.max_steps=1", f"data.sources=[{{path: {data}, streaming: true}}]",
                             "data.max_length=1024"])
    tok = load_tokenizer(tok_dir)
    stream = Stream(cfg.data, tok, resolve_template(tok, None))
    n = tokens = 0
    for window in stream.windows(stream.start()):  # every row is one example (no duplicate, none too long)
        n, tokens = n + len(window.data), tokens + int(window.data.lengths.sum())
        if window.end["epoch"] > 0 or n >= int(sys.argv[5]):
            break
    stream.close()
print(json.dumps({"examples": n, "tokens": tokens, "seconds": time.perf_counter() - t0}))
"""


def write_file(path: Path, n: int) -> None:
    rng = random.Random(7)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    tmp = path.with_suffix(".part")
    with tmp.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"[{i}] " + say(rng.randint(5, 40))},
                                              {"role": "assistant", "content": say(rng.randint(20, 120))}]}) + "\n")
    tmp.rename(path)


def last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", default="1000000,10000000")
    ap.add_argument("--file-conversations", type=int, default=200_000)
    ap.add_argument("--dir", default="/tmp/leansft-stream")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = root / "qwen25"
    if not (tok_dir / "tokenizer.json").exists():
        qwen25_tokenizer(tok_dir)
    py = sys.executable
    stubs = []
    for i in range(3):  # what the config names; the rows come from Synthetic
        stub = root / f"source{i}.jsonl"
        stub.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]}) + "\n")
        stubs.append(str(stub))
    import transformers as tf

    from bench_tokenize import conversations
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    dt, n = plain(tok, conversations(50_000, 1))
    print(f"plain batched tokenizer (50,000 conversations rendered beforehand): {n / dt:,.0f} tokens/s")
    for total in map(int, args.conversations.split(",")):
        dt, peak, pss, out = run_measured([py, "-c", STREAM, str(total), str(tok_dir), json.dumps(stubs),
                                           json.dumps(WORDS)])
        r = last_json(out)
        print(f"stream {r['examples']:,} conversations from 3 sources: {r['seconds']:.0f} s, "
              f"{r['examples'] / r['seconds']:,.0f} conversations/s, {r['tokens'] / r['seconds']:,.0f} tokens/s; "
              f"first window after {r['first_window_s']:.1f} s; peak RSS {peak / 1e9:.2f} GB (PSS {pss / 1e9:.2f} GB); "
              f"shares of the target tokens {', '.join(f'{s:.4f}' for s in r['shares'])} (asked "
              f"{', '.join(map(str, SHARES))}); nothing written")
    data = root / f"file-{args.file_conversations}.jsonl"
    if not data.exists():
        write_file(data, args.file_conversations)
    rates, seconds = {}, {}
    for mode in ("cached", "stream"):
        cache = root / f"cache-{time.time_ns()}"
        _, peak, _, out = run_measured([py, "-c", CACHED_VS_STREAM, mode, str(data), str(tok_dir), str(cache),
                                        str(args.file_conversations)])
        r = last_json(out)
        rates[mode] = r["tokens"] / r["seconds"]
        seconds[mode] = r["seconds"]
        print(f"{mode}: {r['examples']:,} conversations of {data.name} in {r['seconds']:.1f} s, {rates[mode]:,.0f} "
              f"tokens/s, peak RSS {peak / 1e9:.2f} GB")
    print(f"streaming / cached preparation: {rates['stream'] / rates['cached']:.2f}x")
    config = tiny_run_config(root, tok_dir, {"sources": [{"path": str(data), "streaming": True}]}, 2,
                             logging={"log_every": 1})
    t0 = time.perf_counter()
    proc = subprocess.Popen([py, "-m", "leansft", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first_step = None
    for line in proc.stdout:
        if first_step is None and line.startswith("step 1 "):
            first_step = time.perf_counter() - t0
    proc.wait()
    print(f"leansft train on {data.name} streaming: step 1 done {first_step:.1f} s after launch (start-up, model, "
          f"first window, verify); preparing it whole (cached, above) took {seconds['cached']:.0f} s")


if __name__ == "__main__":
    main()
