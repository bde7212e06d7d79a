"""QLoRA's 4-bit base (bitsandbytes ``Linear4bit``: NF4/FP4, double quantisation, a compute dtype) and its
way back out: a plain model whose weights are the dequantised 4-bit ones with the adapters merged in.

The export merges against the dequantised weights (``dequantised_base``), the function the run actually
trained (not the original full-precision checkpoint, which the adapters never saw).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from leansft.core.errors import ModelError


def _bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise ModelError("training.method qlora needs bitsandbytes (pip install 'leansft[qlora]', or "
                         "pip install bitsandbytes==0.50.2)", field="training.method") from None
    return bitsandbytes


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def load_quantised(spec: str, qcfg, device: torch.device, trust_remote_code: bool = False):
    """The model with every linear layer but the output head in 4 bits; norms and embeddings in fp32."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _bnb()
    dtype = compute_dtype(qcfg.compute_dtype, device)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qcfg.quant_type,
                               bnb_4bit_use_double_quant=qcfg.double_quant, bnb_4bit_compute_dtype=dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, quantization_config=quant, dtype=torch.float32,
                                                     device_map={"": str(device)},
                                                     trust_remote_code=trust_remote_code)
    except Exception as err:
        raise ModelError(f"cannot load the model in 4 bits on {device}: {type(err).__name__}: {str(err)[:300]}",
                         file=spec, hint="bitsandbytes needs a kernel for this device (CUDA, or its CPU backend)") \
            from None
    for module in quantised_layers(model).values():
        # On AVX512-BF16 CPUs bitsandbytes repacks a layer's weights for inference the first time it runs in eval
        # mode (verification, evaluation, samples) and from then on multiplies through a kernel without a
        # gradient for its input: earlier layers' adapters would silently stop learning. Keep the training layout.
        module.support_avx512bf16_for_cpu = False
    return model


def quantised_layers(model) -> dict[str, torch.nn.Module]:
    """name (as in the plain model) -> bitsandbytes ``Linear4bit`` module."""
    bnb = _bnb()
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[name.removeprefix("base_model.model.").removesuffix(".base_layer")] = module
    return out


def dequantised(module) -> torch.Tensor:
    """A ``Linear4bit``'s weight as the matmuls see it, in fp32."""
    from bitsandbytes.functional import dequantize_4bit

    w = module.weight
    return dequantize_4bit(w.data, w.quant_state).float()


def weight_bytes(model) -> dict[str, float]:
    """Bytes the quantised linear layers take (packed 4-bit weights + quantisation constants) per parameter they
    hold, and the bytes of all weights and buffers of the model."""
    layers = quantised_layers(model)
    q_params, tensors = 0, {}
    for module in layers.values():
        w, state = module.weight, module.weight.quant_state
        q_params += int(state.shape.numel())
        nested = getattr(state, "state2", None)
        for t in (w.data, state.absmax, state.code, *((nested.absmax, nested.code) if nested is not None else ())):
            if t is not None:
                tensors[t.data_ptr()] = t.numel() * t.element_size()  # shared code books counted once
    q_bytes = sum(tensors.values())
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return {"quantised_params": q_params, "quantised_bytes_per_param": q_bytes / max(q_params, 1),
            "model_bytes": total}


def dequantised_base(trained) -> Iterator[tuple[str, torch.Tensor]]:
    """The 4-bit layers' weights as the run trained with them, in fp32, by their names in the plain model: what
    ``models.merged_plain_model`` merges the adapters into (the function that was trained). One layer at a time,
    on the device the run trained on: all of them at once in fp32 would be 8x the 4-bit base (7B: ~26 GB, more
    than the 24 GB GPU QLoRA trains it on)."""
    for name, m in quantised_layers(trained).items():
        yield f"{name}.weight", dequantised(m)
