"""A vision model's training data: rows with images -> conversations -> ids and labels (image tokens expanded)
and, beside them, each example's images (references and patch grids), read again when a batch is made.

Every image is opened and decoded whole here, so a bad one fails (or is skipped and counted under
``data.on_bad_row: skip``) before the model is loaded. The examples live in memory (vision data sets are
thousands of conversations, their weight is in the images); the text-only path's cache is not used yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leansft.core.config import DataConfig, SourceConfig
from leansft.core.data.clean import content_hash
from leansft.core.data.dataset import PrepReport, TokenizedDataset
from leansft.core.data.formats import Conversation, convert_row, detect_format, map_columns
from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, ChatTemplate
from leansft.core.data.sources import parse_row, read_raw_rows
from leansft.core.data.vision.encode import TextExpandingEncoder, VisionEncoder
from leansft.core.data.vision.family import VisionFamily
from leansft.core.data.vision.images import open_image
from leansft.core.data.vision.processing import ImageProcessing, Pixels
from leansft.core.data.vision.processor_check import ProcessorCheck
from leansft.core.errors import ConfigError, DataError, LeanSFTError, ModelError, TemplateError

log = logging.getLogger("leansft")


@dataclass
class ImageTable:
    """Per stored example: its images' references, the folder they are relative to, and their patch grids."""

    refs: list[list[str]]
    base: list[Path]
    grids: list[np.ndarray]  # [images, 3] each
    processing: ImageProcessing
    lengths: np.ndarray  # each example's tokens
    tokens: list[np.ndarray]  # each example's images' token counts

    def summary(self, examples: np.ndarray) -> dict:
        """Images, their tokens and sizes over ``examples`` (stored indices): what ``leansft plan`` prints."""
        tokens = np.concatenate([self.tokens[e] for e in examples] or [np.zeros(0, np.int64)])
        grids = [self.grids[e] for e in examples if len(self.grids[e])]
        grid = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
        patch = int(getattr(self.processing.processor, "patch_size", 1) or 1)
        total = int(sum(self.lengths[e] for e in examples))
        low, high = self.processing.limits
        pixels = int((grid[:, 1] * grid[:, 2]).max() * patch * patch) if grid.any() else None
        return {"images": len(tokens), "examples_with_images": len(grids), "image_tokens": int(tokens.sum()),
                "image_token_share": float(tokens.sum() / total) if total else 0.0,
                "tokens_per_image_mean": float(tokens.mean()) if len(tokens) else 0.0,
                "tokens_per_image_max": int(tokens.max()) if len(tokens) else 0,
                "pixels_per_image_max": pixels, "min_pixels": low, "max_pixels": high}

    def pixels(self, examples: np.ndarray) -> Pixels | None:
        """The vision tower's input for the images of ``examples`` (stored indices), in order; None without any."""
        images = [open_image(r, self.base[e], file=str(self.base[e]), row=None) for e in examples for r in self.refs[e]]
        if not images:
            return None
        pixels = self.processing(images)
        expected = np.concatenate([self.grids[e] for e in examples if len(self.grids[e])])
        if not np.array_equal(pixels.grid, expected):  # a file changed since the data was prepared
            raise DataError("an image changed since the data was prepared (its patch grid differs)",
                            file=str(self.base[examples[0]]))
        return pixels


def _hash(conv, images: list[str]) -> int:
    """``content_hash`` of the conversation (as the text path dedupes) with its images' files: the same text about
    another image is another example."""
    key = json.dumps([content_hash(conv), images], ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def prepare_vision(cfg: DataConfig, encoder: VisionEncoder, processing: ImageProcessing,
                   sources: list[SourceConfig] | None = None) -> tuple[TokenizedDataset, PrepReport]:
    """Every source's rows as examples with their images; ``data.clean`` (dedupe, lengths) as for text, but an
    example over ``data.max_length`` is dropped, never cut (a cut could fall inside an image's tokens)."""
    sources = cfg.sources if sources is None else sources
    if cfg.clean.pii_scrub:
        raise ConfigError("data.clean.pii_scrub is not supported with images yet", field="data.clean.pii_scrub")
    if any(s.weight != 1 for s in sources) or cfg.mix.mode != "concat":
        raise ConfigError("source weights and data.mix are not supported with images yet", field="data.sources")
    report = PrepReport()
    check = ProcessorCheck(processing, encoder, encoder.text.template)  # the first rows, as the model reads
    ids, labels, refs, bases, grids, counts, rows, hashes, parts = [], [], [], [], [], [], [], [], []
    seen: set[int] = set()
    for part, src in enumerate(sources):
        meta = {"path": src.path, "rows_read": 0, "bad_rows": 0, "bad_row_examples": [], "images": 0}
        base = Path(src.path).parent
        fmt = src.format
        for number, raw in read_raw_rows(src.path, src.split):
            meta["rows_read"] += 1
            try:
                row = parse_row(raw, src.path, number)
                row = map_columns(row, src.columns, src.path, number) if src.columns else row
                if fmt == "auto":
                    fmt = detect_format(row, src.path, number)
                conv = convert_row(row, fmt, src.path, number, images=True)
                if cfg.clean.drop_no_assistant and not conv.has_assistant:
                    continue
                opened = [open_image(r, base, file=src.path, row=number) for r in conv.images]
                pixels = processing(opened) if opened else None
                grid = pixels.grid if pixels is not None else np.zeros((0, 3), np.int64)
                examples = encoder.encode(conv, grid, src.path)
                check(conv, opened, examples, src.path)
            except LeanSFTError as err:
                if cfg.on_bad_row == "error" or not isinstance(err, DataError):
                    raise
                meta["bad_rows"] += 1
                meta["bad_row_examples"] = (meta["bad_row_examples"] + [str(err)])[:5]
                continue
            h = _hash(conv, [str(base / r) for r in conv.images])  # the files, wherever the data file is
            if cfg.clean.dedupe and h in seen:
                report.duplicates_removed += len(examples)
                continue
            seen.add(h)
            meta["images"] += len(conv.images)
            for ex in examples:
                n = len(ex.ids)
                if n < cfg.clean.min_tokens or (cfg.clean.max_tokens is not None and n > cfg.clean.max_tokens):
                    report.too_short += n < cfg.clean.min_tokens
                    report.too_long += n >= cfg.clean.min_tokens
                    continue
                if n > cfg.max_length:
                    report.dropped_over_length += 1
                    continue
                if not (ex.labels[1:] != IGNORE_INDEX).any():
                    report.no_target_tokens += 1
                    continue
                ids.append(ex.ids)
                labels.append(ex.labels)
                refs.append(conv.images[: ex.images])
                bases.append(base)
                grids.append(grid[: ex.images])
                counts.append(encoder.family.tokens_per_image(grid[: ex.images], encoder.config))
                rows.append(number)
                hashes.append(h)
                parts.append(part)
        if meta["bad_rows"]:
            log.warning("%s: %d bad rows skipped (data.on_bad_row: skip), e.g. %s", src.path, meta["bad_rows"],
                        meta["bad_row_examples"][0])
        report.sources.append({**meta, "format": fmt, "weight": 1.0, "examples": sum(p == part for p in parts)})
    if report.dropped_over_length:
        log.warning("%d examples with images longer than data.max_length %d dropped (an image's tokens are never cut):"
                    " raise data.max_length or lower vision.max_pixels", report.dropped_over_length, cfg.max_length)
    if not ids:
        raise DataError(f"no examples left: {sum(s['rows_read'] for s in report.sources)} rows read, "
                        f"{report.dropped_over_length} longer than data.max_length {cfg.max_length}, "
                        f"{report.duplicates_removed} duplicates, {sum(s['bad_rows'] for s in report.sources)} bad",
                        field="data.sources")
    report.examples = len(ids)
    if check.checked:
        log.info("vision: the ids of the first %d conversations equal %s's", check.checked,
                 type(check.processor).__name__)
    table = ImageTable(refs, bases, grids, processing, np.array([len(i) for i in ids]), counts)
    return _dataset(ids, labels, rows, hashes, table), report


def _dataset(ids: list[np.ndarray], labels: list[np.ndarray], rows: list[int], hashes: list[int],
             images: ImageTable) -> TokenizedDataset:
    lengths = np.array([len(i) for i in ids], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    data = TokenizedDataset.from_arrays(np.concatenate(ids), np.concatenate(labels), offsets, np.asarray(rows))
    data.store.hashes = np.asarray(hashes, np.int64)
    data.store.images = images
    return data


def vision_encoder(tokenizer, template: ChatTemplate, family: VisionFamily, config, cfg: DataConfig) -> VisionEncoder:
    """The encoder of a vision model's conversations, after checking that tokenizer and model agree on the image
    tokens."""
    options = (cfg.loss_on, cfg.reasoning, cfg.multi_turn, cfg.special_tokens_in_content)
    placeholder = tokenizer.convert_tokens_to_ids(family.image_token)
    if placeholder is None or placeholder == tokenizer.unk_token_id:
        raise ConfigError(f"the tokenizer has no {family.image_token} token ({family.name}'s image placeholder)",
                          field="tokenizer")
    image_id = int(config.image_token_id)
    expected = image_id if family.expand == "repeat" else int(config.boi_token_index)
    if placeholder != expected:
        raise ConfigError(f"the tokenizer's {family.image_token} is id {placeholder}, the model's is {expected}: "
                          "tokenizer and model disagree", field="tokenizer")
    if family.expand == "text":
        text = TextExpandingEncoder(tokenizer, template, family.image_token, family.image_text(tokenizer, config),
                                    *options)
    else:
        text = ChatEncoder(tokenizer, template, *options)
    if family.template is not None and template.name != family.template:
        _check_answers_stop(text, family)
    return VisionEncoder(text, family, int(placeholder), image_id, config)


def _check_answers_stop(text: ChatEncoder, family: VisionFamily) -> None:
    """A family whose shipped template renders prompts for inference only (LLaVA-1.5's ends no answer with a stop
    token): refused before any row is read, naming the built-in template that trains it."""
    probe = Conversation(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    try:
        text.encode([probe])
    except TemplateError as err:
        raise TemplateError(f"{err.message} ({family.name}'s chat template renders prompts for inference: it ends no "
                            "answer with a stop token)", field="data.template",
                            hint=f"set data.template: {family.template} (the same prompts, the end-of-sequence token "
                                 "after each answer, as the model was trained)") from None


_IMAGE_MARKS = ('"image', "<image>", "'image")  # an images column, image parts, image_url, placeholders


def sources_have_images(sources: list[SourceConfig]) -> bool:
    """Whether any row of ``sources`` may hold an image (its text names one): a vision model's text-only data keeps
    the text path (the token cache, mixtures, packing); a false alarm only takes the image path for text rows."""
    for src in sources:
        for _, raw in read_raw_rows(src.path, src.split):
            text = raw if isinstance(raw, str) else json.dumps(raw, default=str)
            if any(mark in text for mark in _IMAGE_MARKS):
                return True
    return False


def vision_model_config(spec: str, trust_remote_code: bool = False):
    """The model config at ``spec`` where it is a local folder of a vision-language model (a ``vision_config``),
    whatever its family; else None."""
    from transformers import AutoConfig

    if not (Path(spec) / "config.json").is_file() or "vision_config" not in (Path(spec) / "config.json").read_text():
        return None
    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise ModelError(f"cannot load model config: {type(err).__name__}: {str(err)[:300]}", file=spec) from None


def vision_config_of(spec: str, trust_remote_code: bool = False):
    """The model config at ``spec`` where it is a local model folder of a vision model leansft trains with images
    (``trains_images``), else None: the text path."""
    from leansft.core.data.vision.family import trains_images

    config = vision_model_config(spec, trust_remote_code)
    return config if config is not None and trains_images(config) else None
