"""Generation with the model's chat template: samples during training, `leansft generate`/`chat`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from leansft.core.data.masking import ChatTemplate, stop_token_ids
from leansft.core.model.attention import plain_attention
from leansft.core.model.compile import eager


@contextlib.contextmanager
def generation_mode(model):
    """Eval mode and a cache-capable attention for generation; training state restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with plain_attention(model), eager():  # token-by-token shapes: compiled layers would recompile
            yield
    finally:
        model.train(was_training)


@dataclass
class ChatSettings:
    """What the template renders besides the messages: a system prompt (put first where the messages have none),
    tool definitions, and the template's own options (``enable_thinking=False``). (Not the data's
    ``formats.Conversation``: these are the settings a chat or generation renders every prompt with.)"""

    system: str | None = None
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system is not None and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def _apply(self, tokenizer, template: ChatTemplate, prompt: str | list[dict], tokenize: bool):
        return tokenizer.apply_chat_template(template.as_parts(self.messages(prompt)), tools=self.tools,
                                             chat_template=template.source,
                                             add_generation_prompt=True, tokenize=tokenize,
                                             **({"return_dict": False} if tokenize else {}), **self.template_kwargs)

    def render(self, tokenizer, template: ChatTemplate, prompt: str | list[dict]) -> str:
        """The prompt as the model reads it, ending in the generation prompt."""
        return self._apply(tokenizer, template, prompt, tokenize=False)

    def ids(self, tokenizer, template: ChatTemplate, prompt: str | list[dict]) -> list[int]:
        return self._apply(tokenizer, template, prompt, tokenize=True)


@torch.no_grad()
def generate(model, tokenizer, template: ChatTemplate, prompts: list, *, max_new_tokens: int = 64,
             temperature: float = 0.7, top_p: float = 0.9, seed: int = 0,
             settings: ChatSettings | None = None, inputs: list[dict] | None = None) -> list[str]:
    """Answer each prompt: a user string, a message list, or already rendered prompt token ids (ending in
    the generation prompt). ``settings``: the system prompt, tools and template options of the first two.
    ``inputs``: each prompt's further model inputs (a vision model's ``vision_generation_inputs``).
    Sampling is reproducible for a seed."""
    settings = settings or ChatSettings()
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    out = []
    with generation_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i, prompt in enumerate(prompts):
            torch.manual_seed(seed + i)
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
                ids = settings.ids(tokenizer, template, prompt)
            else:
                ids = [int(t) for t in prompt]
            input_ids = torch.tensor([list(ids)], device=device)
            gen = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None, eos_token_id=stops, pad_token_id=pad,
                **({k: v.to(device) for k, v in inputs[i].items()} if inputs else {}),
            )
            new = gen[0, input_ids.shape[1]:].tolist()
            while new and new[-1] in stops:
                new.pop()
            out.append(tokenizer.decode(new, skip_special_tokens=False))
    return out


@torch.no_grad()
def generate_greedy(model, tokenizer, template: ChatTemplate, prompts: list, *, max_new_tokens: int = 64,
                    settings: ChatSettings | None = None, batch_size: int = 16, batch_tokens: int = 8192) -> list[str]:
    """Greedy answers to many prompts in batches (left-padded, the KV cache per batch): what a scored suite needs.
    Prompts are taken shortest first; a batch holds at most ``batch_size`` of them and, past its first, no more than
    ``batch_tokens`` of padded prompt (one long prompt is not padded against seven short ones). The answers come back
    in the prompts' order. A batch's padding can move a logit in its last bits, so an answer may differ from
    ``generate``'s alone where two tokens tie."""
    settings = settings or ChatSettings()
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    ids = [settings.ids(tokenizer, template, p) if isinstance(p, str) or (p and isinstance(p[0], dict))
           else [int(t) for t in p] for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches: list[list[int]] = []
    for i in order:  # ascending lengths: the newest prompt is the batch's widest
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and (len(last) + 1) * len(ids[i]) <= batch_tokens:
            last.append(i)
        else:
            batches.append([i])
    out: list[str] = [""] * len(ids)
    with generation_mode(model):
        for batch in batches:
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + list(ids[i]) for i in batch], device=device)
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in batch], device=device)
            gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, temperature=None, top_p=None, eos_token_id=stops, pad_token_id=pad)
            for row, i in enumerate(batch):
                new = gen[row, width:].tolist()
                cut = next((j for j, t in enumerate(new) if t in stops), len(new))
                out[i] = tokenizer.decode(new[:cut], skip_special_tokens=False)
    return out
