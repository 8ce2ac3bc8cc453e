"""Checkpoints a crash cannot corrupt, and resuming a run from its newest good one.

A checkpoint is ``RUN/checkpoints/step-NNNNNN/``::

    adapter_config.json, adapter_model.safetensors   the LoRA weights (PEFT format)
    trainer_state.pt   optimizer, scheduler, grad scaler, RNG states, step, plan, counters
    manifest.json      sha256 and size of every file above, the step, the config hash

Writing: everything goes into ``.step-NNNNNN.tmp-PID/``, each file fsynced, the manifest last;
then the folder is renamed into place and the parent fsynced. A kill at any moment leaves
either no ``step-NNNNNN`` or a complete one. A checkpoint without a manifest, or whose files do
not match it (a disk error, a copy cut short), is never loaded: the previous one is used.

The step number is the data position: the step plan is a pure function of the config
(``data.step_plan.plan_steps``), so resuming at step N rebuilds the plan and starts at its N-th entry; the
plan's length and hash are stored to catch a changed data file.

``trainer_state.pt`` holds only tensors, dicts, lists, numbers and None, so it loads with
``torch.load(weights_only=True)``: loading a checkpoint never runs pickled code.

Keeping: the newest ``keep_checkpoints`` complete ones; an incomplete one goes only once a newer
complete one exists (prune_checkpoints). When: every ``save_every`` steps, every
``save_every_minutes`` and at the end (SaveSchedule); on an exception in a step, the last
completed step (SaveOnError). A run folder is one hivetune marked (existing_run): --output and
--resume touch no other folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from hivetune.core.config import load_config, load_run_config, to_dict
from hivetune.core.errors import UserError
from hivetune.core.hub import base_model_name
from hivetune.core.fileio import (LOCK_NAME, RUN_FORMAT, RUN_MARKER, atomic_write_bytes, confined,
                                  disk_error_message, fsync_dir, is_disk_error, pause_for_tests, recover_folder,
                                  run_marker_format, sha256_file, write_run_marker)
from hivetune.data.step_plan import BLOCK, StepPlan
from hivetune.model.lora import ADAPTER_WEIGHTS, lora_modules, save_adapter

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
FORMAT = 1
# The run's adapter folders, each replaced whole (fileio.write_folder_atomically): the final
# adapter/ and, with early stopping, best_adapter/.
ADAPTER_FOLDERS = ("adapter", "best_adapter")


def config_hash(run_folder: Path) -> str:
    """sha256 of RUN/config.yaml as written: ties a checkpoint to its run's config, and stays
    valid when a later hivetune adds config fields (the file is not rewritten on resume)."""
    return sha256_file(Path(run_folder) / "config.yaml")


def plan_hash(steps: StepPlan | list[list[int]]) -> str:
    """sha256 of the plan as compact JSON ([[3,1],[0,2]]), written a block of steps at a time: a
    StepPlan and a list of lists of the same steps hash alike."""
    digest = hashlib.sha256(b"[")
    for start in range(0, len(steps), BLOCK):
        block = steps[start:start + BLOCK]
        text = json.dumps(block.tolist() if isinstance(block, StepPlan) else block, separators=(",", ":"))
        digest.update(("," if start else "").encode() + text[1:-1].encode())
    digest.update(b"]")
    return digest.hexdigest()


def capture_rng() -> dict:
    """Python, torch CPU and CUDA generator states as integer tensors."""
    version, internal, gauss = random.getstate()
    state = {"python": torch.tensor(internal, dtype=torch.int64), "python_version": version,
             "python_gauss": gauss, "torch": torch.get_rng_state(), "cuda": []}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()),
                     state["python_gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def save_checkpoint(run, step: int, counters: dict, gathered: tuple | None = None) -> Path:
    """Write checkpoints/step-NNNNNN/ atomically (see the module docstring); keep the last
    cfg.keep_checkpoints. `counters`: loop totals to restore with the step (skipped steps...).
    `gathered`: (LoRA tensors, optimizer state dict) already collected from every rank (FSDP).

    A full or read-only disk (ENOSPC, EDQUOT, EROFS, EACCES) stops with a one-line UserError: the
    temp folder is removed, so no half-written checkpoint stays, and the earlier ones are untouched."""
    root = run.folder / "checkpoints"
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    try:
        _write_checkpoint(run, step, counters, root, tmp, gathered)
        if final.exists():  # a bad checkpoint of this step from before a crash: move it out of the way
            _discard(final)
        os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_disk_error(e):
            raise
        saved = checkpoint_folders(root)
        last = (f"the last checkpoint, {saved[-1]}, is intact; make room, then resume with "
                f"hivetune train --resume {run.folder}") if saved else "no earlier checkpoint exists"
        raise UserError(f"{disk_error_message(e, f'checkpoint of step {step}', root)}; {last}") from None
    try:
        fsync_dir(root)
        prune_checkpoints(root, run.cfg.keep_checkpoints)
    except OSError as e:  # the new checkpoint is in place: old ones staying is not worth stopping for
        print(f"hivetune: warning: could not remove old checkpoints ({e})", file=sys.stderr)
    return final


def _write_checkpoint(run, step: int, counters: dict, root: Path, tmp: Path, gathered: tuple | None = None) -> None:
    """Everything into `tmp`, each file fsynced, the manifest last."""
    tensors, optimizer_state = gathered or (None, run.optimizer.state_dict())
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    base = base_model_name(run.cfg.model, run.model_path)
    save_adapter(run.model, run.spec, tmp, base, tensors=tensors)  # each file fsynced
    pause_for_tests()
    state = {
        "format": FORMAT, "step": step, "plan_length": len(run.steps), "plan_sha256": plan_hash(run.steps),
        "examples": len(run.data), "config_sha256": config_hash(run.folder),
        "optimizer": optimizer_state, "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler is not None else {},
        "rng": capture_rng(), "counters": dict(counters),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(tmp / STATE, buffer.getvalue())
    pause_for_tests()
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {"format": FORMAT, "step": step, "config_sha256": state["config_sha256"],
                "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files}}
    atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks it complete
    fsync_dir(tmp)
    pause_for_tests()


def _discard(folder: Path) -> None:
    """Rename out of sight first (atomic), then delete: a kill mid-delete leaves only a .trash."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    pause_for_tests()
    shutil.rmtree(trash, ignore_errors=True)


def checkpoint_folders(root: Path) -> list[Path]:
    """step-NNNNNN folders, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=_step_of)


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (complete: a checkpoint that cannot be loaded
    does not count). Older ones go, and so does an incomplete one older than the newest complete
    one; nothing newer than that one is touched, so the last loadable checkpoint always stays."""
    folders = checkpoint_folders(root)
    complete = [f for f in folders if not incomplete(f)]
    if not complete:
        return
    kept, newest = complete[-max(1, keep):], _step_of(complete[-1])
    for stale in folders:
        if stale not in kept and _step_of(stale) < newest:
            _discard(stale)


def _step_of(folder: Path) -> int:
    return int(folder.name[5:])


def read_manifest(folder: Path) -> tuple[dict, str]:
    """A checkpoint's manifest and "", or {} and why it cannot be used: missing (it is written
    last, so the checkpoint is incomplete), unreadable, or not listing the checkpoint's files."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return {}, "no manifest.json (written last, so the checkpoint is incomplete)"
    except (OSError, ValueError) as e:
        return {}, f"unreadable manifest.json ({e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or STATE not in files or ADAPTER_WEIGHTS not in files:
        return {}, "manifest.json does not list the checkpoint's files"
    return manifest, ""


def incomplete(folder: Path) -> str:
    """Why `folder` cannot be a loadable checkpoint, from its manifest and file sizes alone
    (verify_checkpoint hashes every file too, before a load); "" when it may be."""
    manifest, why = read_manifest(folder)
    if why:
        return why
    for name, expected in manifest["files"].items():
        path = folder / str(name)
        if not isinstance(expected, dict) or not path.is_file() or path.stat().st_size != expected.get("bytes"):
            return f"{name} is missing or of another size"
    return ""


def remove_leftovers(root: Path) -> None:
    """Temp and trash folders of killed processes (never loaded; safe to delete)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".step-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(folder: Path) -> str:
    """Why `folder` must not be loaded, or "" when its manifest and every checksum match."""
    manifest, why = read_manifest(folder)
    if why:
        return why
    if manifest.get("step") != _step_of(folder):
        return f"manifest.json names step {manifest.get('step')}"
    for name, expected in manifest["files"].items():
        try:
            path = confined(folder, name, "manifest.json names")
        except UserError as e:
            return str(e).partition(": ")[2]
        if not isinstance(expected, dict):
            return f"manifest.json entry {name!r} is not an object"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected.get("bytes") or sha256_file(path) != expected.get("sha256"):
            return f"{name} does not match its sha256 in manifest.json"
    return ""


def newest_valid_checkpoint(run_folder: Path) -> Path | None:
    """The newest checkpoint that verifies; each bad newer one gets a warning line on stderr."""
    for folder in reversed(checkpoint_folders(Path(run_folder) / "checkpoints")):
        reason = verify_checkpoint(folder)
        if not reason:
            return folder
        print(f"hivetune: warning: {folder}: {reason}; using the previous checkpoint", file=sys.stderr)
    return None


def load_lora_weights(model, folder: Path) -> None:
    """Copy the LoRA tensors of folder/adapter_model.safetensors (PEFT names; a checkpoint's, or
    the run's best_adapter/) into the model's LoRA parameters; an FSDP2 shard keeps its part. A
    tensor missing or of another shape is a UserError naming the file."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    tensors = load_file(str(path))
    with torch.no_grad():
        for name, m in lora_modules(model):
            for part in ("lora_A", "lora_B"):
                p = getattr(m, part).weight
                t = tensors.get(f"base_model.model.{name}.{part}.weight")
                if t is None or t.shape != p.shape:  # a DTensor's shape is the whole tensor's
                    raise UserError(f"{path}: no tensor of shape {tuple(p.shape)} for {name}.{part}")
                t = t.to(p.device)
                if hasattr(p, "device_mesh"):  # an FSDP2 shard: keep this rank's part
                    from torch.distributed.tensor import distribute_tensor

                    t = distribute_tensor(t, p.device_mesh, p.placements)
                p.copy_(t)


def load_checkpoint(run, folder: Path, totals: bool = False) -> dict:
    """Restore LoRA weights, optimizer, scheduler, scaler and RNG from `folder` into `run`;
    return the state's step and counters. Call it last before the loop: it sets the RNG.
    `totals`: include the run's time and tokens so far (TOTALS; a resume wants them, a rollback
    within the same process goes on counting its own)."""
    state = torch.load(folder / STATE, map_location="cpu", weights_only=True)
    where = f"{folder}"
    if state.get("format") != FORMAT:
        raise UserError(f"{where}: checkpoint format {state.get('format')!r}; this hivetune reads {FORMAT}")
    if state["config_sha256"] != config_hash(run.folder):
        raise UserError(f"{where}: written for a different config.yaml than {run.folder / 'config.yaml'}")
    world, now = state["counters"].get("world", 1), getattr(getattr(run, "parallel", None), "world", 1)
    if world != now and state["plan_sha256"] != plan_hash(run.steps):
        raise UserError(f"{where}: written by {world} processes (global batch {world} x batch_size x grad_accum); "
                        f"this run has {now}: resume with --nproc-per-node {world}, or change grad_accum in a "
                        f"new run")
    if state["plan_length"] != len(run.steps) or state["plan_sha256"] != plan_hash(run.steps):
        raise UserError(f"{where}: written for a plan of {state['plan_length']} steps over {state['examples']} "
                        f"examples; the config now plans {len(run.steps)} steps over {len(run.data)} examples "
                        f"(did the data file change, or the step order: batch_order?)")
    load_lora_weights(run.model, folder)
    if getattr(run, "strategy", "none") == "fsdp":  # saved as a full (unsharded) state dict
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(run.module, run.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if run.scaler is not None and state["scaler"]:
        run.scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"])
    counters = {k: v for k, v in state["counters"].items() if totals or k not in TOTALS}
    return {"step": state["step"], **counters}


# The run's training time and tokens over all its parts (a run resumed after a kill is several
# processes), kept in each checkpoint's counters so the summary covers the whole run.
TOTALS = ("run_seconds", "run_tokens")


def with_totals(counters: dict, seconds: float, tokens: int) -> dict:
    """`counters` with TOTALS covering this part too: its `seconds` and `tokens` added to those
    of the parts before it (restored by resume_run)."""
    before_s, before_t = run_totals(counters, 0.0, 0)
    return {**counters, "run_seconds": before_s + seconds, "run_tokens": before_t + tokens}


def run_totals(counters: dict, seconds: float, tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of the whole run: this part's plus those of the parts before it."""
    return counters.get("run_seconds", 0.0) + seconds, counters.get("run_tokens", 0) + tokens


def flat_config(cfg) -> dict:
    """{"lora.r": 16, "lr": 0.0002, ...}; output_dir left out (a run folder may be moved)."""
    out = {}
    for key, value in to_dict(cfg).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif key != "output_dir":
            out[key] = value
    return out


# Keys a resumed run may change: where and how fast it runs, not what it computes.
RUNTIME_KEYS = ("threads", "device", "skip_doctor")


def config_diff(old, new) -> list[str]:
    """'key: old -> new' for every config key whose value differs, RUNTIME_KEYS left out."""
    a, b = flat_config(old), flat_config(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in RUNTIME_KEYS]


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics.jsonl lines of steps <= `step`: the steps after it are trained again.
    A line cut short by a kill does not parse and goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    atomic_write_bytes(path, "".join(kept).encode())


# ---- when to save, and saving on a failure -----------------------------------------------------

class SaveSchedule:
    """When fit writes a checkpoint: every cfg.save_every steps, every cfg.save_every_minutes of
    training, and at the last step when either is set. The clock counts in one process only:
    under torchrun each rank would read its own and they could disagree on a collective save."""

    def __init__(self, cfg, total_steps: int, one_process: bool = True, clock=time.monotonic):
        self.every, self.total, self.clock = cfg.save_every, total_steps, clock
        self.seconds = cfg.save_every_minutes * 60 if one_process else 0
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return bool(self.every or self.seconds)

    def due(self, done: int) -> bool:
        """Whether to save after step `done`; a True restarts the minutes."""
        due = (bool(self.every) and done % self.every == 0) or (self.enabled and done == self.total)
        if self.seconds and not due:
            due = self.clock() - self.last >= self.seconds
        if due:
            self.last = self.clock()
        return due


class TrainingFailed(Exception):
    """fit stopped by an exception (not a signal, not a UserError): str() is the one line to
    print, naming the cause, what was saved and the command that resumes."""


class SaveOnError:
    """Around fit's loop: on an exception, write the last completed step's state (`progress()`:
    (step, counters)) with `save(run, step, counters)` after `flush()` (metrics held back),
    then raise TrainingFailed. `passthrough`: exceptions that are not failures (a signal's stop).
    Under torchrun nothing is saved (the other ranks wait in a collective); the last periodic
    checkpoint is named."""

    def __init__(self, run, progress, save, flush=None, passthrough: tuple = ()):
        self.run, self.progress, self.save, self.flush, self.passthrough = run, progress, save, flush, passthrough

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if not isinstance(e, Exception) or isinstance(e, (UserError, *self.passthrough)):
            return False
        cause = f"{type(e).__name__}: {e}".strip().splitlines()[0]
        done, counters = self.progress()
        kept, why = None, ""
        if done > self.run.start_step and not self.run.parallel.enabled:
            try:  # the device or the disk that failed the step may fail this too
                if self.flush is not None:
                    self.flush()
                done, counters = self.progress()
                self.save(self.run, done, counters)
                kept = f"saved the checkpoint of step {done}"
            except Exception as err:
                why = f" (saving step {done} failed: {type(err).__name__})"
        if kept is None:
            last = checkpoint_folders(self.run.folder / "checkpoints")
            kept = (f"the last checkpoint is {last[-1].name}" if last else "no checkpoint was written") + why
        raise TrainingFailed(f"training failed after step {done} ({cause}); {kept}; resume with: "
                             f"hivetune train --resume {self.run.folder}") from e


# ---- which folders are run folders ---------------------------------------------------------------

def existing_run(folder: Path, key: str = "output_dir") -> bool:
    """Whether `folder` holds a run of hivetune's to go on with (True), or is new or empty (False).
    A folder holding files hivetune did not write is refused with a UserError naming the folder and
    why; nothing in it is touched. A run folder carries RUN_MARKER, written first; one written
    before the marker existed is recognised by a checkpoint whose manifest names the sha256 of its
    config.yaml (only hivetune writes those two together)."""
    folder = Path(folder)
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise UserError(f"{key}: {folder} is a file, not a folder")
    names = [p.name for p in folder.iterdir() if p.name not in (RUN_MARKER, LOCK_NAME)]
    # the temp files of a process killed while writing the marker or config.yaml (atomic_write_with)
    leftovers = [n for n in names if re.fullmatch(rf"\.({re.escape(RUN_MARKER)}|config\.yaml)\.tmp-\d+", n)]
    others = sorted(set(names) - set(leftovers))
    marker = run_marker_format(folder)
    if marker is not None and marker > RUN_FORMAT:
        raise UserError(f"{key}: {folder} is a run folder of a newer hivetune (format {marker}; this one "
                        f"reads {RUN_FORMAT}); upgrade hivetune or choose another folder")
    if marker is not None and (folder / "config.yaml").is_file():
        return True
    if not others:  # empty, or marked by a process killed before it wrote config.yaml
        for name in leftovers:
            (folder / name).unlink(missing_ok=True)
        return False
    if marker is None and legacy_run(folder):
        return True
    if marker is not None:
        why = "a run marker but no config.yaml"
    elif (folder / "config.yaml").exists():
        why = f"files hivetune did not write (no {RUN_MARKER} marker, no checkpoint made from its config.yaml)"
    else:
        why = f"files hivetune did not write (no {RUN_MARKER} marker)"
    listing = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
    raise UserError(f"{key}: {folder} holds {why}: {listing}; it is not a run folder, nothing was changed; "
                    f"choose another folder")


def legacy_run(folder: Path) -> bool:
    """A run folder written before RUN_MARKER: config.yaml, and a checkpoint whose manifest.json
    holds that config.yaml's sha256."""
    if not (folder / "config.yaml").is_file():
        return False
    digest = config_hash(folder)
    for checkpoint in checkpoint_folders(folder / "checkpoints"):
        try:
            manifest = json.loads((checkpoint / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("config_sha256") == digest:
            return True
    return False


def read_run_config(path: Path, overrides: dict | None = None):
    """load_run_config, its errors naming the file: '<path>: unknown key ...'."""
    try:
        return load_run_config(path, overrides)
    except UserError as e:
        text = str(e)
        if text.startswith(str(path)):
            raise
        raise UserError(f"{path}: {text}") from None


def resume_point(folder: Path, cfg) -> Path | None:
    """For an output folder that already holds a run (config.yaml): refuse when its config
    differs from `cfg`, else return its newest valid checkpoint (None: start again at step 0)."""
    diff = config_diff(read_run_config(folder / "config.yaml"), cfg)
    if diff:
        raise UserError(f"output_dir: {folder} holds a run with another config ({'; '.join(diff)}); "
                        f"choose another output, or resume it as it was with --resume {folder}")
    checkpoint = newest_valid_checkpoint(folder)
    if checkpoint is None and (folder / "summary.json").exists():
        raise UserError(f"output_dir: {folder} holds a finished run with no checkpoint to resume; "
                        f"choose another output")
    return checkpoint


def resume_run(run, checkpoint: Path | None) -> None:
    """Put `run` at the checkpoint's step (weights, optimizer, RNG...) and cut metrics.jsonl
    back to it; with no checkpoint, start again at step 0 in the same folder. Under torchrun
    only rank 0 touches files (another rank's rewrite of metrics.jsonl would race rank 0's appends)."""
    main = getattr(getattr(run, "parallel", None), "is_main", True)
    if main:
        if run_marker_format(run.folder) is None:  # a run folder of an earlier hivetune (legacy_run)
            write_run_marker(run.folder)
        remove_leftovers(run.folder / "checkpoints")
        for name in ADAPTER_FOLDERS:  # killed while replacing one: the old one back, temp folders gone
            recover_folder(run.folder / name)
    if checkpoint is None:
        if main:
            print(f"hivetune: warning: {run.folder} has no valid checkpoint; starting again at step 0", file=sys.stderr)
            truncate_metrics(run.folder / "metrics.jsonl", 0)
        return
    counters = load_checkpoint(run, checkpoint, totals=True)
    run.start_step = counters.pop("step")
    run.counters = counters
    if main:
        truncate_metrics(run.folder / "metrics.jsonl", run.start_step)
    run.notes.append(f"resuming from {checkpoint} (step {run.start_step} of {len(run.steps)})")


def resume_config(run_folder: str | Path, config_path: str | None, overrides: dict):
    """`hivetune train --resume RUN`: RUN's saved config. Flags or a --config that would change
    it are refused with the keys they change: a resumed run continues the run it was. Only
    RUNTIME_KEYS (threads, device, skip_doctor) may be given anew; config.yaml stays as written."""
    folder = Path(run_folder)
    path = folder / "config.yaml"
    if not existing_run(folder, "--resume"):
        raise UserError(f"--resume: {folder} is not a run folder (no config.yaml)")
    saved = read_run_config(path)
    output = overrides.get("output_dir")
    if output and Path(output).resolve() != folder.resolve():
        raise UserError(f"--output: {output} is not the resumed run {folder}; leave --output out")
    if config_path or overrides:
        wanted = load_config(config_path, overrides) if config_path else read_run_config(path, overrides)
        diff = config_diff(saved, wanted)
        if diff:
            raise UserError(f"--resume: a resumed run keeps its config; these flags change it: {'; '.join(diff)}")
        for key in RUNTIME_KEYS:
            setattr(saved, key, getattr(wanted, key))
    saved.output_dir = str(folder)
    return saved
