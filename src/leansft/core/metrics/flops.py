"""What a step costs: training FLOPs (for MFU), device peak FLOP/s, peak memory."""

from __future__ import annotations

import resource

import torch

# Dense bf16 peak FLOP/s by device name fragment (no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
              "RTX 4090": 165e12, "A6000": 155e12, "V100": 125e12}


def device_peak_flops(device: torch.device, configured: float | None) -> float | None:
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, flops in PEAK_FLOPS.items():
            if frag in name:
                return flops
    return None


def _numel(p: torch.Tensor) -> int:
    """Elements of the weight a parameter stands for (a 4-bit bitsandbytes weight packs two per byte)."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def token_flops(model) -> tuple[float, float]:
    """(body FLOPs per token, output-layer FLOPs per target token) of one training step's matmuls.

    Forward is 2 FLOPs per parameter, the input gradient 2, the weight gradient 2: 6 for a trained
    parameter, 4 for a frozen one (LoRA's and QLoRA's base), which gets no weight gradient. Counting a
    frozen base at 6 would overstate a LoRA run's MFU by half. The body runs on every token; the output
    layer only on target tokens, as the chunked loss computes it. Input embeddings are a lookup (no FLOPs)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    skip = {emb.data_ptr(), head.data_ptr()}
    body = sum((6.0 if p.requires_grad else 4.0) * _numel(p) for p in model.parameters()
               if p.data_ptr() not in skip)
    return body, (6.0 if head.requires_grad else 4.0) * _numel(head)


def step_flops(body_flops: float, layers: int, hidden: int, real_tokens: int, attended_sq: float,
               head_flops: float = 0.0, target_tokens: int = 0) -> float:
    """Training FLOPs of a micro-batch: ``token_flops``' matmuls over its real and target tokens, plus
    attention (QK^T and PV, causal half, forward + backward = 3 x forward): 6 x layers x hidden x sum(L^2)
    over the blocks actually attended."""
    return body_flops * real_tokens + head_flops * target_tokens + 6.0 * layers * hidden * attended_sq


def attended_squares(batch) -> float:
    """Sum of L^2 over the blocks a batch really attends: each packed segment, or rows x width^2 padded."""
    cu = getattr(batch, "cu_seqlens", None)
    if cu is not None:
        return float((torch.diff(cu).double() ** 2).sum())
    rows, width = batch.input_ids.shape
    return float(rows * width * width)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on Linux
