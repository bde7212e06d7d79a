"""The loss-mask contract held against ~100 real chat templates (``zoo.py``): for every template and kind of
conversation, leansft's loss is exactly the reference (the tokens between the inference prompt and the first
stop token, per trained turn, from the template and tokenizer alone) or the example is refused with a
reason. Zero silent mismatches. Skipped where the registries cannot be reached for the templates."""

from __future__ import annotations

import copy

import pytest
import zoo


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    try:
        return zoo.zoo_templates()
    except Exception as err:  # no registry: the zoo cannot be fetched
        pytest.skip(f"template zoo not available: {type(err).__name__}: {err}")


@pytest.fixture(scope="module")
def verdicts(templates) -> dict[str, dict[str, tuple[str, str]]]:
    return {name: {kind: zoo.verdict(name, src, kind) for kind in zoo.KINDS} for name, src in templates.items()}


def test_every_template_is_paired(templates):
    assert len(templates) >= 100
    for name in templates:
        zoo.pairing(name)  # raises KeyError for a template without tokenizer and stop tokens


@pytest.mark.slow  # every template x every conversation kind: ~45 s on a 2-core machine
def test_every_case_is_exact_or_refused(verdicts):
    wrong = [f"{name} / {kind}: {detail}" for name, kinds in verdicts.items()
             for kind, (v, detail) in kinds.items() if v not in ("exact", "expanded", "refused")]
    assert not wrong, "silently wrong loss masks:\n" + "\n".join(wrong)
    assert all(detail for kinds in verdicts.values() for v, detail in kinds.values() if v == "refused")
    exact = sum(v != "refused" for kinds in verdicts.values() for v, _ in kinds.values())
    assert exact > len(verdicts) * len(zoo.KINDS) // 2  # most cases train; the rest are refused with a reason


def test_the_reference_sees_what_the_old_special_cases_missed(templates):
    """The reference itself: Llama-3.1 trains its header-free answer up to <|eot_id|> and nothing after; gpt-oss
    trains the channel header the model generates; an answer's leading spaces are trained."""
    cases = [("meta-llama-Llama-3.1-8B-Instruct", "single", "Paris.<|eot_id|>"),
             ("openai-gpt-oss-120b", "single", "<|channel|>final<|message|>Paris.<|return|>"),
             ("Qwen-Qwen2.5-7B-Instruct", "leading spaces", "  A sentence with leading spaces.<|im_end|>")]
    for name, kind, answer in cases:
        tok, _ = zoo._prepared(name, templates[name])
        case = zoo.KINDS[kind]
        ((_, tokens),) = zoo.reference(tok, case["messages"], case.get("tools"), zoo.pairing(name)[2])
        assert tok.decode(tokens) == answer
        assert zoo.verdict(name, templates[name], kind)[0] == "exact"


@pytest.mark.slow  # every template x every conversation kind: ~45 s on a 2-core machine
def test_readme_template_table_is_current(verdicts):
    text = zoo.README.read_text()
    block = text[text.index(zoo.START) + len(zoo.START): text.index(zoo.END)].strip()
    assert block == zoo.table(verdicts), "docs/templates.md template table is stale: run `python tests/zoo.py`"


def test_every_template_renders_as_transformers_renders_it(templates):
    """leansft renders with its own copy of the compiled template (dict keys looked up without an exception):
    every template of the zoo, every conversation kind and each of its prefixes, with and without the generation
    prompt, gives apply_chat_template's text (or fails as it does)."""
    from transformers.utils.chat_template_utils import _plain_template_data

    from leansft.core.data.formats import Conversation

    def outcome(render):
        try:
            return render()
        except Exception as err:  # noqa: BLE001 - the template refusing a conversation is an outcome too
            return type(err).__name__

    differ = []
    for name, src in templates.items():
        tok, encoder = zoo._prepared(name, src)
        for kind, case in zoo.KINDS.items():
            chat = encoder._for_template(Conversation(messages=copy.deepcopy(case["messages"]), row=1))
            tools = case.get("tools")
            for n in range(1, len(chat) + 1):
                for gen in (False, True):
                    want = outcome(lambda: tok.apply_chat_template(chat[:n], tools=tools, tokenize=False,
                                                                   add_generation_prompt=gen))
                    got = outcome(lambda: encoder._jinja(chat[:n], _plain_template_data(tools) if tools else None,
                                                         gen))
                    if got != want:
                        differ.append(f"{name} / {kind} / {n} messages / generation prompt {gen}")
    assert not differ, differ[:10]


@pytest.mark.slow  # every template of the zoo
def test_special_tokens_in_answers_over_the_zoo(templates):
    """Every real template with its paired tokenizer: a stop token written inside an answer is refused (warn, the
    default); with ``special_tokens_in_content: escape`` the same answer trains its words as plain text (no stop
    token added), and a conversation without such text gets the same tokens as without escape."""
    from leansft.core.data.formats import Conversation
    from leansft.core.data.content_tokens import ContentTokens
    from leansft.core.data.masking import IGNORE_INDEX
    from leansft.core.errors import TemplateError

    def chat(answer: str) -> Conversation:
        return Conversation(messages=[{"role": "user", "content": "Q?"}, {"role": "assistant", "content": answer}],
                            row=1)

    plain_backends: dict = {}  # one plain-text tokenizer per tokenizer and guarded set (rebuilding one takes ~1 s)
    checked = 0
    for name, src in templates.items():
        tok, warned = zoo._prepared(name, src)
        stop = zoo.pairing(name)[2][0]
        try:
            base = warned.encode([chat("Say it now.")])[0]
        except TemplateError:  # refused for its own reasons (the zoo's verdicts)
            continue
        with pytest.raises(TemplateError, match="stop token"):
            warned.encode([chat(f"Say {stop} now.")])
        # the same encoder with the escape policy (a new encoder per template cost 0.3 s each)
        content = ContentTokens(tok, warned._backend, warned._stop_list, warned._written_tokens(), "escape")
        key = (zoo.pairing(name)[0], frozenset(t.content for t in tok.added_tokens_decoder.values()
                                               if not t.special and t.content in content.tokens))
        content._plain = plain_backends[key] if key in plain_backends else plain_backends.setdefault(key, content.plain())
        warned._content, kept = content, warned._content
        try:
            assert [ids.tolist() for ids, _ in warned.encode([chat("Say it now.")])[0]] == [ids.tolist() for ids, _ in base]
            (ids, labels), *_ = warned.encode([chat(f"Say {stop} now.")])[0]
        except TemplateError as err:
            assert "special_tokens_in_content" in str(err), (name, err)  # refused by name, never wrong
            continue
        finally:
            warned._content = kept
        stop_id = tok.convert_tokens_to_ids(stop)
        assert f"Say {stop} now." in tok.decode(ids[labels != IGNORE_INDEX]), name  # the words, trained
        assert (ids == stop_id).sum() == (base[0][0] == stop_id).sum(), name  # as text: no stop token added
        checked += 1
    assert checked >= len(templates) // 2
