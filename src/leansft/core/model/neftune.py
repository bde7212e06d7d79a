"""NEFTune (Jain et al. 2023): uniform noise on the input embeddings, in training mode only.

noise = U(-1, 1) * alpha / sqrt(L * d), with d the embedding width and L the length of the token's own
example. In a packed row L is the example's length, not the row's (TRL and transformers use the padded
row's length, which shrinks the noise of every example packed with others); in padded rows it is the
row's real length. Evaluation and generation (eval mode) see no noise.
"""

from __future__ import annotations

import torch


class NEFTune:
    def __init__(self, model, alpha: float) -> None:
        self.alpha = alpha
        self.lengths: torch.Tensor | None = None  # [B, T] per-token example length of the current batch
        self.handle = model.get_input_embeddings().register_forward_hook(self._hook)

    def set_batch(self, batch) -> None:
        """Per-token example lengths of the batch about to run (packed: from cu_seqlens; padded: real lengths)."""
        cu = getattr(batch, "cu_seqlens", None)
        if cu is not None:
            pieces = torch.diff(cu.long())  # its total given: the host need not read the device's sum back
            self.lengths = torch.repeat_interleave(pieces, pieces, output_size=batch.input_ids.shape[-1]).unsqueeze(0)
        else:
            mask = batch.attention_mask
            self.lengths = mask.sum(dim=1, keepdim=True).expand_as(mask)

    def _hook(self, module, inputs, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or self.lengths is None or self.lengths.shape != output.shape[:2]:
            return None
        scale = self.alpha / torch.sqrt(self.lengths.to(output.device, torch.float32) * output.shape[-1])
        noise = (torch.rand_like(output, dtype=torch.float32) * 2 - 1) * scale.unsqueeze(-1)
        return output + noise.to(output.dtype)

    def remove(self) -> None:
        self.handle.remove()
