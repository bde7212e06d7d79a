"""What ``train()`` builds before its loop, built by the recipe's own builders, for the benchmarks that time or
profile its step (bench_gpu's bare loop, profile_gpu, profile_step, pair_step): one place, so they all measure the
model, loss module and batches the recipe trains with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Parts:
    cfg: object  # RunConfig (batching.strategy as verified, when asked)
    device: object
    data: object  # PreparedData
    pad: int
    model: object
    amp: object  # the autocast dtype, or None
    module: object  # LossModule

    def batches(self, ahead: bool = False):
        """The recipe's steps from the start (lists of micro-batches and their position); ``ahead``: prepared on a
        thread two steps ahead and pinned for a CUDA device, as train() does (a context manager then)."""
        from leansft.recipe.batches import Batcher, Position, Prefetched

        batcher = Batcher(self.data.train, self.cfg.batching, self.cfg.data.max_length, self.pad,
                          self.cfg.training.seed)
        steps = batcher.steps(Position(), 1)
        return Prefetched(steps, pin=self.device.type == "cuda") if ahead else steps

    def engine(self, steps: int = 1000):
        from leansft.recipe.train import build_engine

        return build_engine(self.cfg, self.model, self.module, steps, self.device, self.amp, 1)

    def window(self):
        from leansft.recipe.throughput import ThroughputWindow

        return ThroughputWindow(self.model, self.device, None, 1)


def build_parts(over: list[str], verify: bool = False) -> Parts:
    """The config (``key=value`` overrides), data, model and loss module as train() builds them, in its order;
    ``verify``: the check before step 1 too, whose strategy (the configured one or its exact fallback) is kept."""
    from leansft.core.config import PACKED_STRATEGIES, load_config
    from leansft.core.data.prepare import prepare_data
    from leansft.core.data.tokenizer import pad_id
    from leansft.core.model.forward import LossModule
    from leansft.recipe import builders as b

    cfg = load_config(None, over)
    device = b.pick_device()
    b.seed_everything(cfg.training.seed)
    path = b.model_location(cfg)
    data = prepare_data(cfg.data, cfg.tokenizer or path, seed=cfg.training.seed)
    pad = pad_id(data.tokenizer)
    model, _ = b.build_model(cfg, device, cfg.batching.strategy in PACKED_STRATEGIES, path)
    amp = b.autocast_dtype(cfg.training.precision, device)
    precision = b.head_precision(cfg, device, amp)
    if verify:
        cfg.batching.strategy = b.verified_strategy(cfg, model, data.train, pad, precision)
    b.store_frozen_base(cfg, model, data.train, cfg.batching.strategy, pad, device, amp)
    module = LossModule(model, cfg.training.loss_chunk_size, cfg.training.loss_backend, precision=precision)
    return Parts(cfg, device, data, pad, model, amp, module)
