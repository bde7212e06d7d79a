"""Builders for the training recipe: device, precision, model (+LoRA, attention), optimizer, schedule.

Each takes the config and returns one ready piece; doctor uses the same builders so it checks the
very model and forward the run will use.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from leansft.core import parallel
from leansft.core.attention import choose_backend, use_packed_attention
from leansft.core.config import RunConfig
from leansft.core.errors import LeanSFTError
from leansft.core.models import apply_lora, load_model, resolve_model_path, trainable_parameters
from leansft.core.paths import cache_dir
from leansft.recipe.batches import Batcher


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device() -> torch.device:
    return torch.device("cuda", parallel.local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA (auto or bf16); fp32 on the CPU, where bf16 matmuls are slow and inexact."""
    if precision == "fp32":
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if precision == "bf16":
        raise LeanSFTError("precision bf16 needs a CUDA device with bf16 support", field="training.precision")
    return None


def model_location(cfg: RunConfig) -> str:
    """The model folder to load (``pkg:`` and .gguf resolved; rank 0 converts a GGUF first)."""
    with parallel.rank_zero_first():
        return resolve_model_path(cfg.model, cache_dir(cfg.data.cache_dir))


def build_model(cfg: RunConfig, device: torch.device, packed: bool, model_path: str | None = None):
    """The model in fp32 on ``device``, with gradient checkpointing, LoRA and the attention backend set.
    Returns (model, attention backend)."""
    model = load_model(model_path or cfg.model, torch.float32)
    if cfg.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.training.method == "lora":
        if cfg.training.gradient_checkpointing:
            model.enable_input_require_grads()
        model = apply_lora(model, cfg.training.lora)
    model.to(device)
    backend = choose_backend(device, cfg.training.attention) if packed else "sdpa"
    use_packed_attention(model, backend)
    return model, backend


def build_optimizer(cfg: RunConfig, model, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in trainable_parameters(model):
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.training.learning_rate, betas=cfg.training.betas,
                             fused=device.type == "cuda")


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return f


def build_scheduler(cfg: RunConfig, optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = cfg.training.warmup_steps or int(cfg.training.warmup_ratio * total_steps)
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
