"""Command line: parse, build a config, call one function per command. Errors print without a traceback.

Argument defaults and choices are read from the config models (``leansft.core.config``), so every
default has one home.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import warnings
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from leansft.core.config import (
    BatchingConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    GGUFDType,
    LossOn,
    Method,
    SourceConfig,
    SpecialInContent,
    SuiteConfig,
    TrainingConfig,
    load_config,
)
from leansft.core.errors import LeanSFTError, PeerFailure

# torch, transformers and the modules built on them are imported by the command that needs them: `leansft --help`
# and a mistyped argument answer at once instead of after seconds of imports.

EXIT_ERROR = 2  # a clear error (bad input, config, model, divergence); EXIT_STOPPED (3): stopped by a signal


def default(model, name: str):
    """A config model field's default: the CLI's default for the same setting."""
    return model.model_fields[name].get_default(call_default_factory=True)


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler
    from transformers.utils import logging as hf_logging

    from leansft.core.progress import console

    if not console().is_terminal:  # a file or a pipe: tables and lines at full width, not cut at 80 columns
        console().width = max(console().width, 160)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console(), show_time=False, show_path=False)])
    # under torchrun rank 0 tells the story; the other ranks speak up for warnings and errors only
    rank = int(os.environ.get("RANK", "0"))
    logging.getLogger("leansft").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging.disable_progress_bar()
    # bitsandbytes' CPU backend warns on import (which peft does for every LoRA run) that an optional kernel
    # package is missing; peft 0.21 reads a property and (QLoRA) calls a method transformers 5 deprecated. None of
    # it is the user's to act on.
    for noisy in ("transformers", "datasets", "httpx", "huggingface_hub", "peft", "bitsandbytes.backends.cpu.ops"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(is_gradient_checkpointing|gradient_checkpointing_enable).* is "
                            "deprecated", category=FutureWarning)


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


# -- data commands: plan, show-mask, eval ------------------------------------------------------------
def _add_data_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--data", required=required, action="append",
                   help="data file, dataset folder or Hub name (repeatable)")
    p.add_argument("--format", default=default(SourceConfig, "format"),
                   choices=get_args(SourceConfig.model_fields["format"].annotation),
                   help="the data's format; auto: from the first row's keys")
    p.add_argument("--template", default=default(DataConfig, "template"),
                   help="auto (tokenizer's own), chatml, llama3, qwen2.5, mistral, gemma, or a .jinja file")
    p.add_argument("--loss-on", default=default(DataConfig, "loss_on"), choices=get_args(LossOn),
                   help="which tokens carry loss")
    p.add_argument("--cache-dir", default=default(DataConfig, "cache_dir"),
                   help="tokenised cache (default ~/.cache/leansft or LEANSFT_CACHE)")
    p.add_argument("--on-bad-row", default=default(DataConfig, "on_bad_row"),
                   choices=get_args(DataConfig.model_fields["on_bad_row"].annotation),
                   help="data.on_bad_row: skip leaves out (and counts) rows that are malformed or refused")
    p.add_argument("--special-tokens-in-content", default=default(DataConfig, "special_tokens_in_content"),
                   choices=get_args(SpecialInContent),
                   help="a special token written in a message's text: warn, refuse, allow, or escape (plain text)")


def _data_config(args, max_length: int | None = None) -> DataConfig:
    kw = {"sources": [{"path": d, "format": args.format} for d in args.data], "template": args.template,
          "loss_on": args.loss_on, "cache_dir": args.cache_dir, "on_bad_row": args.on_bad_row,
          "special_tokens_in_content": args.special_tokens_in_content}
    if max_length is not None:
        kw["max_length"] = max_length
    try:
        return DataConfig(**kw)
    except ValidationError as err:  # (a bug elsewhere stays a traceback)
        raise LeanSFTError(f"invalid arguments: {err}") from None


def _prepared(args, max_length: int | None = None, truncate: bool = False):
    from leansft.core.data.prepare import prepare_data

    return prepare_data(_data_config(args, max_length), args.tokenizer, truncate=truncate, holdout=False)


def _plan_data(args):
    """The prepared data a plan is about: --data files, or a run config's data section (--config)."""
    from leansft.core.data.prepare import prepare_data

    if args.config is None:
        if not args.data or not args.tokenizer:
            raise LeanSFTError("plan needs --data and --tokenizer, or --config (a run config)", field="--data")
        return _prepared(args)
    if args.data:
        raise LeanSFTError("--config plans the config's data: leave --data out (or plan the files without --config)",
                           field="--data")
    cfg = load_config(args.config)
    data_cfg = cfg.data.model_copy(deep=True)
    if args.cache_dir is not None:
        data_cfg.cache_dir = args.cache_dir
    return prepare_data(data_cfg, args.tokenizer or cfg.tokenizer or cfg.model, truncate=False, holdout=False,
                        seed=cfg.training.seed, trust_remote_code=cfg.trust_remote_code)


def cmd_plan(args) -> int:
    import numpy as np

    from leansft.tools.plan_report import plot_lengths, print_plan
    from leansft.tools.stats import plan_summary

    prep = _plan_data(args)  # whole examples: the plan is about what max_length would do
    data = prep.train
    max_length = args.max_length
    if max_length is not None:
        longest_prompt = int(data.prompt_lengths.max())
        if max_length <= longest_prompt:
            raise LeanSFTError(
                f"--max-length {max_length} is not longer than the longest prompt ({longest_prompt} tokens): "
                "that example would keep no response token", field="max_length",
            )
    if max_length is None:  # as --help says: the recommendation from these data
        from leansft.tools.stats import recommend_max_length

        max_length = recommend_max_length(data.lengths)
    # as train packs: batching.tokens_per_micro_batch (at least max_length, as train requires)
    micro = args.tokens_per_micro_batch or max(default(BatchingConfig, "tokens_per_micro_batch"), max_length)
    summary = plan_summary(data.lengths, data.target_counts, max_length, args.batch_size, args.window, args.seed,
                           tokens_per_micro_batch=micro)
    summary["preparation"] = prep.report.as_dict()
    if prep.stream is not None:
        from leansft.tools.stats import window_fill

        summary["stream"] = window_fill(prep.stream, max_length)
    if data.store.images is not None:
        summary["images"] = data.store.images.summary(data.index)
    if args.model:
        summary["memory"] = _memory(args, micro)
    print_plan(summary)
    if args.plot:
        plot_lengths(np.asarray(data.lengths), args.plot, summary["max_length"])
        print(f"wrote {args.plot}")
    _write_json(args.json, summary)
    return 0


def _memory(args, tokens: int) -> dict:
    from leansft.core.model.loading import load_model_config
    from leansft.tools.memory import ModelShape, estimate_memory, recommend_context_parallel

    shape = ModelShape.from_config(load_model_config(args.model))
    kw = {"method": args.method, "precision": args.precision, "gradient_checkpointing": args.gradient_checkpointing}
    mem = estimate_memory(shape, tokens, context_parallel=args.context_parallel, **kw)
    mem.update(method=args.method, precision=args.precision)
    if args.device_memory:
        mem["device_memory"] = int(args.device_memory * 2**30)
        mem["recommended_context_parallel"] = recommend_context_parallel(shape, tokens, mem["device_memory"], **kw)
    return mem


def cmd_simulate(args) -> int:
    from leansft.tools.plan_report import print_plan
    from leansft.tools.stats import lognormal_lengths, plan_summary

    lengths = lognormal_lengths(args.examples, args.median, args.sigma, args.cap, args.seed)
    summary = plan_summary(lengths, None, args.max_length, args.batch_size, args.window, args.seed)
    print_plan(summary)
    _write_json(args.json, summary)
    return 0


def cmd_show_mask(args) -> int:
    from leansft.core.data.prepare import prepare_data
    from leansft.tools.show_mask import example_kinds, html_page, print_examples, stop_summary

    cfg = _data_config(args, None)
    prep = prepare_data(cfg, args.tokenizer, truncate=False, holdout=False)
    kinds = example_kinds(prep.tokenizer, prep.template, cfg, prep.train, args.n)
    stops = stop_summary(prep.tokenizer, prep.template)
    out = print_examples(prep.tokenizer, prep.train, args.n, kinds=kinds, show=not args.html)  # the page shows them
    print(stops)
    _write_json(args.json, out, indent=None)
    if args.html:
        Path(args.html).write_text(html_page(prep.tokenizer, prep.train, args.n, args.max_length, kinds, stops),
                                   encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


def cmd_eval(args) -> int:
    if args.suite:
        return eval_suites(args)
    if not args.data:
        raise LeanSFTError("eval needs --data (held-out loss) or --suite (a question set scored)", field="--data")
    from leansft.core.data.prepare import prepare_data
    from leansft.core.inference.heldout_loss import evaluate
    from leansft.core.model.attention import VARLEN, use_packed_attention
    from leansft.recipe.builders import autocast_dtype, model_location

    model, _, _, cfg = _source(args)
    data_cfg = _data_config(args, args.max_length)
    if cfg is not None and args.template is None:  # a run or checkpoint: its own template
        data_cfg.template = cfg.data.template
    tokenizer_spec = args.model if cfg is None else cfg.tokenizer or model_location(cfg)
    prep = prepare_data(data_cfg, tokenizer_spec, holdout=False)
    use_packed_attention(model, VARLEN)
    amp = autocast_dtype(args.precision, next(model.parameters()).device)
    result = evaluate(model, prep.train, args.max_length,
                      max(args.max_length, default(BatchingConfig, "tokens_per_micro_batch")), autocast_dtype=amp)
    result["eval_precision"] = "bf16 autocast" if amp is not None else "fp32"
    print(f"eval loss {result['eval_loss']:.4f}  perplexity {result['eval_perplexity']:.3f}  "
          f"token accuracy {result['eval_token_accuracy']:.2%}  over {result['eval_targets']:,} target tokens  "
          f"({result['eval_precision']})")
    _write_json(args.json, result)
    return 0


def suite_configs(args) -> list[SuiteConfig]:
    """``--suite NAME[=PATH]`` (repeatable, or comma-separated): a benchmark by name, or a .jsonl of your own."""
    from leansft.core.config import BUILTIN_SUITES

    out = []
    for spec in (part for value in args.suite for part in value.split(",") if part):
        name, _, path = spec.partition("=")
        kind = name if name in BUILTIN_SUITES else "qa"  # a file of your own named ifbench.jsonl stays your own
        if kind == "qa":
            name, path = Path(spec).stem, spec
        try:
            out.append(SuiteConfig(name=name, kind=kind, data=path or None, metric=args.metric, limit=args.limit,
                                   max_new_tokens=args.max_new_tokens, shots=args.shots, judge_url=args.judge_url,
                                   judge_model=args.judge_model))
        except ValueError as e:
            raise LeanSFTError(f"--suite {spec}: {e}", field="--suite") from None
    return out


def _given_responses(path: str):
    """``--responses``: a .jsonl of {response} (or {turns: [first, second]} for mtbench), matched to the items by
    their prompt where the rows carry one (IFBench's and IFEval's output files do), else in the suite's order."""
    from leansft.recipe import suites

    from leansft.core.data.sources import jsonl_rows

    rows = []
    for number, row in jsonl_rows(path):
        turns = row.get("turns")
        if not (isinstance(row.get("response"), str)
                or isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise LeanSFTError('expected {"response": TEXT} or {"turns": [TEXT, ...]}', file=path, row=number)
        rows.append(row)
    given = [r["turns"] if "turns" in r else [r["response"]] for r in rows]
    by_prompt = {r["prompt"]: g for r, g in zip(rows, given) if isinstance(r.get("prompt"), str)}
    calls = iter(range(2))

    def answer(prompts: list, max_new_tokens: int) -> list[str]:
        turn = next(calls)
        if by_prompt and all(isinstance(p, str) for p in prompts):
            missing = [p for p in prompts if p not in by_prompt]
            if missing:
                raise LeanSFTError(f"no response for {len(missing)} of the suite's prompts, e.g. {missing[0][:60]!r}",
                                   file=path)
            return [by_prompt[p][0] for p in prompts]
        if len(given) != len(prompts):
            raise LeanSFTError(f"{len(given)} responses for {len(prompts)} items", file=path)
        return [g[min(turn, len(g) - 1)] for g in given]

    return suites.Model(answer=answer, render=lambda prompt: prompt if isinstance(prompt, str) else
                        "\n".join(str(m.get("content")) for m in prompt))


def eval_suites(args) -> int:
    """``eval --suite``: each suite's scores (the headline with a 95% bootstrap interval) on greedy answers (mmlu:
    the letters' log-likelihoods), or on given --responses."""
    from leansft.recipe import suites

    configs = suite_configs(args)
    loaded = [(suite, *suites.load_items(suite, seed=args.seed)) for suite in configs]  # missing data: before the model
    if args.responses:
        if len(configs) != 1:
            raise LeanSFTError("--responses scores one suite at a time", field="--responses")
        model = _given_responses(args.responses)
    else:  # rendered as a run renders its suites: with the system prompt it trained with, where one dominated
        from leansft.core.inference.choices import choice_logprobs
        from leansft.core.inference.generation import ChatSettings, generate_greedy
        from leansft.recipe.system_prompt import trained_system_prompt

        net, tokenizer, template, _ = _source(args)
        trained = trained_system_prompt(args.model)
        settings = ChatSettings(system=trained[0] if trained else None)
        model = suites.Model(
            answer=lambda prompts, n: generate_greedy(net, tokenizer, template, prompts, max_new_tokens=n,
                                                      settings=settings),
            render=lambda prompt: settings.render(tokenizer, template, prompt),
            choices=lambda requests: choice_logprobs(net, tokenizer, requests))
    results, failed = [], []
    try:  # --json holds every suite scored, whatever ends the command
        for suite, items, skipped in loaded:
            result = suites.run_suite(suite, items, model, skipped)
            result["settings"] = {"model": args.model, "responses": args.responses, "suite": suite.name,
                                  "kind": suite.kind, "data": suite.data, "shots": suite.shots, "limit": suite.limit,
                                  "seed": args.seed, "max_new_tokens": suite.answer_tokens,
                                  "judge_url": suite.judge_url, "judge_model": suite.judge_model}
            results.append(result)
            if result["score"] is None and result["metric"] == "rating":  # a judge that rated nothing
                print(f"{suite.name}: rating n/a (the judge's replies held no rating) over {result['n']} items")
            elif result["score"] is None:
                print(f"{suite.name}: {result['n']} answers ({result['metric']})")
            else:
                low, high = result["ci95"]
                print(f"{suite.name}: {result['metric']} {result['score']:.3f} (95% interval {suites.num(low)} to "
                      f"{suites.num(high)}) over {result['n']} items")
            others = {k: v for k, v in result["scores"].items() if k != result["metric"]}
            if others:
                print("  " + ", ".join(f"{k} {suites.num(v)}" for k, v in others.items()))
            for reason, count in result["skipped"].items():
                print(f"  skipped {count}: {reason}")
            if result.get("judge_failed"):
                failed.append(f"{suite.name}: {result['judge_failed']}")
    finally:
        _write_json(args.json, results)
    if failed:  # the answers are written; the scores the judge was to give are not
        raise LeanSFTError("the judge gave no ratings: " + "; ".join(failed), field="--judge-url",
                           hint="the answers are kept" + (f" in {args.json}" if args.json else " (--json FILE keeps "
                                                          "them)") + "; check the judge's address and model")
    return 0


def _write_json(path: str | None, obj, indent: int | None = 2) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=indent))
        print(f"wrote {path}")


# -- model commands: train, doctor, generate, chat, report, lm-eval ---------------------------------
def cmd_train(args) -> int:
    resume = args.resume
    if resume is not None and "=" in resume and not Path(resume).exists():  # `--resume k=v`: --resume, then k=v
        args.overrides.append(resume)
        resume = "auto"
    cfg = load_config(args.config, args.overrides)  # a typo answers before seconds of torch imports
    from leansft.recipe.train import main_train
    from leansft.tools.doctor import run_doctor

    if args.doctor and run_doctor(cfg) != 0:
        return 1
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # torchrun --max-restarts N started this worker again after a failure: go on from the newest checkpoint
        logging.getLogger("leansft").warning("restart %s under torchrun: resuming from the newest complete checkpoint "
                                             "(--resume auto)", os.environ["TORCHELASTIC_RESTART_COUNT"])
        resume = "auto"
    if args.serve and int(os.environ.get("RANK", "0")) == 0:
        from leansft.tools import run_page as server

        page = server.start([Path(cfg.output_dir)], args.host, args.port, allow_hosts=args.allow_host)
        logging.getLogger("leansft").info("the run page: %s", server.url(page))
        if server.exposure(page):
            logging.getLogger("leansft").warning("%s", server.exposure(page))
    return main_train(cfg, resume)


def cmd_doctor(args) -> int:
    from leansft.tools.doctor import run_doctor

    return run_doctor(load_config(args.config, args.overrides), json_out=args.json)


def _source(args):
    """(model, tokenizer, template, run config or None) of what ``args.model`` names, read as ``export`` reads
    it: a run folder (its newest checkpoint), a checkpoint (LoRA merged), or a model; on the GPU where there is
    one (``export`` reads on the CPU), in fp32 weights. An explicit ``--template`` wins over the run's own."""
    from leansft.core.data.masking import resolve_template
    from leansft.recipe.builders import pick_device
    from leansft.recipe.export_run import load_source

    model, tok, template, cfg = load_source(args.model, trust_remote_code=args.trust_remote_code,
                                            base_model=args.base_model)
    model.to(pick_device())  # eval, generate and chat ran on the CPU even beside a GPU
    if args.template is not None or template is None:
        template = resolve_template(tok, args.template)
    return model, tok, template, cfg


def cmd_generate(args) -> int:
    from leansft.tools.chat import generate_answers

    return generate_answers(args, _source)


def cmd_chat(args) -> int:
    from leansft.tools.chat import chat

    return chat(args, _source)


def cmd_report(args) -> int:
    from leansft.recipe.report import write_report

    if args.serve:
        return serve_page([Path(p) for p in args.run_dir], args.host, args.port, args.allow_host)
    if len(args.run_dir) != 1:
        raise LeanSFTError("report writes one run's report: several folders are for --serve")
    for path in write_report(Path(args.run_dir[0])):
        print(f"wrote {path}")
    return 0


def cmd_datasets(args) -> int:
    from leansft.tools.datasets import print_registry

    return print_registry(Path(args.registry))


def serve_page(folders: list[Path], host: str, port: int, allow_hosts: list[str] = ()) -> int:
    """The live run page until Ctrl-C."""
    from leansft.tools import run_page as server

    for folder in folders:
        if not folder.is_dir():
            raise LeanSFTError("not a folder", file=str(folder))
    page = server.start(folders, host, port, allow_hosts=allow_hosts)
    print(f"the run page: {server.url(page)} (Ctrl-C ends it)", flush=True)
    if server.exposure(page):
        print(f"warning: {server.exposure(page)}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        page.shutdown()
    return 0


LLAMA_QUANTIZE = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k")  # llama-quantize's, not ours


def cmd_export(args) -> int:
    from leansft.recipe.export_run import export_source

    if args.dtype in LLAMA_QUANTIZE:
        stem = Path(args.out).with_suffix("")
        raise LeanSFTError(
            f"--dtype {args.dtype}: leansft writes f16, bf16, q8_0 or f32 (llama.cpp's converter); {args.dtype} is "
            "llama.cpp's quantizer's work", field="--dtype",
            hint=f"export with --dtype f16, then: llama-quantize {stem}.gguf {stem}-{args.dtype}.gguf "
                 f"{args.dtype.upper()}")
    path = export_source(args.source, args.to, args.out, args.dtype, overwrite=args.overwrite,
                         trust_remote_code=args.trust_remote_code, base_model=args.base_model)
    print(f"wrote {path}")
    return 0


def cmd_lm_eval(args) -> int:
    """Optional: lm-evaluation-harness on an exported model folder, when the lm-eval package is installed."""
    try:
        import lm_eval
    except ImportError:
        raise LeanSFTError("leansft lm-eval needs the lm-eval package (pip install lm-eval)") from None
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={args.model}", tasks=args.tasks.split(","),
                                      limit=args.limit, apply_chat_template=True)
    print(json.dumps(results.get("results", {}), indent=2))
    _write_json(args.json, results.get("results", {}))
    return 0


def _add_source_args(p: argparse.ArgumentParser) -> None:
    """How a command reads a run, checkpoint or model (``export_run.load_source``): nothing in its files runs code
    or names what to download, unless said here."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code a model folder ships (custom architectures); a checkpoint's own "
                        "config.yaml never turns this on")
    p.add_argument("--base-model", default=None,
                   help="a checkpoint's base model to read instead of the one its config.yaml names (a local folder, "
                        "or a Hub id to fetch: a Hub id the config names is read only from the local cache)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a run folder (its newest checkpoint), a checkpoint, or a model folder such as "
                                 "OUTPUT_DIR/final, as for export")
    _add_source_args(p)
    p.add_argument("--template", default=default(DataConfig, "template"),
                   help="chat template (default: the run's, else the tokenizer's own)")
    p.add_argument("--max-new-tokens", type=_positive, default=default(EvalConfig, "max_new_tokens"),
                   help="tokens per answer at most")
    p.add_argument("--temperature", type=float, default=default(EvalConfig, "temperature"),
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=default(EvalConfig, "top_p"), help="nucleus sampling's mass")
    p.add_argument("--seed", type=int, default=default(TrainingConfig, "seed"), help="sampling seed")
    p.add_argument("--system", default=None,
                   help="system prompt: TEXT or @FILE (default: the one the run trained with where most of its "
                        "conversations shared one, else the template's own default, which '' also asks for)")
    p.add_argument("--tools", default=None, help="a JSON file of tool definitions the template renders "
                                                 "(OpenAI's function format, as in tool-calling data)")
    p.add_argument("--chat-template-kwargs", action="append", metavar="KEY=VALUE",
                   help="an option of the chat template, e.g. enable_thinking=false (repeatable)")
    p.add_argument("--show-prompt", action="store_true", help="print each prompt as the model reads it")


def _add_plan_args(p: argparse.ArgumentParser, batch_size: int, window: int, seed: int) -> None:
    p.add_argument("--batch-size", type=_positive, default=batch_size, help="examples per batch for sorted/padded")
    p.add_argument("--window", type=_positive, default=window, help="sorted: examples per sorting window")
    p.add_argument("--seed", type=int, default=seed, help="seed of the padded strategy's shuffle")
    p.add_argument("--json", default=None, help="write the plan's numbers here")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default beside its help (unless the help says it, or there is none to say); epilogs keep
    their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and "default" not in text
        return f"{text} (default: %(default)s)" if shown and action.option_strings else text


def _command(sub, name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=_Help, **kw)


TRAIN_EPILOG = """\
config keys: `leansft config --defaults` lists every key with its default and meaning (docs/config.md).

exit codes:
  0    finished (and exported); also: a finished run resumed, with nothing left to train
  2    stopped with an error message (bad input, config, model, damaged checkpoints, divergence)
  3    stopped by SIGINT/SIGTERM (inside the steps: after saving a checkpoint; continue with --resume auto)
  1    an unexpected crash (a bug: please report the traceback)
  130  a second Ctrl-C (no checkpoint)"""


def cmd_config(args) -> int:
    from leansft.tools.config_reference import text

    if args.defaults or args.config is None:
        print(text())
        return 0
    import yaml

    print(yaml.safe_dump(load_config(args.config, args.overrides).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8765, help="the run page's port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the run page listens on: loopback unless given (0.0.0.0: every interface; the "
                        "page then asks for a token, printed in its URL)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a name the page also answers to in the Host header (a tunnel's or proxy's name); others get "
                        "403, so a web site that rebinds its name to this machine reads nothing")


def build_parser() -> argparse.ArgumentParser:
    from leansft import __version__

    p = argparse.ArgumentParser(prog="leansft", description="Supervised fine-tuning of causal LMs, done right.",
                                formatter_class=_Help)
    p.add_argument("-v", "--verbose", action="store_true", help="log transformers' and other libraries' INFO too")
    p.add_argument("--version", action="version", version=f"leansft {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    batch_size, window = default(BatchingConfig, "batch_size"), default(BatchingConfig, "window")

    sp = _command(sub, "plan", help="length statistics, batching simulation and memory estimate for real data")
    _add_data_args(sp, required=False)
    sp.add_argument("--config", default=None,
                    help="a run config instead of --data: its data section (sources, weights and data.mix, the "
                         "registry, template, cleaning) and its tokenizer, as train prepares them")
    sp.add_argument("--tokenizer", default=None,
                    help="tokenizer folder, tokenizer.json, .gguf, pkg: path or Hub id (default with --config: the "
                         "run's)")
    sp.add_argument("--max-length", type=_positive, default=None, help="default: recommended from the data")
    _add_plan_args(sp, batch_size, window, default(TrainingConfig, "seed"))
    sp.add_argument("--model", default=None, help="model folder, config.json or .gguf, for the memory estimate")
    sp.add_argument("--method", default=default(TrainingConfig, "method"), choices=get_args(Method),
                    help="training method of the memory estimate")
    sp.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="precision of the memory estimate")
    sp.add_argument("--gradient-checkpointing", action="store_true", help="the memory estimate with checkpointing")
    sp.add_argument("--context-parallel", type=_positive, default=default(DistributedConfig, "context_parallel"),
                    help="distributed.context_parallel of the memory estimate: each rank holds 1/N of a row's "
                         "activations")
    sp.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                    help="one device's memory in GiB: the plan then recommends a context-parallel size where a "
                         "micro-batch would not fit whole")
    sp.add_argument("--tokens-per-micro-batch", type=_positive, default=None,
                    help="batching.tokens_per_micro_batch: packed micro-batches and the memory estimate (default: "
                         "train's default, or max_length where that is longer)")
    sp.add_argument("--plot", default=None, help="write a length histogram to this .png")
    sp.set_defaults(func=cmd_plan)

    ss = _command(sub, "simulate", help="the plan's batching simulation on synthetic lognormal lengths")
    ss.add_argument("--examples", type=_positive, default=20000, help="how many synthetic examples")
    ss.add_argument("--median", type=float, default=450, help="median length in tokens")
    ss.add_argument("--sigma", type=float, default=0.9, help="spread of the lognormal lengths (log scale)")
    ss.add_argument("--cap", type=_positive, default=4096, help="longest example")
    ss.add_argument("--max-length", type=_positive, default=4096, help="data.max_length to simulate")
    _add_plan_args(ss, batch_size, window, 0)
    ss.set_defaults(func=cmd_simulate)

    sm = _command(sub, "show-mask", help="print examples with the tokens that carry loss highlighted")
    _add_data_args(sm)
    sm.add_argument("--tokenizer", required=True, help="tokenizer folder, tokenizer.json, .gguf, pkg: path or Hub id")
    sm.add_argument("-n", type=_positive, default=3, help="how many examples to show")
    sm.add_argument("--json", default=None, help="write input_ids, labels and stop tokens of each example here")
    sm.add_argument("--html", default=None, help="write one self-contained page of the first -n examples (instead "
                                                 "of printing them)")
    sm.add_argument("--max-length", type=_positive, default=None, help="mark examples longer than this truncated")
    sm.set_defaults(func=cmd_show_mask)

    t = _command(sub, "train", help="train as a YAML config says; key=value overrides (training.max_steps=20)",
                       epilog=TRAIN_EPILOG)
    t.add_argument("config", help="the run's YAML config (examples/*.yaml)")
    t.add_argument("overrides", nargs="*", help="dotted key=value, e.g. training.learning_rate=1e-4")
    t.add_argument("--resume", nargs="?", const="auto", default=None, help="checkpoint folder, or auto (latest)")
    t.add_argument("--doctor", action="store_true", help="run `leansft doctor` first; stop on FAIL")
    t.add_argument("--serve", action="store_true", help="serve the run page while it trains (rank 0)")
    _add_serve_args(t)
    t.set_defaults(func=cmd_train)

    d = _command(sub, "doctor", help="pre-flight correctness checks on the real model and data")
    d.add_argument("config", help="the run's YAML config")
    d.add_argument("overrides", nargs="*", help="dotted key=value, as for train")
    d.add_argument("--json", default=None, help="write the checks and their numbers here")
    d.set_defaults(func=cmd_doctor)

    e = _command(sub, "eval", help="held-out loss, perplexity and token accuracy of a model on a data file; --suite: "
                                    "benchmarks (ifbench, ifeval, mmlu, mtbench) or questions of your own, scored")
    e.add_argument("model", help="a run folder (its newest checkpoint), a checkpoint or a model, as for export")
    _add_source_args(e)
    _add_data_args(e, required=False)
    e.add_argument("--suite", action="append", default=None, metavar="NAME[=PATH]",
                   help="ifbench, ifeval, mmlu or mtbench (=PATH: that suite's local data; mmlu and ifeval need "
                        "one offline), or a .jsonl of {prompt or messages, answer} of your own; repeatable or "
                        "comma-separated")
    e.add_argument("--metric", default=default(SuiteConfig, "metric"),
                   choices=get_args(SuiteConfig.model_fields["metric"].annotation),
                   help="how an answer of your own suite scores")
    e.add_argument("--limit", type=_positive, default=None,
                   help="a suite's items at most: a fixed sample spread over instruction types, subjects, categories")
    e.add_argument("--seed", type=int, default=0, help="the seed of --limit's sample")
    e.add_argument("--max-new-tokens", type=_positive, default=None,
                   help="answer tokens at most (default 64 for your own suites, 512 for the benchmarks)")
    e.add_argument("--shots", type=int, choices=range(6), default=0, metavar="0-5",
                   help="mmlu: worked examples from the subject's dev questions before each (0 or 5 as reported)")
    e.add_argument("--judge-url", default=None,
                   help="mtbench: an OpenAI-compatible endpoint (http://host:port/v1) that grades the answers; "
                        "OPENAI_API_KEY is sent where set")
    e.add_argument("--judge-model", default=None, help="mtbench: the judge's model name at --judge-url")
    e.add_argument("--responses", default=None,
                   help="score these answers instead of generating: a .jsonl of {response} (mtbench: {turns: [first, "
                        "second]}) in the suite's order")
    e.add_argument("--max-length", type=_positive, default=default(DataConfig, "max_length"),
                   help="examples are cut at this many tokens")
    e.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="fp32",
                   help="fp32: the loss as the plain model computes it; bf16 / auto: the decoder under bf16 autocast "
                        "(auto: where the device multiplies bf16 in hardware), as a bf16 run evaluates while it "
                        "trains; the logits and the loss stay fp32")
    e.add_argument("--json", default=None, help="write the results here")
    e.set_defaults(func=cmd_eval)

    g = _command(sub, "generate", help="answer prompts with the model's chat template")
    _add_generation_args(g)
    g.add_argument("--prompt", action="append", help="a user message (repeatable)")
    g.add_argument("--from", dest="source_file", default=None,
                   help='a .jsonl of {"messages": [...]} or {"prompt": "..."} rows to answer (a trailing assistant '
                        "turn is left out)")
    g.add_argument("--out", default=None, help="write each --from row with its \"answer\" here (JSON lines)")
    g.add_argument("--image", action="append", default=None,
                   help="a picture the --prompt asks about (repeatable; a vision-language model: docs/vision.md)")
    g.set_defaults(func=cmd_generate)

    c = _command(sub, "chat", help="interactive chat with a model")
    _add_generation_args(c)
    c.set_defaults(func=cmd_chat)

    ds = _command(sub, "datasets", help="the data sets a registry (datasets.yaml) names, with formats and sizes")
    ds.add_argument("registry", nargs="?", default="datasets.yaml", help="the registry file (default: ./datasets.yaml)")
    ds.set_defaults(func=cmd_datasets)

    r = _command(sub, "report", help="plots and a one-page summary of a run folder (report.md, report.html); "
                                      "--serve: the live run page")
    r.add_argument("run_dir", nargs="+", help="a run's output_dir; with --serve, also several, or a folder of runs")
    r.add_argument("--serve", action="store_true", help="serve the run page, redrawn as the run writes")
    _add_serve_args(r)
    r.set_defaults(func=cmd_report)

    x = _command(sub, "export", help="a run (its newest checkpoint), a checkpoint or any model train takes out as "
                                      "a Hugging Face folder or one GGUF file (LoRA merged)")
    x.add_argument("source", help="OUTPUT_DIR, OUTPUT_DIR/checkpoints/step-N, or what train takes as model: a model "
                                  "folder (e.g. OUTPUT_DIR/final), a .gguf file, pkg:PACKAGE/FILE or a Hub id")
    x.add_argument("out", help="the folder (--to hf) or .gguf file (--to gguf) to write")
    x.add_argument("--to", choices=["hf", "gguf"], default="hf",
                   help="hf: a plain Hugging Face model folder (safetensors, tokenizer, config); gguf: one GGUF file "
                        "for llama.cpp and friends (default: hf)")
    x.add_argument("--dtype", choices=get_args(GGUFDType) + LLAMA_QUANTIZE, default="f16",
                   help="GGUF tensor type (norms stay f32); 4-bit and k-quant types come from llama.cpp's "
                        "llama-quantize, run on the f16 file")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an OUT that leansft did not export (an earlier export is replaced without it); "
                        "a run, a checkpoint or what the export reads is never replaced")
    _add_source_args(x)
    x.set_defaults(func=cmd_export)

    le = _command(sub, "lm-eval", help="optional: run lm-evaluation-harness on an exported model (needs lm-eval)")
    le.add_argument("model", help="an exported model folder (e.g. OUTPUT_DIR/final)")
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    le.add_argument("--limit", type=int, default=None, help="examples per task at most")
    le.add_argument("--json", default=None, help="write the results here")
    le.set_defaults(func=cmd_lm_eval)

    cf = _command(sub, "config", help="every config key with its default and meaning, or a config as it resolves")
    cf.add_argument("config", nargs="?", default=None, help="a YAML config to resolve (omit: the defaults)")
    cf.add_argument("overrides", nargs="*", help="dotted key=value, as for train")
    cf.add_argument("--defaults", action="store_true", help="list every key with its default and meaning")
    cf.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra  # key=value typed after the options (`train CFG --resume auto k=v`), as users do
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except LeanSFTError as err:
        # under torchrun every rank stops; each node's first rank says why, naming itself (on node-local disks a
        # node's reason, a file it lacks, is not rank 0's)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            who = f" (rank {os.environ.get('RANK', '0')}/{world} on {socket.gethostname()})" if world > 1 else ""
            print(f"error{who}: {err}", file=sys.stderr)
        if isinstance(err, PeerFailure):  # leaving normally would wait on the gone peer in a destructor
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_ERROR)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `leansft config --defaults | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
