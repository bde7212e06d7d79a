"""One forward to final hidden states for either batch kind, and the loss the config chose on them."""

from __future__ import annotations

import torch

from leansft.core.batching.collate import PackedBatch, PaddedBatch
from leansft.core.errors import ConfigError, ModelError
from leansft.core.model.attention import decoder_of, packed_forward
from leansft.core.model.head import read_output_head
from leansft.core.model.loss import PLAIN, HeadPrecision, chunked_loss, liger_loss
from leansft.core.model.rope import batch_lengths, per_example_rope
from leansft.core.model.vision_forward import packed_vision_forward, padded_vision_forward


def hidden_states(model, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    """Final hidden states of every token; rotary embeddings that depend on the sequence length are computed
    for each example as it runs alone (``core/model/rope.py``)."""
    per_example_rope(model)
    with batch_lengths(batch):
        if isinstance(batch, PackedBatch):
            if batch.vision is not None:
                return packed_vision_forward(model, batch)
            return packed_forward(model, batch)
        impl = model.config._attn_implementation
        if impl.startswith("leansft"):
            raise ModelError("padded batches need a padding-aware attention implementation (sdpa), not " + impl)
        if batch.vision is not None:
            return padded_vision_forward(model, batch)
        out = decoder_of(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, use_cache=False)
        return out.last_hidden_state


def loss_of(model, batch, hidden: torch.Tensor, chunk_size: int, backend: str = "chunked",
            precision: HeadPrecision = PLAIN) -> tuple[torch.Tensor, int]:
    """(summed loss, targets) with the output layer as the model applies it (bias, scale, soft-capping).
    ``precision``: the chunked head's matmul policy (``core/model/loss.py``)."""
    head = read_output_head(model)
    weight, bias = head.weight(model), head.bias(model)
    if backend == "liger":
        if batch.weights is not None:
            raise ConfigError("training.loss_backend 'liger' has no per-token loss weights, which this data uses "
                              "(a message 'weight' between 0 and 1)", field="training.loss_backend",
                              hint="use loss_backend: chunked")
        if bias is not None or head.scale != 1.0 or head.softcap is not None:
            raise ConfigError("training.loss_backend 'liger' has no output bias, logit scale or soft-capping, which "
                              "this model uses", field="training.loss_backend", hint="use loss_backend: chunked")
        return liger_loss(hidden, weight, batch.labels, batch.host_target_index(), precision.matmul_dtype)
    return chunked_loss(hidden, weight, batch.labels, chunk_size, head.softcap, bias, head.scale, batch.weights,
                        target_index=batch.host_target_index(), precision=precision)


class LossModule(torch.nn.Module):
    """Model + loss in one module, so DDP/FSDP see every gradient-producing op inside ``forward``.

    ``forward(batch)`` returns the summed loss over the batch's target tokens (never a mean).
    """

    def __init__(self, model, chunk_size: int = 1024, backend: str = "chunked", neftune=None,
                 precision: HeadPrecision = PLAIN) -> None:
        super().__init__()
        self.model = model
        self.chunk_size, self.backend = chunk_size, backend
        self.neftune = neftune  # NEFTune noise needs each token's example length (``core/model/neftune.py``)
        self.precision = precision  # the head's matmul policy (``core/cpu/bf16_head.py`` where opted in)

    def forward(self, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
        if self.neftune is not None:
            self.neftune.set_batch(batch)
        hidden = hidden_states(self.model, batch)
        if getattr(batch, "context", (0, 1))[1] > 1:  # a context share: its labels run one token past its tokens
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, 1))
        return loss_of(self.model, batch, hidden, self.chunk_size, self.backend, self.precision)[0]
