"""The output layer exactly as the model applies it: ``logits = softcap(scale * (h @ W^T + b))``.

Read from the model, not from a list of config names: the weight and bias are the output embedding
module's own; the scale is measured by running the model once on a few tokens and comparing its
final logits with what the output module produced (Cohere multiplies by ``logit_scale``, Granite
divides by ``logits_scaling``, most models do neither); soft-capping (Gemma 2/3) is the config's
``final_logit_softcapping``, confirmed by the same measurement. A model whose logits follow none of
these forms gets ``exact=False``, and the run is refused before step 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leansft.core.model.attention import plain_attention

PROBE_TOKENS = 12


@dataclass(frozen=True)
class OutputHead:
    scale: float = 1.0
    softcap: float | None = None
    exact: bool = True  # False: the model's logits are not softcap(scale * linear(h)) (see ``reason``)
    reason: str = ""

    @staticmethod
    def weight(model) -> torch.Tensor:
        return model.get_output_embeddings().weight

    @staticmethod
    def bias(model) -> torch.Tensor | None:
        return getattr(model.get_output_embeddings(), "bias", None)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """Logits from the output module's result ``z = h @ W^T + b``."""
        z = z.float() * self.scale if self.scale != 1.0 else z.float()
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits of ``hidden``: for small inputs (checks); training never builds them."""
        return self.apply(model.get_output_embeddings()(hidden))


def _fits(final: torch.Tensor, predicted: torch.Tensor) -> bool:
    return bool((final - predicted).abs().max() <= 1e-4 * max(1.0, float(final.abs().max())))


@torch.no_grad()
def read_output_head(model) -> OutputHead:
    """Measure how ``model`` turns its output module's result into logits (cached on the model)."""
    cached = getattr(model, "_leansft_output_head", None)
    if cached is not None:
        return cached
    head = _measure(model)
    model._leansft_output_head = head
    return head


def _measure(model) -> OutputHead:
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None
    module = model.get_output_embeddings()
    if module is None:
        return OutputHead(exact=False, reason="the model has no output embedding module")
    seen: list[torch.Tensor] = []
    hook = module.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    device = next(model.parameters()).device
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % model.config.get_text_config().vocab_size
    # a base held in bf16 (``core/model/bf16_base.py``) runs under bf16 autocast, as the run's own forward does
    low = any(p.dtype == torch.bfloat16 for p in model.parameters())
    was = model.training
    model.eval()
    try:
        with plain_attention(model), torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
            final = model(input_ids=ids, use_cache=False).logits.float()
    except Exception as err:  # noqa: BLE001 - any failure means "cannot confirm the head"
        return OutputHead(softcap=softcap, exact=False, reason=f"forward failed: {type(err).__name__}: {err}"[:300])
    finally:
        hook.remove()
        model.train(was)
    if len(seen) != 1 or seen[0].shape != final.shape:
        return OutputHead(softcap=softcap, exact=False,
                          reason="the output module is not applied once to every position")
    z = seen[0].float()
    target = final
    if softcap is not None:
        target = softcap * torch.atanh((final / softcap).clamp(-1 + 1e-7, 1 - 1e-7))
    scale = float((target * z).sum() / (z * z).sum().clamp_min(1e-30))
    scale = 1.0 if math.isclose(scale, 1.0, rel_tol=1e-5) else scale
    head = OutputHead(scale=scale, softcap=softcap)
    if not _fits(final, head.apply(z)):
        return OutputHead(scale=scale, softcap=softcap, exact=False,
                          reason="the model's logits are not softcap(scale * output_layer(hidden))")
    return head
