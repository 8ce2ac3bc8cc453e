"""The learning loop's registry: numbered versions of a LoRA adapter on one base model, the one in
service, and a line per change.

    REG/registry.json      {"base": MODEL, "created": TIME}
    REG/current.json       {"version": VID or null (the base alone), "time", "action", "previous"}
    REG/history.jsonl      {"time", "action": "promote" | "rollback", "from", "to"} per change
    REG/versions/VID/      adapter/, lora-adapter.gguf (a .gguf base), data/ (copies of the files the
                           version trained on), version.json {"id", "parent", "time", "base", "config",
                           "data": {"files": {name: sha256}, "train": [names]}, "metrics", "source"}
    REG/logs/              the serve logs the cycle learns from; REG/cycles/: one folder per cycle

Crash safety. A version folder is built under a temp name (versions/.add-PID-N) and renamed to its
VID when complete, so a VID folder always holds a whole version. current.json is replaced through
a temp file, fsync, os.replace and an fsync of REG: a kill at any moment leaves the old or the new
version in service, never neither. current.json also names the change that made it ("action",
"previous"), so a kill between its replacement and the history line is repaired by the next change
(repair_history). Every change of current.json and every new VID happen under REG/.registry.lock,
a kernel lock that dies with its process: concurrent promotes are serialised, a killed one frees it.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Linux / macOS: the registry is not locked
    fcntl = None

from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_with, fsync_dir, fsync_tree, pause_for_tests, pid_alive, sha256_file
from hivetune.data.interaction_log import utc_now

REGISTRY_JSON, CURRENT_JSON, HISTORY_JSONL, LOCK_NAME = "registry.json", "current.json", "history.jsonl", ".registry.lock"
LORA_GGUF = "lora-adapter.gguf"
VID = re.compile(r"^v(\d{4,})$")
LOCK_TIMEOUT_S = 600.0  # a promote waits this long for another change to finish
CURRENT = "current"  # add_version's parent: the version in service when the version is added
PARENT = "parent"  # rollback's target: the parent of the version in service


# ------------------------------------------------------------------------------ reading


def init_registry(root: str | Path, base: str) -> dict:
    """A new registry in `root` (new or empty) for `base`, with nothing in service."""
    root = Path(root)
    if (root / REGISTRY_JSON).exists():
        raise UserError(f"{root}: already a registry ({REGISTRY_JSON} exists)")
    if root.is_dir() and any(p.name != LOCK_NAME for p in root.iterdir()):
        raise UserError(f"{root}: not empty; a registry starts in a new or empty folder")
    if not base:
        from hivetune.core.embedded import embedded_model_path

        base = str(embedded_model_path())
    elif Path(base).exists():
        base = str(Path(base).resolve())
    for sub in ("versions", "logs", "cycles"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    now = utc_now()
    write_json(root / CURRENT_JSON, {"version": None, "time": now})
    info = {"base": base, "created": now}
    write_json(root / REGISTRY_JSON, info)  # last: a folder with registry.json is a whole registry
    return info


def registry_info(root: str | Path) -> dict:
    path = Path(root) / REGISTRY_JSON
    if not path.is_file():
        raise UserError(f"{root}: not a registry (no {REGISTRY_JSON}); create one with "
                        f"`hivetune registry init {root} --base MODEL`")
    info = read_json(path)
    if not isinstance(info.get("base"), str):
        raise UserError(f"{path}: no \"base\" model named")
    return info


def read_current(root: str | Path) -> dict:
    current = read_json(Path(root) / CURRENT_JSON)
    vid = current.get("version")
    if vid is not None and not (isinstance(vid, str) and VID.match(vid)):
        raise UserError(f"{Path(root) / CURRENT_JSON}: \"version\" is {vid!r}, not a version id (v0001) or null")
    return current


def current_version(root: str | Path) -> str | None:
    return read_current(root).get("version")


def version_dir(root: str | Path, vid: str) -> Path:
    if not isinstance(vid, str) or not VID.match(vid):
        raise UserError(f"version: {vid!r} is not a version id (v0001, v0002, ...)")
    return Path(root) / "versions" / vid


def read_version(root: str | Path, vid: str) -> dict:
    """version.json of `vid`; a UserError when the registry has no such version."""
    path = version_dir(root, vid) / "version.json"
    if not path.is_file():
        known = ", ".join(v["id"] for v in list_versions(root)) or "none yet"
        raise UserError(f"{root}: no version {vid} (versions: {known})")
    return read_json(path)


def list_versions(root: str | Path) -> list[dict]:
    """version.json of every version, oldest first (temp folders of unfinished adds are not versions)."""
    folder = Path(root) / "versions"
    if not folder.is_dir():
        return []
    vids = sorted((p.name for p in folder.iterdir() if VID.match(p.name)), key=lambda v: int(v[1:]))
    return [read_json(folder / v / "version.json") for v in vids if (folder / v / "version.json").is_file()]


def version_train_files(root: str | Path, vid: str | None) -> list[Path]:
    """The copies of the files version `vid` trained on (none for the base alone)."""
    if vid is None:
        return []
    data = read_version(root, vid).get("data") or {}
    return [version_dir(root, vid) / "data" / name for name in data.get("train", [])
            if (version_dir(root, vid) / "data" / name).is_file()]


def read_history(root: str | Path) -> list[dict]:
    """The history lines that parse (a kill mid-append can cut the last one short)."""
    path = Path(root) / HISTORY_JSONL
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_bytes().splitlines():
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            lines.append(rec)
    return lines


def key_metrics(version: dict) -> dict:
    """The gate's figures of a version: held-out and regression loss, candidate and the one it beat."""
    sets = (version.get("metrics") or {}).get("sets") or {}
    out = {}
    for name in ("heldout", "regression"):
        s = sets.get(name)
        if isinstance(s, dict):
            out[name] = {"loss": (s.get("candidate") or {}).get("loss"), "against": (s.get("against") or {}).get("loss"),
                         "examples": s.get("examples")}
    return out


def listing(root: str | Path) -> dict:
    info, current = registry_info(root), current_version(root)
    versions = [{"id": v["id"], "parent": v.get("parent"), "time": v.get("time"), "in_service": v["id"] == current,
                 "metrics": key_metrics(v), "source": v.get("source")} for v in list_versions(root)]
    return {"registry": str(root), "base": info["base"], "current": current, "versions": versions,
            "history": read_history(root)[-10:]}


def format_listing(data: dict) -> str:
    def loss(m: dict, name: str) -> str:
        s = m.get(name)
        if not s or s.get("loss") is None:
            return "-"
        was = f" (was {s['against']:.4f})" if s.get("against") is not None else ""
        return f"{s['loss']:.4f}{was}"

    lines = [f"registry {data['registry']}  base: {data['base']}",
             f"in service: {data['current'] or 'the base model alone (no version)'}", ""]
    if not data["versions"]:
        return "\n".join(lines + ["no versions yet: `hivetune registry add DIR RUN` or `hivetune cycle`"])
    rows = [("", "version", "parent", "time", "held-out loss", "regression loss")]
    for v in data["versions"]:
        rows.append(("*" if v["in_service"] else "", v["id"], v["parent"] or "-", (v["time"] or "")[:19].replace("T", " "),
                     loss(v["metrics"], "heldout"), loss(v["metrics"], "regression")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + ["", "* in service"])


# ------------------------------------------------------------------------------ changes


@contextmanager
def registry_lock(root: str | Path, timeout: float = LOCK_TIMEOUT_S):
    """Hold REG/.registry.lock, waiting up to `timeout` seconds for another change to finish."""
    with file_lock(Path(root) / LOCK_NAME, timeout, "another registry change"):
        yield


@contextmanager
def file_lock(path: Path, timeout: float, holder_is: str):
    """Hold a kernel lock on `path` (it dies with its process), waiting up to `timeout` seconds;
    then a UserError naming the holder's pid. The file is never removed, so every process locks
    the same file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while fcntl is not None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                waited = f" for more than {timeout:g} s" if timeout > 0 else ""
                raise UserError(f"{path}: {holder_is} (pid {pid}) holds the lock{waited}; try again when it has finished")
            time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def promote(root: str | Path, vid: str | None, action: str = "promote", lock_timeout: float = LOCK_TIMEOUT_S) -> dict | None:
    """Put `vid` (None: the base alone) in service. Returns the history line, or None when `vid`
    is in service already."""
    root = Path(root)
    registry_info(root)
    with registry_lock(root, lock_timeout):
        return _switch(root, vid, action)


def rollback(root: str | Path, vid: str | None = PARENT, lock_timeout: float = LOCK_TIMEOUT_S) -> dict | None:
    """Put `vid` (None: the base alone) in service, by default the parent of the version in service
    (its parent's parent after a second rollback; null, the base alone, after the first version)."""
    root = Path(root)
    registry_info(root)
    with registry_lock(root, lock_timeout):
        current = current_version(root)
        if vid == PARENT:
            if current is None:
                raise UserError(f"{root}: nothing to roll back: the base model alone is in service")
            vid = read_version(root, current).get("parent")
        return _switch(root, vid, "rollback")


def _switch(root: Path, vid: str | None, action: str) -> dict | None:
    """Under the lock: current.json -> vid, then the history line."""
    repair_history(root)
    if vid is not None:
        read_version(root, vid)  # a complete version, or a UserError naming the known ones
    for stale in root.glob(f".{CURRENT_JSON}.tmp-*"):  # a promote killed before its rename
        stale.unlink(missing_ok=True)
    previous = current_version(root)
    if previous == vid:
        return None
    now = utc_now()
    data = json.dumps({"version": vid, "time": now, "action": action, "previous": previous}, indent=2).encode() + b"\n"

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # in two halves, so a test's kill can land in a half-written temp file
            f.write(data[:len(data) // 2])
            f.flush()
            pause_for_tests()
            f.write(data[len(data) // 2:])
        pause_for_tests()

    atomic_write_with(root / CURRENT_JSON, write)
    pause_for_tests()
    line = {"time": now, "action": action, "from": previous, "to": vid}
    append_history(root, line)
    return line


def repair_history(root: Path) -> None:
    """Append the history line of a change whose process was killed after replacing current.json."""
    current = read_current(root)
    lines = read_history(root)
    last = lines[-1]["to"] if lines else None
    if current.get("version") != last and "action" in current:
        append_history(root, {"time": current.get("time"), "action": current["action"],
                              "from": current.get("previous"), "to": current.get("version")})


def append_history(root: Path, line: dict) -> None:
    path = root / HISTORY_JSONL
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and open(path, "rb").read()[-1:] != b"\n":
            data = b"\n" + data  # a line cut short by a kill ends here; ours starts a line of its own
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


_TMP_COUNTER = itertools.count()


def add_version(root: str | Path, run: str | Path, compare: str | Path | dict | None = None,
                parent: str | None = CURRENT, train_files: list[str | Path] | None = None,
                other_files: list[str | Path] = (), lora_gguf: str | Path | None = None,
                source: dict | None = None) -> str:
    """Register the finished run `run` as a new version; returns its id. compare: a compare.json
    (path or dict) whose figures become the version's metrics. train_files / other_files: the
    files it trained on and its held-out files, copied into the version (default: the run's data
    and val_data files). lora_gguf: the run's LoRA GGUF when already exported (a .gguf base;
    otherwise it is exported here)."""
    from hivetune.workflows.export import export, finished_adapter  # torch: only when a version is added

    root = Path(root)
    info = registry_info(root)
    adapter = finished_adapter(Path(run))
    config = run_config(adapter.parent if adapter.name == "adapter" else adapter)
    check_same_base(info["base"], config.get("model") or adapter_base(adapter), run)
    metrics = read_json(Path(compare)) if isinstance(compare, (str, Path)) else (compare or {})
    if train_files is None:
        train_files, other_files = run_data_files(config, "data"), run_data_files(config, "val_data")
    versions = root / "versions"
    versions.mkdir(exist_ok=True)
    remove_dead_adds(versions)
    tmp = versions / f".add-{os.getpid()}-{next(_TMP_COUNTER)}"
    try:
        tmp.mkdir()
        export(adapter, "adapter", tmp / "adapter")
        pause_for_tests()
        if info["base"].endswith(".gguf"):
            copy_lora_gguf(adapter, tmp, lora_gguf)
        hashes: dict[str, str] = {}
        train_names = copy_data([Path(f) for f in train_files], tmp / "data", hashes)
        copy_data([Path(f) for f in other_files], tmp / "data", hashes)
        pause_for_tests()
        with registry_lock(root):
            if parent == CURRENT:
                parent = current_version(root)
            elif parent is not None:
                read_version(root, parent)
            numbers = [int(p.name[1:]) for p in versions.iterdir() if VID.match(p.name)]
            vid = f"v{max(numbers, default=0) + 1:04d}"
            version = {"id": vid, "parent": parent, "time": utc_now(), "base": info["base"], "config": config,
                       "data": {"files": hashes, "train": train_names},
                       "metrics": metrics, "source": source or {"run": str(Path(run).resolve())}}
            (tmp / "version.json").write_text(json.dumps(version, indent=2) + "\n")
            fsync_tree(tmp)
            pause_for_tests()
            os.rename(tmp, versions / vid)
            fsync_dir(versions)
        return vid
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def find_version(root: str | Path, **source) -> str | None:
    """The newest version whose "source" holds these items (a cycle finds the version it added)."""
    for v in reversed(list_versions(root)):
        if all((v.get("source") or {}).get(k) == value for k, value in source.items()):
            return v["id"]
    return None


def remove_dead_adds(versions: Path) -> None:
    """Temp folders of adds whose process is gone."""
    for p in versions.iterdir():
        m = re.match(r"^\.add-(\d+)-\d+$", p.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def copy_lora_gguf(adapter: Path, folder: Path, lora_gguf: str | Path | None) -> None:
    """folder/lora-adapter.gguf: the given file, or written here (write_lora_gguf)."""
    if lora_gguf:
        shutil.copy2(lora_gguf, folder / LORA_GGUF)
    else:
        write_lora_gguf(adapter, folder / LORA_GGUF)


def write_lora_gguf(run: str | Path, out: str | Path) -> Path:
    """The run's LoRA as GGUF for `llama-server --lora`: the lora-adapter.gguf that `hivetune export
    --format gguf` writes (the same functions, the same bytes), without the merged model beside it
    (a whole f16 copy of the base: 35 s instead of 5 s for SmolLM2-135M on 2 CPU cores)."""
    from hivetune.model import gguf_write  # torch: only when a GGUF is written
    from hivetune.workflows.export import base_model_path, finished_adapter, load_merged_source

    adapter = finished_adapter(Path(run))
    base = base_model_path(adapter, "")
    net, _ = load_merged_source(base, adapter)
    out = Path(out)
    atomic_write_with(out, lambda tmp: gguf_write.write_lora_gguf(tmp, net, f"hivetune LoRA for {base.stem}",
                                                                   str(adapter)))
    return out


def copy_data(files: list[Path], folder: Path, hashes: dict[str, str]) -> list[str]:
    """Copy each data file into `folder` under a name not yet in `hashes`, add {name: sha256} to
    `hashes`; returns the names."""
    names = []
    for f in files:
        if not f.is_file():
            raise UserError(f"{f}: data file not found")
        name = f.name
        n = 1
        while name in hashes:
            n += 1
            name = f"{f.stem}-{n}{f.suffix}"
        folder.mkdir(exist_ok=True)
        shutil.copy2(f, folder / name)
        hashes[name] = sha256_file(folder / name)
        names.append(name)
    return names


def run_config(run: Path) -> dict:
    import yaml  # a dependency of hivetune's config; read here only when a version is added

    path = run / "config.yaml"
    if not path.is_file():
        return {}
    cfg = yaml.safe_load(path.read_text()) or {}
    return cfg if isinstance(cfg, dict) else {}


def run_data_files(config: dict, key: str) -> list[Path]:
    """The local files of a run's `key` (data, val_data): a file, a folder's files; a Hub id: none."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("path")
    p = Path(value) if value else None
    if p is not None and p.is_file():
        return [p]
    if p is not None and p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    return []


def adapter_base(adapter: Path) -> str:
    try:
        return json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    except (OSError, json.JSONDecodeError):
        return ""


def check_same_base(base: str, run_base: str, run: str | Path) -> None:
    if not run_base:
        return
    same = (Path(base).resolve() == Path(run_base).resolve()) if Path(base).exists() and Path(run_base).exists() \
        else base == run_base
    if not same:
        raise UserError(f"{run}: trained on {run_base}, but the registry's base is {base}")


# ------------------------------------------------------------------------------ files


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: dict) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))
