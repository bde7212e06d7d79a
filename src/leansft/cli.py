"""Command line: parse, load config, call one function per command. Errors print without a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from leansft.errors import LeanSFTError


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(show_time=False, show_path=False)])
    logging.getLogger("leansft").setLevel(logging.INFO)
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    for noisy in ("transformers", "datasets", "httpx", "huggingface_hub", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _add_data_args(p: argparse.ArgumentParser, tokenizer_required: bool = True) -> None:
    p.add_argument("--data", required=True, action="append", help="data file, dataset folder or Hub name (repeatable)")
    p.add_argument("--format", default="auto", help="auto | alpaca | sharegpt | messages | prompt_completion | text")
    p.add_argument("--tokenizer", required=tokenizer_required, help="tokenizer folder, tokenizer.json, .gguf or Hub id")
    p.add_argument("--template", default=None, help="auto (tokenizer's own), chatml, llama3, qwen2.5, mistral, gemma, or a .jinja file")
    p.add_argument("--loss-on", default="assistant", choices=["assistant", "last_assistant", "all"])
    p.add_argument("--cache-dir", default=None)


def _data_config(args, max_length: int | None = None):
    from leansft.config import DataConfig

    kw = dict(sources=[{"path": d, "format": args.format} for d in args.data], template=args.template,
              loss_on=args.loss_on, cache_dir=args.cache_dir)
    if max_length is not None:
        kw["max_length"] = max_length
    try:
        return DataConfig(**kw)
    except Exception as err:
        raise LeanSFTError(f"invalid arguments: {err}") from None


def _prepare(args, max_length: int):
    from leansft.data.dataset import build_dataset
    from leansft.data.template import resolve_template
    from leansft.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    template = resolve_template(tok, args.template)
    cfg = _data_config(args, max_length)
    data, report = build_dataset(cfg, tok, template)
    return tok, data, report


def cmd_plan(args) -> int:
    import numpy as np

    from leansft.plan.report import plot_lengths, print_plan
    from leansft.plan.stats import plan_summary

    # Tokenise without truncation: the plan is about what max_length would do.
    tok, data, report = _prepare(args, 10**9)
    lengths = data.lengths
    max_length = args.max_length
    if max_length is not None:
        longest_prompt = int(data.prompt_lengths.max())
        if max_length <= longest_prompt:
            raise LeanSFTError(
                f"--max-length {max_length} is not longer than the longest prompt ({longest_prompt} tokens): "
                "that example would keep no response token", field="max_length",
            )
    summary = plan_summary(lengths, data.target_counts, max_length or 2048, args.batch_size, args.window, args.seed)
    summary["preparation"] = report.as_dict()
    if args.model:
        summary["memory"] = _memory(args, args.tokens_per_micro_batch or summary["max_length"])
    print_plan(summary)
    if args.plot:
        plot_lengths(np.asarray(lengths), args.plot, summary["max_length"])
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return 0


def _memory(args, tokens: int) -> dict:
    from leansft.model.load import load_config
    from leansft.plan.memory import ModelShape, estimate_memory

    shape = ModelShape.from_config(load_config(args.model))
    mem = estimate_memory(shape, tokens, method=args.method, precision=args.precision,
                          gradient_checkpointing=args.gradient_checkpointing)
    mem.update(method=args.method, precision=args.precision)
    return mem


def cmd_simulate(args) -> int:
    from leansft.plan.report import print_plan
    from leansft.plan.stats import lognormal_lengths, plan_summary

    lengths = lognormal_lengths(args.examples, args.median, args.sigma, args.cap, args.seed)
    summary = plan_summary(lengths, None, args.max_length, args.batch_size, args.window, args.seed)
    print_plan(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return 0


def cmd_show_mask(args) -> int:
    from rich.console import Console
    from rich.text import Text

    from leansft.data.template import IGNORE_INDEX

    tok, data, _ = _prepare(args, 10**9)
    console = Console()
    out = []
    for i in range(min(args.n, len(data))):
        ids, labels = data.example(i)
        ids, labels = ids.tolist(), labels.tolist()
        out.append({"row": int(data.rows[i]), "input_ids": ids, "labels": labels})
        text = Text()
        for t, lab in zip(ids, labels):
            text.append(tok.decode([t]), style="bold green" if lab != IGNORE_INDEX else "dim")
        n_t = sum(1 for x in labels if x != IGNORE_INDEX)
        console.rule(f"example {i} (row {data.rows[i]}): {len(ids)} tokens, {n_t} carry loss (green)")
        console.print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(out))
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leansft", description="Supervised fine-tuning of causal LMs, done right.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="length statistics, batching simulation and memory estimate for real data")
    _add_data_args(sp)
    sp.add_argument("--max-length", type=_positive, default=None)
    sp.add_argument("--batch-size", type=_positive, default=8)
    sp.add_argument("--window", type=_positive, default=512)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--model", default=None, help="model folder, config.json or .gguf, for the memory estimate")
    sp.add_argument("--method", default="full", choices=["full", "lora", "qlora"])
    sp.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    sp.add_argument("--gradient-checkpointing", action="store_true")
    sp.add_argument("--tokens-per-micro-batch", type=_positive, default=None)
    sp.add_argument("--json", default=None)
    sp.add_argument("--plot", default=None)
    sp.set_defaults(func=cmd_plan)

    ss = sub.add_parser("simulate", help="the plan's batching simulation on synthetic lognormal lengths")
    ss.add_argument("--examples", type=_positive, default=20000)
    ss.add_argument("--median", type=float, default=450)
    ss.add_argument("--sigma", type=float, default=0.9)
    ss.add_argument("--cap", type=_positive, default=4096)
    ss.add_argument("--max-length", type=_positive, default=4096)
    ss.add_argument("--batch-size", type=_positive, default=8)
    ss.add_argument("--window", type=_positive, default=512)
    ss.add_argument("--seed", type=int, default=0)
    ss.add_argument("--json", default=None)
    ss.set_defaults(func=cmd_simulate)

    sm = sub.add_parser("show-mask", help="print examples with the tokens that carry loss highlighted")
    _add_data_args(sm)
    sm.add_argument("-n", type=_positive, default=3)
    sm.add_argument("--json", default=None)
    sm.set_defaults(func=cmd_show_mask)

    from leansft import commands  # train/eval/generate/doctor/report register themselves

    commands.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except LeanSFTError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
