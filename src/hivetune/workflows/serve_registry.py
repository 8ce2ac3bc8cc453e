"""What `hivetune serve` serves and where it logs: model specs, the registry, the log files.

A ``ModelSpec`` names a model id and what to load: a .gguf base with an optional LoRA GGUF
(llama.cpp), or an HF folder with an optional adapter folder (hivetune). With ``--registry REG``
the spec comes from REG/registry.json's base and REG/current.json's version (null: the base alone,
id "base"); ``RegistryWatcher`` polls current.json and hands each new version to a callback.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.data.interaction_log import InteractionLog

BASE_ID = "base"
LORA_GGUF = "lora-adapter.gguf"


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    model: Path  # a .gguf file or an HF folder
    adapter: Path | None = None  # gguf: a LoRA GGUF file; HF: a PEFT adapter folder

    @property
    def is_gguf(self) -> bool:
        return self.model.suffix.lower() == ".gguf"


def resolve_model(model: str) -> Path:
    """A model path, Hub id or (empty) the embedded model, as a local path."""
    from hivetune.core.hub import model_path

    return Path(model_path(model))


def lora_gguf_of(path: Path) -> Path:
    """A LoRA GGUF file, or a folder holding lora-adapter.gguf (`hivetune export --format gguf`)."""
    if path.is_dir() and (path / LORA_GGUF).is_file():
        return path / LORA_GGUF
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise UserError(f"--adapter {path}: a .gguf model takes a LoRA GGUF: a {LORA_GGUF} file or the folder "
                    f"`hivetune export RUN --format gguf` wrote")


def direct_spec(model: str, adapter: str) -> ModelSpec:
    """MODEL [--adapter DIR] from the command line; the id is the model's name (+ the adapter's)."""
    from hivetune.workflows.generate import resolve_adapter_folder

    path = resolve_model(model)
    if not path.exists():
        raise UserError(f"{path}: model not found")
    spec = ModelSpec(path.name, path)
    if not adapter:
        return spec
    if spec.is_gguf:
        lora = lora_gguf_of(Path(adapter))
    else:
        lora = resolve_adapter_folder(adapter)
    name = Path(adapter).name if Path(adapter).name != "adapter" else Path(adapter).parent.name
    return ModelSpec(f"{path.name}+{name}", path, lora)


def registry_base(registry: Path) -> str:
    path = registry / "registry.json"
    try:
        base = json.loads(path.read_text()).get("base")
    except FileNotFoundError:
        raise UserError(f"--registry {registry}: no registry.json in this folder") from None
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{path}: not a registry file ({e})") from None
    if not isinstance(base, str) or not base:
        raise UserError(f'{path}: "base" must name the base model (a path or a Hub id)')
    return base


def current_version(registry: Path) -> tuple[str | None, bytes]:
    """(version id or None for the base alone, the file's bytes); a missing current.json is the base."""
    path = registry / "current.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, b""
    try:
        version = json.loads(raw).get("version")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise UserError(f"{path}: not a current-version file ({e})") from None
    if version is not None and (not isinstance(version, str) or not version or "/" in version
                                or version.startswith(".")):
        raise UserError(f'{path}: "version" must be a version id (v0001, ...) or null, got {version!r}')
    return version, raw


def registry_spec(registry: Path, version: str | None) -> ModelSpec:
    base = resolve_model(registry_base(registry))
    if version is None:
        return ModelSpec(BASE_ID, base)
    folder = registry / "versions" / version
    if not folder.is_dir():
        raise UserError(f"{registry}/current.json: version {version} has no folder {folder}")
    if base.suffix.lower() == ".gguf":
        lora = folder / LORA_GGUF
        if not lora.is_file():
            raise UserError(f"{folder}: no {LORA_GGUF} (the base {base.name} is served by llama.cpp)")
        return ModelSpec(version, base, lora)
    if not (folder / "adapter" / "adapter_config.json").is_file():
        raise UserError(f"{folder}: no adapter/adapter_config.json")
    return ModelSpec(version, base, folder / "adapter")


class RegistryWatcher:
    """Polls REG/current.json every `interval_s`; calls `on_change(version)` in its own thread when
    the file's content changes. The callback loads and swaps; what it raises is printed and the
    same content is not retried (the next change of current.json is)."""

    def __init__(self, registry: Path, seen: bytes, on_change, interval_s: float = 1.0):
        self.registry, self.seen, self.on_change, self.interval_s = registry, seen, on_change, interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="registry-watcher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                raw = (self.registry / "current.json").read_bytes()
            except OSError:
                continue  # absent for a moment, or unreadable: keep serving what is loaded
            if raw == self.seen:
                continue
            self.seen = raw
            try:
                version, _ = current_version(self.registry)
                self.on_change(version)
            except Exception as e:  # a broken version: the one loaded keeps serving
                print(f"hivetune serve: {self.registry}/current.json changed but the new version is not served: "
                      f"{e}", file=sys.stderr, flush=True)


class DailyLog:
    """InteractionLog over FOLDER/interactions-YYYY-MM-DD.jsonl (UTC), a new file each day."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._lock = threading.Lock()
        self._day = ""
        self._log: InteractionLog | None = None
        self._earlier: list[InteractionLog] = []  # closed at close(): a writer may still hold one

    @property
    def path(self) -> Path:
        return self._current().path

    def _current(self) -> InteractionLog:
        day = time.strftime("%Y-%m-%d", time.gmtime())
        with self._lock:
            if day != self._day:
                if self._log is not None:
                    self._earlier.append(self._log)
                self._log = InteractionLog(self.folder / f"interactions-{day}.jsonl")
                self._day = day
            return self._log

    def exchange(self, *args, **kwargs) -> str:
        return self._current().exchange(*args, **kwargs)

    def feedback(self, *args, **kwargs) -> None:
        self._current().feedback(*args, **kwargs)

    def close(self) -> None:
        with self._lock:
            for log in self._earlier + ([self._log] if self._log else []):
                log.close()
            self._log, self._earlier = None, []


def open_log(log: str, registry: Path | None) -> InteractionLog | DailyLog:
    """--log FILE.jsonl: that file; --log DIR: daily files in it; default REG/logs, else ./logs."""
    if log and log.endswith(".jsonl"):
        return InteractionLog(log)
    folder = Path(log) if log else (registry / "logs" if registry is not None else Path("logs"))
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--log {folder}: not a folder (a log file's name ends in .jsonl)")
    return DailyLog(folder)
