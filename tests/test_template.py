"""The assistant-only loss mask, on real tokenizers with their real templates."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import CHAT, build_tiny_bpe, trl_template

from leansft.core.data.formats import Conversation
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, resolve_template
from leansft.core.errors import TemplateError

# (fixture, template, end-of-turn text, whether content is trimmed by the template)
CASES = [
    ("qwen25_path", None, "<|im_end|>"),
    ("qwen3_path", trl_template("qwen3_training"), "<|im_end|>"),
    ("llama3_path", "llama3", "<|eot_id|>"),
    ("mistral_path", "mistral", "</s>"),
    ("tiny_bpe_path", None, "<|im_end|>"),
]


def spans(labels: np.ndarray) -> list[tuple[int, int]]:
    on = np.r_[False, labels != IGNORE_INDEX, False].astype(np.int8)
    d = np.diff(on)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def encode(tok, template, messages, loss_on="assistant", multi_turn="auto"):
    enc = ChatEncoder(tok, resolve_template(tok, template), loss_on, multi_turn=multi_turn)
    ((ids, labels),), = enc.encode([Conversation(messages=messages, row=1)])
    return ids, labels


@pytest.mark.parametrize("fixture,template,eot", CASES)
def test_assistant_spans_are_content_plus_end_of_turn(request, load_tok, fixture, template, eot):
    tok = load_tok(request.getfixturevalue(fixture))
    ids, labels = encode(tok, template, CHAT)
    assert np.array_equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
    decoded = [tok.decode(ids[a:b]) for a, b in spans(labels)]
    expected = [m["content"] + eot for m in CHAT if m["role"] == "assistant"]
    assert [d.strip() for d in decoded] == expected
    # system and user text never carries loss
    masked_text = tok.decode(ids[labels == IGNORE_INDEX])
    for m in CHAT:
        if m["role"] != "assistant":
            assert m["content"] in masked_text


@pytest.mark.parametrize(
    "fixture,plain,marked",
    [("qwen25_path", trl_template("qwen2_5"), trl_template("qwen2_5_training")),
     ("llama3_path", trl_template("llama3"), trl_template("llama3_training")),
     ("qwen3_path", "chatml", trl_template("qwen2_5_training"))],
)
def test_marked_and_unmarked_templates_give_the_same_mask(request, load_tok, fixture, plain, marked):
    tok = load_tok(request.getfixturevalue(fixture))
    assert resolve_template(tok, marked).has_generation_markers
    assert not resolve_template(tok, plain).has_generation_markers
    for messages in (CHAT, CHAT[1:3]):
        ids_a, lab_a = encode(tok, plain, messages)
        ids_b, lab_b = encode(tok, marked, messages)
        if np.array_equal(ids_a, ids_b):
            assert np.array_equal(lab_a, lab_b)
        else:  # templates differ in scaffolding (e.g. default system prompt): compare the target tokens
            assert np.array_equal(ids_a[lab_a != IGNORE_INDEX], ids_b[lab_b != IGNORE_INDEX])


def test_last_assistant_and_all_modes(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    ids, labels = encode(tok, None, CHAT, "last_assistant")
    assert [tok.decode(ids[a:b]) for a, b in spans(labels)] == ["Two plus two equals four.<|im_end|>"]
    ids, labels = encode(tok, None, CHAT, "all")
    assert np.array_equal(ids, labels)


def test_pad_equal_to_eos_does_not_mask_end_of_turn(load_tok, tiny_bpe_path):
    tok = load_tok(tiny_bpe_path)
    assert tok.pad_token_id == tok.eos_token_id
    ids, labels = encode(tok, None, CHAT[1:3])
    assert labels[labels != IGNORE_INDEX][-1] == tok.eos_token_id


def test_template_that_rewrites_earlier_turns_is_refused_when_asked(load_tok, qwen3_path):
    tok = load_tok(qwen3_path)  # Qwen3's own template drops <think> blocks of earlier turns
    encode(tok, None, CHAT[1:3])  # one turn is fine
    with pytest.raises(TemplateError) as err:
        encode(tok, None, CHAT, multi_turn="single")  # the default, auto, trains it one turn at a time
    msg = str(err.value)
    assert "prefix" in msg and "turn 1" in msg and "training template" in msg and "row 1" in msg


def test_qwen3_empty_think_scaffold_is_not_trained(load_tok, qwen3_path):
    tok = load_tok(qwen3_path)
    ids, labels = encode(tok, None, CHAT[1:3])
    assert [tok.decode(ids[a:b]) for a, b in spans(labels)] == ["Paris is the capital.<|im_end|>"]
    for answer in ("think", "\n\nOk", "/"):  # text that also occurs inside the empty <think></think> scaffold
        ids, labels = encode(tok, None, [CHAT[1], {"role": "assistant", "content": answer}])
        assert [tok.decode(ids[a:b]) for a, b in spans(labels)] == [answer.strip() + "<|im_end|>"]
    reasoning = [CHAT[1], {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital."}]
    ids, labels = encode(tok, None, reasoning)
    assert "France's capital." in tok.decode(ids[labels != IGNORE_INDEX])


def test_tokenizer_without_template_needs_an_explicit_choice(tmp_path, load_tok):
    tok = load_tok(build_tiny_bpe(tmp_path / "t", chat_template=""))
    with pytest.raises(TemplateError, match="no chat template"):
        resolve_template(tok, None)
    ids, labels = encode(tok, "chatml", CHAT[1:3])
    assert (labels != IGNORE_INDEX).any()
    with pytest.raises(TemplateError, match="unknown template"):
        resolve_template(tok, "vicuna")


def test_template_without_assistant_turns_marked(load_tok, tiny_bpe_path):
    tok = load_tok(tiny_bpe_path)
    broken = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    with pytest.raises(TemplateError, match="generation prompt"):
        encode(tok, broken, CHAT[1:3])


def test_batch_encoding_matches_apply_chat_template(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    convs = [Conversation(messages=CHAT[: k + 1], row=k) for k in (2, 4)]
    enc = ChatEncoder(tok, resolve_template(tok, None))
    for conv, ((ids, _),) in zip(convs, enc.encode(convs)):
        ref = tok.apply_chat_template(conv.messages, tokenize=True, return_dict=False)
        assert ids.tolist() == list(ref)


def test_plain_text_trains_on_every_token_and_ends_with_eos(load_tok, qwen25_path):
    tok = load_tok(qwen25_path)
    enc = ChatEncoder(tok, resolve_template(tok, None))
    ((ids, labels),), = enc.encode([Conversation(text="Just some text.")])
    assert np.array_equal(ids, labels) and ids[-1] == tok.eos_token_id


def test_template_that_closes_the_conversation_with_eos(load_tok, tiny_bpe_path):
    """Phi-3 style: a finished conversation gets a trailing eos that a longer one does not have there."""
    from leansft.core.data.builtin_templates import CHATML

    tok = load_tok(tiny_bpe_path)
    phi_like = CHATML + "{% if not add_generation_prompt %}{{ '<|endoftext|>' }}{% endif %}"
    ids, labels = encode(tok, phi_like, CHAT[1:])
    got = [tok.decode(ids[a:b]) for a, b in spans(labels)]
    assert got[0] == "Paris is the capital.<|im_end|>"  # not the next turn's <|im_start|>
    assert got[1].startswith("Two plus two equals four.<|im_end|>") and got[1].endswith("<|endoftext|>")
    for a, b in spans(labels):
        assert tok.convert_tokens_to_ids("<|im_start|>") not in ids[a:b].tolist()
