"""`hivetune cycle` (workflows/cycle.py) on a tiny random model: nothing to do without enough new
logs; the gate promotes a better candidate and rejects a worse one; a cycle SIGKILLed before each
stage in turn (and once in the middle of training) is finished by the next run without redoing a
finished stage. Tools this checkout lacks (data curate, eval --candidate, train --init-adapter)
are stood in by tests/workflows/fake_cycle_tools.py through run_cycles' `commands`; the real
end-to-end test runs once `hivetune data curate --help` works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_tiny_model, build_tokenizer, write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.data.interaction_log import InteractionLog, read_logs
from hivetune.workflows import registry as reg
from hivetune.workflows.cycle import STAGES, CycleOptions, format_report, gate, run_cycles

SRC = Path(__file__).parents[2] / "src"
FAKE = str(Path(__file__).with_name("fake_cycle_tools.py"))
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
FAKES = {"curate": [sys.executable, FAKE, "curate"], "eval": [sys.executable, FAKE, "eval"],
         "train": [sys.executable, FAKE, "train"]}
TRAIN_SET = ["max_steps=3", "batch_size=4", "device=cpu", "lora.r=2"]
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


def new_registry(tmp_path: Path, base: Path, heldout_loss=(1.0, 1.5), regression_loss=(2.0, 2.01)) -> Path:
    root = tmp_path / "REG"
    reg.init_registry(root, str(base))
    write_jsonl(root / "regression.jsonl", [{"messages": [{"role": "user", "content": f"restart {s}?"},
                                                          {"role": "assistant", "content": f"systemctl restart {s}"}]}
                                            for s in SERVICES])
    set_fake_losses(root, heldout_loss, regression_loss)
    return root


def set_fake_losses(root: Path, heldout, regression) -> None:
    (root / "fake-eval.json").write_text(json.dumps({"heldout": heldout, "regression": regression}))


def serve(root: Path, n: int, start: int = 0, day: str = "2026-11-28", answer: str = "systemctl restart {s}") -> None:
    """n exchanges as `hivetune serve` logs them: every 4th disliked, every 3rd corrected."""
    log = InteractionLog(root / "logs" / f"interactions-{day}.jsonl")
    for i in range(start, start + n):
        s = SERVICES[i % len(SERVICES)]
        ex = log.exchange("v", [{"role": "user", "content": f"How do I restart {s}? ({i})"}],
                          answer.format(s=s), 0.1, 5, 5)
        if i % 4 == 3:
            log.feedback(ex, -1)
        elif i % 3 == 2:
            log.feedback(ex, 1, correction=f"Run `systemctl restart {s}` as root. ({i})")
    log.close()


def calls(root: Path) -> list[dict]:
    path = root / "fake-calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_too_few_new_exchanges_is_nothing_to_do(tmp_path, base, capsys):
    root = new_registry(tmp_path, base)
    serve(root, 5)
    assert main(["cycle", "--registry", str(root)]) == 0
    assert capsys.readouterr().out == f"nothing to do: 5 new exchanges in {root}/logs (a cycle needs 20)\n"
    assert [p.name for p in (root / "cycles").iterdir()] == [".cycle.lock"]
    assert main(["cycle", "--registry", str(root), "--replay", "1.5"]) == 2
    assert capsys.readouterr().err == "hivetune: error: --replay: expected a fraction in [0, 1), got 1.5\n"


def test_too_few_curated_examples_leave_the_logs_for_the_next_cycle(tmp_path, base, capsys):
    root = new_registry(tmp_path, base)
    serve(root, 24)  # 18 of them curated: fewer than 20
    [report] = run_cycles(root, CycleOptions(), commands=FAKES)
    assert report["status"] == "too-little-data" and (report["exchanges"], report["curated"]) == (24, 18)
    assert sorted(p.name for p in Path(report["folder"]).glob("*.json")) == ["collect.json", "curate.json", "report.json"]
    assert format_report(report).splitlines()[1:3] == [
        "  data:  24 exchanges -> 18 curated examples",
        "  fewer curated examples than --min-examples: the logs stay for the next cycle"]
    serve(root, 4, start=24, day="2026-11-29")
    [again] = run_cycles(root, CycleOptions(min_examples=28), commands=FAKES)
    assert again["status"] == "too-little-data" and again["exchanges"] == 28  # yesterday's 24 again, and 4 new
    [since] = run_cycles(root, CycleOptions(data_since="2026-11-29", min_examples=4), commands=FAKES)
    assert since["status"] == "too-little-data" and since["exchanges"] == 4
    assert reg.current_version(root) is None


def test_a_failed_stage_stops_with_its_log_and_runs_again_next_time(tmp_path, base):
    root = new_registry(tmp_path, base)
    serve(root, 24)
    broken = {**FAKES, "curate": [sys.executable, "-c", "import sys; print('curate: no such flag'); sys.exit(3)"]}
    with pytest.raises(UserError) as e:
        run_cycles(root, CycleOptions(), commands=broken)
    [folder] = [p for p in (root / "cycles").iterdir() if not p.name.startswith(".")]
    first, *rest = str(e.value).splitlines()
    assert first.startswith(f"cycle {folder.name}: curate: `{sys.executable} -c ")
    assert first.endswith(f"exited with 3; see {folder}/curate.log; `hivetune cycle --registry {root}` runs the "
                          f"stage again")
    assert rest == ["  curate: no such flag"]
    [report, nothing] = run_cycles(root, CycleOptions(), commands=FAKES)
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


def test_cycle_promotes_a_better_candidate_then_rejects_one_worse_on_regression(tmp_path, base):
    root = new_registry(tmp_path, base)
    serve(root, 24)
    opts = CycleOptions(train_set=TRAIN_SET, min_examples=10)
    [first] = run_cycles(root, opts, commands=FAKES)
    assert first["status"] == "promoted" and first["version"] == "v0001" and reg.current_version(root) == "v0001"
    assert (first["exchanges"], first["curated"], first["train"], first["heldout"], first["replay"]) == (24, 18, 14, 4, 0)
    folder = Path(first["folder"])
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(f"{s}.json" for s in STAGES)
    v1 = reg.read_version(root, "v0001")
    assert v1["parent"] is None and v1["source"]["cycle"] == folder.name
    assert v1["metrics"] == json.loads((folder / "eval" / "compare.json").read_text())
    assert v1["data"]["train"] == ["train.jsonl"]
    assert v1["data"]["files"]["train.jsonl"] == reg.sha256_file(folder / "train.jsonl")
    curate, train, ev = calls(root)
    assert "--train-data" not in curate["argv"] and "--init-adapter" not in train["argv"]
    assert ev["argv"][ev["argv"].index("--against") + 1] == "base"
    assert ev["argv"][ev["argv"].index("--regression") + 1] == str(root / "regression.jsonl")

    serve(root, 24, start=24)  # the same day's file, appended: only the new lines are collected
    set_fake_losses(root, (0.9, 1.0), (2.3, 2.0))
    [second] = run_cycles(root, opts, commands=FAKES)
    assert second["status"] == "rejected" and reg.current_version(root) == "v0001"
    assert second["reasons"] == ["regression loss 2.3000 is above 2.0400 (2.0000 + 2%)"]
    assert [v["id"] for v in reg.list_versions(root)] == ["v0001"]
    collected = json.loads((Path(second["folder"]) / "collect.json").read_text())
    first_to = json.loads((folder / "collect.json").read_text())["files"]["interactions-2026-11-28.jsonl"]["to"]
    assert list(collected["files"]) == ["interactions-2026-11-28.jsonl"]
    assert collected["files"]["interactions-2026-11-28.jsonl"]["from"] == first_to
    v1_train = root / "versions/v0001/data/train.jsonl"
    curate, train, ev = calls(root)[3:]
    assert curate["argv"][curate["argv"].index("--train-data") + 1] == str(v1_train)
    assert train["argv"][train["argv"].index("--init-adapter") + 1] == str(root / "versions/v0001/adapter")
    assert ev["argv"][ev["argv"].index("--against") + 1] == str(root / "versions/v0001/adapter")
    assert second["replay"] == 6  # round(0.3 / 0.7 * 14)
    mixed = (Path(second["folder"]) / "train.jsonl").read_text().splitlines()
    assert len(mixed) == 20 and set(mixed[14:]) <= set(v1_train.read_text().splitlines())
    summary = format_report(second).splitlines()
    assert summary[0] == f"cycle {second['cycle']}: rejected"
    assert summary[1] == "  data:  24 exchanges -> 18 curated examples -> 14 train + 6 replayed, 4 held out"
    assert summary[-2:] == ["  v0001 stays in service", f"  folder: {second['folder']}"]
    assert run_cycles(root, opts, commands=FAKES)[0]["status"] == "nothing-to-do"


RUNNER = """
import json, os, signal, sys, threading
from hivetune.workflows.cycle import CycleOptions, run_cycles
root, kill_at, mid_train = sys.argv[1], sys.argv[2], float(sys.argv[3])
def on_stage(stage, folder):
    if stage == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if stage == "train" and mid_train:
        threading.Timer(mid_train, os.kill, (os.getpid(), signal.SIGKILL)).start()
opts = CycleOptions(train_set=%r, min_examples=10)
print(json.dumps(run_cycles(root, opts, commands=json.loads(sys.argv[4]), on_stage=on_stage)))
""" % (TRAIN_SET,)


def run_killed(root: Path, kill_at: str, mid_train: float = 0.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, str(root), kill_at, str(mid_train), json.dumps(FAKES)],
                          env=ENV, capture_output=True, text=True)


def stage_files(root: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (root / "cycles").glob("c*/*.json")}


def test_a_killed_cycle_resumes_from_its_first_unfinished_stage(tmp_path, base):
    root = new_registry(tmp_path, base)
    serve(root, 24)
    before = {}
    for kill_at in STAGES:
        p = run_killed(root, kill_at)
        assert p.returncode == -9, p.stderr
        files = stage_files(root)
        assert {k: v for k, v in files.items() if k in before} == before  # finished stages are not redone
        assert sorted(files) == sorted(f"{s}.json" for s in STAGES[:STAGES.index(kill_at)])
        before = files
        if kill_at == "train":  # once more, killed 1.5 s into training: the run goes on from its folder
            assert run_killed(root, "", mid_train=1.5).returncode == -9
            assert stage_files(root) == before
    p = run_killed(root, "")
    assert p.returncode == 0, p.stderr
    [report, nothing] = json.loads(p.stdout)
    assert report["status"] == "promoted" and nothing["status"] == "nothing-to-do"
    assert {k: v for k, v in stage_files(root).items() if k in before} == before
    assert reg.current_version(root) == "v0001" and len(reg.list_versions(root)) == 1
    assert [c["tool"] for c in calls(root)] == ["curate", "train", "train", "eval"]  # train: once killed
    folder = Path(report["folder"])
    assert (folder / "split.log").read_text().count("$ ") == 1
    assert json.loads((folder / "train.json").read_text())["steps"] == 3


def real_tools_present() -> bool:
    p = subprocess.run([sys.executable, "-m", "hivetune", "data", "curate", "--help"], env=ENV,
                       capture_output=True)
    return p.returncode == 0


@pytest.mark.skipif(not real_tools_present(), reason="`hivetune data curate` is not in this checkout yet")
def test_real_cycle_promotes_good_data_and_rejects_data_contradicting_the_regression_set(tmp_path, base):
    """Every stage real: cycle 1 learns answers that agree with the regression set (promoted);
    cycle 2 learns corrections that contradict it (held-out better, regression worse: rejected)."""
    first, second = good_then_contradicting_cycles(tmp_path, base)
    assert first["status"] == "promoted", first
    assert first["figures"]["heldout"]["candidate"] < first["figures"]["heldout"]["against"]
    assert second["status"] == "rejected", second
    assert second["figures"]["heldout"]["candidate"] < second["figures"]["heldout"]["against"]
    assert second["figures"]["regression"]["candidate"] > second["figures"]["regression"]["limit"]
    assert reg.current_version(tmp_path / "REG") == "v0001"


def good_then_contradicting_cycles(tmp_path: Path, base: Path, commands: dict | None = None) -> tuple[dict, dict]:
    root = new_registry(tmp_path, base)
    (root / "fake-eval.json").unlink()
    opts = CycleOptions(train_set=["max_steps=30", "batch_size=4", "device=cpu", "lr=0.005"], min_examples=20)
    serve(root, 40)
    [first] = run_cycles(root, opts, commands=commands)
    serve(root, 40, start=40, day="2026-11-29", answer="Never restart {s}: reboot the whole machine instead.")
    log = InteractionLog(root / "logs" / "interactions-2026-11-29.jsonl")
    for ex in list(read_logs([log.path]).exchanges):
        log.feedback(ex, 1, correction="Never restart it: reboot the whole machine instead.")
    log.close()
    [second] = run_cycles(root, CycleOptions(**{**opts.__dict__, "replay": 0.0}), commands=commands)
    return first, second
