"""When to save, what a run's state is, and where a run resumes from.

The checkpoint files themselves are written and verified by ``leansft.core.checkpoint``; here:
``resume_point`` picks the checkpoint (and the accumulation that keeps its global step on another world
size), and the Checkpointer decides "save now?" (every ``save_every`` steps and when the run ends or is
stopped), saves the loop's state with the evaluator's, and keeps the last/best ones.
"""

from __future__ import annotations

import json
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


def resume_point(cfg: RunConfig, out: Path, resume: str | None, world: int) -> tuple[Path | None, int]:
    """The checkpoint to resume from (None: a fresh start) and the gradient accumulation that keeps its
    global step (world size x accumulation micro-batches) on this world size. A fresh start over an
    earlier run's checkpoints, or a step that cannot be kept, is refused before anything is written."""
    accum = cfg.batching.gradient_accumulation
    path = ckpt.find_resume(out, resume) if resume else None
    if path is None:
        earlier = ckpt.list_checkpoints(out / "checkpoints")
        if earlier:  # every rank checks, so all stop together
            raise LeanSFTError(
                f"output_dir already holds checkpoints of an earlier run (latest {earlier[-1].name})",
                file=str(out),
                hint="continue it with --resume auto, or choose another output_dir (nothing was changed)",
            )
        return None, accum
    saved = json.loads((path / "state.json").read_text())
    per_step = saved.get("world_size", 1) * saved.get("gradient_accumulation", accum)
    if per_step % world:
        raise LeanSFTError(
            f"the checkpoint's step is {per_step} micro-batches ({saved.get('world_size', 1)} ranks x accumulation "
            f"{saved.get('gradient_accumulation', accum)}), which {world} ranks cannot split evenly", file=str(path),
            hint="resume on a world size that divides it")
    if per_step // world != accum:
        log.warning("resuming a %d-rank run on %d ranks: gradient_accumulation %d -> %d keeps the same global step",
                    saved.get("world_size", 1), world, accum, per_step // world)
    return path, per_step // world


class Checkpointer:
    def __init__(self, cfg: RunConfig, out: Path, root, optimizer, scheduler, sharded: bool = False) -> None:
        self.folder = out / "checkpoints"
        self.cfg, self.root, self.optimizer, self.scheduler, self.sharded = cfg, root, optimizer, scheduler, sharded
        self.config_dict = cfg.model_dump(mode="json")

    def load(self, path: Path | None) -> tuple[TrainState, dict]:
        """The state to continue from (a fresh one without ``path``) and the saved evaluator state."""
        if path is None:
            return TrainState(), {}
        saved = ckpt.load_checkpoint(path, self.root, self.optimizer, self.scheduler)
        log.info("resumed from %s at step %d", path, saved["step"])
        state = TrainState(step=saved["step"], position=Position(**saved["position"]),
                           **{k: saved[k] for k in ("tokens_seen", "examples_seen", "target_tokens_seen")})
        return state, saved.get("evaluator", {})

    def should_save(self, step: int, done: bool) -> bool:
        every = self.cfg.checkpoint.save_every
        return done or bool(every and step % every == 0)

    def save(self, state: TrainState, evaluator: dict) -> None:
        """Rank 0 writes (every rank takes part when the checkpoint is sharded), then old ones are pruned."""
        if not self.sharded and parallel.rank() != 0:
            return
        extra = state.as_dict()
        step = extra.pop("step")
        extra.update(eval_loss=evaluator.get("last_eval_loss"), evaluator=evaluator,
                     gradient_accumulation=self.cfg.batching.gradient_accumulation)
        ckpt.save_checkpoint(self.folder, step, self.root, self.optimizer, self.scheduler, extra, self.config_dict,
                             self.sharded)
        if parallel.rank() == 0:
            ckpt.prune(self.folder, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)
