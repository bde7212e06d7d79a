"""A run's rows split over context-parallel groups (``distributed.context_parallel``): refused where the split
would compute otherwise than one process, else switched on and checked before step 1."""

from __future__ import annotations

import logging

import torch

from leansft.core import distributed
from leansft.core.batching.collate import collate_rows
from leansft.core.batching.context_shard import context_shard
from leansft.core.errors import LeanSFTError
from leansft.core.model.context_parallel import check_supported, use_context_parallel, whole_rows
from leansft.recipe.batches import Batcher

log = logging.getLogger("leansft")

TOLERANCE = {None: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}  # relative, on the summed loss of one row


def split_rows(cfg, model, loss_module, batcher: Batcher, grid: distributed.Mesh, device: torch.device, amp) -> None:
    """Context parallelism on for ``model``, once the loss of the run's first row, split over this rank's group and
    summed, equals the same row's whole (every rank computes both on its unwrapped ``loss_module``, no gradient
    kept; before DDP or FSDP wrap it: under FSDP2 the check's forwards left the first steps' gradients wrong)."""
    check_supported(model, grid.cp_size, cfg.training.lora.dropout if cfg.training.method != "full" else 0.0,
                    bool(cfg.training.neftune_noise_alpha))
    use_context_parallel(model, grid.cp_group, grid.cp_size, grid.cp_rank)
    plan, groups = batcher.epoch_plan(0)
    row = collate_rows(batcher.data, plan, groups[0])
    share = context_shard(row, grid.cp_rank, grid.cp_size)
    with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        with whole_rows(model):
            whole = loss_module(row.to(device)).float()
        split = distributed.all_reduce_sum(loss_module(share.to(device)).float(), device, grid.cp_group)
    whole, split = float(whole), float(split)
    diff = abs(split - whole) / max(abs(whole), 1e-12)
    if not diff <= TOLERANCE.get(amp, 2e-3):
        raise LeanSFTError(f"the context-parallel loss of the first row differs from the whole row's by {diff:.1e} "
                           f"(split {split:.6g}, whole {whole:.6g}): refused before step 1",
                           hint="train without distributed.context_parallel, and report the model")
    if distributed.rank() == 0:
        log.info("context parallel: each row split over %d ranks, %d data-parallel %s; the first row's loss split "
                 "and whole agree to %.1e", grid.cp_size, grid.dp_size, "place" if grid.dp_size == 1 else "places",
                 diff)
