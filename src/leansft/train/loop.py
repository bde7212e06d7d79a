"""The training recipe: plain code from config to exported model.

    data -> model (+LoRA) -> AdamW + schedule -> for each step: micro-batches, token-weighted loss,
    clip, step -> metrics / eval / samples / checkpoints -> export
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from leansft.config import RunConfig
from leansft.data.dataset import TokenizedDataset, build_dataset
from leansft.data.template import resolve_template
from leansft.data.tokenizer import load_tokenizer
from leansft.errors import LeanSFTError
from leansft.model.attention import choose_backend, use_packed_attention
from leansft.model.load import apply_lora, load_model, resolve_model_path, resolve_package_path, trainable_parameters
from leansft.train import checkpoint as ckpt
from leansft.train import distributed as dist
from leansft.train.batches import Batcher, Position
from leansft.train.loss import normalise
from leansft.train.metrics import MetricsLog, attended_squares, device_peak_flops, peak_memory_bytes, step_flops
from leansft.train.step import LossModule

log = logging.getLogger("leansft")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device() -> torch.device:
    return torch.device("cuda", dist.local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA (auto or bf16); fp32 on the CPU, where bf16 matmuls are slow and inexact."""
    if precision == "fp32":
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if precision == "bf16":
        raise LeanSFTError("precision bf16 needs a CUDA device with bf16 support", field="training.precision")
    return None


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return f


def split_eval(data: TokenizedDataset, fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """Seeded held-out split; the eval rows never enter training."""
    if fraction <= 0:
        return data, None
    n_eval = max(1, int(round(len(data) * fraction)))
    perm = np.random.default_rng(seed + 17).permutation(len(data))
    return data.select(np.sort(perm[n_eval:])), data.select(np.sort(perm[:n_eval]))


@dataclass
class Prepared:
    tokenizer: object
    template: object
    train: TokenizedDataset
    eval: TokenizedDataset | None
    report: dict = field(default_factory=dict)


def model_location(cfg: RunConfig) -> str:
    """The model folder to load (``pkg:`` and .gguf resolved; rank 0 converts a GGUF first)."""
    from leansft.data.dataset import default_cache_dir

    with dist.rank_zero_first():
        return resolve_model_path(cfg.model, Path(cfg.data.cache_dir or default_cache_dir()))


def prepare_data(cfg: RunConfig, model_path: str | None = None) -> Prepared:
    """Tokenise (rank 0 first, so the cache is built once), then split off the eval set."""
    tok = load_tokenizer(resolve_package_path(cfg.tokenizer) if cfg.tokenizer else (model_path or cfg.model))
    template = resolve_template(tok, cfg.data.template)
    data_cfg = cfg.data
    if cfg.batching.strategy in ("bfd_split", "wrapped"):  # these cut long examples themselves
        data_cfg = data_cfg.model_copy(update={"max_length": 10**9})
    with dist.rank_zero_first():
        data, report = build_dataset(data_cfg, tok, template, seed=cfg.training.seed)
        eval_data = None
        if cfg.data.eval_file:
            eval_cfg = cfg.data.model_copy(update={"sources": [{"path": cfg.data.eval_file}]})
            eval_cfg = type(cfg.data).model_validate(eval_cfg.model_dump())
            eval_data, _ = build_dataset(eval_cfg, tok, template, seed=cfg.training.seed)
    if eval_data is None:
        data, eval_data = split_eval(data, cfg.data.eval_split, cfg.training.seed)
    return Prepared(tok, template, data, eval_data, report.as_dict())


def build_model(cfg: RunConfig, device: torch.device, packed: bool, model_path: str | None = None):
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
    decay, no_decay = [], []
    for name, p in trainable_parameters(model):
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.training.learning_rate, betas=cfg.training.betas,
                             fused=device.type == "cuda")


class StopFlag:
    """SIGINT/SIGTERM ask for a clean stop: the current step finishes, a checkpoint is saved."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self.requested = True
        log.warning("signal %s: finishing this step, saving a checkpoint, then stopping", signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg: RunConfig, resume: str | None = None, hooks: dict | None = None) -> dict:
    """Run training as configured; returns the last logged metrics. ``hooks`` are for tests."""
    hooks = hooks or {}
    dist.init()
    rank, world = dist.rank(), dist.world_size()
    device = pick_device()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.training.seed)
    model_path = model_location(cfg)
    prep = prepare_data(cfg, model_path)
    packed = cfg.batching.strategy in ("bfd", "bfd_split", "wrapped")
    pad_id = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else 0
    batcher = Batcher(prep.train, cfg.batching, cfg.data.max_length, pad_id, cfg.training.seed, rank, world)
    accum = cfg.batching.gradient_accumulation
    steps_per_epoch = batcher.micro_batches_per_epoch() // accum
    if steps_per_epoch == 0:
        raise LeanSFTError(f"not enough data for one optimizer step ({batcher.micro_batches_per_epoch()} micro-batches "
                           f"per epoch, gradient_accumulation {accum})", field="batching.gradient_accumulation")
    total_steps = cfg.training.max_steps or max(1, math.ceil(cfg.training.epochs * steps_per_epoch))
    seed_everything(cfg.training.seed)  # LoRA init and dropout do not depend on what ran before
    model, backend = build_model(cfg, device, packed, model_path)
    amp = autocast_dtype(cfg.training.precision, device)
    loss_module = dist.wrap(LossModule(model, cfg.training.loss_chunk_size, cfg.training.loss_backend),
                            cfg.distributed.strategy, device, mixed_precision=amp is not None)
    optimizer = build_optimizer(cfg, model, device)
    warmup = cfg.training.warmup_steps or int(cfg.training.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.training.schedule, warmup, total_steps))
    n_params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    mcfg = model.config
    peak = device_peak_flops(device, cfg.logging.peak_flops)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=rank == 0, tensorboard=cfg.logging.tensorboard)
    config_dict = cfg.model_dump(mode="json")
    if rank == 0:
        (out / "config.yaml").write_text(yaml.safe_dump(config_dict, sort_keys=False))
        (out / "data_report.json").write_text(json.dumps(prep.report, indent=1))

    step, pos = 0, Position()
    counters = {"tokens_seen": 0, "examples_seen": 0, "target_tokens_seen": 0}
    resume_from = ckpt.find_resume(out, resume) if resume else None
    if resume_from is None:  # every rank checks, so all stop together
        earlier = ckpt.list_checkpoints(out / "checkpoints")
        if earlier:
            raise LeanSFTError(
                f"output_dir already holds checkpoints of an earlier run (latest {earlier[-1].name})",
                file=str(out), hint="continue it with --resume auto, or choose another output_dir (nothing was changed)",
            )
        dist.barrier()
        if rank == 0:
            for stale in ("metrics.jsonl", "samples.jsonl"):  # a fresh run starts fresh logs
                (out / stale).unlink(missing_ok=True)
    sharded = loss_module if (world > 1 and cfg.distributed.strategy == "fsdp") else None
    if resume_from is not None:
        st = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler, sharded)
        step, pos = st["step"], Position(**st["position"])
        counters.update({k: st[k] for k in counters})
        metrics.truncate_after(step)
        log.info("resumed from %s at step %d", resume_from, step)
    if rank == 0:
        log.info("training %d steps (%d per epoch), %s attention, %s precision, %s, %d trainable params",
                 total_steps, steps_per_epoch, backend, "bf16 autocast" if amp else "fp32", cfg.training.method,
                 sum(p.numel() for _, p in trainable_parameters(model)))

    from leansft.evaluate.hooks import EvalRunner

    evaluator = EvalRunner(cfg, model, prep, device, amp, out, sharded)
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
               if cfg.training.activation_offloading else contextlib.nullcontext())
    last: dict = {}
    model.train()
    if step == 0:  # the "before" picture: eval loss and samples of the untrained model
        first = evaluator.maybe_eval(0, total_steps, counters)
        if first:
            metrics.write({"step": 0, **first})
            if rank == 0:
                evaluator.print_record({"step": 0, **first})
        evaluator.maybe_sample(0, total_steps)
    steps = batcher.steps(pos, accum)
    window_t0, window = time.perf_counter(), {"real": 0, "target": 0, "slots": 0, "flops": 0.0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = _progress(total_steps, step) if rank == 0 else None
    with StopFlag() as stop, (progress or contextlib.nullcontext()):
        task = progress.add_task("train", total=total_steps, completed=step, info="") if progress else None
        while step < total_steps:
            step_t0 = time.perf_counter()
            batches, next_pos = next(steps)
            local_targets = sum(b.target_tokens for b in batches)
            step_targets = dist.all_reduce_sum(local_targets, device)
            loss_total = torch.zeros((), device=device)
            for i, b in enumerate(batches):
                b = b.to(device)
                sync = dist.no_sync(loss_module) if i < len(batches) - 1 else contextlib.nullcontext()
                with sync, offload, torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss_sum = loss_module(b)
                    normalise(loss_sum, step_targets, world).backward()
                loss_total += loss_sum.detach()
                window["real"] += b.real_tokens
                window["target"] += b.target_tokens
                window["slots"] += int(b.input_ids.numel())
                window["flops"] += step_flops(n_params, mcfg.num_hidden_layers, mcfg.hidden_size, b.real_tokens,
                                              attended_squares(b))
                counters["examples_seen"] += len(np.unique(b.examples))
                counters["tokens_seen"] += b.real_tokens
            step_loss = float(dist.all_reduce_sum(loss_total, device)) / max(step_targets, 1)
            if not math.isfinite(step_loss):
                raise LeanSFTError(f"loss is {step_loss} at step {step + 1}; stopping",
                                   hint="lower the learning rate, check the data of this step, or use fp32")
            params = [p for _, p in trainable_parameters(model)]
            clip = cfg.training.max_grad_norm or float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            pos = next_pos
            counters["target_tokens_seen"] += step_targets
            if progress is not None:
                rate = sum(b.real_tokens for b in batches) * world / max(time.perf_counter() - step_t0, 1e-9)
                progress.update(task, completed=step, info=f"loss {step_loss:.4f}  lr {lr:.2e}  {rate:,.0f} tok/s")
            if "after_step" in hooks:
                hooks["after_step"](step, step_loss)
            record = None
            if step % cfg.logging.log_every == 0 or step == total_steps:
                dt = max(time.perf_counter() - window_t0, 1e-9)
                real = dist.all_reduce_sum(window["real"], device)
                record = {
                    "step": step, "epoch": pos.epoch, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                    "real_tokens_per_s": real / dt,
                    "target_tokens_per_s": dist.all_reduce_sum(window["target"], device) / dt,
                    "padding_share": 1.0 - window["real"] / max(window["slots"], 1),
                    "tokens_seen": counters["tokens_seen"] * world, "examples_seen": counters["examples_seen"] * world,
                    "peak_memory_bytes": peak_memory_bytes(device),
                    "mfu": (dist.all_reduce_sum(window["flops"], device) / dt) / (peak * world) if peak else None,
                }
                window_t0, window = time.perf_counter(), {"real": 0, "target": 0, "slots": 0, "flops": 0.0}
            eval_result = evaluator.maybe_eval(step, total_steps, counters)
            if eval_result:
                record = {**(record or {"step": step}), **eval_result}
            evaluator.maybe_sample(step, total_steps)
            if record is not None:
                metrics.write(record)
                last = record
                if rank == 0:
                    evaluator.print_record(record)
            state = {"position": pos.__dict__, **counters, "eval_loss": evaluator.last_eval_loss}
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 or stop.requested:
                _save(cfg, out, step, model, optimizer, scheduler, state, config_dict, hooks, sharded)
            if stop.requested or evaluator.should_stop:
                log.warning("stopping at step %d (%s)", step, "signal" if stop.requested else "early stopping")
                break
    if (not cfg.checkpoint.save_every or step % cfg.checkpoint.save_every) and not stop.requested:
        state = {"position": pos.__dict__, **counters, "eval_loss": evaluator.last_eval_loss}
        _save(cfg, out, step, model, optimizer, scheduler, state, config_dict, hooks, sharded)
    if cfg.checkpoint.export and not stop.requested:
        from leansft.train.export import export, full_state_dict

        plain = model
        if sharded is not None:  # gather the shards (every rank), load them into an unsharded copy on rank 0
            full = full_state_dict(loss_module)
            if rank == 0:
                plain, _ = build_model(cfg, torch.device("cpu"), packed, model_path)
                plain.load_state_dict(full)
        if rank == 0:
            export(plain, prep.tokenizer, prep.template, out / "final", cfg)
            log.info("exported %s", out / "final")
    dist.barrier()
    return last


def _progress(total: int, done: int):
    """A live progress bar (step, loss, lr, tokens/s) on a terminal; plain log lines elsewhere."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console()
    if not console.is_terminal:
        return None
    return Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(), console=console, transient=True)


def _save(cfg, out, step, model, optimizer, scheduler, state, config_dict, hooks, sharded) -> None:
    """Rank 0 writes (every rank takes part when the checkpoint is sharded), then old ones are pruned."""
    if sharded is None and dist.rank() != 0:
        return
    if "before_save" in hooks:
        hooks["before_save"](step)
    ckpt.save_checkpoint(out / "checkpoints", step, model, optimizer, scheduler, state, config_dict, sharded)
    if dist.rank() == 0:
        ckpt.prune(out / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)


def main_train(cfg: RunConfig, resume: str | None) -> int:
    try:
        train(cfg, resume)
    finally:
        dist.shutdown()
    return 0

