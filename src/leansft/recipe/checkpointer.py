"""When to save, what a run's state is, and where a run resumes from.

The checkpoint files themselves are written and verified by ``leansft.core.io.checkpoint_files``; here:
``resume_point`` picks the checkpoint (and the accumulation that keeps its global step on another world
size), and the Checkpointer decides "save now?" (every ``save_every`` steps and when the run ends or is
stopped), saves the loop's state with the evaluator's, and keeps the last/best ones.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from leansft.core import distributed
from leansft.core.config import RunConfig
from leansft.core.errors import LeanSFTError
from leansft.core.io import checkpoint_files as ckpt
from leansft.recipe.batches import Position
from leansft.recipe.throughput import StepCounts
from leansft.recipe.trackers import flatten

log = logging.getLogger("leansft")

# What a resumed run may change: execution choices that compute the same values, what is honoured from the
# resume point on (a longer run, clipping, logging, eval, checkpoints), and the accumulation resume_point
# keeps consistent. Anything else is refused: the optimizer and scheduler state would silently keep the saved
# learning rate, betas and weight decay, and the saved data position means nothing in another data plan
# (data, batching, seed), nor do the saved weights under another model or adapter setup.
CHANGEABLE_ON_RESUME = (
    "trust_remote_code", "eval.", "checkpoint.", "logging.", "distributed.", "batching.gradient_accumulation",
    "training.max_steps", "training.epochs",
    "cpu.", "training.precision", "training.compile", "training.fused_layers", "training.gradient_checkpointing",
    "training.activation_offloading", "training.loss_chunk_size", "training.loss_backend", "training.attention",
    "training.verify", "training.loss_spike_factor", "training.max_grad_norm", "training.neftune_noise_alpha",
    "training.lora.bf16_base", "training.lora.merge_on_export", "training.qlora.compute_dtype",
)
NOT_COMPARED = ("output_dir", "data.cache_dir", "data.num_workers")  # where things are kept; preparation workers


def config_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: the keys whose value differs between a checkpoint's config and this run's, as
    ``key: saved -> now``. A key only one side has (another leansft version) is not compared."""
    old, new = flatten(saved), flatten(now)
    refused, allowed = [], []
    for key in sorted(old.keys() & new.keys() - set(NOT_COMPARED)):
        if old[key] != new[key]:
            free = any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE_ON_RESUME)
            (allowed if free else refused).append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return refused, allowed


@dataclass
class TrainState:
    """Everything the loop carries from step to step (and a checkpoint restores). Counts are global."""

    step: int = 0
    position: Position = field(default_factory=Position)
    tokens_seen: int = 0
    examples_seen: int = 0
    target_tokens_seen: int = 0
    step_seconds: float = 0.0  # time inside training steps, over every process of the run
    wall_seconds: float = 0.0  # wall time of the run's processes up to the last checkpoint
    finished: bool = False  # every step done (or early stopping said stop): nothing left to train

    def advance(self, position: Position, counts: StepCounts, seconds: float) -> None:
        self.step += 1
        self.position = position
        self.tokens_seen += counts.real
        self.examples_seen += counts.examples
        self.target_tokens_seen += counts.targets
        self.step_seconds += seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "position": asdict(self.position)}


def finished_run(path: Path | None, cfg: RunConfig) -> int | None:
    """The step a finished run ended at, when ``path`` is its last checkpoint, the run got to its end (the totals
    line in metrics.jsonl, and the export's model card where it exports: a run killed while exporting is not
    finished) and this config asks for no more (the same ``max_steps`` and ``epochs``); else None. Read from the
    run folder alone, before any model loads."""
    if path is None:
        return None
    state = json.loads((path / "state.json").read_text())
    saved_file, out = path / "config.yaml", path.parents[1]
    saved = (yaml.safe_load(saved_file.read_text()) or {}).get("training", {}) if saved_file.exists() else {}
    same = all(saved.get(k) == getattr(cfg.training, k) for k in ("max_steps", "epochs"))
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    try:
        last = json.loads(lines[-1]) if lines else {}
    except ValueError:  # a torn last line: the run did not end well
        last = {}
    ended = "run_wall_s" in last and last.get("step") == state["step"]
    exported = not cfg.checkpoint.export or (out / "final" / "README.md").exists()
    return state["step"] if state.get("finished") and same and ended and exported else None


def resume_point(cfg: RunConfig, out: Path, resume: str | None, world: int) -> tuple[Path | None, int]:
    """The checkpoint to resume from (None: a fresh start) and the gradient accumulation that keeps its global
    step, decided alike on every rank. Each rank finds its own (``_resume_point_here``: on node-local disks they can
    differ); the views are gathered, and unless every rank found the same checkpoint, or a fresh start, every rank
    refuses with the same words, naming each rank, its host and what it found. A rank never starts fresh while
    another resumes."""
    if world == 1:
        return _resume_point_here(cfg, out, resume, world)
    try:
        path, accum = _resume_point_here(cfg, out, resume, world)
        view = {"who": distributed.whoami(), "found": path.name if path else None, "error": None}
    except LeanSFTError as err:
        path, accum, view = None, 0, {"who": distributed.whoami(), "found": None, "error": str(err)}
    views = distributed.all_gather_object(view)
    failed = [v for v in views if v["error"]]
    if failed:  # the first rank's reason, on every rank
        raise LeanSFTError(f"{failed[0]['who']}: {failed[0]['error']}")
    if len({v["found"] for v in views}) > 1:
        seen = "; ".join(f"{v['who']}: {v['found'] or 'no checkpoint (a fresh start)'}" for v in views)
        raise LeanSFTError(
            f"the ranks would not resume from the same checkpoint ({seen}): each node reads output_dir {out} on its "
            "own disk", hint="give every node the same shared output_dir (node-local checkpoints are not supported "
                             "yet), or copy the checkpoint to every node; nothing was changed")
    return path, accum


def _resume_point_here(cfg: RunConfig, out: Path, resume: str | None, world: int) -> tuple[Path | None, int]:
    """This rank's view: the checkpoint it finds and the accumulation that keeps the checkpoint's global step (world
    size x accumulation micro-batches) on this world size. A fresh start over an earlier run's checkpoints, or a
    step that cannot be kept, is refused before anything is written."""
    accum = cfg.batching.gradient_accumulation
    path = ckpt.find_resume(out, resume) if resume else None
    if path is None:
        earlier = ckpt.list_checkpoints(out / "checkpoints")
        if earlier:  # every rank checks, so all stop together
            raise LeanSFTError(
                f"output_dir already holds checkpoints of an earlier run (latest {earlier[-1].name})",
                file=str(out),
                hint="continue it with --resume auto (a finished run has nothing left to train: export, report "
                     "or eval it), or choose another output_dir (nothing was changed)",
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
    def __init__(self, cfg: RunConfig, out: Path, root, optimizer, scheduler, sharded: bool = False,
                 data_fingerprint: str | None = None) -> None:
        self.folder = out / "checkpoints"
        self.cfg, self.root, self.optimizer, self.scheduler, self.sharded = cfg, root, optimizer, scheduler, sharded
        self.config_dict = cfg.model_dump(mode="json")
        self.data_fingerprint = data_fingerprint  # the training data's (TokenizedDataset.fingerprint)

    def load(self, path: Path | None) -> tuple[TrainState, dict]:
        """The state to continue from (a fresh one without ``path``) and the saved evaluator state."""
        if path is None:
            return TrainState(), {}
        self._check_config(path)
        saved = ckpt.load_checkpoint(path, self.root, self.optimizer, self.scheduler)
        self._check_data(path, saved.get("data_fingerprint"))
        log.info("resumed from %s at step %d", path, saved["step"])
        state = TrainState(step=saved["step"], position=Position(**saved["position"]),
                           **{k: saved[k] for k in ("tokens_seen", "examples_seen", "target_tokens_seen")},
                           **{k: saved[k] for k in ("step_seconds", "wall_seconds", "finished") if k in saved})
        return state, saved.get("evaluator", {})

    def _check_config(self, path: Path) -> None:
        """Refuse a resume whose config changes what the checkpoint's state means; log the changes allowed."""
        saved_file = path / "config.yaml"
        if not saved_file.exists():
            return
        refused, allowed = config_changes(yaml.safe_load(saved_file.read_text()) or {}, self.config_dict)
        if refused:
            raise LeanSFTError(
                "resuming with a changed config: " + "; ".join(refused) + ". The change would be silently lost "
                "(the optimizer and scheduler state keep the saved learning rate, betas and weight decay) or would "
                "change what the saved weights and data position mean", file=str(path),
                hint="resume with the run's own config (config.yaml in the checkpoint), or export the checkpoint "
                     "(leansft export) and start a new run from it in another output_dir")
        if allowed:
            log.warning("resuming with changes from the checkpoint's config: %s", "; ".join(allowed))

    def _check_data(self, path: Path, saved: str | None) -> None:
        """Refuse a resume on training data other than the checkpoint's (``saved``: its fingerprint): the same
        config can read a data file that has changed since, and the saved position would then point at other
        examples."""
        if saved is not None and self.data_fingerprint is not None and saved != self.data_fingerprint:
            raise LeanSFTError(
                "the training data differ from the checkpoint's (a source file, the tokenizer, the template or "
                "the cleaning changed since): its data position would point at other examples", file=str(path),
                hint="resume with the data the run started with, or export the checkpoint (leansft export) and "
                     "start a new run from it in another output_dir")

    def should_save(self, step: int, done: bool) -> bool:
        every = self.cfg.checkpoint.save_every
        return done or bool(every and step % every == 0)

    def save(self, state: TrainState, evaluator: dict) -> None:
        """Rank 0 writes (every rank takes part when the checkpoint is sharded), then old ones are pruned."""
        if not self.sharded and distributed.rank() != 0:
            return
        extra = state.as_dict()
        step = extra.pop("step")
        extra.update(eval_loss=evaluator.get("last_eval_loss"), evaluator=evaluator,
                     gradient_accumulation=self.cfg.batching.gradient_accumulation,
                     data_fingerprint=self.data_fingerprint)
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.folder, step, self.root, self.optimizer, self.scheduler, extra,
                                    self.config_dict, self.sharded)
        if distributed.rank() == 0:
            size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
            log.info("saved checkpoint %s (%.1f MB, %.1f s)", path, size / 1e6, time.perf_counter() - t0)
            ckpt.prune(self.folder, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)
