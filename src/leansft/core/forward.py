"""One forward to final hidden states for either batch kind, and the loss function the config chose."""

from __future__ import annotations

import torch

from leansft.core.attention import packed_forward
from leansft.core.collate import PackedBatch, PaddedBatch
from leansft.core.errors import ModelError
from leansft.core.loss import chunked_loss, liger_loss, output_softcap


def hidden_states(model, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    if isinstance(batch, PackedBatch):
        return packed_forward(model, batch)
    impl = model.config._attn_implementation
    if impl.startswith("leansft"):
        raise ModelError("padded batches need a padding-aware attention implementation (sdpa), not " + impl)
    out = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False)
    return out.last_hidden_state


def loss_of(model, batch, hidden: torch.Tensor, chunk_size: int, backend: str = "chunked") -> tuple[torch.Tensor, int]:
    weight = model.get_output_embeddings().weight
    if backend == "liger":
        return liger_loss(hidden, weight, batch.labels)
    return chunked_loss(hidden, weight, batch.labels, chunk_size, output_softcap(model))


class LossModule(torch.nn.Module):
    """Model + loss in one module, so DDP/FSDP see every gradient-producing op inside ``forward``.

    ``forward(batch)`` returns the summed loss over the batch's target tokens (never a mean).
    """

    def __init__(self, model, chunk_size: int = 1024, backend: str = "chunked") -> None:
        super().__init__()
        self.model = model
        self.chunk_size, self.backend = chunk_size, backend

    def forward(self, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
        hidden = hidden_states(self.model, batch)
        return loss_of(self.model, batch, hidden, self.chunk_size, self.backend)[0]
