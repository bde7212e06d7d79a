"""Regional ``torch.compile``: each decoder layer compiled on its own, all sharing one compiled graph.

Why regional: the layers are modules of one class whose parameters are graph inputs, so the code
compiled for the first layer serves every layer (one compile, not one per layer, and far less than a
whole-model compile). Packed attention stays outside the graph (its functions are
``torch.compiler.disable``-d in ``core/model/attention.py``: per-segment SDPA loops over host-side
boundaries), so each layer compiles to the fused projections, norms, rotary embedding, MLP and
residuals around it. Shapes are dynamic: packed micro-batches vary in length, one graph serves all.

``auto`` compiles on CUDA (where fusing the elementwise ops around the matmuls is the usual win; a
compile failure there falls back to eager, which is exact) and not on the CPU, where the gain measured
in benchmarks/results/cpu-step-and-trl.md is ~10% a step for 30-40 s of compiling: opt in with ``compile: true`` for
long runs.
"""

from __future__ import annotations

import contextlib
import logging
import shutil

import torch

from leansft.core.errors import ConfigError
from leansft.core.paths import private_compile_cache

log = logging.getLogger("leansft")


def wants_compile(setting: bool | str, device: torch.device, strategy: str, world: int) -> bool:
    """Whether this run compiles its decoder layers; a request that cannot be honoured is refused."""
    sharded = world > 1 and strategy == "fsdp"
    if setting == "auto":
        return device.type == "cuda" and not sharded
    if not setting:
        return False
    if sharded:
        raise ConfigError("training.compile with distributed.strategy fsdp is not supported (FSDP2's hooks inside "
                          "the compiled layers are not verified here)", field="training.compile",
                          hint="use compile: false (or auto) with fsdp, or ddp")
    if device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++")):
        raise ConfigError("training.compile on the CPU needs a C++ compiler (torch.compile's CPU backend "
                          "generates C++)", field="training.compile", hint="install g++, or use compile: false")
    return True


def compile_layers(model, fall_back: bool = False) -> int:
    """Compile every repeated decoder layer in place (state-dict keys unchanged); returns how many.
    ``fall_back``: a layer that fails to compile runs eagerly (dynamo's warning says why) instead of stopping."""
    from leansft.core.model.attention import decoder_of

    layers = getattr(decoder_of(model), "layers", None)
    if not layers:
        raise ConfigError(f"training.compile: {type(model).__name__} has no decoder layer list to compile",
                          field="training.compile", hint="use compile: false")
    if fall_back:
        torch._dynamo.config.suppress_errors = True
    private_compile_cache()
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("compile: %d decoder layers compiled regionally (compiled on the first step, which is slower)",
             len(layers))
    return len(layers)


def compile_counts() -> dict[str, int]:
    """dynamo's counts so far in this process: ``frames`` compiled (a recompile adds one) and ``graph_breaks``.
    Their growth after the warm-up steps is what a benchmark reports: 0 is the bar."""
    counters = torch._dynamo.utils.counters
    return {"frames": int(counters["frames"]["total"]), "graph_breaks": int(sum(counters["graph_break"].values()))}


def eager() -> contextlib.AbstractContextManager:
    """Run compiled modules eagerly inside the block: the plain model's references, generation."""
    return torch.compiler.set_stance("force_eager")
