"""When to save, what a run's state is, and where a run resumes from.

The checkpoint files themselves are written and verified by ``leansft.core.io.checkpoint_files``; here:
``resume_point`` picks the checkpoint (and the accumulation that keeps its global step on another world
size), and the Checkpointer decides "save now?" (every ``save_every`` steps and when the run ends or is
stopped), saves the loop's state with the evaluator's, and keeps the last/best ones.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from leansft.core import distributed
from leansft.core.config import RunConfig
from leansft.core.errors import LeanSFTError
from leansft.core.io import async_save
from leansft.core.io import checkpoint_files as ckpt
from leansft.core.io import run_lock
from leansft.core.io.host_copies import HostBuffers
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


def checkpoint_storage(cfg: RunConfig, out: Path) -> distributed.Storage:
    """How the ranks share ``output_dir`` (``distributed.storage_of``: every rank reads back a token file), held
    against ``checkpoint.storage``: ``shared`` refuses anything but one folder for every rank, naming a rank that
    cannot see rank 0's; ``node_local`` refuses a folder that ranks on different nodes share (torchrun's node
    rank, ``GROUP_RANK``), naming two of them; ``auto`` takes what is there. Said once, by rank 0."""
    storage = distributed.storage_of(out)
    want, world = cfg.checkpoint.storage, distributed.world_size()
    if want == "shared" and not storage.shared:
        blind = next(r for r in range(world) if r not in storage.group(0))
        raise LeanSFTError(
            f"checkpoint.storage is shared, but output_dir {out} is not one folder for every rank: "
            f"{storage.names[blind]} does not see what rank 0 writes there ({storage.describe()})",
            hint="give every node the same mounted output_dir, or set checkpoint.storage: node_local (each node "
                 "keeps its own part of every checkpoint)")
    if want == "node_local" and world > 1:
        nodes = distributed.all_gather_object(os.environ.get("GROUP_RANK") or socket.gethostname())
        mixed = next((g for g in storage.groups if len({nodes[r] for r in g}) > 1), None)
        if mixed is not None:
            other = next(r for r in mixed if nodes[r] != nodes[mixed[0]])
            raise LeanSFTError(
                f"checkpoint.storage is node_local, but {storage.names[mixed[0]]} and {storage.names[other]}, on "
                f"different nodes, share output_dir {out}: it is shared storage", file=str(out),
                hint="set checkpoint.storage: shared (or auto), or give each node a folder of its own")
    if world > 1 and distributed.rank() == 0:
        if storage.shared:
            log.info("checkpoints: output_dir %s is one folder for every rank (shared storage); rank 0 writes them",
                     out)
        else:
            log.info("checkpoints: output_dir %s is each node's own (node-local storage; %s): each node writes its "
                     "part of every checkpoint", out, storage.describe())
    return storage


def claim_output_dir(cfg: RunConfig, out: Path) -> distributed.Storage:
    """Hold ``out`` for this run (``run_lock``) and say how the ranks share it (``checkpoint_storage``). Rank 0 takes
    the lock before anything in the folder changes; once the storage check has shown which ranks see their own
    folder (node-local disks), the first rank of each other group takes its folder's. A folder another run holds is
    one refusal, in the same words on every rank. So is a folder holding files of the names a run writes that no
    leansft run wrote (``foreign_files``): the run would replace them."""
    foreign = foreign_files(out) if distributed.rank() == 0 else []
    if distributed.world_size() > 1:
        foreign = distributed.broadcast_object(foreign)
    if foreign:
        raise LeanSFTError(f"output_dir holds {', '.join(foreign)}, which a run would replace, and no leansft run "
                           "wrote them", file=str(out),
                           hint="choose another output_dir (an empty or new folder); nothing was changed")
    refusal = run_lock.acquire(out) if distributed.rank() == 0 else None
    try:
        _refuse_held(out, [(distributed.whoami(), refusal)] if distributed.world_size() == 1
                     else [("rank 0", distributed.broadcast_object(refusal))])
        storage = checkpoint_storage(cfg, out)
        mine = run_lock.acquire(out) if storage.writer() and distributed.rank() != 0 else None
        _refuse_held(out, distributed.all_gather_object((distributed.whoami(), mine)))
    except BaseException:
        run_lock.release(out)
        raise
    return storage


RUN_FILES = ("config.yaml", "data_report.json", "metrics.jsonl", "samples.jsonl", "suites.jsonl", "progress.json",
             "report.md", "report.png", "report.html", "final")


def foreign_files(out: Path) -> list[str]:
    """The files in ``out`` a run would replace (``RUN_FILES``) where no leansft run has used ``out``: it holds
    neither the run lock's file (left by every run since) nor a checkpoint with a manifest (an older run's)."""
    if not out.is_dir() or (out / run_lock.LOCK).exists():
        return []
    if any((p / ckpt.MANIFEST).is_file() for p in ckpt.list_checkpoints(out / "checkpoints")):
        return []
    return [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]


def _refuse_held(out: Path, views: list[tuple[str, str | None]]) -> None:
    held = [(who, by) for who, by in views if by]
    if held:
        who, by = held[0]
        where = f" (seen by {who})" if distributed.world_size() > 1 else ""
        raise LeanSFTError(f"output_dir is in use by another leansft run: {by}{where}; one run per output_dir at a "
                           "time", file=str(out),
                           hint="wait for that run to end (or stop it), or choose another output_dir; nothing in the "
                                "folder was changed")


def resume_point(cfg: RunConfig, out: Path, resume: str | None, world: int,
                 storage: distributed.Storage | None = None, data_parallel: int | None = None
                 ) -> tuple[Path | None, int]:
    """The checkpoint to resume from (None: a fresh start) and the gradient accumulation that keeps its global
    step, decided alike on every rank (``agreed_checkpoint``). A step that cannot be kept is refused. The step
    is counted in micro-batches over the data-parallel ranks (``data_parallel``, default ``world``): the ranks of
    a context-parallel group share theirs."""
    accum = cfg.batching.gradient_accumulation
    storage = storage or distributed.Storage.one_folder()
    if storage.writer():  # the run holds output_dir (``run_lock``): a .tmp-* there is an earlier run's, killed
        ckpt.clean_unfinished(out / "checkpoints")
    path = agreed_checkpoint(out, resume, storage,
                             world > 1 and cfg.distributed.strategy == "fsdp")
    if path is None:
        return None, accum
    saved = json.loads((path / "state.json").read_text())
    readers, was = data_parallel or world, saved.get("data_parallel", saved.get("world_size", 1))
    per_step = was * saved.get("gradient_accumulation", accum)
    if per_step % readers:
        raise LeanSFTError(
            f"the checkpoint's step is {per_step} micro-batches ({was} data-parallel ranks x accumulation "
            f"{saved.get('gradient_accumulation', accum)}), which {readers} data-parallel ranks cannot split evenly",
            file=str(path), hint="resume on a data-parallel size (world / context_parallel) that divides it")
    if per_step // readers != accum and distributed.rank() == 0:
        log.warning("resuming a run of %d data-parallel ranks on %d: gradient_accumulation %d -> %d keeps the same "
                    "global step", was, readers, accum, per_step // readers)
    return path, per_step // readers


def agreed_checkpoint(out: Path, resume: str | None, storage: distributed.Storage, sharded: bool) -> Path | None:
    """One checkpoint for every rank, or one refusal in the same words on every rank. The first rank of each group
    of ranks sharing a folder (``storage``) speaks for it: it lists its checkpoints and verifies (``damage_for``) what its ranks will read. ``auto``: the newest checkpoint
    every group holds intact (newer or damaged ones are named in the log and skipped); none anywhere is a fresh
    start, but none in common while some group holds one is refused: a rank never starts fresh while another
    resumes. A path: it, intact for every group. Without ``resume``: a fresh start, refused over earlier checkpoints."""
    folder, writer, world = out / "checkpoints", storage.writer(), distributed.world_size()
    where = (lambda who: f"{who}: ") if world > 1 else (lambda who: "")
    if resume and resume != "auto":
        path = Path(resume)
        problem = None if not writer else ("not a checkpoint folder" if not path.is_dir()
                                           else ckpt.damage_for(path, storage, sharded))
        failed = [(who, p) for who, p in distributed.all_gather_object((distributed.whoami(), problem)) if p]
        if failed:
            who, p = failed[0]
            raise LeanSFTError(where(who) + (p if p == "not a checkpoint folder" else f"damaged checkpoint: {p}"),
                               file=resume)
        return path
    names = [p.name for p in ckpt.list_checkpoints(folder)] if writer else None
    held = [(who, n) for who, n in distributed.all_gather_object((distributed.whoami(), names)) if n is not None]
    if not resume:
        earlier = next(((who, n) for who, n in held if n), None)
        if earlier:  # every rank knows, so all stop together
            raise LeanSFTError(
                f"output_dir already holds checkpoints of an earlier run (latest {earlier[1][-1]}"
                + (f" on {earlier[0]})" if world > 1 else ")"), file=str(out),
                hint="continue it with --resume auto (a finished run has nothing left to train: export, report "
                     "or eval it), or choose another output_dir (nothing was changed)")
        return None
    common = sorted(set.intersection(*(set(n) for _, n in held)), key=lambda n: int(n[len(ckpt.PREFIX):]), reverse=True)
    skipped = []
    for name in common:
        problem = ckpt.damage_for(folder / name, storage, sharded) if writer else None
        failed = [(who, p) for who, p in distributed.all_gather_object((distributed.whoami(), problem)) if p]
        if not failed:
            if distributed.rank() == 0:
                for n, why in skipped:
                    log.warning("checkpoint %s is damaged (%s); resuming from %s instead", n, why, name)
                step = int(name[len(ckpt.PREFIX):])
                for who, n in held:
                    newer = [x for x in n if int(x[len(ckpt.PREFIX):]) > step and x not in common]
                    if newer:
                        log.warning("%s holds %s, which not every node holds; resuming from %s, the newest every "
                                    "node holds", who, ", ".join(newer), name)
            return folder / name
        skipped.append((name, "; ".join(where(who) + p for who, p in failed)))
    if not any(n for _, n in held):
        return None
    if len(held) == 1:
        raise LeanSFTError("no intact checkpoint to resume: " + "; ".join(f"{n}: {w}" for n, w in skipped),
                           file=str(folder))
    seen = "; ".join(f"{who}: {', '.join(n) or 'none'}" for who, n in held)
    damaged = f"; damaged: {'; '.join(f'{n}: {w}' for n, w in skipped)}" if skipped else ""
    raise LeanSFTError(
        f"the nodes hold no intact checkpoint in common to resume from (checkpoints by node: {seen}{damaged}): each "
        f"node reads output_dir {out} on its own disk, and a rank must not start fresh while another resumes",
        hint="copy the newest checkpoint folder to every node's output_dir, or resume from one every node holds "
             "(--resume PATH); nothing was changed")


class Checkpointer:
    def __init__(self, cfg: RunConfig, out: Path, root, optimizer, scheduler, sharded: bool = False,
                 data_fingerprint: str | None = None, storage: distributed.Storage | None = None) -> None:
        self.folder = out / "checkpoints"
        self.cfg, self.root, self.optimizer, self.scheduler, self.sharded = cfg, root, optimizer, scheduler, sharded
        self.storage = storage or distributed.Storage.one_folder()
        self.config_dict = cfg.model_dump(mode="json")
        self.data_fingerprint = data_fingerprint  # the training data's (TokenizedDataset.fingerprint)
        # checkpoint.async: every rank writes its part on a thread of its own, the ranks agreeing on a group of theirs
        self.background = async_save.BackgroundSave(root) if cfg.checkpoint.async_ else None
        self.buffers = HostBuffers() if self.background is not None else None
        self.group = distributed.side_group(cfg.distributed.timeout_s) if self.background is not None else None
        self.waits: list[float] = []  # seconds the loop waited for each save (staging and a save still in flight)

    def load(self, path: Path | None) -> tuple[TrainState, dict]:
        """The state to continue from (a fresh one without ``path``) and the saved evaluator state."""
        if path is None:
            return TrainState(), {}
        self._check_config(path)
        saved = ckpt.load_checkpoint(path, self.root, self.optimizer, self.scheduler, verified=True)
        self._check_data(path, saved.get("data_fingerprint"))
        log.info("resumed from %s at step %d", path, saved["step"])
        self._follow_schedule(saved["step"])
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

    def _follow_schedule(self, step: int) -> None:
        """The learning rate from the schedule this run built, from its first resumed step on. The saved optimizer
        holds the rate the saved schedule set for that step: where ``max_steps`` or ``epochs`` changed, one step
        would run at the old schedule's end (0 after a cosine). The same schedule gives the same numbers."""
        s = self.scheduler
        was = [g["lr"] for g in self.optimizer.param_groups]
        now = [base * f(s.last_epoch) for base, f in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, now):
            group["lr"] = lr
        s._last_lr = list(now)  # what get_last_lr() reports (LambdaLR keeps it there)
        if was == now or distributed.rank() != 0:
            return
        peak = now[0] / max(s.base_lrs[0], 1e-30)
        log.warning(
            "the learning-rate schedule changed with the run's length: step %d runs at lr %.2e of the new schedule "
            "(%.0f%% of the peak; the saved one had reached %.2e)%s", step + 1, now[0], 100 * peak, was[0],
            "" if peak >= 0.5 or self.cfg.training.schedule == "constant" else
            ": a decayed schedule extended trains little more; to train materially further, export this run and "
            "start a new one from it (its own warm-up and decay)")

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

    def save(self, state: TrainState, evaluator: dict, last: bool = False) -> None:
        """Every rank takes part (``save_checkpoint``); then each folder's writer prunes its old ones. With
        ``checkpoint.async`` each rank's part is copied to the host and written in the background (``async_save``);
        ``last``: the run ends after this save, which is then awaited."""
        extra = state.as_dict()
        step = extra.pop("step")
        extra.update(eval_loss=evaluator.get("last_eval_loss"), evaluator=evaluator,
                     gradient_accumulation=self.cfg.batching.gradient_accumulation,
                     data_parallel=distributed.world_size() // self.cfg.distributed.context_parallel,
                     data_fingerprint=self.data_fingerprint)
        t0 = time.perf_counter()
        if self.background is None:
            path = ckpt.save_checkpoint(self.folder, step, self.root, self.optimizer, self.scheduler, extra,
                                        self.config_dict, self.sharded, self.storage)
            self.waits.append(time.perf_counter() - t0)
            self._written(path, time.perf_counter() - t0)
            return
        self.background.wait()  # at most one save in flight
        snap = ckpt.take_snapshot(step, self.root, self.optimizer, self.scheduler, extra, self.sharded, self.storage,
                                  self.buffers)
        self.background.start(step, self.folder, lambda: ckpt.write_snapshot(
            self.folder, snap, self.root, self.config_dict, self.sharded, self.storage, self.group), self._written)
        if last:
            self.background.wait()
        self.waits.append(time.perf_counter() - t0)

    def _written(self, path: Path, seconds: float) -> None:
        """After a checkpoint is in place (on the writer thread where async): said, and the old ones pruned."""
        if distributed.rank() == 0:
            size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
            log.info("saved checkpoint %s (%.1f MB, %.1f s%s%s)", path, size / 1e6, seconds,
                     "" if self.storage.shared else f", on each of {len(self.storage.groups)} nodes",
                     ", in the background" if self.background is not None else "")
        if self.storage.writer():
            ckpt.prune(self.folder, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, err, tb) -> None:
        """A save still being written is waited for when the loop ends, however it ends: its error raised, unless
        the loop's own is on its way (then logged)."""
        if self.background is not None:
            try:
                self.background.wait()
            except LeanSFTError as failed:
                if err is None:
                    raise
                log.error("%s", failed)
        if self.waits and distributed.rank() == 0:
            waits = sorted(self.waits)
            log.info("checkpoints: the training loop waited %.2f s per save (median of %d%s)", waits[len(waits) // 2],
                     len(waits), ", written in the background" if self.background is not None else "")
