"""Data preparation as a user runs it vs. the plain batched tokenizer on the same rendered text (issue 69).

- plain: the conversations rendered beforehand with the tokenizer's own chat template (untimed), then
  ``tokenizer(texts[i:i + 1024], add_special_tokens=False)`` over all of them, ``TOKENIZERS_PARALLELISM=true``
  (the Rust tokenizer's threads on every core): the pace a tokenizer sets;
- ``leansft plan``: the command a user types (``leansft plan --data F --tokenizer T``), timed end to end in a fresh
  process: start-up, imports, reading, rendering, masking, tokenising, writing the cache, the plan;
- train's preparation: ``prepare_data`` as ``leansft train`` calls it, in a fresh process (start-up left out);
- the floor: the Rust tokenizer without offset tracking (``encode_batch_fast``) on the same text, which leansft's
  preparation also uses where offsets follow from token lengths: plan's ratio to it is printed beside.

Each with a fresh cache. Qwen2.5's template opens every conversation without a system message with its own default
system turn, which leansft tokenises once (core/data/shared_prefix.py); 2-turn chats that each carry their own
system prompt show train's preparation without that help. Also the same for 40-turn conversations (tokens/s against 2-turn ones) and the peak RSS of
``leansft plan`` (its process tree) at 1x and 4x the rows. Targets: plan and train's preparation >= 0.9x plain;
40-turn >= 0.8x 2-turn; peak memory < 25% more at 4x the rows.

    .venv/bin/python benchmarks/bench_prepare.py [--conversations 200000] [--repeat 2] [--turns 1,20] [--scale 4]
        [--own-system 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_tokenize import conversations, plain, qwen25_tokenizer  # noqa: E402  (same rows, same plain side)


def floor(tok, rows: list[dict]) -> tuple[float, int]:
    """The Rust tokenizer alone without offset tracking (``encode_batch_fast``, 1,024 texts a call, its threads on):
    the least a tokenizer call costs, which leansft's preparation also calls where offsets follow from token
    lengths (core/data/token_offsets.py)."""
    texts = tok.apply_chat_template([r["messages"] for r in rows], tokenize=False)
    backend = tok.backend_tokenizer
    t0 = time.perf_counter()
    n = sum(len(e.ids) for i in range(0, len(texts), 1024)
            for e in backend.encode_batch_fast(texts[i : i + 1024], add_special_tokens=False))
    return time.perf_counter() - t0, n


def plan(data: Path, tok_dir: Path, cache: Path) -> tuple[float, int, int]:
    """(seconds, tokens, peak RSS in bytes of the process tree's largest member... summed) of ``leansft plan``."""
    shutil.rmtree(cache, ignore_errors=True)
    out = cache.parent / "plan.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "leansft", "plan", "--data", str(data), "--tokenizer", str(tok_dir),
                    "--cache-dir", str(cache), "--json", str(out)], check=True, capture_output=True, env=env)
    dt = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads(out.read_text())["preparation"]
    return dt, sum(int(src["tokens"]) for src in report["sources"]), usage.ru_maxrss * 1024


TRAIN_PREP = """
import json, sys, time
from leansft.core.config import DataConfig
from leansft.core.data.prepare import prepare_data
t0 = time.perf_counter()
prep = prepare_data(DataConfig(sources=[sys.argv[1]], cache_dir=sys.argv[3]), sys.argv[2], truncate=False,
                    holdout=False)
print(json.dumps([time.perf_counter() - t0, sum(int(src["tokens"]) for src in prep.report.sources)]))
"""


def train_prep(data: Path, tok_dir: Path, cache: Path) -> tuple[float, int]:
    """``prepare_data`` as ``leansft train`` calls it, timed inside a fresh process (start-up and imports left
    out). Not in this one: after the plain side's parallel tokenizer, forked workers would inherit its threads'
    locks (tokenizers keeps its threads on after a fork where TOKENIZERS_PARALLELISM is set)."""
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", TRAIN_PREP, str(data), str(tok_dir), str(cache)], check=True,
                         capture_output=True, text=True)
    dt, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    return dt, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--turns", default="1,20", help="user/assistant pairs per conversation (1: two-turn chats)")
    ap.add_argument("--scale", type=int, default=4, help="the memory check: peak RSS at this many times the rows")
    ap.add_argument("--own-system", type=int, default=1, help="1: also 2-turn chats that each have their own "
                    "system prompt (no opening many share: the figure without core/data/shared_prefix.py's help)")
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = qwen25_tokenizer(work / "qwen25")
        rates: dict[int, float] = {}
        print(f"{os.cpu_count()} cores; Qwen2.5's tokenizer and template")
        print("| pairs | conversations | side | tokens | seconds | tokens/s | vs plain |\n| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for pairs in (int(p) for p in args.turns.split(",")):
            n = max(1, args.conversations // pairs)
            rows = conversations(n, pairs)
            data = work / f"p{pairs}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            best_plain = min(plain(tok, rows) for _ in range(args.repeat))
            plain_rate = best_plain[1] / best_plain[0]
            print(f"| {pairs} | {n:,} | plain tokenizer | {best_plain[1]:,} | {best_plain[0]:.1f} | {plain_rate:,.0f} | 1.00 |")
            best_floor = min(floor(tok, rows) for _ in range(args.repeat))
            floor_rate = best_floor[1] / best_floor[0]
            print(f"| {pairs} | {n:,} | tokenizer without offsets (encode_batch_fast) | {best_floor[1]:,} | "
                  f"{best_floor[0]:.1f} | {floor_rate:,.0f} | {floor_rate / plain_rate:.2f} |")
            runs = [plan(data, work / "qwen25", work / "cache") for _ in range(args.repeat)]
            dt, tokens, _ = min(runs)
            rates[pairs] = tokens / dt
            print(f"| {pairs} | {n:,} | leansft plan (end to end) | {tokens:,} | {dt:.1f} | {tokens / dt:,.0f} | "
                  f"{tokens / dt / plain_rate:.2f} ({tokens / dt / floor_rate:.2f} of the floor) |", flush=True)
            dt, tokens = min(train_prep(data, work / "qwen25", work / "cache") for _ in range(args.repeat))
            print(f"| {pairs} | {n:,} | train's preparation | {tokens:,} | {dt:.1f} | {tokens / dt:,.0f} | "
                  f"{tokens / dt / plain_rate:.2f} |", flush=True)
        if args.own_system:  # no opening shared by many conversations: the tokenizer's whole work, every row
            n = args.conversations
            rows = [{"messages": [{"role": "system", "content": f"You are assistant number {i}."}, *r["messages"]]}
                    for i, r in enumerate(conversations(n, 1))]
            data = work / "own_system.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            best_plain = min(plain(tok, rows) for _ in range(args.repeat))
            plain_rate = best_plain[1] / best_plain[0]
            print(f"| 1, own system prompts | {n:,} | plain tokenizer | {best_plain[1]:,} | {best_plain[0]:.1f} | "
                  f"{plain_rate:,.0f} | 1.00 |")
            dt, tokens = min(train_prep(data, work / "qwen25", work / "cache") for _ in range(args.repeat))
            print(f"| 1, own system prompts | {n:,} | train's preparation | {tokens:,} | {dt:.1f} | "
                  f"{tokens / dt:,.0f} | {tokens / dt / plain_rate:.2f} |", flush=True)
        pairs = sorted(rates)
        if len(pairs) > 1:
            print(f"{pairs[-1] * 2}-turn / {pairs[0] * 2}-turn tokens/s (leansft plan): "
                  f"{rates[pairs[-1]] / rates[pairs[0]]:.2f} (target >= 0.8)")
        if args.scale > 1:
            peaks = []
            for k in (1, args.scale):
                rows = conversations(args.conversations * k // 4, 1, seed=k)
                data = work / f"mem{k}.jsonl"
                data.write_text("".join(json.dumps(r) + "\n" for r in rows))
                peaks.append(memory_of_plan(data, work / "qwen25", work / "cache"))
            print(f"peak RSS of leansft plan: {peaks[0] / 1e6:,.0f} MB at {args.conversations // 4:,} conversations, "
                  f"{peaks[1] / 1e6:,.0f} MB at {args.conversations * args.scale // 4:,} "
                  f"(+{peaks[1] / peaks[0] - 1:.0%}; target < 25%)")


def memory_of_plan(data: Path, tok_dir: Path, cache: Path) -> int:
    """The peak RSS summed over ``leansft plan``'s process tree, sampled every 50 ms from /proc."""
    shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "leansft", "plan", "--data", str(data), "--tokenizer", str(tok_dir),
                             "--cache-dir", str(cache)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    return peak


def tree_rss(pid: int) -> int:
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
    return total


if __name__ == "__main__":
    main()
