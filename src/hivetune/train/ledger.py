"""What the host learns of each finished step, read from the device in batches (StepLedger)."""

from __future__ import annotations

import math
import time

import torch


class StepLedger:
    """What the host learns of each finished step (finite or skipped, its log record, whether a
    rank was signalled), read from the device in one batch.

    Without deferral (CPU, fp16's scaler, foreach AdamW) every step is read at once.
    Deferred (CUDA + fused AdamW, where the optimizer kernel skips a non-finite step on its own)
    the host reads every FLUSH_STEPS steps and at each validation, checkpoint, stop and the last
    step: between reads the host runs ahead of the GPU (W1's steps are ~25 ms; a sync each step
    left the GPU idle ~5 ms of each while the host prepared the next). The read replays the
    counters step by step, so skipped_steps, bad_in_a_row and the logged records are what the
    per-step reads gave; a rollback (max_bad_steps in a row) starts at the read that sees it.
    Reads happen at the same steps on every rank (step counts, never time), so under torchrun
    all ranks stop at the same step.

    Deferred, the host dates a record when it queues the step, up to FLUSH_STEPS steps before
    the GPU runs it (graphed W1 steps 3-5 ms apart where each takes ~16 ms), so
    with `started` (the loop's start on `clock`) a read re-dates its records: the GPU finished
    every step read by the time the read returns, so the steps since the previous read ran in
    that window, and each record's elapsed_s is placed in it by the tokens done (tokens_per_s and
    samples_per_s then follow: the window's rate).
    """

    FLUSH_STEPS = 16

    def __init__(self, deferred: bool, started: float | None = None, clock=time.perf_counter):
        self.deferred, self.started, self.clock = deferred, started, clock
        # (finite, record, signal, tokens, samples) per step
        self.pending: list[tuple[object, dict | None, object, int, int]] = []
        self.synced = 0.0  # seconds from the start to the previous read
        self.dated = 0.0  # ... to the newest record dated
        self.since = [0, 0]  # tokens and samples since that record

    def add(self, finite, record: dict | None, signal, tokens: int = 0, samples: int = 0) -> None:
        self.pending.append((finite, record, signal, tokens, samples))

    def _redate(self, now: float) -> None:
        window = max(now - self.synced, 1e-9)
        total = sum(t for *_, t, _ in self.pending)
        done = 0
        for k, (_, record, _, tokens, samples) in enumerate(self.pending):
            done += tokens
            self.since[0] += tokens
            self.since[1] += samples
            if record is None:
                continue
            share = done / total if total else (k + 1) / len(self.pending)
            elapsed = self.synced + window * share
            span = max(elapsed - self.dated, 1e-9)
            record.update(elapsed_s=round(elapsed, 3), tokens_per_s=round(self.since[0] / span, 1),
                          samples_per_s=round(self.since[1] / span, 3))
            self.dated, self.since = elapsed, [0, 0]
        self.synced = now

    def due(self, forced: bool) -> bool:
        return not self.deferred or forced or len(self.pending) >= self.FLUSH_STEPS

    def read(self, counters: dict, max_bad_steps: int) -> tuple[list[dict], bool, bool]:
        """(the log records with numbers, whether max_bad_steps non-finite steps came in a row,
        whether a rank was signalled at the newest step); counters updated in step order."""
        values = []
        for finite, record, *_ in self.pending:
            values.append(finite)
            if record is not None:
                values += [record["loss"], record["grad_norm"]]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        signal = self.pending[-1][2]
        if isinstance(signal, torch.Tensor):
            tensors.append(signal)
        host = iter(torch.stack([t.float().reshape(()) for t in tensors]).tolist() if tensors else [])
        if self.deferred and self.started is not None:
            self._redate(self.clock() - self.started)
        read = (lambda v: float(next(host)) if isinstance(v, torch.Tensor) else float(v))
        records, bad_run = [], False
        for finite, record, *_ in self.pending:
            if read(finite):
                counters["bad_in_a_row"] = 0
            else:
                counters["skipped_steps"] += 1
                counters["bad_in_a_row"] += 1
                bad_run = bad_run or counters["bad_in_a_row"] >= max_bad_steps
            if record is not None:
                loss, norm = read(record["loss"]), read(record["grad_norm"])
                records.append({**record, "loss": loss if math.isfinite(loss) else None,
                                "grad_norm": round(norm, 6) if math.isfinite(norm) else None,
                                "skipped_steps": counters["skipped_steps"]})
        signalled = bool(read(signal)) if isinstance(signal, torch.Tensor) else bool(signal)
        self.pending = []
        return records, bad_run, signalled
