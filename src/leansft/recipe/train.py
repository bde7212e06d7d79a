"""The training recipe: builders first, then a plain loop of ``train_step`` calls.

    data -> model (+LoRA) -> AdamW + schedule -> for each step: micro-batches, token-weighted loss,
    clip, step -> metrics / eval / samples / checkpoints -> export

The checkpointer, the evaluator and the throughput window each decide "now?" themselves, so the loop
only says what happens in which order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.profiler import record_function

from leansft.core import distributed
from leansft.core.config import PACKED_STRATEGIES, SPLITTING_STRATEGIES, RunConfig
from leansft.core.data.prepare import PreparedData, prepare_data
from leansft.core.data.stream import contributions
from leansft.core.data.tokenizer import pad_id
from leansft.core.errors import LeanSFTError, PeerFailure
from leansft.core.io import run_lock
from leansft.core.io.hf_export import export, gather_full_weights
from leansft.core.model.bf16_base import holds_bf16_base
from leansft.core.model.forward import LossModule
from leansft.core.model.grad_clip import clip_gradients
from leansft.core.model.loading import merged_plain_model, trainable_parameters
from leansft.core.model.loss import nonzero, normalise
from leansft.core.model.neftune import NEFTune
from leansft.core.model.qlora import dequantised_base
from leansft.core.model.verify import check_position_table
from leansft.core.paths import cache_dir
from leansft.core.progress import console, phase, plural
from leansft.recipe.batches import Batcher, Prefetched, StreamBatcher
from leansft.recipe.builders import (
    autocast_dtype,
    build_model,
    build_optimizer,
    build_scheduler,
    count_steps,
    head_precision,
    model_location,
    pick_device,
    seed_everything,
    store_frozen_base,
    verified_strategy,
)
from leansft.recipe.checkpointer import Checkpointer, claim_output_dir, finished_run, resume_point
from leansft.recipe.context_parallel import split_rows
from leansft.recipe.divergence import DivergenceGuard
from leansft.recipe.evaluator import Evaluator
from leansft.recipe.metrics_log import MetricsLog, ProgressFile, read_jsonl, truncate_jsonl
from leansft.recipe.model_card import write_model_card
from leansft.recipe.progress import ProgressBar
from leansft.recipe.report import write_report
from leansft.recipe.signals import StopAnywhere, StopFlag, Stopped
from leansft.recipe.throughput import RunTotals, StepCounts, ThroughputWindow
from leansft.recipe.trackers import Trackers

log = logging.getLogger("leansft")


@dataclass
class Engine:
    """What one optimizer step needs: the (wrapped) loss module, optimizer, schedule and precision."""

    loss_module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: list[torch.nn.Parameter]
    device: torch.device
    amp: torch.dtype | None
    max_grad_norm: float | None
    offload: contextlib.AbstractContextManager
    world: int


def build_engine(cfg: RunConfig, model, loss_module, total_steps: int, device: torch.device, amp, world: int) -> Engine:
    optimizer = build_optimizer(cfg, model, device)
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
               if cfg.training.activation_offloading else contextlib.nullcontext())
    return Engine(loss_module, optimizer, build_scheduler(cfg, optimizer, total_steps),
                  [p for _, p in trainable_parameters(model)], device, amp, cfg.training.max_grad_norm, offload, world)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    stop: bool
    counts: StepCounts  # the step's counts over every rank


def train_step(engine: Engine, batches: list, counts: StepCounts, step: int,
               stop: StopFlag | None = None) -> StepResult:
    """One optimizer step over this rank's micro-batches, whose counts (``ThroughputWindow.count``) are ``counts``.

    Each micro-batch's summed loss is divided by the step's global target count (the sum of loss weights where
    messages are weighted) before backward, so the gradient is the token mean over the whole step, whatever the
    accumulation or world size. Over several ranks that count is summed on the device and divides there: the host
    waits for nothing before the forward. The host reads the step back once (loss, gradient norm, stop requests,
    counts), after the update is queued, a non-finite loss or gradient norm making the fused AdamW skip the update
    on the device (``found_inf``, as GradScaler uses it): on CUDA the device runs on while the host reads. An
    optimizer that is not fused reads before its update. ``stop`` is true when any rank had a stop signal: every
    rank gets the same answer at the same step (a rank stopping alone would leave the others waiting in a
    collective)."""
    e = engine
    summed = None  # the counts over all ranks, on the device
    if e.world > 1:
        summed = distributed.all_reduce_sum(torch.tensor(counts.as_list(), dtype=torch.float64, device=e.device),
                                            e.device)
    targets = counts.weight if summed is None else summed[1].float()
    loss_total = torch.zeros((), device=e.device)
    for i, b in enumerate(batches):
        sync = distributed.no_sync(e.loss_module) if i < len(batches) - 1 else contextlib.nullcontext()
        with sync, e.offload, torch.autocast(e.device.type, dtype=e.amp, enabled=e.amp is not None):
            with record_function("forward+loss"):
                loss_sum = e.loss_module(b.to(e.device))
            with record_function("backward"):
                normalise(loss_sum, targets, e.world).backward()
        loss_total += loss_sum.detach()
    with record_function("clip"):
        norm = clip_gradients(e.params, e.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    requested = torch.tensor(float(stop is not None and stop.requested), device=e.device)
    loss_sum, stops = distributed.all_reduce_sum(torch.stack([loss_total, requested]), e.device)
    loss = loss_sum / nonzero(targets)
    figures = torch.stack([loss, norm.to(e.device, torch.float32), stops]).double()
    figures = figures if summed is None else torch.cat([figures, summed])
    lr = e.scheduler.get_last_lr()[0]
    ahead = bool(e.optimizer.defaults.get("fused"))
    if ahead:  # the update queued first, skipped on the device where the step is not finite
        e.optimizer.found_inf = (~torch.isfinite(torch.stack([loss, norm.to(loss.device, loss.dtype)]))).any().float()
        try:
            with record_function("optimizer"):
                e.optimizer.step()
        finally:
            del e.optimizer.found_inf
    with record_function("read back"):
        values = figures.tolist()  # the step's one host sync
    loss, grad_norm, stops = values[:3]
    if not math.isfinite(loss) or (ahead and not math.isfinite(grad_norm)):
        raise LeanSFTError(f"loss is {loss} at step {step} (gradient norm {grad_norm}); stopping",
                           hint="lower the learning rate, check the data of this step, or use fp32")
    if not ahead:
        with record_function("optimizer"):
            e.optimizer.step()
    e.scheduler.step()
    e.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, lr, stops > 0, counts if summed is None else StepCounts.from_list(values[3:]))


def train(cfg: RunConfig, resume: str | None = None) -> dict:
    """Run training as configured; returns the last logged record plus ``stopped`` (by a signal). The run holds its
    output_dir (``claim_output_dir``) from before it changes anything there until it ends."""
    distributed.init(cfg.distributed.timeout_s)
    out = check_output_dir(cfg.output_dir)
    storage = claim_output_dir(cfg, out)
    try:
        return run_training(cfg, resume, out, storage)
    finally:
        run_lock.release(out)


def run_training(cfg: RunConfig, resume: str | None, out: Path, storage: distributed.Storage) -> dict:
    run = RunTotals()
    cfg = cfg.model_copy(deep=True)  # strategy/accumulation may change below; the caller's config stays as given
    rank, world, device = distributed.rank(), distributed.world_size(), pick_device()
    grid = distributed.mesh(cfg.distributed.context_parallel)  # data-parallel x context-parallel places
    resume_from, cfg.batching.gradient_accumulation = resume_point(cfg, out, resume, world, storage, grid.dp_size)
    done = distributed.broadcast_object(finished_run(resume_from, cfg) if rank == 0 else None)  # rank 0 has the logs
    if done is not None:  # before any model loads; nothing in the run folder is touched
        log.info("nothing left to train: %s finished at step %d (its final model, report and metrics are left as "
                 "they are; raise training.max_steps or epochs to train on)", out, done)
        distributed.barrier()
        return {"step": done, "stopped": False, "nothing_left": True}
    seed_everything(cfg.training.seed)
    cache = distributed.storage_of(cache_dir(cfg.data.cache_dir))  # tokenised data and converted models
    model_path = model_location(cfg, cache)
    data = prepare_data(cfg.data, cfg.tokenizer or model_path, seed=cfg.training.seed,
                        truncate=cfg.batching.strategy not in SPLITTING_STRATEGIES,
                        trust_remote_code=cfg.trust_remote_code, cache_storage=cache, model_spec=model_path,
                        vision=cfg.vision)
    log_data(data, cfg.data.max_length)
    seed_everything(cfg.training.seed)  # LoRA init and dropout do not depend on what ran before
    model, _ = build_model(cfg, device, cfg.batching.strategy in PACKED_STRATEGIES, model_path)
    check_position_table(model, data.longest(cfg.data.max_length))
    amp = autocast_dtype(cfg.training.precision, device)
    precision = head_precision(cfg, device, amp)
    cfg.batching.strategy = verified_strategy(cfg, model, data.train, pad_id(data.tokenizer), precision)
    store_frozen_base(cfg, model, data.train, cfg.batching.strategy, pad_id(data.tokenizer), device, amp)
    # (a stream's: over its first window, for the checks before step 1; the loop reads a StreamBatcher, below)
    batcher = Batcher(data.train, cfg.batching, cfg.data.max_length, pad_id(data.tokenizer), cfg.training.seed,
                      grid.dp_rank, grid.dp_size, (grid.cp_rank, grid.cp_size))
    total_steps = cfg.training.max_steps if data.stream is not None else count_steps(cfg, batcher)
    neftune = NEFTune(model, cfg.training.neftune_noise_alpha) if cfg.training.neftune_noise_alpha else None
    loss_module = LossModule(model, cfg.training.loss_chunk_size, cfg.training.loss_backend, neftune, precision)
    if grid.cp_size > 1:  # checked on the whole model, before DDP or FSDP wraps it
        split_rows(cfg, model, loss_module, batcher, grid, device, amp)
    loss_module = distributed.wrap(loss_module, cfg.distributed.strategy, device, mixed_precision=amp is not None)
    sharded = world > 1 and cfg.distributed.strategy == "fsdp"
    engine = build_engine(cfg, model, loss_module, total_steps, device, amp, world)
    checkpointer = Checkpointer(cfg, out, loss_module, engine.optimizer, engine.scheduler, sharded,
                                data.fingerprint(), storage)
    state, evaluator_state = checkpointer.load(resume_from)
    run.wall_before = state.wall_seconds
    start_run_folder(cfg, out, data, state.step)
    trackers = Trackers(cfg, out, enabled=rank == 0)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=rank == 0, trackers=trackers)
    evaluator = Evaluator(cfg, model, data, device, amp, out, loss_module if sharded else None)
    evaluator.restore(evaluator_state)
    window = ThroughputWindow(model, device, cfg.logging.peak_flops, world)
    guard = DivergenceGuard(model.get_output_embeddings().weight.shape[0], cfg.training.loss_spike_factor)
    log.info("training %s, %s batches, %s attention, %s, %s, %s trainable params%s", plural(total_steps, "step"),
             cfg.batching.strategy, model.config._attn_implementation, compute_dtype(cfg, amp), cfg.training.method,
             f"{sum(p.numel() for p in engine.params):,}",
             (f", {cfg.distributed.strategy.upper()} over {world} ranks" if world > 1 else "")
             + (f", each row split over {grid.cp_size} of them (context parallel)" if grid.cp_size > 1 else ""))
    last = log_record(metrics, evaluator, None, 0, evaluator.after_step(0, total_steps) if state.step == 0 else None)
    progress_file = ProgressFile(out / "progress.json", rank == 0, total_steps, world, state.step)
    progress_file.write(state.step, run.wall())
    if data.stream is not None:  # its workers start here, before the loop's thread does
        data.stream.open()
        batcher = StreamBatcher(data.stream, cfg.batching, cfg.data.max_length, pad_id(data.tokenizer),
                                cfg.training.seed, grid.dp_rank, grid.dp_size, (grid.cp_rank, grid.cp_size))
    steps = Prefetched(batcher.steps(state.position, cfg.batching.gradient_accumulation), depth=2,
                       pin=device.type == "cuda")
    stopped = False
    # (a stream's workers stop last, whatever ends the loop: after the thread that reads from them)
    with contextlib.closing(data), steps, StopFlag() as stop, ProgressBar(total_steps, state.step, rank == 0) \
            as progress, checkpointer:
        while state.step < total_steps and not evaluator.should_stop:
            t0 = time.perf_counter()
            batches, position = next(steps)
            done = train_step(engine, batches, window.count(batches), state.step + 1, stop)
            seconds = time.perf_counter() - t0
            window.add(done.counts)
            window.add_time(seconds)
            state.advance(position, done.counts, seconds)
            guard.check(state.step, done.loss, done.grad_norm)
            record = None
            if state.step % cfg.logging.log_every == 0 or state.step == total_steps:
                record = {"step": state.step, "epoch": position.epoch, "loss": done.loss, "lr": done.lr,
                          "grad_norm": done.grad_norm, **window.record(), "tokens_seen": state.tokens_seen,
                          "examples_seen": state.examples_seen}
            progress.update(state.step, done.loss, done.lr, done.counts.real, logged=record is not None)
            if record is not None:
                progress_file.write(state.step, run.wall())
            last = log_record(metrics, evaluator, record, state.step, evaluator.after_step(state.step, total_steps)) \
                or last
            stopped = done.stop  # as every rank saw it at the step's all-reduce: they stop (and save) together
            stopping = stopped or evaluator.should_stop
            state.finished = state.step == total_steps or evaluator.should_stop
            if checkpointer.should_save(state.step, stopping or state.finished):
                state.wall_seconds = run.wall()
                checkpointer.save(state, evaluator.state(), last=stopping or state.finished)
            if stopping:
                log.warning("stopping at step %d (%s)", state.step, "signal" if stopped else "early stopping")
                break
    if data.stream is not None and rank == 0 and state.position.stream:
        report_stream(out, contributions(state.position.stream, cfg.data))
    if cfg.checkpoint.export and not stopped:
        export_final(cfg, model, loss_module, sharded, data, out, model_path)
    metrics.write(run.record(state))  # the whole run's totals: wall time, time in steps, run-average rates
    progress_file.write(state.step, run.wall(), finished=not stopped, stopped=stopped)
    if rank == 0:
        finish_run_folder(cfg, out, trackers, exported=cfg.checkpoint.export and not stopped)
        if not stopped:
            say_where(out, state.step, exported=cfg.checkpoint.export)
    distributed.barrier()
    return {**(last or {}), "stopped": stopped}


def say_where(out: Path, step: int, exported: bool) -> None:
    """The run's last line: where the model is and the command to talk to it."""
    model = out / "final" if exported else out  # a run folder: chat, eval and export read its newest checkpoint
    what = f"the model is in {model}" if exported else f"its checkpoints are in {out / 'checkpoints'}"
    report = f"; report: {out / 'report.md'}" if (out / "report.md").exists() else ""
    console().print(f"finished at step {step}: {what}{report}\ntalk to it: leansft chat {model}", soft_wrap=True,
                    markup=False, highlight=False)  # a path stays whole and as it is


def compute_dtype(cfg: RunConfig, amp: torch.dtype | None) -> str:
    """What the layers really compute in: QLoRA's 4-bit layers in their compute dtype, the rest as autocast says."""
    mode = "bf16 autocast" if amp else "fp32"
    if cfg.training.method == "qlora":
        from leansft.core.model.qlora import compute_dtype as qlora_dtype

        dtype = qlora_dtype(cfg.training.qlora.compute_dtype, pick_device())
        return f"{mode}, 4-bit layers computing in {str(dtype).removeprefix('torch.')}"
    return mode


def log_data(data: PreparedData, max_length: int) -> None:
    """What the run trains on, and a warning when cutting at max_length loses answer tokens."""
    if distributed.rank() != 0:
        return
    log.info("data: %s", data.summary())
    lost = data.lost_target_share() if data.report.truncated else 0.0
    if lost > 0:
        log.warning("cutting %d examples at data.max_length %d loses %.1f%% of the training target tokens "
                    "(`leansft plan` recommends a max_length)", data.report.truncated, max_length, 100 * lost)


def report_stream(out: Path, given: list[dict]) -> None:
    """A streaming run's end: what each source gave (up to the window the run stopped in), logged and in
    data_report.json's ``stream``."""
    log.info("the stream, epoch %d: %s", given[0]["epoch"], "; ".join(
        f"{g['path']}: {g['examples']:,} examples, {g['target_tokens']:,} target tokens ({g['share_got']:.1%} of the "
        f"{g['share_of']}, asked {g['share_asked']:.1%}), read through {g['read_through']} times" for g in given))
    path = out / "data_report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**report, "stream": given}, indent=1))


def check_output_dir(path: str) -> Path:
    """The run folder, or a clear error before anything is written (a file there, or not writable)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise LeanSFTError("output_dir is a file, not a folder", file=path, hint="choose another output_dir")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise LeanSFTError(f"cannot write under {probe} (permission denied)", file=path,
                           hint="choose a writable output_dir")
    return out


def start_run_folder(cfg: RunConfig, out: Path, data: PreparedData, step: int) -> None:
    """Rank 0 writes the resolved config and data report; logs restart with a fresh run or resume at ``step``."""
    if distributed.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        report = {**data.report.as_dict(),
                  "length_histogram": length_histogram(data.train.lengths, cfg.data.max_length)}
        (out / "data_report.json").write_text(json.dumps(report, indent=1))
        # a fresh run starts fresh logs; a resumed one keeps what came before its checkpoint
        for log_file in ("metrics.jsonl", "samples.jsonl", "suites.jsonl"):
            if step == 0:
                (out / log_file).unlink(missing_ok=True)
            else:
                truncate_jsonl(out / log_file, step)
    distributed.barrier()


def length_histogram(lengths, max_length: int, bins: int = 32) -> dict:
    """The training examples' lengths in tokens (after truncation) in ``bins`` equal bins up to ``max_length``: the
    data report's histogram (the run page draws it)."""
    counts, edges = np.histogram(np.asarray(lengths), bins=bins, range=(0, max_length))
    return {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}


def finish_run_folder(cfg: RunConfig, out: Path, trackers: Trackers, exported: bool) -> None:
    """The run's report, and the model card of the export; both (and the data report) go to the trackers."""
    records, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    files = [out / "data_report.json"]
    if any("loss" in r for r in records):
        files += write_report(out, quiet=True)
    if exported:
        report = json.loads((out / "data_report.json").read_text())
        files.append(write_model_card(cfg, out, out / "final", records, samples, report))
    trackers.samples(samples)
    for f in files:
        trackers.artifact(f)
    trackers.finish()


def log_record(metrics: MetricsLog, evaluator: Evaluator, record: dict | None, step: int,
               eval_result: dict | None = None) -> dict | None:
    """Merge a step's training and eval fields, append them to metrics.jsonl and print them (rank 0)."""
    if eval_result:
        record = {**(record or {"step": step}), **eval_result}
    if record is None:
        return None
    metrics.write(record)
    if distributed.rank() == 0:
        evaluator.print_record(record)
    return record


def export_final(cfg: RunConfig, model, loss_module, sharded: bool, data: PreparedData, out: Path,
                 model_path: str) -> None:
    """A plain Hugging Face folder at OUTPUT_DIR/final (FSDP: shards gathered into a copy on rank 0)."""
    plain = model
    if sharded:
        plain = build_model(cfg, torch.device("cpu"), True, model_path)[0] if distributed.rank() == 0 else None
        gather_full_weights(loss_module, plain)  # a collective: every rank
    if distributed.rank() == 0:
        if cfg.training.method == "qlora" and cfg.training.lora.merge_on_export:  # merged against the 4-bit weights
            plain = merged_plain_model(plain, model_path, cfg.training.lora, cfg.trust_remote_code,
                                       dequantised_base(plain))
            log.info("qlora: adapters merged into the dequantised 4-bit base weights (fp32 export)")
        elif holds_bf16_base(plain) and cfg.training.lora.merge_on_export:  # into the fp32 base, not its bf16 copy
            plain = merged_plain_model(plain, model_path, cfg.training.lora, cfg.trust_remote_code)
        with phase(f"exporting {out / 'final'}"):
            export(plain, data.tokenizer, data.template, out / "final", cfg, images=data.images)


EXIT_STOPPED = 3  # stopped by SIGINT/SIGTERM after saving a checkpoint (resume with --resume auto)


def main_train(cfg: RunConfig, resume: str | None) -> int:
    """0: finished (and exported); EXIT_STOPPED: stopped by a signal (inside the steps, with a checkpoint saved)."""
    ended_well = False
    try:
        with StopAnywhere():
            result = train(cfg, resume)
        ended_well = True
    except Stopped as s:
        log.warning("signal %d outside the training steps: stopped; the checkpoints stay as they were (continue "
                    "with --resume auto where there is one, else run the same command again)", s.signum)
        return EXIT_STOPPED
    except Exception as err:  # a collective a peer never joined: one line instead of gloo's traceback
        line = distributed.peer_failure(err, cfg.distributed.timeout_s)
        if line is None:
            raise
        raise PeerFailure(line, hint="continue with --resume auto once every node runs again") from None
    finally:
        distributed.shutdown(wait=ended_well)
    return EXIT_STOPPED if result.get("stopped") else 0
