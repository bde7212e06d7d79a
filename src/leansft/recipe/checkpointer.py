"""When to save, what a run's state is, and where a run resumes from.

The checkpoint files themselves are written by ``leansft.core.checkpoint``; this class decides "save
now?" (every ``save_every`` steps and when the run ends or is stopped), keeps the last/best ones, and
refuses to start a fresh run over an earlier run's checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leansft.core import checkpoint as ckpt
from leansft.core import parallel
from leansft.core.config import RunConfig
from leansft.core.errors import LeanSFTError
from leansft.recipe.batches import Position
from leansft.recipe.throughput import StepCounts

log = logging.getLogger("leansft")


@dataclass
class TrainState:
    """Everything the loop carries from step to step (and a checkpoint restores). Counts are global."""

    step: int = 0
    position: Position = field(default_factory=Position)
    tokens_seen: int = 0
    examples_seen: int = 0
    target_tokens_seen: int = 0

    def advance(self, position: Position, counts: StepCounts) -> None:
        self.step += 1
        self.position = position
        self.tokens_seen += counts.real
        self.examples_seen += counts.examples
        self.target_tokens_seen += counts.targets

    def as_dict(self) -> dict:
        return {**asdict(self), "position": asdict(self.position)}


class Checkpointer:
    def __init__(self, cfg: RunConfig, out: Path, model, optimizer, scheduler, sharded=None) -> None:
        self.folder = out / "checkpoints"
        self.cfg, self.model, self.optimizer, self.scheduler, self.sharded = cfg, model, optimizer, scheduler, sharded
        self.config_dict = cfg.model_dump(mode="json")

    def start(self, resume: str | None) -> TrainState:
        """The state to start from: a checkpoint's (``resume``: a folder, or auto = the latest), or a fresh
        one, refused when the output folder already holds an earlier run's checkpoints."""
        path = ckpt.find_resume(self.folder.parent, resume) if resume else None
        if path is None:
            earlier = ckpt.list_checkpoints(self.folder)
            if earlier:  # every rank checks, so all stop together
                raise LeanSFTError(
                    f"output_dir already holds checkpoints of an earlier run (latest {earlier[-1].name})",
                    file=str(self.folder.parent),
                    hint="continue it with --resume auto, or choose another output_dir (nothing was changed)",
                )
            return TrainState()
        saved = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.sharded)
        log.info("resumed from %s at step %d", path, saved["step"])
        return TrainState(step=saved["step"], position=Position(**saved["position"]),
                          **{k: saved[k] for k in ("tokens_seen", "examples_seen", "target_tokens_seen")})

    def should_save(self, step: int, done: bool) -> bool:
        every = self.cfg.checkpoint.save_every
        return done or bool(every and step % every == 0)

    def save(self, state: TrainState, eval_loss: float | None) -> None:
        """Rank 0 writes (every rank takes part when the checkpoint is sharded), then old ones are pruned."""
        if self.sharded is None and parallel.rank() != 0:
            return
        extra = state.as_dict()
        step = extra.pop("step")
        ckpt.save_checkpoint(self.folder, step, self.model, self.optimizer, self.scheduler,
                             {**extra, "eval_loss": eval_loss}, self.config_dict, self.sharded)
        if parallel.rank() == 0:
            ckpt.prune(self.folder, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)
