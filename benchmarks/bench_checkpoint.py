"""How long the training loop waits for a checkpoint: ``checkpoint.async`` off (the loop waits for the whole write)
and on (it waits for the state's copy, and for a save still in flight), side by side in one run.

A full fine-tune of a random model of SmolLM2-135M's shape (49,152 vocabulary; AdamW: weights, two moments) or a
smaller one, a training step between saves (a checkpoint every step: the worst case), alternating sync / async
runs. Prints the loop's wait per save, the save's own write time, and the steps' time next to it. ``--ranks 2``:
two CPU ranks (gloo) under DDP or FSDP (``--strategy``), the CPU's threads split between them; rank 0's waits.

    .venv/bin/python benchmarks/bench_checkpoint.py [--shape smollm2|small] [--saves 4] [--pairs 2] [--tokens 512]
                                                    [--ranks 2 --strategy ddp|fsdp]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from leansft.core import distributed
from leansft.core.config import load_config
from leansft.recipe.checkpointer import Checkpointer, TrainState

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False),
}


class Root(torch.nn.Module):
    """The model under a root module, as the loop trains it (FSDP shards its decoder layers, then the root)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)


def one_run(model, vocab: int, shape_tokens: int, saves: int, use_async: bool, folder: Path,
            strategy: str = "ddp") -> dict:
    cfg = load_config(None, ["model=unused", f"output_dir={folder}", "data.sources=[unused.jsonl]",
                             f"checkpoint.async={str(use_async).lower()}", "checkpoint.keep_last=1",
                             "checkpoint.keep_best=0", f"distributed.strategy={strategy}"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sharded = distributed.world_size() > 1 and strategy == "fsdp"
    ckpt = Checkpointer(cfg, folder, model, opt, sched, sharded=sharded)
    ids = torch.randint(0, vocab, (1, shape_tokens))
    steps, waits = [], []
    t_all = time.perf_counter()
    with ckpt:
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(time.perf_counter() - t0)
            ckpt.save(TrainState(step=step), {}, last=step == saves)
        waits = list(ckpt.waits)
    return {"wait": waits, "step": steps, "wall": time.perf_counter() - t_all}


def build(shape: str, strategy: str):
    """(the model under its root, wrapped for the strategy; its parameters; its vocabulary)."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096))
    n = sum(p.numel() for p in model.parameters())
    return distributed.wrap(Root(model), strategy, torch.device("cpu")), n, model.config.vocab_size


def measure(args, folder: Path | None = None) -> dict[bool, list[dict]] | None:
    """The alternating sync/async runs on this process (every rank runs them; rank 0 returns what it measured)."""
    root, n, vocab = build(args.shape, args.strategy)
    if distributed.rank() == 0:
        where = (f"{distributed.world_size()} ranks ({args.strategy.upper()}, gloo), {torch.get_num_threads()} "
                 "threads each" if distributed.world_size() > 1 else f"one process, {torch.get_num_threads()} threads")
        print(f"{args.shape}: {n / 1e6:.0f}M parameters, full fine-tune, AdamW, fp32 on {where}; a checkpoint after "
              f"each of {args.saves} steps of {args.tokens} tokens", flush=True)
    got: dict[bool, list[dict]] = {False: [], True: []}
    for pair in range(args.pairs):
        for use_async in ((False, True) if pair % 2 == 0 else (True, False)):
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                got[use_async].append(one_run(root, vocab, args.tokens, args.saves, use_async, Path(tmp),
                                              args.strategy))
            distributed.barrier()
    return got if distributed.rank() == 0 else None


def _rank(rank: int, world: int, port: int, folder: str, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    distributed.init(600)
    try:
        got = measure(args, Path(folder))
        if got is not None:
            report(got)
    finally:
        distributed.shutdown()


def report(got: dict[bool, list[dict]]) -> None:
    for use_async, runs in got.items():
        # the last save of a run is awaited (the run ends): reported apart from the ones in the middle
        middle = [w for r in runs for w in r["wait"][:-1]]
        last = [r["wait"][-1] for r in runs]
        step = statistics.median(s for r in runs for s in r["step"])
        print(f"async={str(use_async).lower():5}  loop wait per save: median {statistics.median(middle):.2f} s "
              f"(max {max(middle):.2f}), the last (awaited) {statistics.median(last):.2f} s; step {step:.2f} s; "
              f"run wall {statistics.median(r['wall'] for r in runs):.1f} s")
    sync_wait = statistics.median(w for r in got[False] for w in r["wait"][:-1])
    async_wait = statistics.median(w for r in got[True] for w in r["wait"][:-1])
    print(f"loop wait per save, async / sync: {async_wait / sync_wait:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--saves", type=int, default=4, help="training steps, a checkpoint after each")
    ap.add_argument("--pairs", type=int, default=2, help="sync/async pairs, alternating")
    ap.add_argument("--tokens", type=int, default=512, help="tokens in a step's batch")
    ap.add_argument("--ranks", type=int, default=1, help="CPU ranks (gloo): 1, or 2 for the multi-rank figure")
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="with --ranks 2")
    args = ap.parse_args()
    if args.ranks == 1:
        report(measure(args))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:  # one folder both ranks write in, as shared storage
        torch.multiprocessing.spawn(_rank, args=(args.ranks, port, folder, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
