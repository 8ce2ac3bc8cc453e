"""`hivetune cycle` (workflows/cycle.py) on a tiny random model, with the real tools (`data curate`,
`data split`, `train --init-adapter`, `eval --candidate --against`): nothing to do without enough
new logs; too little curated data leaves the logs for the next cycle; a failed stage names its log;
a cycle learning good answers is promoted and one learning answers that contradict the regression
set is rejected; a cycle SIGKILLed before each stage in turn (and once in the middle of training,
once in the middle of register's promote) is finished by the next run without redoing a finished
stage, while a `hivetune serve --registry` beside it keeps answering with the version in service
(every tool real, the eval too: 3 steps at lr 0.01 promote with a 4% margin). The loop through a running server's own log is in test_loop.py (an HF base) and
test_loop_gguf.py (the embedded GGUF through llama.cpp, with a cycle killed in its real eval)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_client import Server, needs_http, wait_for_model

from conftest import build_tiny_model, build_tokenizer, write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.data.interaction_log import InteractionLog, read_logs
from hivetune.workflows import registry as reg
from hivetune.workflows.cycle import STAGES, CycleOptions, format_report, gate, run_cycles, write_train_mix

SRC = Path(__file__).parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
# 3 steps at lr 0.01 learn the served answers, which agree with the regression set: the real eval
# promotes with room to spare (held-out and regression losses well below the base's)
TRAIN_SET = ["max_steps=3", "batch_size=4", "device=cpu", "lora.r=2", "lr=0.01"]
SERVICES = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]


@pytest.fixture(autouse=True)
def subprocess_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SRC))  # the tools run as `python -m hivetune` from this checkout
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    build_tokenizer(folder)
    build_tiny_model(folder, seed=4)
    return folder


def new_registry(tmp_path: Path, base: Path) -> Path:
    root = tmp_path / "REG"
    reg.init_registry(root, str(base))
    write_jsonl(root / "regression.jsonl", [{"messages": [{"role": "user", "content": f"restart {s}?"},
                                                          {"role": "assistant", "content": f"systemctl restart {s}"}]}
                                            for s in SERVICES])
    return root


def serve(root: Path, n: int, start: int = 0, day: str = "2026-11-28", answer: str = "systemctl restart {s}",
          correction: str | None = None, unrated: tuple = ()) -> None:
    """n exchanges as `hivetune serve` logs them. Without `correction`: every 4th disliked, every 3rd
    corrected, the rest liked, those numbered in `unrated` left unrated; with it: each corrected so."""
    log = InteractionLog(root / "logs" / f"interactions-{day}.jsonl")
    for i in range(start, start + n):
        s = SERVICES[i % len(SERVICES)]
        ex = log.exchange("v", [{"role": "user", "content": f"How do I restart {s}? ({i})"}],
                          answer.format(s=s), 0.1, 5, 5)
        if correction is not None:
            log.feedback(ex, -1, correction=correction)
        elif i in unrated:
            continue
        elif i % 4 == 3:
            log.feedback(ex, -1)
        elif i % 3 == 2:
            log.feedback(ex, 1, correction=f"Run `systemctl restart {s}` as root. ({i})")
        else:
            log.feedback(ex, 1)
    log.close()


def tool_argv(folder: Path, stage: str) -> list[str]:
    """The command line of the last tool run of `stage` (the `$ ` lines of CYCLE/<stage>.log)."""
    lines = [line for line in (folder / f"{stage}.log").read_text().splitlines() if line.startswith("$ ")]
    return lines[-1][2:].split(" ")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_too_few_new_exchanges_is_nothing_to_do(tmp_path, base, capsys):
    root = new_registry(tmp_path, base)
    serve(root, 5)
    assert main(["cycle", "--registry", str(root)]) == 0
    assert capsys.readouterr().out == f"nothing to do: 5 new exchanges in {root}/logs (a cycle needs 20)\n"
    assert [p.name for p in (root / "cycles").iterdir()] == [".cycle.lock"]
    assert main(["cycle", "--registry", str(root), "--replay", "1.5"]) == 2
    assert capsys.readouterr().err == "hivetune: error: --replay: expected a fraction in [0, 1), got 1.5\n"


def test_eval_engine_llama_cpp_without_llama_cpp_python_is_one_line(tmp_path, base, capsys, monkeypatch):
    import importlib.util

    root = new_registry(tmp_path, base)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert main(["cycle", "--registry", str(root), "--eval-engine", "llama.cpp"]) == 2
    assert capsys.readouterr().err == ("hivetune: error: --eval-engine llama.cpp: pip install llama-cpp-python "
                                       "(or bash scripts/install_llama_cpp.sh)\n")
    assert not (root / "cycles").exists() or [p.name for p in (root / "cycles").iterdir()] == []


def test_too_few_curated_examples_leave_the_logs_for_the_next_cycle(tmp_path, base):
    root = new_registry(tmp_path, base)
    serve(root, 24)  # 6 disliked: 18 curated, fewer than 20
    [report] = run_cycles(root, CycleOptions())
    assert report["status"] == "too-little-data" and (report["exchanges"], report["curated"]) == (24, 18)
    folder = Path(report["folder"])
    assert sorted(p.name for p in folder.glob("*.json")) == ["collect.json", "curate.json", "report.json"]
    assert tool_argv(folder, "curate")[-2:] == ["--out", str(folder / "curated.jsonl")]
    assert format_report(report).splitlines()[1:3] == [
        "  data:  24 exchanges -> 18 curated examples",
        "  fewer curated examples than --min-examples: the logs stay for the next cycle"]
    serve(root, 4, start=24, day="2026-11-29", unrated=(24, 25))  # 26 corrected, 27 disliked
    [again] = run_cycles(root, CycleOptions(min_examples=28))
    assert again["status"] == "too-little-data" and (again["exchanges"], again["curated"]) == (28, 19)
    [since] = run_cycles(root, CycleOptions(data_since="2026-11-29", min_examples=4))
    assert since["status"] == "too-little-data" and (since["exchanges"], since["curated"]) == (4, 1)
    [unrated] = run_cycles(root, CycleOptions(data_since="2026-11-29", min_examples=4, keep_unrated=True))
    assert (unrated["exchanges"], unrated["curated"]) == (4, 3)
    assert tool_argv(Path(unrated["folder"]), "curate")[-1] == "--keep-unrated"
    assert reg.current_version(root) is None


def test_a_failed_stage_stops_with_its_log_and_runs_again_next_time(tmp_path, base):
    root = new_registry(tmp_path, base)
    serve(root, 24)
    broken = {"curate": [sys.executable, "-c", "import sys; print('curate: no such flag'); sys.exit(3)"]}
    with pytest.raises(UserError) as e:
        run_cycles(root, CycleOptions(), commands=broken)
    [folder] = [p for p in (root / "cycles").iterdir() if not p.name.startswith(".")]
    first, *rest = str(e.value).splitlines()
    assert first.startswith(f"cycle {folder.name}: curate: `{sys.executable} -c ")
    assert first.endswith(f"exited with 3; see {folder}/curate.log; `hivetune cycle --registry {root}` runs the "
                          f"stage again")
    assert rest == ["  curate: no such flag"]
    [report, nothing] = run_cycles(root, CycleOptions())
    assert report["cycle"] == folder.name and report["status"] == "too-little-data"
    assert nothing["status"] == "nothing-to-do"


def test_gate_promotes_only_a_better_candidate_within_the_margin():
    def compare(held, regr=None):
        sets = {"heldout": {"candidate": {"loss": held[0]}, "against": {"loss": held[1]}}}
        if regr:
            sets["regression"] = {"candidate": {"loss": regr[0]}, "against": {"loss": regr[1]}}
        return {"sets": sets}

    assert gate(compare((1.0, 1.2), (2.04, 2.0)), 0.02)["promote"] is True
    assert gate(compare((1.0, 1.2)), 0.02)["promote"] is True
    assert gate(compare((1.2, 1.2), (1.0, 2.0)), 0.02)["reasons"] == ["held-out loss 1.2000 is not below 1.2000"]
    assert gate(compare((1.0, 1.2), (2.05, 2.0)), 0.02)["reasons"] == [
        "regression loss 2.0500 is above 2.0400 (2.0000 + 2%)"]


def test_train_mix_replays_a_share_of_the_earlier_data_as_chat(tmp_path):
    chat = lambda q, a: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    new = write_jsonl(tmp_path / "new.jsonl", [chat(f"q{i}", f"a{i}") for i in range(14)])
    old = write_jsonl(tmp_path / "old.jsonl", [chat(f"old{i}", "x") for i in range(4)]
                      + [{"instruction": f"alpaca{i}", "input": "", "output": "y"} for i in range(4)]
                      + [{"text": "plain text"}])
    out = tmp_path / "train.jsonl"
    assert write_train_mix(new, [old], 0.3, 0, out) == (14, 6, 1)  # round(0.3 / 0.7 * 14) replayed
    lines = out.read_text().splitlines()
    assert lines[:14] == new.read_text().splitlines()
    replayed = [json.loads(line) for line in lines[14:]]
    assert all(r["messages"][-1]["content"] in ("x", "y") for r in replayed)
    assert write_train_mix(new, [old], 0.0, 0, out) == (14, 0, 1) and len(out.read_text().splitlines()) == 14


def test_curate_deduplicates_against_every_file_the_version_trained_on(tmp_path):
    from types import SimpleNamespace

    from hivetune.data.curate import curate
    from hivetune.workflows.cycle import Cycle

    chat = lambda q: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "a"}]}
    files = [write_jsonl(tmp_path / "a.jsonl", [chat("q0"), chat("q1")]),
             write_jsonl(tmp_path / "b.jsonl", [{"instruction": "q2", "input": "", "output": "a"}])]
    assert Cycle.previous_train_data(SimpleNamespace(folder=tmp_path), files[:1]) == files[0]
    joined = Cycle.previous_train_data(SimpleNamespace(folder=tmp_path), files)
    assert joined == tmp_path / "previous-train.jsonl"
    assert joined.read_text().splitlines() == files[0].read_text().splitlines() + files[1].read_text().splitlines()
    log = InteractionLog(tmp_path / "log.jsonl")
    for q in ("q0", "q2", "q3"):
        log.feedback(log.exchange("v", [{"role": "user", "content": q}], "a", 0.1, 1, 1), 1)
    log.close()
    result = curate([log.path], tmp_path / "out.jsonl", train_data=joined)
    assert (result.new, result.dropped["duplicate_train"]) == (1, 2)


def test_real_cycle_promotes_good_data_and_rejects_data_contradicting_the_regression_set(tmp_path, base):
    """Every stage real: cycle 1 learns answers that agree with the regression set (promoted);
    cycle 2 learns, from v0001, corrections that contradict it (held-out better, regression worse:
    rejected); a third finds nothing new."""
    root = new_registry(tmp_path, base)
    opts = CycleOptions(train_set=["max_steps=30", "batch_size=4", "device=cpu", "lr=0.005"], min_examples=20)
    serve(root, 40)
    [first] = run_cycles(root, opts)
    assert first["status"] == "promoted", first
    assert first["version"] == "v0001" and reg.current_version(root) == "v0001"
    assert (first["exchanges"], first["curated"], first["train"], first["heldout"], first["replay"]) == (40, 30, 24, 6, 0)
    held = first["figures"]["heldout"]
    assert held["candidate"] < held["against"] and held["examples"] == 6
    folder = Path(first["folder"])
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(f"{s}.json" for s in STAGES)
    v1 = reg.read_version(root, "v0001")
    assert v1["parent"] is None and v1["source"]["cycle"] == folder.name
    assert v1["metrics"] == json.loads((folder / "eval" / "compare.json").read_text())
    assert v1["data"]["train"] == ["train.jsonl"]
    assert v1["data"]["files"]["train.jsonl"] == reg.sha256_file(folder / "train.jsonl")
    curate, train, ev = (tool_argv(folder, s) for s in ("curate", "train", "eval"))
    assert "--train-data" not in curate and "--init-adapter" not in train
    assert (flag(ev, "--against"), flag(ev, "--model"), flag(ev, "--device")) == ("base", str(base), "cpu")
    assert flag(ev, "--regression") == str(root / "regression.jsonl")

    # the same day's file, appended: answers and corrections that contradict the regression set
    serve(root, 40, start=40, answer="Never restart {s}: reboot the whole machine instead.",
          correction="Never restart it: reboot the whole machine instead.")
    [second] = run_cycles(root, CycleOptions(**{**opts.__dict__, "replay": 0.0}))
    assert second["status"] == "rejected", second
    held, regr = second["figures"]["heldout"], second["figures"]["regression"]
    assert held["candidate"] < held["against"] and regr["candidate"] > regr["limit"]
    assert second["reasons"] == [f"regression loss {regr['candidate']:.4f} is above {regr['limit']:.4f} "
                                 f"({regr['against']:.4f} + 2%)"]
    assert reg.current_version(root) == "v0001" and [v["id"] for v in reg.list_versions(root)] == ["v0001"]
    folder2 = Path(second["folder"])
    collected = json.loads((folder2 / "collect.json").read_text())["files"]
    first_to = json.loads((folder / "collect.json").read_text())["files"]["interactions-2026-11-28.jsonl"]["to"]
    assert list(collected) == ["interactions-2026-11-28.jsonl"]
    assert collected["interactions-2026-11-28.jsonl"]["from"] == first_to
    assert (second["exchanges"], second["curated"], second["train"], second["heldout"]) == (40, 40, 32, 8)
    v1_dir = root / "versions" / "v0001"
    curate, train, ev = (tool_argv(folder2, s) for s in ("curate", "train", "eval"))
    assert flag(curate, "--train-data") == str(v1_dir / "data" / "train.jsonl")
    assert flag(train, "--init-adapter") == str(v1_dir / "adapter") == flag(ev, "--against")
    summary = json.loads((folder2 / "run" / "summary.json").read_text())
    assert summary["init_adapter"]["path"] == str((v1_dir / "adapter").resolve())
    lines = format_report(second).splitlines()
    assert lines[:2] == [f"cycle {second['cycle']}: rejected",
                         "  data:  40 exchanges -> 40 curated examples -> 32 train + 0 replayed, 8 held out"]
    assert lines[-2:] == ["  v0001 stays in service", f"  folder: {folder2}"]
    assert run_cycles(root, opts)[0]["status"] == "nothing-to-do"


RUNNER = """
import json, os, signal, sys, threading, time
from pathlib import Path
from hivetune.workflows import registry
from hivetune.workflows.cycle import CycleOptions, run_cycles
root, kill_at, mid_train = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def kill_once_training(folder):  # once train has made its run folder, on any machine's speed
    marker = Path(folder) / "run" / ".hivetune-run"
    while not marker.is_file():
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
def on_stage(stage, folder):
    if stage == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if stage == "train" and mid_train:
        threading.Thread(target=kill_once_training, args=(folder,), daemon=True).start()
write_atomically = registry.atomic_write_with
def killed_before_the_rename(path, write):  # kill_at "promote": the new current.json whole in its temp file
    if path.name == "current.json":
        write(path.with_name(".current.json.tmp-%%d" %% os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    write_atomically(path, write)
if kill_at == "promote":
    registry.atomic_write_with = killed_before_the_rename
opts = CycleOptions(train_set=%r, min_examples=10)
print(json.dumps(run_cycles(root, opts, commands=json.loads(sys.argv[4]), on_stage=on_stage)))
""" % (TRAIN_SET,)
# Where run_killed kills a cycle: before each stage, and in the middle of register's promote
KILLS = STAGES[:STAGES.index("register") + 1] + ("promote",) + STAGES[STAGES.index("register") + 1:]


def run_killed(root: Path, kill_at: str, mid_train: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, str(root), kill_at, str(int(mid_train)),
                           "{}"],
                          env=ENV, capture_output=True, text=True)


def stage_files(root: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (root / "cycles").glob("c*/*.json")}


def served_models(srv: Server, expected: str) -> str:
    """The id /v1/models names and a chat is answered by, once the server has taken `expected`."""
    wait_for_model(srv, expected)
    return srv.chat("How do I restart nginx?", max_tokens=2)["model"]


@needs_http
def test_a_killed_cycle_resumes_from_its_first_unfinished_stage(tmp_path, base):
    """A server on the registry all along answers with the version in service after each kill: the
    base until register's promote has replaced current.json, v0001 from then on."""
    root = new_registry(tmp_path, base)
    serve(root, 24)
    srv = Server(["--registry", str(root), "--log", str(tmp_path / "served"), "--max-new-tokens", "2",
                  "--device", "cpu", "--precision", "fp32"], tmp_path / "out.txt")
    try:
        before, answered = {}, []
        for kill_at in KILLS:
            p = run_killed(root, kill_at)
            assert p.returncode == -9, p.stderr
            files = stage_files(root)
            assert {k: v for k, v in files.items() if k in before} == before  # finished stages are not redone
            done = STAGES[:STAGES.index("register" if kill_at == "promote" else kill_at)]
            assert sorted(files) == sorted(f"{s}.json" for s in done)
            before = files
            if kill_at == "train":  # once more, killed in training: the run goes on from its folder
                assert run_killed(root, "", mid_train=True).returncode == -9
                assert stage_files(root) == before
            if kill_at == "promote":  # v0001 added whole, its promote killed before the rename
                assert [v["id"] for v in reg.list_versions(root)] == ["v0001"]
                assert len(list(root.glob(".current.json.tmp-*"))) == 1
                time.sleep(1.5)  # the server's watcher polls current.json each second: it must not move
            in_service = reg.current_version(root) or "base"
            answered.append(served_models(srv, in_service))
            assert answered[-1] == in_service
        assert answered == ["base"] * (len(KILLS) - 1) + ["v0001"]  # killed before report: promoted
        p = run_killed(root, "")
        assert p.returncode == 0, p.stderr
        assert served_models(srv, "v0001") == "v0001"
    finally:
        srv.stop()
    assert "is not served" not in srv.out.read_text()  # current.json was whole at every poll
    [report, nothing] = json.loads(p.stdout)
    assert report["status"] == "promoted" and nothing["status"] == "nothing-to-do"
    held, regr = report["figures"]["heldout"], report["figures"]["regression"]  # measured: 5.65 vs 5.89, 5.71 vs 5.92
    assert held["candidate"] < 0.98 * held["against"] and regr["candidate"] < regr["against"], report["figures"]
    assert {k: v for k, v in stage_files(root).items() if k in before} == before
    assert reg.current_version(root) == "v0001" and len(reg.list_versions(root)) == 1
    assert [(h["from"], h["to"]) for h in reg.read_history(root)] == [(None, "v0001")]
    assert not list(root.glob(".current.json.tmp-*"))
    folder = Path(report["folder"])
    runs = {s: (folder / f"{s}.log").read_text().count("\n$ ") + 1 for s in ("curate", "split", "train", "eval")}
    assert runs == {"curate": 1, "split": 1, "train": 2, "eval": 1}  # train: once killed
    assert json.loads((folder / "train.json").read_text())["steps"] == 3
    day = time.strftime("%Y-%m-%d", time.gmtime())
    contents = read_logs([tmp_path / "served" / f"interactions-{day}.jsonl"])
    assert [ex.model for ex in contents.exchanges.values()] == answered + ["v0001"]
