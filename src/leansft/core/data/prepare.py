"""The one way data is prepared, for train, doctor, plan, show-mask and eval alike.

tokenizer spec -> tokenizer -> chat template -> tokenised, masked, cleaned dataset (cached; rank 0
first under torchrun so the cache is built once) -> optional held-out split or eval file. A vision model's folder
(a supported family) takes data with images through ``core/data/vision/prepare.py``; its text-only data, and every
other model's, take the text path.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np

from leansft.core import distributed
from leansft.core.config import DataConfig, SourceConfig, VisionConfig
from leansft.core.data.dataset import PrepReport, TokenizedDataset, build_dataset
from leansft.core.data.masking import ChatTemplate, resolve_template
from leansft.core.data.stream import Stream
from leansft.core.data.tokenizer import load_tokenizer
from leansft.core.data.formats import TEXT_ONLY
from leansft.core.data.vision.family import SUPPORTED, trains_images, vision_family
from leansft.core.data.vision.prepare import prepare_vision, sources_have_images, vision_encoder, vision_model_config
from leansft.core.data.vision.processing import ImageProcessing
from leansft.core.errors import ConfigError, DataError
from leansft.core.paths import cache_dir

log = logging.getLogger("leansft")


@dataclass
class PreparedData:
    tokenizer: object
    template: ChatTemplate
    train: TokenizedDataset
    eval: TokenizedDataset | None
    report: PrepReport
    images: ImageProcessing | None = None  # a vision model's image processor (exported beside the tokenizer)
    stream: Stream | None = None  # streaming sources: ``train`` is then the stream's first window

    def fingerprint(self) -> str:
        """What a checkpoint's data position points into (``TokenizedDataset.fingerprint``, or the stream's)."""
        return self.stream.fingerprint() if self.stream is not None else self.train.fingerprint()

    def close(self) -> None:
        """Stop a stream's worker processes."""
        if self.stream is not None:
            self.stream.close()

    def summary(self) -> str:
        """One line for the run's log: examples trained and held out, and what cleaning removed or cut."""
        r = self.report
        if self.stream is not None:
            return (f"streaming {len(self.stream.sources)} source(s) in windows of {self.stream.cfg.stream.window:,} "
                    f"examples; the first window: {len(self.train):,} examples"
                    + (f", {len(self.eval):,} held out" if self.eval is not None else ""))
        parts = [f"{len(self.train):,} training examples"
                 + (f", {len(self.eval):,} held out" if self.eval is not None else "")]
        for count, what in ((r.duplicates_removed, "duplicates removed"),
                            (r.too_short + r.too_long, "outside clean.min_tokens/max_tokens removed"),
                            (r.dropped_over_length, "longer than max_length dropped"),
                            (r.truncated, "cut at max_length"), (r.no_target_tokens, "without target tokens removed")):
            if count:
                parts.append(f"{count:,} {what}")
        return "; ".join(parts)

    def longest(self, max_length: int) -> int:
        """The most tokens one forward sees of an example (training or held out): longer ones run cut or split."""
        return max((min(int(d.lengths.max()), max_length) for d in (self.train, self.eval) if d is not None and len(d)),
                   default=0)

    def lost_target_share(self) -> float:
        """The share of the training examples' target tokens that cutting at max_length removed."""
        whole = int(self.train.store.targets[self.train.index].sum())
        return 1 - int(self.train.target_counts.sum()) / whole if whole else 0.0


def split_eval(data: TokenizedDataset, fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """Seeded held-out split of conversations: the examples of a held-out conversation never enter training.

    A conversation is its content hash, so the copies a source weight > 1 makes, the per-turn examples of
    one conversation and (with dedupe off) the same text at another row fall on the same side; a copy is
    evaluated once. Conversations are numbered by first appearance, so without such groups the split is the
    plain seeded permutation of examples."""
    if fraction <= 0:
        return data, None
    _, first, group = np.unique(data.hashes, return_index=True, return_inverse=True)
    number = np.empty(len(first), dtype=np.int64)
    number[np.argsort(first, kind="stable")] = np.arange(len(first))
    held = np.zeros(len(first), dtype=bool)
    n_eval = max(1, round(len(first) * fraction))
    held[np.random.default_rng(seed + 17).permutation(len(first))[:n_eval]] = True
    out = held[number[group]]
    evaluated = np.flatnonzero(out)
    _, once = np.unique(data.index[evaluated], return_index=True)  # a weight's copies of one example: once
    return data.select(np.flatnonzero(~out)), data.select(np.sort(evaluated[once]))


@contextlib.contextmanager
def images_named(config):
    """A vision model of a family leansft has not checked takes the text path: a row with images is refused, naming
    the model's architecture and the families that train with images (not as if the model read text alone)."""
    try:
        yield
    except DataError as err:
        if config is None or TEXT_ONLY not in err.message:
            raise
        supported = ", ".join(sorted({f.name for f in SUPPORTED.values()}))
        named = (f"vision-language architecture '{config.model_type}' is not supported for images yet (supported: "
                 f"{supported}): its image tokens, masks and batches have not been checked")
        raise DataError(err.message.replace(TEXT_ONLY, named), file=err.file, row=err.row, field=err.field,
                        hint="train a supported model, or leave the images out to fine-tune its language model on "
                             "the text (docs/vision.md)") from None


def prepare_data(cfg: DataConfig, tokenizer_spec: str, *, seed: int = 0, truncate: bool = True,
                 holdout: bool = True, trust_remote_code: bool = False,
                 cache_storage: distributed.Storage | None = None, model_spec: str | None = None,
                 vision: VisionConfig | None = None) -> PreparedData:
    """Tokenise ``cfg.sources`` with the tokenizer's (or the configured) template, once per cache folder: by its
    first rank, the others then reading its cache (``cache_storage``: how the ranks share the cache folder, where the
    caller found out already).

    ``truncate``: cut examples at ``cfg.max_length`` (False for plans and for strategies that split
    long examples themselves). ``holdout``: set aside ``cfg.eval_file`` or an ``eval_split`` fraction.
    ``model_spec``: the model, where it is not the tokenizer's folder (a vision model's data is prepared with
    its image processor, ``vision``'s resolution limits).
    """
    tokenizer = load_tokenizer(tokenizer_spec, trust_remote_code)
    template = resolve_template(tokenizer, cfg.template)
    any_vision = vision_model_config(model_spec or tokenizer_spec, trust_remote_code)
    config = any_vision if any_vision is not None and trains_images(any_vision) else None
    read = cfg.sources + ([SourceConfig(path=cfg.eval_file)] if holdout and cfg.eval_file else [])
    streaming = any(s.streaming for s in cfg.sources)
    if config is not None and streaming:
        raise ConfigError("streaming sources for a vision model are not supported: prepare its data cached "
                          "(streaming: false)", field="data.sources[*].streaming")
    if config is not None and sources_have_images(read):
        return _prepare_vision(cfg, tokenizer, template, config, model_spec or tokenizer_spec, vision, seed, holdout)
    eval_data = None
    folder = cache_dir(cfg.cache_dir)
    cache = cache_storage or distributed.storage_of(folder)
    if streaming:
        with images_named(any_vision):
            stream = Stream(cfg, tokenizer, template, truncate)
            first = stream.first_window()
        if holdout and cfg.eval_file:
            with distributed.writers_first(cache), images_named(any_vision):
                eval_data, _ = build_dataset(cfg, tokenizer, template, seed=seed,
                                             sources=[SourceConfig(path=cfg.eval_file)])
        return PreparedData(tokenizer, template, first.data, eval_data, stream.report(first), stream=stream)
    if distributed.world_size() > 1 and distributed.rank() == 0:
        log.info("preparing the data %s", f"once for all {distributed.world_size()} ranks (the cache folder {folder} "
                 "is shared)" if cache.shared else f"once per node (the cache folder {folder}: {cache.describe()})")
    with distributed.writers_first(cache), images_named(any_vision):
        data, report = build_dataset(cfg, tokenizer, template, seed=seed, truncate=truncate)
        if holdout and cfg.eval_file:
            eval_data, _ = build_dataset(cfg, tokenizer, template, seed=seed,
                                         sources=[SourceConfig(path=cfg.eval_file)])
    if holdout and eval_data is None:
        data, eval_data = split_eval(data, cfg.eval_split, seed)
    elif eval_data is not None:
        shared = np.isin(eval_data.hashes, data.hashes)
        if shared.any() and distributed.rank() == 0:
            log.warning("%d of %d examples of eval_file %s are also in the training data (same conversation): "
                        "their held-out loss is not held out", int(shared.sum()), len(eval_data), cfg.eval_file)
    return PreparedData(tokenizer, template, data, eval_data, report)


def _prepare_vision(cfg: DataConfig, tokenizer, template: ChatTemplate, config, model_spec: str,
                    vision: VisionConfig | None, seed: int, holdout: bool) -> PreparedData:
    vision = vision or VisionConfig()
    images = ImageProcessing(model_spec, vision.min_pixels, vision.max_pixels)
    encoder = vision_encoder(tokenizer, template, vision_family(config), config, cfg)
    data, report = prepare_vision(cfg, encoder, images)
    eval_data = None
    if holdout and cfg.eval_file:
        eval_data, _ = prepare_vision(cfg, encoder, images, [SourceConfig(path=cfg.eval_file)])
    elif holdout:
        data, eval_data = split_eval(data, cfg.eval_split, seed)
    return PreparedData(tokenizer, template, data, eval_data, report, images)
