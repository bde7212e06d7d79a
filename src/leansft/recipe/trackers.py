"""Experiment trackers: TensorBoard, Weights & Biases, MLflow. Rank 0 only.

Every metrics.jsonl record goes to each tracker with the same keys and step; the resolved config is
logged as parameters; samples as a table (W&B) or an artifact (MLflow); the final report and model card
as artifacts. A tracker whose package is missing is a clear error naming the pip install. Each tracker's
own environment (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ``WANDB_PROJECT``, ``WANDB_DIR``,
``WANDB_MODE``...) is honoured unless the config sets the value; where the run went is logged.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path

from leansft.core.config import RunConfig
from leansft.core.errors import ConfigError

log = logging.getLogger("leansft")


def _project(cfg: RunConfig, env: str) -> str:
    """``logging.project`` where the config sets it, else the tracker's environment variable, else the default."""
    if "project" in cfg.logging.model_fields_set:
        return cfg.logging.project
    return os.environ.get(env) or cfg.logging.project


def _require(tracker: str, module: str, package: str):
    """The tracker's module, or a clear error naming the pip install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.trackers '{tracker}' needs the {package} package (pip install {package}, or "
                          "pip install 'leansft[trackers]')", field="logging.trackers") from None


def _scalars(record: dict) -> dict[str, float]:
    """The record's numbers (booleans and the step left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, sort_keys=True)
    return out


class TensorBoard:
    def __init__(self, cfg: RunConfig, out: Path) -> None:
        tensorboard = _require("tensorboard", "torch.utils.tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(str(out / "tensorboard"))

    def log(self, record: dict) -> None:
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()

    def samples(self, rows: list[dict]) -> None:
        pass

    def artifact(self, path: Path) -> None:
        pass

    def finish(self) -> None:
        self.writer.close()


class Wandb:
    """W&B run in OUTPUT_DIR/wandb (or WANDB_DIR); offline when WANDB_MODE=offline (no account or network
    needed); the project from ``logging.project``, else WANDB_PROJECT."""

    def __init__(self, cfg: RunConfig, out: Path) -> None:
        self.wandb = wandb = _require("wandb", "wandb", "wandb")
        os.environ.setdefault("WANDB_SILENT", "true")
        project, folder = _project(cfg, "WANDB_PROJECT"), os.environ.get("WANDB_DIR") or str(out)
        self.run = wandb.init(project=project, name=cfg.logging.run_name or out.name, dir=folder,
                              config=cfg.model_dump(mode="json"), reinit="finish_previous")
        log.info("wandb: run %s in project %s (%s, files in %s)", self.run.id, project,
                 os.environ.get("WANDB_MODE", "online"), folder)

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def samples(self, rows: list[dict]) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "answer"],
                                 data=[[r["step"], r["prompt"], r["answer"]] for r in rows])
        self.run.log({"samples": table}, step=rows[-1]["step"])

    def artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self) -> None:
        self.run.finish()


class Mlflow:
    """MLflow run at ``logging.mlflow_tracking_uri``, else MLFLOW_TRACKING_URI, else a local file store in
    OUTPUT_DIR/mlruns; experiment ``logging.project``, else MLFLOW_EXPERIMENT_NAME."""

    def __init__(self, cfg: RunConfig, out: Path) -> None:
        mlflow = _require("mlflow", "mlflow", "mlflow-skinny")
        uri = (cfg.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (out / "mlruns").resolve().as_uri())
        if uri.startswith("file:") or "://" not in uri:  # a local file store: no server, no database
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.mlflow = mlflow
        experiment = _project(cfg, "MLFLOW_EXPERIMENT_NAME")
        try:  # at start, so a store the run cannot reach stops it before anything trains, in one line
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(experiment)
            self.run = mlflow.start_run(run_name=cfg.logging.run_name or out.name)
        except Exception as err:  # noqa: BLE001 - whatever MLflow raises for a store it cannot use
            raise ConfigError(f"MLflow cannot use the tracking store {uri}: {type(err).__name__}: {str(err)[:300]}",
                              field="logging.mlflow_tracking_uri",
                              hint="a file store (file:///path), sqlite:///path.db (with sqlalchemy and alembic, which "
                                   "pip install 'leansft[trackers]' brings) or an http(s) MLflow server") from None
        log.info("mlflow: run %s in experiment %s at %s", self.run.info.run_id, experiment, uri)
        mlflow.log_params(flatten(cfg.model_dump(mode="json")))
        self.out = out

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics(_scalars(record), step=record["step"])

    def samples(self, rows: list[dict]) -> None:
        pass  # samples.jsonl goes up as an artifact at the end

    def artifact(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def finish(self) -> None:
        samples = self.out / "samples.jsonl"
        if samples.exists():
            self.mlflow.log_artifact(str(samples))
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


class Trackers:
    """All configured trackers as one (nothing at all on ranks other than 0)."""

    def __init__(self, cfg: RunConfig, out: Path, enabled: bool) -> None:
        names = list(dict.fromkeys(cfg.logging.trackers + (["tensorboard"] if cfg.logging.tensorboard else [])))
        self.items = [TRACKERS[n](cfg, out) for n in names] if enabled else []

    def log(self, record: dict) -> None:
        for t in self.items:
            t.log(record)

    def samples(self, rows: list[dict]) -> None:
        for t in self.items:
            if rows:
                t.samples(rows)

    def artifact(self, path: Path) -> None:
        for t in self.items:
            if path.exists():
                t.artifact(path)

    def finish(self) -> None:
        for t in self.items:
            t.finish()
