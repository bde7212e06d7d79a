"""`leansft doctor CONFIG`: pre-flight correctness checks on the run's real model, tokenizer and data.

Every classic SFT bug is silent; each check here prints PASS/WARN/FAIL with numbers and, on failure,
a fix. The checks run on a sample of the real data with the attention backend the run will use.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from leansft.core.batching.collate import collate_packed, collate_padded
from leansft.core.config import PACKED_STRATEGIES, RunConfig
from leansft.core.data.masking import stop_token_ids
from leansft.core.data.prepare import prepare_data
from leansft.core.data.tokenizer import pad_id
from leansft.core.errors import DataError, LeanSFTError, TemplateError
from leansft.core.metrics.flops import attended_squares, device_peak_flops, step_flops, token_flops
from leansft.core.metrics.memtrack import TensorMemoryTracker
from leansft.core.model.attention import use_plain_attention
from leansft.core.model.bf16_base import holds_bf16_base
from leansft.core.model.forward import LossModule
from leansft.core.model.loss import PLAIN, HeadPrecision, normalise
from leansft.core.model.verify import (
    check_position_table,
    check_vocabulary,
    choose_strategy,
    probe_segments,
    verify_model,
)
from leansft.core.model.vision_verify import verify_vision
from leansft.core.progress import console, phase
from leansft.recipe.batches import Batcher
from leansft.recipe.builders import (
    autocast_dtype,
    build_model,
    head_precision,
    model_location,
    pick_device,
    seed_everything,
    store_frozen_base,
)
from leansft.tools.memory import ModelShape, estimate_memory
from leansft.tools.plan_report import template_summary
from leansft.tools.show_mask import stop_summary

SAMPLE = 64


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    message: str
    numbers: dict = field(default_factory=dict)
    fix: str | None = None


def _spans(labels: np.ndarray) -> list[tuple[int, int]]:
    on = np.r_[False, labels != -100, False].astype(np.int8)
    d = np.diff(on)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def check_template(tok, template, data, report: dict) -> Check:

    stops = set(stop_token_ids(tok, template))
    n_spans = ended = 0
    zero = int(report.get("no_target_tokens", 0))
    for i in range(min(len(data), 4 * SAMPLE)):
        ids, labels = data.example(i)
        for a, b in _spans(np.asarray(labels)):
            n_spans += 1
            ended += int(ids[b - 1]) in stops
    numbers = {"assistant_spans": n_spans, "spans_ending_with_end_of_turn": ended,
               "examples_with_zero_targets": zero, "pad_is_eos": tok.pad_token_id == tok.eos_token_id,
               "end_of_turn_ids": sorted(stops)}
    if n_spans == 0:
        return Check("template", "FAIL", "no token carries loss in the sample", numbers,
                     "check loss_on and that the data has assistant turns")
    if ended < n_spans:
        hint = " (pad token == eos: a collator that masks pad ids masks the end-of-turn token too)" \
            if numbers["pad_is_eos"] else ""
        return Check("template", "FAIL", f"{n_spans - ended} of {n_spans} assistant spans end without their "
                     f"end-of-turn token carrying loss{hint}", numbers,
                     "build labels from the template's assistant spans, not from token ids; the model must learn "
                     "to stop")
    status = "WARN" if zero else "PASS"
    per_source = [f"\n{src['path']}: {template_summary(src['template'])}" for src in report.get("sources", [])
                  if src.get("template")]
    numbers["sources"] = {src["path"]: src.get("template", {}) for src in report.get("sources", [])}
    numbers["stop_tokens"] = stop_summary(tok, template)
    return Check("template", status, f"{n_spans} assistant spans found, each ends with its stop token; "
                 f"{numbers['stop_tokens']}; "
                 f"{zero} examples had zero target tokens (dropped)" + "".join(per_source), numbers)


def check_isolation_and_loss(cfg: RunConfig, model, data, pad: int,
                             precision: HeadPrecision = PLAIN) -> tuple[list[Check], str | None]:
    """The run's forward and loss against the plain Hugging Face model (``leansft.core.model.verify``): the
    same check train runs before step 1, reported with its numbers; and the batching strategy train takes
    from it (the configured one, ``sorted`` as its fallback, or None where train refuses)."""
    packed = cfg.batching.strategy in PACKED_STRATEGIES
    v = verify_model(model, probe_segments(data, model.get_input_embeddings().weight.shape[0]),
                     ("packed", "padded") if packed else ("padded",), pad,
                     cfg.batching.tokens_per_micro_batch, cfg.data.max_length, precision)
    try:
        strategy = choose_strategy(v, cfg.batching.strategy, cfg.training.verify)
    except LeanSFTError:
        strategy = None
    path = "packed" if packed else "padded"
    c = v.checks[path]
    numbers = {"architecture": v.architecture, "path": path, "backend": model.config._attn_implementation,
               **c.numbers, "output_scale": v.head.scale, "output_softcap": v.head.softcap}
    falls_back = packed and not c.ok and v.ok("padded") and cfg.training.verify == "fallback"
    checks = []
    if c.logits_ok:
        checks.append(Check("isolation", "PASS", f"{path} logits = the plain model's on each example alone "
                            f"(max diff {c.numbers.get('max_logit_diff', 0):.1e} of the largest logit)", numbers))
    else:
        status = "WARN" if falls_back else "FAIL"
        checks.append(Check("isolation", status, f"{path} batches: {c.reason or 'differ from the plain model'}"
                            + ("; train falls back to sorted (unpacked, exact) batches" if falls_back else ""),
                            numbers, "batching.strategy: sorted (or training.verify: fallback)"))
    if c.loss_ok and v.head.exact:
        checks.append(Check("loss", "PASS", f"chunked loss = the model's own loss (relative diff "
                            f"{c.numbers.get('loss_rel_diff', 0):.1e}; output scale {v.head.scale:g}, soft-cap "
                            f"{v.head.softcap})", numbers))
    else:
        status = "WARN" if falls_back else "FAIL"
        checks.append(Check("loss", status, v.head.reason or f"{path} batches: the loss differs from the model's own",
                            numbers, "this architecture's output layer or forward is not supported packed"))
    return checks, strategy


def check_images(cfg: RunConfig, model, data, precision) -> Check:
    """A vision model: packed examples with their images against each run alone through the plain model."""
    try:
        return Check("images", "PASS", verify_vision(model, data, cfg.batching.tokens_per_micro_batch, precision), {})
    except LeanSFTError as err:
        return Check("images", "FAIL", str(err), {}, err.hint)


def check_positions(batcher) -> Check:
    plan, groups = batcher.epoch_plan(0)
    batch = batcher.collate(plan, groups[0])
    if not hasattr(batch, "cu_seqlens"):
        return Check("positions", "PASS", "padded batches: positions are 0..L-1 per row", {})
    cu = batch.cu_seqlens.long()
    lens = torch.diff(cu)
    expected = torch.cat([torch.arange(int(n)) for n in lens])
    ok = torch.equal(batch.position_ids[0].cpu(), expected)
    numbers = {"examples_in_batch": len(lens), "tokens": int(cu[-1])}
    if not ok:
        return Check("positions", "FAIL", "position_ids do not restart at 0 for every packed example", numbers,
                     "derive position_ids from cu_seqlens (leansft's collator does)")
    return Check("positions", "PASS", f"position_ids restart at 0 for all {len(lens)} examples of a micro-batch",
                 numbers)


def check_truncation(full_lengths: np.ndarray, full_targets: np.ndarray, max_length: int) -> Check:
    over = full_lengths > max_length
    lost = float(np.minimum(full_targets, np.maximum(full_lengths - max_length, 0))[over].sum())
    share_ex = float(over.mean()) if len(over) else 0.0
    share_t = lost / max(float(full_targets.sum()), 1.0)
    numbers = {"examples": len(over), "truncated": int(over.sum()), "truncated_share": share_ex,
               "target_tokens_lost_share": share_t, "max_length": max_length,
               "p99_length": float(np.percentile(full_lengths, 99)) if len(full_lengths) else 0.0}
    if share_ex > 0.25 or share_t > 0.10:
        return Check("truncation", "FAIL", f"max_length {max_length} truncates {share_ex:.0%} of examples and "
                     f"{share_t:.0%} of target tokens", numbers, "raise data.max_length (see `leansft plan`), or "
                     "use truncation: drop / strategy bfd_split")
    status = "WARN" if over.any() else "PASS"
    return Check("truncation", status, f"{int(over.sum())} examples truncated ({share_t:.2%} of target tokens)",
                 numbers)


def check_normalisation(model, data, device, packed: bool, pad: int) -> Check:
    """Accumulation 1 vs 8 on the batches the run will use (packed rows, or padded ones on the fallback)."""
    n = min(8, len(data))
    ex = np.arange(n)
    module = LossModule(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(groups):
        model.zero_grad(set_to_none=True)
        batches = [(collate_packed(data, g, np.zeros(len(g), np.int64), data.lengths[g]) if packed
                    else collate_padded(data, g, pad)).to(device) for g in groups]
        total = sum(b.target_tokens for b in batches)
        logged = 0.0
        for b in batches:
            loss = module(b)
            normalise(loss, total).backward()
            logged += float(loss.detach()) / total
        grads = torch.cat([p.grad.detach().float().flatten() for p in params if p.grad is not None]).cpu()
        return logged, grads

    was = model.training
    model.eval()  # no dropout: the two runs must see the same function
    try:
        l1, g1 = run([ex])
        l8, g8 = run([ex[i : i + 1] for i in range(n)])
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    rel = float((g1 - g8).norm() / max(float(g1.norm()), 1e-12))
    numbers = {"loss_accum_1": l1, "loss_accum_8": l8, "grad_relative_diff": rel, "examples": int(n)}
    if abs(l1 - l8) > 1e-4 * max(abs(l1), 1) or rel > 1e-3:
        return Check("normalisation", "FAIL", "accumulation 1 and 8 give different losses or gradients", numbers,
                     "divide the summed loss by the step's global target-token count, once per step")
    return Check("normalisation", "PASS", f"accumulation 1 vs {n}: loss {l1:.4f} = {l8:.4f}, gradients within "
                 f"{rel:.1e}", numbers)


def check_memory_and_throughput(cfg: RunConfig, model, batcher, device, amp) -> list[Check]:

    module = LossModule(model, cfg.training.loss_chunk_size, cfg.training.loss_backend,
                        precision=head_precision(cfg, device, amp))
    plan, groups = batcher.epoch_plan(0)
    batch = batcher.collate(plan, groups[0]).to(device)
    est = estimate_memory(ModelShape.from_config(model.config), batch.real_tokens, method=cfg.training.method,
                          precision="bf16" if amp else "fp32",
                          gradient_checkpointing=cfg.training.gradient_checkpointing,
                          chunk_size=cfg.training.loss_chunk_size, lora_r=cfg.training.lora.r,
                          bf16_base=holds_bf16_base(model))
    act_est = sum(est["parts"][k] for k in ("weight_casts", "activations", "logits", "gradients"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    tracker = TensorMemoryTracker(exclude=[*model.parameters(), *model.buffers()]) if device.type == "cpu" else None
    with (tracker if tracker is not None else contextlib.nullcontext(),
          torch.autocast(device.type, dtype=amp, enabled=amp is not None)):
        module(batch).backward()
    measured = tracker.peak if tracker else torch.cuda.max_memory_allocated(device) - base
    model.zero_grad(set_to_none=True)
    mem = Check("memory", "PASS" if measured < 3 * act_est else "WARN",
                f"one micro-batch of {batch.real_tokens} tokens: measured {measured / 1e6:.1f} MB above the weights, "
                f"estimated {act_est / 1e6:.1f} MB (bf16 weight copies + activations + logits + gradients)",
                {"measured_bytes": int(measured), "estimated_bytes": int(act_est), "estimate": est["parts"]})
    steps = min(3, len(groups))
    t0, tokens, flops = time.perf_counter(), 0, 0.0
    body, head = token_flops(model)
    for g in groups[:steps]:
        b = batcher.collate(plan, g).to(device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            module(b).backward()
        tokens += b.real_tokens
        text = model.config.get_text_config()  # a vision model: its language model's
        flops += step_flops(body, text.num_hidden_layers, text.hidden_size, b.real_tokens,
                            attended_squares(b), head, b.target_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    peak = device_peak_flops(device, cfg.logging.peak_flops)
    mfu = (flops / dt) / peak if peak else None
    thr = Check("throughput", "PASS", f"{tokens / dt:,.0f} real tokens/s over {steps} micro-batches (fwd+bwd)"
                + (f", MFU {mfu:.1%}" if mfu is not None else ", MFU n/a (device peak unknown)"),
                {"real_tokens_per_s": tokens / dt, "mfu": mfu})
    return [mem, thr]


def run_checks(cfg: RunConfig) -> list[Check]:
    seed_everything(cfg.training.seed)
    model_path = model_location(cfg)
    try:  # whole examples, so the truncation check sees what max_length would cut
        prep = prepare_data(cfg.data, cfg.tokenizer or model_path, seed=cfg.training.seed, truncate=False,
                            holdout=False, model_spec=model_path, vision=cfg.vision)
    except (TemplateError, DataError) as err:
        return [Check("template", "FAIL", str(err), {}, err.hint or "pass a training template")]
    tok, full = prep.tokenizer, prep.train
    checks = [check_template(tok, prep.template, full, prep.report.as_dict()),
              check_truncation(full.lengths, full.target_counts, cfg.data.max_length)]
    sample = full.select(np.arange(min(SAMPLE, len(full))), max_length=cfg.data.max_length)
    device = pick_device()
    model, _ = build_model(cfg, device, True, model_path, bf16_read=False)  # its checks run the fp32 model first
    amp = autocast_dtype(cfg.training.precision, device)
    for name, check in (("vocabulary", lambda: check_vocabulary(model, full)),
                        ("positions", lambda: check_position_table(model, prep.longest(cfg.data.max_length)))):
        try:
            check()
        except LeanSFTError as err:  # the model cannot even embed this data: nothing else can run
            return checks + [Check(name, "FAIL", str(err), {}, err.hint)]
    with phase("doctor: isolation and loss against the plain model"):
        found, strategy = check_isolation_and_loss(cfg, model, sample, pad_id(tok), head_precision(cfg, device, amp))
    checks += found
    if full.store.images is not None:  # the checks above ran the language model on ids alone: now with the images
        with phase("doctor: packed examples with their images against each alone"):
            checks.append(check_images(cfg, model, full, head_precision(cfg, device, amp)))
    if strategy is None:  # train refuses this model before step 1: nothing further to judge
        return checks
    # from here on, the path the run will take (train's fallback to sorted batches included)
    batching = cfg.batching.model_copy(update={"strategy": strategy})
    batcher = Batcher(sample, batching, cfg.data.max_length, pad_id(tok), cfg.training.seed)
    if not batcher.packed:
        use_plain_attention(model)
    with phase("doctor: positions and gradient-accumulation invariance"):
        checks.append(check_positions(batcher))
        checks.append(check_normalisation(model, sample, device, batcher.packed, pad_id(tok)))
    store_frozen_base(cfg, model, sample, strategy, pad_id(tok), device, amp)  # as train does, before step 1
    with phase("doctor: memory and throughput of a few micro-batches"):
        checks += check_memory_and_throughput(cfg, model, batcher, device, amp)
    return checks


def run_doctor(cfg: RunConfig, json_out: str | None = None) -> int:
    """Print the checks; write JSON if asked; return 1 on any FAIL."""

    checks = run_checks(cfg)
    table = Table(title="leansft doctor")
    for col in ("check", "status", "result"):
        table.add_column(col)
    colour = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in checks:
        text = c.message + (f"\nfix: {c.fix}" if c.status == "FAIL" and c.fix else "")
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", text)
    console().print(table)
    if json_out:
        Path(json_out).write_text(json.dumps([asdict(c) for c in checks], indent=2, default=str))
    return 1 if any(c.status == "FAIL" for c in checks) else 0
