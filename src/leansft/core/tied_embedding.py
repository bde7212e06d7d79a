"""A tied embedding's gradient without a second dense [vocab, hidden] buffer (full fine-tuning, CPU, one process).

When the input embedding and the output layer share one weight (SmolLM2, Qwen2.5 up to 3B, Gemma, ...), autograd
by default makes the embedding's gradient as a zero-filled [vocab, hidden] tensor with the batch's few thousand
rows scattered into it, then adds it to the output layer's gradient out of place: a fill and an add over the
largest matrix of the model every micro-batch, for rows that are almost all zero (SmolLM2: 113 MB; ~6% of a full
fine-tuning step on the CPU here). Instead the embedding's gradient stays sparse (its rows only), the chunked loss
writes the output layer's gradient straight into ``weight.grad`` (autograd never adds into a gradient returned by
a Python autograd Function in place: it would copy it), and autograd adds the embedding's rows into it in place.
Same sum, in another order of fp32 additions.

Only where it was measured and can be relied on: the CPU (on CUDA, adding a sparse gradient into a dense one uses
atomics, not checked here for determinism) and one process (DDP's and FSDP's gradient hooks expect a dense
gradient from one autograd accumulation).
"""

from __future__ import annotations

import torch


def share_tied_gradient(model, device: torch.device, world: int) -> bool:
    """Switch a trainable tied ``nn.Embedding`` to sparse gradients; True where the loss should then write the
    output layer's gradient into ``weight.grad`` itself (``LossModule(tied_gradient=True)``)."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if (device.type != "cpu" or world != 1 or not isinstance(emb, torch.nn.Embedding) or out is None
            or getattr(out, "weight", None) is not emb.weight or not emb.weight.requires_grad):
        return False
    emb.sparse = True
    # A micro-batch with no target tokens has no output-layer gradient: the embedding's sparse one would then be
    # all there is, which clipping and the optimizer do not take. Make it dense there (rare; the default's cost).
    emb.weight.register_post_accumulate_grad_hook(_densify)
    return True


def _densify(param: torch.Tensor) -> None:
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's accumulation would (taking it over when there is none)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
