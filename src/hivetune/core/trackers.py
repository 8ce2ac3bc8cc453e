"""Experiment trackers beside metrics.jsonl: MLflow and Weights & Biases, through their own clients.

Each gets the numbers of every metrics.jsonl record (``metrics.scalar_tags``: ``train/loss``,
``val/loss``...) at the record's step, and the run's config as parameters. Where they go is the
clients' own setting: ``MLFLOW_TRACKING_URI`` (a server, ``sqlite:///FILE``, ``file:DIR``; default
MLflow's own) and ``MLFLOW_EXPERIMENT_NAME`` (default hivetune); ``WANDB_MODE`` (online, offline),
``WANDB_PROJECT`` (default hivetune), ``WANDB_DIR`` (default the run folder). A resumed run goes on
in the same tracker run: the ids are kept in RUN/trackers.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes

TRACKERS = ("tensorboard", "mlflow", "wandb")
IDS_FILE = "trackers.json"


def require_tracker(name: str):
    """The client module of mlflow or wandb, or a UserError saying how to install it. Setup calls it
    before any weight is read, so a missing package costs nothing."""
    try:
        # Function-local: each client (mlflow 1.8 s, wandb 0.7 s to import) only when reported to.
        if name == "mlflow":
            import mlflow
            return mlflow
        import wandb
        return wandb
    except ImportError:
        raise UserError(f"report_to: {name} needs the {name} package, which is not installed: "
                        f"pip install 'hivetune[trackers]' (or pip install {name})") from None


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """{"lora": {"r": 8}} -> {"lora.r": "8"}: a config as tracker parameters."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


class MLflowTracker:
    """One MLflow run (MlflowClient, no global active run), named after the run folder."""

    def __init__(self, folder: Path, config: dict, run_id: str = ""):
        # Function-local: mlflow is an optional extra (hivetune[trackers]).
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "hivetune"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=folder.name,
                                             tags={"hivetune.run_folder": str(folder.resolve())}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flat_params(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, step: int, tags: list[tuple[str, float]]) -> None:
        from mlflow.entities import Metric  # function-local: the optional extra, as above

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step) for tag, value in tags])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker:
    """One W&B run, named after the run folder; `step` is logged as a metric and every other one
    plotted against it, so the steps a rollback repeats are kept, not dropped as out of order."""

    def __init__(self, folder: Path, config: dict, run_id: str = ""):
        import wandb  # function-local: wandb is an optional extra (hivetune[trackers])

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "hivetune", name=folder.name,
                              dir=os.environ.get("WANDB_DIR") or str(folder), config=config,
                              id=run_id or None, resume="allow" if run_id else None)
        self.run_id = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, tags: list[tuple[str, float]]) -> None:
        self.run.log({"step": step, **dict(tags)})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def tracker_ids(folder: Path) -> dict[str, str]:
    """The tracker runs this run folder logged to before (RUN/trackers.json), by tracker name."""
    path = Path(folder) / IDS_FILE
    try:
        ids = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return ids if isinstance(ids, dict) else {}


def open_trackers(names: list[str], folder: Path, config: dict) -> dict:
    """The MLflow / W&B trackers named in `names` by name (TensorBoard is MetricsSink's own), each
    resuming the tracker run this folder logged to before. Train setup opens them before it
    creates the run folder, so a tracker that does not start leaves nothing behind."""
    folder, ids, trackers = Path(folder), tracker_ids(folder), {}
    for name in names:
        if name in ("mlflow", "wandb"):
            require_tracker(name)
            cls = MLflowTracker if name == "mlflow" else WandbTracker
            try:
                trackers[name] = cls(folder, config, ids.get(name, ""))
            except Exception as e:  # the client's own errors (a refused URI, no login): one line
                for tracker in trackers.values():
                    tracker.close(failed=True)
                text = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else ""
                raise UserError(f"report_to: {name} did not start ({type(e).__name__}: {text})") from None
    return trackers


def save_tracker_ids(folder: Path, trackers: dict) -> None:
    """RUN/trackers.json: the tracker runs a resumed run goes on in."""
    if trackers:
        ids = {**tracker_ids(folder), **{name: t.run_id for name, t in trackers.items()}}
        atomic_write_bytes(Path(folder) / IDS_FILE, json.dumps(ids).encode())
