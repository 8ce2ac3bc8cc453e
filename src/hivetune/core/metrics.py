"""Where training metrics go: one JSON line per record in RUN/metrics.jsonl, and, with
``tensorboard`` (or ``report_to`` naming it), the same numbers as TensorBoard scalars in
RUN/tensorboard/; with ``report_to`` naming mlflow or wandb, to those too (core.trackers).

Records are the loop's own dicts: per-step ones (``step``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``...) become ``train/<key>``; validation ones (``step``, ``val_loss``,
``val_tokens``) become ``val/loss``, ``val/tokens``. Non-numeric and null values (a skipped
step's loss) are left out of TensorBoard; metrics.jsonl gets every record as it is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.trackers import open_trackers, save_tracker_ids

TENSORBOARD_DIR = "tensorboard"


def require_tensorboard():
    """torch's SummaryWriter, or a UserError saying how to install what it needs. Call it
    before loading weights, so a missing package costs nothing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("tensorboard: event files need the tensorboard package, which is not installed: "
                        "pip install 'hivetune[tensorboard]' (or pip install tensorboard)") from None
    return SummaryWriter


def scalar_tags(record: dict) -> list[tuple[str, float]]:
    """(tag, value) for every finite number in a record except its step."""
    validation = "val_loss" in record
    tags = []
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        tags.append((f"val/{key.removeprefix('val_')}" if validation else f"train/{key}", float(value)))
    return tags


class MetricsSink:
    """Append records to RUN/metrics.jsonl (flushed per record, so a crash loses at most the
    line being written) and, when asked, to TensorBoard event files in RUN/tensorboard/.

        with MetricsSink(run.folder, tensorboard=cfg.tensorboard) as sink:
            sink.write({"step": 1, "loss": 2.5, ...})
    """

    def __init__(self, folder: Path, tensorboard: bool = False, report_to: list[str] = (), config: dict | None = None,
                 trackers: dict | None = None):
        """`trackers`: those report_to names, opened already (core.trackers.open_trackers); None:
        opened here."""
        writer_cls = require_tensorboard() if tensorboard or "tensorboard" in report_to else None
        if trackers is None:
            trackers = open_trackers(list(report_to), Path(folder), config or {})
        save_tracker_ids(Path(folder), trackers)
        self.trackers = list(trackers.values())
        self.path = Path(folder) / "metrics.jsonl"
        self.file = open(self.path, "a")
        self.tensorboard = None
        if writer_cls is not None:
            self.tensorboard = writer_cls(log_dir=str(Path(folder) / TENSORBOARD_DIR))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        tags = scalar_tags(record) if self.tensorboard is not None or self.trackers else []
        if self.tensorboard is not None:
            for tag, value in tags:
                self.tensorboard.add_scalar(tag, value, global_step=record["step"])
            self.tensorboard.flush()
        for tracker in self.trackers:
            tracker.log(record["step"], tags)

    def reopen(self) -> None:
        """After metrics.jsonl was rewritten in place (a rollback cuts it back): append to the new file."""
        self.file.close()
        self.file = open(self.path, "a")

    def close(self, failed: bool = False) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.close(failed)

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, kind, *exc) -> bool:
        self.close(failed=kind is not None)
        return False
