"""The learning loop on an HF base, served by hivetune's own decoder: `hivetune serve --registry REG`
(a tiny random HF model) logs the chats and feedback of its clients into REG/logs; `hivetune cycle`
learns from that log with the real tools and promotes v0001; the running server loads v0001's
adapter folder (/v1/models, the answers' "model", the log's records) and answers as `hivetune chat`
does with that adapter.

The same loop on the embedded GGUF through llama.cpp, with a rejected cycle (the server keeps the
version) and a cycle killed in its eval, is test_loop_gguf.py; a cycle SIGKILLed at each stage while
a server runs is in test_cycle.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_client import Server, needs_http, wait_for_model

from conftest import build_tiny_model, build_tokenizer, write_jsonl
from hivetune.data.interaction_log import read_logs
from hivetune.workflows import registry as reg
from hivetune.workflows.cycle import CycleOptions, run_cycles

SRC = Path(__file__).parents[2] / "src"
SERVICES = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]
GOOD = "systemctl restart {s}"
OPTS = CycleOptions(train_set=["max_steps=30", "batch_size=4", "device=cpu", "lr=0.005"], replay=0.0, min_examples=20)


@pytest.fixture(autouse=True)
def subprocess_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SRC))  # the cycle's tools run as `python -m hivetune` from this checkout
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def chat_and_correct(srv: Server, n: int, start: int, correction: str) -> dict[str, str]:
    """n chats over HTTP, each answer disliked and corrected: exchange id -> the model that answered."""
    models = {}
    for i in range(start, start + n):
        s = SERVICES[i % len(SERVICES)]
        body = srv.chat(f"How do I restart {s}? ({i})", max_tokens=6)
        models[body["id"]] = body["model"]
        assert srv.call("POST", "/v1/feedback", {"id": body["id"], "rating": -1,
                                                 "correction": correction.format(s=s)}) == \
            (200, {"id": body["id"], "recorded": True})
    return models


@needs_http
def test_a_cycle_learns_from_the_served_log_and_the_hf_server_takes_the_new_version(tmp_path):
    from hivetune.workflows.chat import reply
    from hivetune.workflows.generate import load_for_generation

    base = tmp_path / "base"
    build_tokenizer(base)
    build_tiny_model(base, seed=4)
    root = tmp_path / "REG"
    reg.init_registry(root, str(base))
    write_jsonl(root / "regression.jsonl", [{"messages": [{"role": "user", "content": f"restart {s}?"},
                                                          {"role": "assistant", "content": GOOD.format(s=s)}]}
                                            for s in SERVICES])
    question = [{"role": "user", "content": "How do I restart nginx?"}]
    srv = Server(["--registry", str(root), "--max-new-tokens", "6", "--device", "cpu", "--precision", "fp32"],
                 tmp_path / "out.txt")
    try:
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "base"
        models = chat_and_correct(srv, 40, 0, GOOD)
        before = srv.call("POST", "/v1/chat/completions", {"messages": question})[1]

        [first] = run_cycles(root, OPTS)  # REG/logs as the running server wrote it
        assert first["status"] == "promoted", first
        assert (first["version"], reg.current_version(root)) == ("v0001", "v0001")
        assert (first["exchanges"], first["curated"], first["train"], first["heldout"]) == (41, 40, 32, 8)
        assert wait_for_model(srv, "v0001") < 10
        after = srv.call("POST", "/v1/chat/completions", {"messages": question})[1]
    finally:
        srv.stop()

    assert (before["model"], after["model"]) == ("base", "v0001")
    answer = lambda body: body["choices"][0]["message"]["content"]
    net, tok = load_for_generation(str(base), "", "cpu", "fp32")
    assert answer(before) == reply(net, tok, question, 6)
    net, tok = load_for_generation(str(base), str(root / "versions" / "v0001" / "adapter"), "cpu", "fp32")
    assert answer(after) == reply(net, tok, question, 6) != answer(before)
    assert "hivetune serve: now serving v0001" in srv.out.read_text()

    contents = read_logs(sorted((root / "logs").glob("interactions-*.jsonl")))
    assert contents.broken_lines == 0
    logged = {i: ex.model for i, ex in contents.exchanges.items()}
    assert logged == {**models, before["id"]: "base", after["id"]: "v0001"}
    assert set(models.values()) == {"base"} and {ex.correction for ex in contents.exchanges.values()} >= {
        GOOD.format(s="nginx")}
    v1 = reg.read_version(root, "v0001")
    assert v1["parent"] is None and json.loads((root / "current.json").read_text())["version"] == "v0001"
