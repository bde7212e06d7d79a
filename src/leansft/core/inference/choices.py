"""Log-likelihoods of continuations (multiple-choice answers) after a context, on raw text as lm-eval's Hugging
Face backend computes them: the context's trailing spaces move to the continuation, ``context + continuation`` is
encoded whole and split at the context's length, and each continuation's log-probability is the sum over its
tokens. One forward per question serves all its choices: where every choice is one token after the context (MMLU's
" A".." D"), the context's last logits score them all; else each choice is a row of one batch. Rows are left-padded
(positions counted from each row's first token) so the head computes logits only for the positions scored."""

from __future__ import annotations

import torch

from leansft.core.inference.generation import generation_mode


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair`` for a causal model (the tokenizer's default special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    head = tokenizer.encode(context)
    return head, whole[len(head):]


@torch.no_grad()
def choice_logprobs(model, tokenizer, requests: list[tuple[str, list[str]]], *, max_length: int | None = None,
                    batch_size: int = 8) -> list[list[tuple[float, bool]]]:
    """Per request (context, continuations): each continuation's (log-likelihood, is it the greedy continuation)."""
    device = next(model.parameters()).device
    limit = max_length or getattr(model.config, "max_position_embeddings", None) or 2048
    rows: list[tuple[int, int, list[int], list[list[int]]]] = []  # (request, choice or -1 for all, ids, conts)
    for r, (context, continuations) in enumerate(requests):
        pairs = [encode_pair(tokenizer, context, c) for c in continuations]
        if all(len(cont) == 1 and head == pairs[0][0] for head, cont in pairs):
            rows.append((r, -1, pairs[0][0], [cont for _, cont in pairs]))
        else:
            rows.extend((r, c, head + cont[:-1], [cont]) for c, (head, cont) in enumerate(pairs))
    out: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(c) for _, c in requests]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][2]))
    with generation_mode(model):
        for start in range(0, len(order), batch_size):
            batch = [rows[i] for i in order[start:start + batch_size]]
            ids = [row[2][-limit:] for row in batch]
            width = max(len(x) for x in ids)
            keep = max(1 if c == -1 else len(conts[0]) for _, c, _, conts in batch)  # the scored positions, at the end
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            try:
                logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               logits_to_keep=keep).logits
            except TypeError:  # a model class without logits_to_keep: every position's logits, the last kept
                logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, -keep:]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for (r, c, _, conts), lp in zip(batch, logprobs):
                if c == -1:  # every choice one token: the context's last position scores them all
                    last = lp[-1]
                    for k, cont in enumerate(conts):
                        out[r][k] = (float(last[cont[0]]), bool(last.argmax() == cont[0]))
                else:
                    cont = conts[0]
                    span = lp[lp.shape[0] - len(cont):]
                    target = torch.tensor(cont, device=span.device)
                    out[r][c] = (float(span.gather(1, target[:, None]).sum()), bool((span.argmax(-1) == target).all()))
    return out
