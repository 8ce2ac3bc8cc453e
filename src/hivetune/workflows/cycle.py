"""`hivetune cycle`: one turn of the learning loop on a registry (workflows/registry.py).

    collect   snapshot the log lines of REG/logs/*.jsonl no earlier cycle used -> CYCLE/logs/
    curate    `hivetune data curate` -> CYCLE/curated.jsonl (minus what the version in service trained on;
              its replay stays off: the cycle replays after the split, so held-out data is new data only)
    split     `hivetune data split` -> new-train.jsonl + heldout.jsonl; train.jsonl = new-train plus a
              --replay share drawn from the data of the version in service
    train     `hivetune train --init-adapter REG/versions/<in service>/adapter` -> CYCLE/run
    export    CYCLE/lora-adapter.gguf when the base is a .gguf (export's LoRA GGUF, for llama.cpp)
    eval      `hivetune eval --candidate CYCLE/run --against <in service> --model BASE --data heldout.jsonl
              [--regression REG/regression.jsonl] --engine E` -> CYCLE/eval/compare.json; E (--eval-engine)
              llama.cpp for a .gguf base where llama-cpp-python is installed (the versions as served:
              the GGUF's quant blocks and the LoRA GGUF), else hivetune on the training device
    gate      promote only when the candidate's held-out loss is lower and its regression loss is at
              most (1 + --margin) x that of the version in service
    register  add the run as a new version and promote it, or record the rejection
    report    CYCLE/report.json and a printed summary

Each stage writes CYCLE/<stage>.json (atomically) when it has finished, before the next starts: a
killed cycle is finished by the next `hivetune cycle`, from the first stage without its file. The
tools run as subprocesses (`python -m hivetune ...`, output in CYCLE/<stage>.log) that die with the
cycle; a stage that was killed half-way removes its outputs and runs again (training goes on from
its newest checkpoint). One cycle runs at a time (REG/cycles/.cycle.lock).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_with, die_with_parent, fsync_dir, fsync_tree
from hivetune.core.versions import LLAMA_CPP_INSTALL, llama_cpp_installed
from hivetune.data.interaction_log import read_logs, utc_now
from hivetune.workflows import registry as reg
from hivetune.workflows.registry import file_lock, read_json, write_json

STAGES = ("collect", "curate", "split", "train", "export", "eval", "gate", "register", "report")
HIVETUNE = [sys.executable, "-m", "hivetune"]
# The command line (before its arguments) of each tool a stage runs. Tests stand a tool in with
# a fake one through run_cycles' `commands`.
TOOLS = {"curate": HIVETUNE + ["data", "curate"], "split": HIVETUNE + ["data", "split"], "train": HIVETUNE + ["train"],
         "eval": HIVETUNE + ["eval"]}
CYCLE_ID = re.compile(r"^c\d{8}-\d{6}(-\d+)?$")
LOG_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


@dataclass
class CycleOptions:
    data_since: str = ""  # YYYY-MM-DD: the logs of that day on, used before or not
    replay: float = 0.3  # share of train.jsonl drawn from the data of the version in service
    margin: float = 0.02  # relative rise of the regression loss the gate accepts
    heldout: float = 0.2  # share of the curated data held out for the comparison
    min_examples: int = 20  # fewer new exchanges or curated examples: nothing to do
    keep_unrated: bool = False  # curate unrated exchanges too, with their answer
    train_set: list[str] = field(default_factory=list)  # KEY=VALUE training config overrides
    seed: int = 0
    # who scores the gate's comparison: llama.cpp (the served GGUF quant + LoRA GGUF), hivetune's
    # decoder, or auto: llama.cpp for a .gguf base where llama-cpp-python is installed
    eval_engine: str = "auto"

    def check(self) -> None:
        if self.data_since and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", self.data_since):
            raise UserError(f"--data-since: expected a date YYYY-MM-DD, got {self.data_since!r}")
        if not 0 <= self.replay < 1:
            raise UserError(f"--replay: expected a fraction in [0, 1), got {self.replay:g}")
        if self.margin < 0:
            raise UserError(f"--margin: expected a fraction >= 0, got {self.margin:g}")
        if self.eval_engine not in ("auto", "hivetune", "llama.cpp"):
            raise UserError(f"--eval-engine: expected auto, hivetune or llama.cpp, got {self.eval_engine!r}")
        if self.eval_engine == "llama.cpp" and not llama_cpp_installed():
            raise UserError(f"--eval-engine llama.cpp: {LLAMA_CPP_INSTALL}")
        if not 0 < self.heldout < 1:
            raise UserError(f"--heldout: expected a fraction in (0, 1), got {self.heldout:g}")
        if self.min_examples < 2:
            raise UserError(f"--min-examples: expected at least 2, got {self.min_examples}")
        for pair in self.train_set:
            if "=" not in pair:
                raise UserError(f"--train-set: expected KEY=VALUE, got {pair!r}")


def run_cycles(registry: str | Path, opts: CycleOptions | None = None, commands: dict[str, list[str]] | None = None,
               on_stage: Callable[[str, Path], None] | None = None) -> list[dict]:
    """Finish the registry's unfinished cycles, then run a new one; their reports. commands: tool
    name -> command line replacing TOOLS' (tests). on_stage(stage, folder): called before a stage runs."""
    root = Path(registry).absolute()
    reg.registry_info(root)
    opts = opts or CycleOptions()
    opts.check()
    tools = {**TOOLS, **(commands or {})}
    (root / "cycles").mkdir(exist_ok=True)
    with file_lock(root / "cycles" / ".cycle.lock", 0, "another hivetune cycle"):
        reports = [Cycle(root, folder, tools, on_stage).run() for folder in unfinished_cycles(root)]
        if on_stage is not None:
            on_stage("collect", root / "cycles")
        folder, count = collect(root, opts)
        if folder is None:
            reports.append({"status": "nothing-to-do", "exchanges": count, "min_examples": opts.min_examples,
                            "logs": str(root / "logs")})
        else:
            reports.append(Cycle(root, folder, tools, on_stage).run())
    return reports


def unfinished_cycles(root: Path) -> list[Path]:
    folders = sorted(p for p in (root / "cycles").iterdir() if CYCLE_ID.match(p.name))
    return [p for p in folders if (p / "collect.json").is_file() and not (p / "report.json").is_file()]


# ------------------------------------------------------------------------------ collect


def collect(root: Path, opts: CycleOptions) -> tuple[Path | None, int]:
    """Snapshot the new log lines into a new cycle folder (created whole, with collect.json), or
    (None, exchanges) when there are fewer than opts.min_examples new exchanges."""
    start_time = time.monotonic()
    cycles = root / "cycles"
    for stale in cycles.glob(".c*.tmp-*"):  # a collect killed half-way (we hold the cycle lock)
        shutil.rmtree(stale, ignore_errors=True)
    cid = new_cycle_id(cycles)
    tmp = cycles / f".{cid}.tmp-{os.getpid()}"
    (tmp / "logs").mkdir(parents=True)
    try:
        used = {} if opts.data_since else used_log_offsets(root)
        seen = {} if opts.data_since else used_log_offsets(root, all_cycles=True)
        if not any(log.stat().st_size != seen.get(log.name, 0) for log in (root / "logs").glob("*.jsonl")):
            shutil.rmtree(tmp)  # nothing logged since the last cycle looked
            return None, 0
        files = {}
        for log in sorted((root / "logs").glob("*.jsonl")):
            if opts.data_since and log_date(log) < opts.data_since:
                continue
            start = used.get(log.name, 0)
            data = log.read_bytes()
            if len(data) < start:  # the file was rewritten: all of it is new
                start = 0
            end = data.rfind(b"\n", start) + 1  # whole lines only: serve may be writing the last one
            if end <= start:
                continue
            (tmp / "logs" / log.name).write_bytes(data[start:end])
            files[log.name] = {"from": start, "to": end, "sha256": reg.sha256_file(tmp / "logs" / log.name)}
        contents = read_logs(sorted((tmp / "logs").iterdir()))
        count = len(contents.exchanges)
        if count < opts.min_examples:
            shutil.rmtree(tmp)
            return None, count
        write_json(tmp / "collect.json", {
            "cycle": cid, "time": utc_now(), "version": reg.current_version(root), "files": files,
            "exchanges": count, "rated": sum(e.rating is not None for e in contents.exchanges.values()),
            "corrected": sum(e.correction is not None for e in contents.exchanges.values()),
            "broken_lines": contents.broken_lines, "options": asdict(opts),
            "seconds": round(time.monotonic() - start_time, 3)})
        fsync_tree(tmp)
        os.rename(tmp, cycles / cid)
        fsync_dir(cycles)
        return cycles / cid, count
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def new_cycle_id(cycles: Path) -> str:
    base = "c" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    cid, n = base, 1
    while (cycles / cid).exists():
        n += 1
        cid = f"{base}-{n}"
    return cid


def used_log_offsets(root: Path, all_cycles: bool = False) -> dict[str, int]:
    """Log name -> the end of the bytes earlier cycles took. Cycles that stopped for too little
    curated data leave theirs to the next cycle, unless `all_cycles` (what any cycle has seen)."""
    used: dict[str, int] = {}
    for folder in sorted((root / "cycles").iterdir()):
        if not CYCLE_ID.match(folder.name) or not (folder / "collect.json").is_file():
            continue
        if not all_cycles and (folder / "report.json").is_file() \
                and read_json(folder / "report.json").get("status") == "too-little-data":
            continue
        for name, span in read_json(folder / "collect.json").get("files", {}).items():
            used[name] = max(used.get(name, 0), int(span["to"]))
    return used


def log_date(log: Path) -> str:
    """YYYY-MM-DD of a log: from its name (interactions-2026-11-29.jsonl), else its modification time."""
    m = LOG_DATE.search(log.name)
    return m.group(1) if m else time.strftime("%Y-%m-%d", time.gmtime(log.stat().st_mtime))


# ------------------------------------------------------------------------------ the stages


class Cycle:
    """One cycle folder, taken from its first unfinished stage to report.json."""

    def __init__(self, root: Path, folder: Path, tools: dict[str, list[str]], on_stage=None):
        self.root, self.folder, self.tools, self.on_stage = root, folder, tools, on_stage
        self.done: dict[str, dict] = {}
        self.base = reg.registry_info(root)["base"]

    def run(self) -> dict:
        for stage in STAGES:
            path = self.folder / f"{stage}.json"
            if path.is_file():
                self.done[stage] = read_json(path)
                continue
            if self.stopped() and stage != "report":
                continue
            if self.on_stage is not None:
                self.on_stage(stage, self.folder)
            print(f"cycle {self.folder.name}: {stage}", file=sys.stderr, flush=True)
            start = time.monotonic()
            result = getattr(self, f"stage_{stage}")()
            result["seconds"] = round(time.monotonic() - start, 3)
            write_json(path, result)
            self.done[stage] = result
        return self.done["report"]

    def stopped(self) -> bool:
        return any("stop" in r for r in self.done.values())

    @property
    def parent(self) -> str | None:
        """The version in service when the cycle began: the one it trains from and compares with."""
        return self.done["collect"].get("version")

    @property
    def opts(self) -> CycleOptions:
        return CycleOptions(**self.done["collect"].get("options", {}))

    def tool(self, stage: str, name: str, args: list) -> None:
        """Run a tool; its output goes to CYCLE/<stage>.log. A failure is a UserError naming the log."""
        argv = self.tools[name] + [str(a) for a in args]
        log = self.folder / f"{stage}.log"
        with open(log, "ab") as f:
            # a killed run's last line may be cut (or a progress bar's \r): each command starts a line
            cut = f.tell() > 0 and not log.read_bytes().endswith(b"\n")
            f.write(("\n" * cut + "$ " + " ".join(argv) + "\n").encode())
            f.flush()
            rc = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
        if rc != 0:
            lines = log.read_text(errors="replace").splitlines()
            start = max(i for i, line in enumerate(lines) if line.startswith("$ ")) + 1
            tail = [line for line in lines[start:] if line.strip()][-5:]  # this run's last lines
            raise UserError(f"cycle {self.folder.name}: {stage}: `{' '.join(argv[:6])} ...` exited with {rc}; "
                            f"see {log}; `hivetune cycle --registry {self.root}` runs the stage again\n"
                            + "\n".join("  " + line for line in tail))

    def stage_curate(self) -> dict:
        out = self.folder / "curated.jsonl"
        out.unlink(missing_ok=True)
        logs = sorted((self.folder / "logs").iterdir())
        train_data = reg.version_train_files(self.root, self.parent)
        dedupe = [] if not train_data else ["--train-data", self.previous_train_data(train_data)]
        unrated = ["--keep-unrated"] if self.opts.keep_unrated else []
        self.tool("curate", "curate", [*logs, "--out", out, *dedupe, *unrated])
        n = count_records(out)
        result = {"out": str(out), "examples": n, "train_data": [str(p) for p in train_data]}
        if n < self.opts.min_examples:
            result["stop"] = "too-little-data"
        return result

    def previous_train_data(self, files: list[Path]) -> Path:
        """curate's one --train-data: the version's file, or its files joined into CYCLE/previous-train.jsonl."""
        if len(files) == 1:
            return files[0]
        out = self.folder / "previous-train.jsonl"
        text = "".join(line + "\n" for f in files for line in f.read_text().splitlines() if line.strip())
        atomic_write_with(out, lambda tmp: Path(tmp).write_text(text))
        return out

    def stage_split(self) -> dict:
        f = self.folder
        self.tool("split", "split", [f / "curated.jsonl", "--heldout", self.opts.heldout, "--seed", self.opts.seed,
                                     "--out-train", f / "new-train.jsonl", "--out-heldout", f / "heldout.jsonl",
                                     "--force"])
        replay = reg.version_train_files(self.root, self.parent)
        n_new, n_replay, skipped = write_train_mix(f / "new-train.jsonl", replay, self.opts.replay, self.opts.seed,
                                                   f / "train.jsonl")
        return {"train": str(f / "train.jsonl"), "new": n_new, "replay": n_replay, "replay_skipped": skipped,
                "replay_from": [str(p) for p in replay], "heldout": count_records(f / "heldout.jsonl")}

    def stage_train(self) -> dict:
        run = self.folder / "run"
        if not finished_run(run):  # a run killed half-way goes on from its newest checkpoint
            init = [] if self.parent is None else ["--init-adapter", reg.version_dir(self.root, self.parent) / "adapter"]
            overrides = flag_each("--set", self.opts.train_set)
            self.tool("train", "train", ["--model", self.base, "--data", self.folder / "train.jsonl", "--output", run,
                                         *init, *overrides, "--quiet"])
        summary = read_json(run / "summary.json")
        return {"run": str(run), "init": self.parent, "steps": summary.get("steps"),
                "final_loss": summary.get("final_loss")}

    def stage_export(self) -> dict:
        if not self.base.endswith(".gguf"):
            return {"skipped": "the base is not a .gguf: llama.cpp needs no LoRA GGUF"}
        return {"lora_gguf": str(reg.write_lora_gguf(self.folder / "run", self.folder / reg.LORA_GGUF))}

    def stage_eval(self) -> dict:
        out = self.folder / "eval"
        shutil.rmtree(out, ignore_errors=True)
        against = "base" if self.parent is None else reg.version_dir(self.root, self.parent) / "adapter"
        regression = self.root / "regression.jsonl"
        extra = ["--regression", regression] if regression.is_file() else []
        device = [x for pair in self.opts.train_set if pair.partition("=")[0] == "device"
                  for x in ("--device", pair.partition("=")[2])][-2:]  # where training ran
        engine = self.eval_engine()
        self.tool("eval", "eval", ["--candidate", self.folder / "run", "--against", against, "--model", self.base,
                                   "--data", self.folder / "heldout.jsonl", *extra, "--out", out, *device,
                                   "--engine", engine])
        if not (out / "compare.json").is_file():
            raise UserError(f"cycle {self.folder.name}: eval wrote no {out / 'compare.json'}")
        return {"compare": str(out / "compare.json"), "against": str(against),
                "regression": str(regression) if extra else None, "engine": engine}

    def eval_engine(self) -> str:
        """--eval-engine, auto resolved: llama.cpp (the model as served) for a .gguf base where
        llama-cpp-python is installed, else hivetune's decoder."""
        if self.opts.eval_engine != "auto":
            return self.opts.eval_engine
        return "llama.cpp" if self.base.endswith(".gguf") and llama_cpp_installed() else "hivetune"

    def stage_gate(self) -> dict:
        verdict = gate(read_json(Path(self.done["eval"]["compare"])), self.opts.margin)
        now = reg.current_version(self.root)
        if now != self.parent:
            verdict["promote"] = False
            verdict["reasons"].append(f"the version in service changed during the cycle ({self.parent or 'base'} -> "
                                      f"{now or 'base'}): the comparison is not against it")
        return verdict

    def stage_register(self) -> dict:
        if not self.done["gate"]["promote"]:
            return {"promoted": False, "reasons": self.done["gate"]["reasons"]}
        cid = self.folder.name
        vid = reg.find_version(self.root, cycle=cid)  # added before a kill: not again
        if vid is None:
            vid = reg.add_version(self.root, self.folder / "run", compare=Path(self.done["eval"]["compare"]),
                                  parent=self.parent, train_files=[self.folder / "train.jsonl"],
                                  other_files=[self.folder / "heldout.jsonl"],
                                  lora_gguf=self.done["export"].get("lora_gguf"),
                                  source={"cycle": cid, "run": str(self.folder / "run")})
        reg.promote(self.root, vid)
        return {"promoted": True, "version": vid}

    def stage_report(self) -> dict:
        d = self.done
        stop = next((r["stop"] for r in d.values() if "stop" in r), None)
        status = stop or ("promoted" if d["register"]["promoted"] else "rejected")
        return {"cycle": self.folder.name, "folder": str(self.folder), "time": utc_now(), "status": status,
                "parent": self.parent, "version": d.get("register", {}).get("version"),
                "exchanges": d["collect"]["exchanges"], "curated": d["curate"]["examples"],
                "train": d.get("split", {}).get("new"), "replay": d.get("split", {}).get("replay"),
                "heldout": d.get("split", {}).get("heldout"), "steps": d.get("train", {}).get("steps"),
                "figures": {k: d["gate"][k] for k in ("heldout", "regression")} if "gate" in d else None,
                "reasons": d["gate"]["reasons"] if "gate" in d else [],
                "stage_seconds": {s: d[s]["seconds"] for s in STAGES if "seconds" in d.get(s, {})}}


# ------------------------------------------------------------------------------ the gate


def gate(compare: dict, margin: float) -> dict:
    """Promote when the candidate's held-out loss is below the other's and its regression loss (when
    measured) is at most (1 + margin) x the other's. The figures and the reasons for a rejection."""
    sets = compare.get("sets") or {}
    reasons = []
    figures = {}
    for name in ("heldout", "regression"):
        s = sets.get(name)
        if s is None:
            figures[name] = None
            continue
        try:
            figures[name] = {"candidate": float(s["candidate"]["loss"]), "against": float(s["against"]["loss"]),
                             "examples": s.get("examples")}
        except (KeyError, TypeError, ValueError):
            raise UserError(f"compare.json: sets.{name} has no candidate / against loss") from None
    held = figures["heldout"]
    if held is None:
        raise UserError("compare.json: no held-out set (sets.heldout)")
    if not held["candidate"] < held["against"]:
        reasons.append(f"held-out loss {held['candidate']:.4f} is not below {held['against']:.4f}")
    regr = figures["regression"]
    if regr is not None:
        limit = regr["against"] * (1 + margin)
        regr["limit"] = limit
        if not regr["candidate"] <= limit:
            reasons.append(f"regression loss {regr['candidate']:.4f} is above {limit:.4f} "
                           f"({regr['against']:.4f} + {margin:.0%})")
    return {"promote": not reasons, "reasons": reasons, "heldout": held, "regression": regr, "margin": margin}


def format_report(r: dict) -> str:
    if r["status"] == "nothing-to-do":
        return (f"nothing to do: {r['exchanges']} new exchange{'s' * (r['exchanges'] != 1)} in {r['logs']} "
                f"(a cycle needs {r['min_examples']})")
    lines = [f"cycle {r['cycle']}: {r['status']}"]
    lines.append(f"  data:  {r['exchanges']} exchanges -> {r['curated']} curated examples"
                 + (f" -> {r['train']} train + {r['replay']} replayed, {r['heldout']} held out" if r["train"] is not None else ""))
    if r["status"] == "too-little-data":
        lines.append("  fewer curated examples than --min-examples: the logs stay for the next cycle")
    for name, f in (r.get("figures") or {}).items():
        if f:
            label = {"heldout": "held-out loss:", "regression": "regression loss:"}[name]
            lines.append(f"  {label:16s} {f['candidate']:.4f} (candidate) vs {f['against']:.4f} "
                         f"({r['parent'] or 'base'})")
    if r["status"] == "promoted":
        lines.append(f"  {r['version']} is in service (parent {r['parent'] or 'the base'})")
    lines += [f"  rejected: {reason}" for reason in r.get("reasons", [])]
    if r["status"] == "rejected":
        lines.append(f"  {r['parent'] or 'the base model'} stays in service")
    lines.append(f"  folder: {r['folder']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ helpers


def write_train_mix(new: Path, replay: list[Path], share: float, seed: int, out: Path) -> tuple[int, int, int]:
    """out = the lines of `new`, then a seeded sample of the records of `replay` making up `share` of
    the whole (as many as there are, at most). Replayed alpaca records become chat records when the
    new data is chat (one format per file); text records are skipped. (new, replayed, skipped)."""
    new_lines = [line for line in new.read_text().splitlines() if line.strip()]
    want = round(share / (1 - share) * len(new_lines)) if share > 0 else 0
    chat = bool(new_lines) and "messages" in json.loads(new_lines[0])
    pool, skipped = [], 0
    for path in replay:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if chat and "messages" not in record:
                if "instruction" not in record or "output" not in record:
                    skipped += 1
                    continue
                from hivetune.data.formats import alpaca_messages  # only when the formats differ

                record = {"messages": alpaca_messages(record)}
            elif not chat and "messages" in record:
                skipped += 1
                continue
            pool.append(json.dumps(record, ensure_ascii=False))
    picked = random.Random(seed).sample(pool, min(want, len(pool)))
    write_text = "".join(line + "\n" for line in new_lines + picked)
    atomic_write_with(out, lambda tmp: Path(tmp).write_text(write_text))
    return len(new_lines), len(picked), skipped


def count_records(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def finished_run(run: Path) -> bool:
    return (run / "adapter" / "adapter_config.json").is_file() and (run / "summary.json").is_file()


def flag_each(flag: str, values) -> list:
    return [x for v in values for x in (flag, v)]
