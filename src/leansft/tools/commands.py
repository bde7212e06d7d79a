"""Sub-commands that need a model: train, eval, generate, chat, report (and doctor)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_train(args) -> int:
    from leansft.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.doctor:
        from leansft.doctor import run_doctor

        if run_doctor(cfg) != 0:
            return 1
    from leansft.train.loop import main_train

    return main_train(cfg, args.resume)


def _load_for_inference(spec: str, template: str | None):
    import torch

    from leansft.data.template import resolve_template
    from leansft.data.tokenizer import load_tokenizer
    from leansft.model.load import load_model

    model = load_model(spec, torch.float32)
    tok = load_tokenizer(spec)
    return model, tok, resolve_template(tok, template)


def cmd_eval(args) -> int:
    from leansft.config import DataConfig
    from leansft.data.dataset import build_dataset
    from leansft.evaluate.loss import evaluate
    from leansft.model.attention import VARLEN, use_packed_attention

    model, tok, template = _load_for_inference(args.model, args.template)
    cfg = DataConfig(sources=[{"path": d, "format": args.format} for d in args.data], template=args.template,
                     max_length=args.max_length, cache_dir=args.cache_dir)
    data, _ = build_dataset(cfg, tok, template)
    use_packed_attention(model, VARLEN)
    result = evaluate(model, data, args.max_length, max(args.max_length, 8192))
    print(f"eval loss {result['eval_loss']:.4f}  perplexity {result['eval_perplexity']:.3f}  "
          f"token accuracy {result['eval_token_accuracy']:.2%}  over {result['eval_targets']:,} target tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def cmd_generate(args) -> int:
    from leansft.evaluate.samples import generate

    model, tok, template = _load_for_inference(args.model, args.template)
    for prompt in args.prompt:
        (answer,) = generate(model, tok, template, [prompt], max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        print(answer)
    return 0


def cmd_chat(args) -> int:
    from leansft.evaluate.samples import generate

    model, tok, template = _load_for_inference(args.model, args.template)
    history: list[dict] = []
    print("leansft chat: empty line or Ctrl-D to quit")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        (answer,) = generate(model, tok, template, [history], max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}")
    return 0


def cmd_report(args) -> int:
    from leansft.evaluate.report import write_report

    for path in write_report(Path(args.run_dir)):
        print(f"wrote {path}")
    return 0


def cmd_lm_eval(args) -> int:
    """Optional: lm-evaluation-harness on an exported model folder, when the lm-eval package is installed."""
    try:
        import lm_eval
    except ImportError:
        from leansft.errors import LeanSFTError

        raise LeanSFTError("leansft lm-eval needs the lm-eval package (pip install lm-eval)") from None
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={args.model}", tasks=args.tasks.split(","),
                                      limit=args.limit, apply_chat_template=True)
    print(json.dumps(results.get("results", {}), indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results.get("results", {}), indent=2))
    return 0


def cmd_doctor(args) -> int:
    from leansft.config import load_config
    from leansft.doctor import run_doctor

    return run_doctor(load_config(args.config, args.overrides), json_out=args.json)


def _gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an exported model folder (OUTPUT_DIR/final) or any HF model folder")
    p.add_argument("--template", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train as a YAML config says; key=value overrides (training.max_steps=20)")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted key=value, e.g. training.learning_rate=1e-4")
    t.add_argument("--resume", nargs="?", const="auto", default=None, help="checkpoint folder, or auto (latest)")
    t.add_argument("--doctor", action="store_true", help="run `leansft doctor` first; stop on FAIL")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out loss, perplexity and token accuracy of a model on a data file")
    e.add_argument("model")
    e.add_argument("--data", required=True, action="append")
    e.add_argument("--format", default="auto")
    e.add_argument("--template", default=None)
    e.add_argument("--max-length", type=int, default=2048)
    e.add_argument("--cache-dir", default=None)
    e.add_argument("--json", default=None)
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="answer prompts with the model's chat template")
    _gen_args(g)
    g.add_argument("--prompt", required=True, action="append")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with a model")
    _gen_args(c)
    c.set_defaults(func=cmd_chat)

    r = sub.add_parser("report", help="plots and a one-page summary of a run folder")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)

    le = sub.add_parser("lm-eval", help="optional: run lm-evaluation-harness on an exported model (needs lm-eval)")
    le.add_argument("model")
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    le.add_argument("--limit", type=int, default=None)
    le.add_argument("--json", default=None)
    le.set_defaults(func=cmd_lm_eval)

    d = sub.add_parser("doctor", help="pre-flight correctness checks on the real model and data")
    d.add_argument("config")
    d.add_argument("overrides", nargs="*")
    d.add_argument("--json", default=None)
    d.set_defaults(func=cmd_doctor)
