"""Builders for the training recipe: device, precision, model (+LoRA, attention), optimizer, schedule.

Each takes the config and returns one ready piece; doctor uses the same builders so it checks the
very model and forward the run will use.
"""

from __future__ import annotations

import logging
import math
import random
import time

import numpy as np
import torch

from leansft.core import cpu, distributed
from leansft.core.batching.collate import collate_packed, collate_padded
from leansft.core.config import PACKED_STRATEGIES, SPLITTING_STRATEGIES, RunConfig
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.vision.family import trains_images, vision_family
from leansft.core.errors import ConfigError, LeanSFTError
from leansft.core.model.attention import choose_backend, use_packed_attention, use_plain_attention
from leansft.core.model.bf16_base import confirm_bf16_base, holds_bf16_base, load_base_in_bf16, store_base_in_bf16
from leansft.core.model.compile import compile_layers, eager, wants_compile
from leansft.core.model.forward import hidden_states
from leansft.core.model.head import read_output_head
from leansft.core.model.loading import (
    apply_lora,
    load_model,
    load_model_config,
    resolve_model_path,
    trainable_parameters,
)
from leansft.core.model.loss import PLAIN, HeadPrecision, head_precision_for
from leansft.core.model.qlora import load_quantised
from leansft.core.model.verify import check_vocabulary, choose_strategy, probe_segments, verify_model
from leansft.core.model.vision_parts import freeze_untrained, lora_targets
from leansft.core.model.vision_verify import verify_vision
from leansft.core.paths import cache_dir
from leansft.recipe.batches import Batcher
from leansft.recipe.schedule import lr_lambda, warmup_steps

log = logging.getLogger("leansft")

PROBE_TOKENS = 256  # tokens of the first example the bf16-base check runs


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device() -> torch.device:
    return torch.device("cuda", distributed.local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def cpu_has_bf16_units() -> bool:
    """AMX or AVX512-BF16: the CPU multiplies bf16 in hardware (several times its fp32 rate)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the run: bf16 where the device multiplies bf16 in hardware (CUDA with bf16
    support; CPUs with AMX or AVX512-BF16) under ``auto``, or wherever ``bf16`` is asked for; else None (fp32).
    Weights, optimizer state, the loss and its softmax statistics stay fp32 either way."""
    if precision == "fp32":
        return None
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if precision == "bf16":
            raise LeanSFTError("precision bf16: this CUDA device has no bf16 support", field="training.precision",
                               hint="use precision: fp32 (or auto)")
        return None
    if cpu_has_bf16_units():
        return torch.bfloat16
    if precision == "bf16":
        log.warning("precision bf16 on a CPU without bf16 matrix units (AMX / AVX512-BF16): emulated, "
                    "often 10-50x slower than fp32 (precision: auto picks fp32 here)")
        return torch.bfloat16
    return None


def model_location(cfg: RunConfig, cache_storage: distributed.Storage | None = None) -> str:
    """The model folder to load (``pkg:`` and .gguf resolved; a GGUF is converted once per cache folder: by rank 0
    where the ranks share it, by each node where each has its own). ``cache_storage``: how the ranks share the cache
    folder, where the caller found out already (``distributed.storage_of``)."""
    cache = cache_dir(cfg.data.cache_dir)
    with distributed.writers_first(cache_storage or distributed.storage_of(cache)):
        return resolve_model_path(cfg.model, cache)


def frozen_base_in_bf16(cfg: RunConfig, device: torch.device) -> bool:
    """Whether a LoRA run holds its frozen decoder linear weights in bf16 (``core/model/bf16_base.py``): under bf16
    autocast, plain LoRA (no DoRA, no pissa/olora init), not sharded by FSDP."""
    t = cfg.training
    return (t.method == "lora" and t.lora.bf16_base and not t.lora.use_dora and t.lora.init in ("default", "gaussian")
            and autocast_dtype(t.precision, device) == torch.bfloat16
            and not (distributed.world_size() > 1 and cfg.distributed.strategy == "fsdp"))


def reads_base_in_bf16(cfg: RunConfig, device: torch.device, spec: str) -> bool:
    """On CUDA such a run reads a model saved in bf16 in bf16 (no whole fp32 copy of the base on the GPU), unless
    modules are trained in full beside the adapters (peft copies them from the base)."""
    if device.type != "cuda" or not frozen_base_in_bf16(cfg, device) or cfg.training.lora.modules_to_save:
        return False
    saved = getattr(load_model_config(spec, cfg.trust_remote_code), "dtype", None)
    return saved in (torch.bfloat16, "bfloat16")


def build_model(cfg: RunConfig, device: torch.device, packed: bool, model_path: str | None = None,
                bf16_read: bool = True):
    """The model in fp32 on ``device``, with gradient checkpointing, LoRA, compiled layers (``training.compile``)
    or, on the CPU and where opted in, fused ones (``cpu.fused_layers``), and the attention backend set.
    ``bf16_read``: where ``reads_base_in_bf16`` says so (doctor, whose checks run the fp32 model, says no).
    Returns (model, attention backend)."""
    t = cfg.training
    if t.method == "qlora":  # 4-bit base, loaded onto the device (bitsandbytes quantises as it places weights)
        from peft import prepare_model_for_kbit_training

        model = load_quantised(model_path or cfg.model, t.qlora, device, cfg.trust_remote_code)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=t.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        # read straight onto an accelerator (in bf16 where the run keeps its base so); on the CPU, loaded where it
        # trains anyway
        low = bf16_read and reads_base_in_bf16(cfg, device, model_path or cfg.model)
        model = load_model(model_path or cfg.model, torch.bfloat16 if low else torch.float32,
                           trust_remote_code=cfg.trust_remote_code, device=device if device.type != "cpu" else None)
        if t.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if t.gradient_checkpointing:
        model.config.use_cache = False
    family = vision_family(model.config) if trains_images(model.config) else None
    if family is not None and t.method == "full":
        log.info("vision model: %d parameters of the frozen parts stay as loaded", freeze_untrained(model, family,
                                                                                                    cfg.vision))
    if t.method in ("lora", "qlora"):
        if t.gradient_checkpointing:
            model.enable_input_require_grads()
        targets = lora_targets(model, family, cfg.vision, t.lora.target_modules) if family is not None else None
        model = apply_lora(model, t.lora, targets)
        if t.method == "lora" and low:
            n = load_base_in_bf16(model)
            log.info("frozen base read in bf16: %d linear layers as saved, the rest upcast to fp32", n)
    # from_pretrained returns eval mode, where dropout, NEFTune and transformers' gradient checkpointing are
    # off (a LoRA-wrapped model came back in training mode, a plain one did not: full fine-tuning trained in eval).
    model.train().to(device)
    read_output_head(model)  # measured once here, on the plain model, before any wrapping
    compiled = wants_compile(t.compile, device, cfg.distributed.strategy, distributed.world_size())
    if compiled:
        compile_layers(model, fall_back=t.compile == "auto")
    cpu.switch_on(model, cfg.cpu, device, compiled=compiled, gradient_checkpointing=t.gradient_checkpointing)
    if not packed:  # padded batches: the model's own, padding-aware attention
        return model, model.config._attn_implementation
    backend = choose_backend(device, cfg.training.attention,
                             half=autocast_dtype(t.precision, device) is not None)
    use_packed_attention(model, backend)
    return model, backend


def head_precision(cfg: RunConfig, device: torch.device, amp: torch.dtype | None) -> HeadPrecision:
    """The loss head's matmul policy: the CPU's opt-in one (``cpu.bf16_head``) on the CPU, else the device's
    default (``TENSOR_CORES`` on CUDA under bf16 autocast)."""
    return cpu.head_precision(cfg.cpu, device, amp) if device.type == "cpu" else head_precision_for(device, amp)


def verified_strategy(cfg: RunConfig, model, data: TokenizedDataset, pad: int,
                      precision: HeadPrecision = PLAIN) -> str:
    """Check the run's forward and loss (with the head's ``precision``) against the plain model before step 1
    (``leansft.core.model.verify``); return the batching strategy to train with (the configured one, or ``sorted`` as the exact fallback,
    logged), or raise a clear error."""
    check_vocabulary(model, data)
    strategy = cfg.batching.strategy
    if data.store.images is not None:  # data with images: whole examples (packed or padded), checked per example
        if strategy in SPLITTING_STRATEGIES:
            raise ConfigError(f"batching.strategy {strategy} with images: it cuts examples, and an image's tokens "
                              "must stay with their image (bfd packs whole examples; sorted and padded pad them)",
                              field="batching.strategy")
        if cfg.distributed.context_parallel > 1:
            raise ConfigError("distributed.context_parallel with images is not supported: a row's images cannot be "
                              "split over ranks", field="distributed.context_parallel")
        family = vision_family(model.config)
        if strategy in PACKED_STRATEGIES and not family.packs and any(map(len, data.store.images.refs)):
            log.warning("%s: packed rows would not be exact (its image tokens attend to each other both ways); "
                        "training with sorted (padded) batches instead", family.name)
            strategy = "sorted"
            use_plain_attention(model)
        if cfg.training.verify != "skip":
            log.info("vision: %s", verify_vision(model, data, cfg.batching.tokens_per_micro_batch, precision,
                                                 None if strategy in PACKED_STRATEGIES else pad))
        return strategy
    if cfg.training.verify == "skip":
        log.warning("training.verify is skip: the packed forward and the loss are not checked against the model")
        return strategy
    packed = strategy in PACKED_STRATEGIES
    log.info("checking the run's forward and loss against the plain model (before step 1)...")
    t0 = time.perf_counter()
    v = verify_model(model, probe_segments(data, model.get_input_embeddings().weight.shape[0]),
                     ("packed", "padded") if packed else ("padded",), pad,
                     cfg.batching.tokens_per_micro_batch, cfg.data.max_length, precision)
    log.info("verified in %.1f s: %s", time.perf_counter() - t0, v.summary())
    chosen = choose_strategy(v, strategy, cfg.training.verify)
    if chosen != strategy:
        log.warning("%s: packed batches would not be exact (%s); training with sorted (unpacked) batches instead "
                    "(training.verify: refuse stops instead)", v.architecture, v.checks["packed"].reason)
        use_plain_attention(model)
    return chosen


def store_frozen_base(cfg: RunConfig, model, data: TokenizedDataset, strategy: str, pad: int,
                      device: torch.device, amp: torch.dtype | None) -> int:
    """LoRA under bf16 autocast: the frozen base's linear weights stored in bf16 where the run's forward on the
    first example stays bitwise the same (``core/model/bf16_base.py``); returns how many layers changed."""
    if not frozen_base_in_bf16(cfg, device) or len(data) == 0:
        return 0
    n = np.array([min(int(data.lengths[0]), PROBE_TOKENS)])
    first = np.zeros(1, dtype=np.int64)
    batch = (collate_packed(data, first, first, n) if strategy in PACKED_STRATEGIES
             else collate_padded(data, first, pad, int(n[0]))).to(device)

    def probe() -> torch.Tensor:  # eager: compiled layers would compile a graph for this no-grad call alone
        with torch.autocast(device.type, dtype=amp), eager():
            return hidden_states(model, batch)

    if holds_bf16_base(model):  # read in bf16 (``reads_base_in_bf16``): checked on its first layer
        return confirm_bf16_base(model, probe)
    return store_base_in_bf16(model, probe)


def build_optimizer(cfg: RunConfig, model, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norms; LoRA+: the B matrices at ``lora.lr_ratio`` x the learning rate."""
    lr, ratio, wd = cfg.training.learning_rate, cfg.training.lora.lr_ratio, cfg.training.weight_decay
    split: dict[tuple[bool, bool], list] = {(fast, no): [] for fast in (False, True) for no in (False, True)}
    for name, p in trainable_parameters(model):
        split[(ratio is not None and "lora_B" in name, p.ndim < 2 or "norm" in name.lower())].append(p)
    groups = [{"params": split[(False, False)], "weight_decay": wd}, {"params": split[(False, True)], "weight_decay": 0.0}]
    if ratio is not None:
        groups += [{"params": split[(True, False)], "weight_decay": wd, "lr": lr * ratio},
                   {"params": split[(True, True)], "weight_decay": 0.0, "lr": lr * ratio}]
    # Fused (one kernel for all parameters) on CUDA and the CPU; foreach elsewhere. The 4-bit base of qlora
    # is frozen, so the trainable parameters are plain floating tensors either way.
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.training.betas, fused=device.type in ("cuda", "cpu"))


def build_scheduler(cfg: RunConfig, optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps(cfg.training, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.training.schedule, warmup, total_steps))


def count_steps(cfg: RunConfig, batcher: Batcher) -> int:
    """Optimizer steps of the run: max_steps, or epochs x full steps per epoch."""
    accum = cfg.batching.gradient_accumulation
    per_epoch = batcher.micro_batches_per_epoch() // accum
    if per_epoch == 0:
        raise LeanSFTError(f"not enough data for one optimizer step ({batcher.micro_batches_per_epoch()} "
                           f"micro-batches per epoch, gradient_accumulation {accum})",
                           field="batching.gradient_accumulation")
    return cfg.training.max_steps or max(1, math.ceil(cfg.training.epochs * per_epoch))
