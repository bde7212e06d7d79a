"""``leansft chat`` and ``leansft generate``: the model answers as it was trained, with the system prompt the run
trained with (``recipe/system_prompt.py``), tool definitions and the template's options; chat's commands; batch
answers from a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from leansft.core.data.sources import read_rows
from leansft.core.data.vision.family import trains_images
from leansft.core.data.vision.processing import ImageProcessing
from leansft.core.errors import LeanSFTError
from leansft.core.inference.generation import ChatSettings, generate
from leansft.core.inference.images import image_prompt, user_message
from leansft.recipe.system_prompt import trained_system_prompt


def sampling(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed}


def _text_or_file(value: str) -> str:
    """``TEXT``, or ``@FILE``: the file's text (a system prompt too long, or too many lines, for a flag)."""
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text(encoding="utf-8").strip()
        except OSError as err:
            raise LeanSFTError(f"cannot read {value[1:]}: {err.strerror}", field="--system") from None
    return value


def settings_of(args, source, announce) -> tuple:
    """(model, tokenizer, template, ChatSettings): what ``generate`` and ``chat`` render each prompt with. The
    system prompt: ``--system`` (``''``: none of ours, the template's own default where it has one), else the one
    the run trained with where one dominated its data (said once through ``announce``), else the template's."""
    tools = None
    if args.tools:
        try:
            tools = json.loads(Path(args.tools).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise LeanSFTError(f"cannot read tool definitions: {err}", file=args.tools) from None
        tools = tools.get("tools", tools) if isinstance(tools, dict) else tools
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise LeanSFTError("tool definitions must be a JSON list of objects (OpenAI's function format)",
                               file=args.tools)
    options = {}
    for item in args.chat_template_kwargs or []:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise LeanSFTError(f"--chat-template-kwargs takes key=value, got {item!r}", field="--chat-template-kwargs")
        options[key.strip()] = yaml.safe_load(raw)
    system = _text_or_file(args.system) if args.system is not None else None
    if system is None:
        trained = trained_system_prompt(args.model)
        if trained is not None:
            system = trained[0]
            announce(f"system prompt: the one {trained[1]:.0%} of the training conversations opened with "
                     f"({_short(system)}); --system TEXT for another, --system '' for the template's own")
    model, tok, template, _ = source(args)
    return model, tok, template, ChatSettings(system or None, tools, options)


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def _prompt_rows(path: str) -> list[dict]:
    """``generate --from``: JSON lines of ``{"messages": [...]}`` (answered after their last user turn: a trailing
    assistant turn, the reference answer, is left out) or ``{"prompt": "..."}``."""
    rows = []
    for number, row in read_rows(path):
        if isinstance(row.get("messages"), list) and row["messages"]:
            messages = list(row["messages"])
            while messages and messages[-1].get("role") == "assistant":
                messages.pop()
            prompt = messages
        elif isinstance(row.get("prompt"), str):
            prompt = row["prompt"]
        else:
            raise LeanSFTError('each row needs "messages" (a list) or "prompt" (a string)', file=path, row=number)
        if not prompt:
            raise LeanSFTError("no message to answer", file=path, row=number, field="messages")
        rows.append({"row": row, "prompt": prompt})
    return rows


def generate_answers(args, source) -> int:
    """``leansft generate``: each ``--prompt`` (several: labelled), or each row of ``--from`` (to ``--out``)."""
    if not args.prompt and not args.source_file:
        raise LeanSFTError("nothing to answer: give --prompt TEXT (repeatable) or --from FILE.jsonl")
    if args.out and not args.source_file:
        raise LeanSFTError("--out writes the answers of --from FILE.jsonl", field="--out")
    rows = _prompt_rows(args.source_file) if args.source_file else [{"prompt": p} for p in args.prompt]
    model, tok, template, settings = settings_of(args, source, lambda line: print(line, file=sys.stderr))
    if args.image:
        return _answer_about_images(args, model, tok, template, settings)
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115 (closed below)
    try:
        for i, item in enumerate(rows, 1):
            if args.show_prompt:
                print(settings.render(tok, template, item["prompt"]), file=sys.stderr)
            (answer,) = generate(model, tok, template, [item["prompt"]], settings=settings,
                                 **sampling(args))
            if out is not None:
                out.write(json.dumps({**item["row"], "answer": answer}, ensure_ascii=False) + "\n")
            elif len(rows) > 1:  # each answer under the prompt it answers
                asked = item["prompt"] if isinstance(item["prompt"], str) else item["prompt"][-1].get("content", "")
                print(f"[{i}] {_short(str(asked))}\n{answer}\n")
            else:
                print(answer)
    finally:
        if out is not None:
            out.close()
    if out is not None:
        print(f"wrote {len(rows)} answers to {args.out}")
    return 0


def _answer_about_images(args, model, tok, template, settings) -> int:
    """``generate MODEL --image PATH [--image PATH] --prompt TEXT``: a vision model answers about the pictures."""
    if args.source_file or not args.prompt or len(args.prompt) != 1:
        raise LeanSFTError("--image takes one --prompt (the question about the pictures)", field="--image")
    ask = _image_asker(args, model, tok, template, settings)
    print(ask([user_message(args.prompt[0], len(args.image))], list(args.image)))
    return 0


def _image_asker(args, model, tok, template, settings):
    """``ask(messages, images)``: the model's answer to a conversation whose image parts are ``images``."""
    if not trains_images(model.config):
        raise LeanSFTError(f"images need a vision-language model leansft supports (docs/vision.md); {args.model} is "
                           "not one", field="--image")
    processing = ImageProcessing(_processor_folder(args.model))

    def ask(messages: list[dict], images: list[str]) -> str:
        ids, inputs = image_prompt(model, tok, template, settings, messages, images, processing)
        return generate(model, tok, template, [ids], inputs=[inputs], **sampling(args))[0]

    return ask


def _processor_folder(spec: str) -> str:
    """The folder holding the image processor: a model folder (final/ has one), or a run's base model."""
    from leansft.recipe.export_run import checkpoint_config, checkpoint_of

    if (Path(spec) / "preprocessor_config.json").is_file():
        return spec
    checkpoint = checkpoint_of(spec)
    if checkpoint is not None:
        return checkpoint_config(checkpoint).model
    raise LeanSFTError("no preprocessor_config.json (the image processor) here", file=spec, field="--image")


CHAT_HELP = """commands:
  /system TEXT   a new system prompt (the conversation so far is kept); /system alone shows it, /system none
                 removes it
  /image PATH    a picture for your next message (a vision-language model; repeatable)
  /reset         start the conversation again (the system prompt stays)
  /help          this list
  /quit          leave (also: Ctrl-D, or an empty line)
  //text         send a message that starts with /"""


def chat(args, source) -> int:
    """``leansft chat``: a conversation at the terminal, with the commands of ``CHAT_HELP``."""
    model, tok, template, settings = settings_of(args, source, print)
    history: list[dict] = []
    images: list[str] = []  # the conversation's pictures, in order
    pending: list[str] = []  # those for the next message
    ask = None
    print("leansft chat: /help for commands; an empty line, /quit or Ctrl-D leaves")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line or line in ("/quit", "/exit"):
            break
        if line.startswith("/") and not line.startswith("//"):
            command, _, rest = line.partition(" ")
            if command == "/help":
                print(CHAT_HELP)
            elif command == "/reset":
                history, images, pending = [], [], []
                print("(conversation reset)")
            elif command == "/image" and rest.strip():
                ask = ask or _image_asker(args, model, tok, template, settings)
                if not Path(rest.strip()).is_file():
                    print(f"no such file: {rest.strip()}")
                    continue
                pending.append(rest.strip())
                print(f"(picture {len(images) + len(pending)} goes with your next message)")
            elif command == "/system" and not rest.strip():
                print(f"system prompt: {settings.system!r}" if settings.system is not None
                      else "no system prompt (the template's default, if it has one)")
            elif command == "/system":
                settings.system = None if rest.strip() == "none" else _text_or_file(rest.strip())
                print("(system prompt removed)" if settings.system is None else "(system prompt set)")
            else:
                print(f"unknown command {command}: /help lists them (//text sends a message starting with /)")
            continue
        text = line[1:] if line.startswith("//") else line
        history.append(user_message(text, len(pending)) if pending else {"role": "user", "content": text})
        images, pending = images + pending, []
        if args.show_prompt:
            print(settings.render(tok, template, history))
        if images:
            answer = ask(history, images)
        else:
            (answer,) = generate(model, tok, template, [history], settings=settings, **sampling(args))
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}")
    return 0
