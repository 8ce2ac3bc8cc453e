"""The learning loop with the real parts: `hivetune serve --registry REG` serves the embedded
SmolLM2-135M GGUF through llama.cpp; 4 concurrent clients chat over HTTP and correct half the
answers through POST /v1/feedback; `hivetune cycle` learns from REG/logs as the server wrote them
with the real tools (train on the GGUF base, its LoRA GGUF, eval --candidate --against scored by
llama.cpp as it serves the versions), and

- cycle 1, SIGKILLed in its eval stage and finished by the next cycle with the real eval, promotes
  v0001 (corrections that agree with the regression set): the running server takes it (/v1/models,
  the answers' "model", the log's records, its "now serving" line) and answers exactly as
  llama-cpp-python does on the base with v0001's lora-adapter.gguf;
- cycle 2 (corrections that contradict the regression set) is rejected for its regression loss
  alone (its held-out loss is lower): the registry and the server keep v0001.

3 steps of 4 examples at lr 3e-3 leave wide margins: cycle 1's held-out loss 0.006 against the
base's 3.8 and regression loss 0.23 against 4.2; cycle 2's regression loss 1.8-2.1 against v0001's
0.23 (its held-out set depends on the order in which the concurrent chats reached the log). About
2 minutes on the 2-core CPU (busy), most of it the two training runs.
"""

from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_client import Server, concurrently, embedded, needs_http, needs_llama, wait_for_model

from conftest import write_jsonl
from hivetune.data.interaction_log import read_logs
from hivetune.workflows import registry as reg
from hivetune.workflows.cycle import CycleOptions, flag_each, gate, run_cycles

SRC = Path(__file__).parents[2] / "src"
SERVICES = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd", "crond", "cups", "firewalld", "auditd"]
GOOD = "systemctl restart {s}"
WORSE = "Never restart it: reboot the whole machine instead."
QUESTION = [{"role": "user", "content": "How do I restart nginx?"}]
MAX_TOKENS = 12
TRAIN = ["max_steps=3", "batch_size=4", "lr=0.003", "device=cpu", "lora.r=8", "max_new_tokens=8", "eval_prompts=0"]
OPTS = CycleOptions(train_set=TRAIN, replay=0.0, heldout=0.3, min_examples=10)


@pytest.fixture(autouse=True)
def subprocess_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SRC))  # the cycle's tools run as `python -m hivetune` from this checkout
    # one thread each: two of them spin-wait for each other on a busy 2-core machine (eval 5x slower)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def chat_and_correct(srv: Server, start: int, correction: str) -> dict[str, str]:
    """20 chats from 4 concurrent clients, then the even-numbered half corrected: exchange id -> the
    model that answered."""
    asked: dict[int, dict] = {}

    def client(k: int) -> None:
        for i in range(start + k, start + 20, 4):
            asked[i] = srv.chat(f"How do I restart {SERVICES[i % len(SERVICES)]}? (ticket {i})",
                                max_tokens=MAX_TOKENS)

    concurrently(4, client)
    assert sorted(asked) == list(range(start, start + 20))
    for i in range(start, start + 20, 2):
        ex_id = asked[i]["id"]
        assert srv.call("POST", "/v1/feedback", {"id": ex_id, "rating": -1, "correction": correction.format(
            s=SERVICES[i % len(SERVICES)])}) == (200, {"id": ex_id, "recorded": True})
    return {body["id"]: body["model"] for body in asked.values()}


def killed_in_eval(root: Path) -> Path:
    """`hivetune cycle` in a subprocess, SIGKILLed once its eval (llama.cpp, the model as served) has
    written the candidate's LoRA GGUF into its scratch folder and starts scoring; the cycle's
    folder. The eval dies with the cycle."""
    argv = [sys.executable, "-m", "hivetune", "cycle", "--registry", str(root), "--replay", "0", "--heldout", "0.3",
            "--min-examples", "10", *flag_each("--train-set", TRAIN)]
    out = root.parent / "cycle.txt"
    scratch = root.parent / "tmp"  # the eval's TemporaryDirectory: left behind by the kill, here
    scratch.mkdir(exist_ok=True)
    proc = subprocess.Popen(argv, stdout=out.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "TMPDIR": str(scratch)})
    try:
        deadline = time.time() + 300
        while not list(scratch.glob("hivetune-eval-*/candidate.gguf")):
            assert proc.poll() is None and time.time() < deadline, f"no eval started scoring:\n{out.read_text()}"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    [folder] = [p.parent for p in (root / "cycles").glob("c*/eval.log")]
    assert (folder / "export.json").is_file() and not (folder / "eval.json").is_file()
    deadline = time.time() + 10
    while tool_rss(folder):
        assert time.time() < deadline, "the eval outlived its cycle"
        time.sleep(0.1)
    return folder


def tool_rss(folder: Path) -> list[int]:
    """The resident bytes of each process whose command line names the cycle's folder (its tools)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(folder).encode() in (proc / "cmdline").read_bytes():
                found.append(int((proc / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except OSError:  # it ended while we looked
            continue
    return found


def direct_answer(lora: Path | None) -> str:
    """What llama-cpp-python answers on the embedded base (+ lora) with the server's greedy settings."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=embedded(), lora_path=str(lora) if lora else None, n_ctx=4096, n_threads=1,
                          n_threads_batch=1, verbose=False)
    try:
        out = llm.create_chat_completion(messages=QUESTION, temperature=0.0, max_tokens=MAX_TOKENS)
        return out["choices"][0]["message"]["content"]
    finally:
        llm.close()


def check_report(report: dict) -> None:
    """The report agrees with the gate on the compare.json the real eval wrote."""
    folder = Path(report["folder"])
    verdict = gate(reg.read_json(folder / "eval" / "compare.json"), OPTS.margin)
    assert report["status"] == ("promoted" if verdict["promote"] else "rejected")
    assert report["reasons"] == verdict["reasons"]
    assert report["figures"] == {"heldout": verdict["heldout"], "regression": verdict["regression"]}


@pytest.mark.slow
@needs_http
@needs_llama
def test_the_loop_on_the_embedded_gguf_through_llama_cpp(tmp_path):
    root = tmp_path / "REG"
    reg.init_registry(root, embedded())
    write_jsonl(root / "regression.jsonl", [{"messages": [{"role": "user", "content": f"restart {s}?"},
                                                          {"role": "assistant", "content": GOOD.format(s=s)}]}
                                            for s in SERVICES[:6]])
    srv = Server(["--registry", str(root), "--max-new-tokens", str(MAX_TOKENS)], tmp_path / "out.txt")
    try:
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "base"
        models = chat_and_correct(srv, 0, GOOD)
        before = srv.call("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": MAX_TOKENS})[1]

        folder = killed_in_eval(root)
        assert reg.current_version(root) is None and srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "base"
        [first, nothing] = run_cycles(root, OPTS)  # finishes the killed cycle from its eval, then collects
        assert nothing["status"] == "nothing-to-do"
        assert first["status"] == "promoted" and first["folder"] == str(folder), first
        runs = {stage: [line for line in (folder / f"{stage}.log").read_text().splitlines() if line.startswith("$ ")]
                for stage in ("train", "eval")}
        assert len(runs["train"]) == 1 and len(runs["eval"]) == 2  # the killed eval, then the one that finished
        assert runs["eval"][0] == runs["eval"][1]
        check_report(first)
        assert json.loads((folder / "eval" / "compare.json").read_text())["engine"] == "llama.cpp"  # as served
        assert (first["version"], first["parent"], reg.current_version(root)) == ("v0001", None, "v0001")
        assert (first["exchanges"], first["curated"], first["train"], first["heldout"]) == (21, 10, 7, 3)
        held, regr = first["figures"]["heldout"], first["figures"]["regression"]  # measured: 0.006 vs 3.8, 0.23 vs 4.2
        assert held["candidate"] < held["against"] / 4 and regr["candidate"] < regr["against"] / 4, first
        assert wait_for_model(srv, "v0001") < 20
        after = srv.call("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": MAX_TOKENS})[1]

        models.update(chat_and_correct(srv, 20, WORSE))
        [second] = run_cycles(root, OPTS)
        check_report(second)
        assert second["status"] == "rejected" and second["parent"] == "v0001", second
        assert (second["exchanges"], second["curated"], second["train"], second["heldout"]) == (21, 10, 7, 3)
        [reason] = second["reasons"]  # it learned the new corrections: rejected for the regression set alone
        assert reason.startswith("regression loss "), reason
        held, regr = second["figures"]["heldout"], second["figures"]["regression"]  # measured: 0.36 vs 6.4, 2.1 vs 0.23
        assert held["candidate"] < held["against"] / 4 and regr["candidate"] > regr["against"] * 4, second
        assert reg.current_version(root) == "v0001" and [v["id"] for v in reg.list_versions(root)] == ["v0001"]
        time.sleep(1.5)  # the server's watcher polls current.json each second: nothing to take
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "v0001"
        still = srv.call("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": MAX_TOKENS})[1]
    finally:
        srv.stop()

    answer = lambda body: body["choices"][0]["message"]["content"]
    assert (before["model"], after["model"], still["model"]) == ("base", "v0001", "v0001")
    assert answer(before) == direct_answer(None)
    lora = root / "versions" / "v0001" / reg.LORA_GGUF
    assert answer(after) == answer(still) == direct_answer(lora) != answer(before)
    assert answer(after) == "systemctl restart nginx"  # what the corrections taught, then the end of turn
    out = srv.out.read_text()
    assert "hivetune serve: now serving v0001" in out and "v0002" not in out

    contents = read_logs(sorted((root / "logs").glob("interactions-*.jsonl")))
    assert contents.broken_lines == 0
    logged = {i: ex.model for i, ex in contents.exchanges.items()}
    assert logged == {**models, before["id"]: "base", after["id"]: "v0001", still["id"]: "v0001"}
    assert list(models.values()) == ["base"] * 20 + ["v0001"] * 20
