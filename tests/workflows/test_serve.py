"""`hivetune serve` as a client sees it: a real server in a subprocess on a free port, the embedded
SmolLM2-135M GGUF in llama.cpp (no engine mocked), HTTP from the standard library (serve_client).

- errors: 401 without / with a wrong key (JSON body), /health open, 400 for a body that is not JSON
  or has no messages, 413 for a 10 MiB + 1 body from its Content-Length (before it is sent) or
  while a chunked one is read;
- stop strings (whole and streamed), text parts, seeds of a sampled answer;
- 20 chats from 4 concurrent clients (greedy: the same prompt gets the same answer from any client,
  which a Llama shared without the engine's serialization would not give), feedback on half, a
  streamed chat; a client that leaves mid-stream (its exchange logged as sent, "disconnected"), a
  SIGKILL mid-stream, a restart on the same log: the log reads back whole;
- an HF folder served by hivetune's own decoder answers as `hivetune chat` does; --no-auth only on
  127.0.0.1, no start without a key.

The registry (live versions) is in test_serve_registry.py.
"""

from __future__ import annotations

import http.client
import json
import signal
import time

import pytest
from serve_client import KEY, PROMPTS, Server, concurrently, embedded, events, needs_http, needs_llama

from hivetune.data.interaction_log import read_logs

LONG_PROMPT = "Write a long essay about the history of the Linux kernel."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    srv = Server([embedded(), "--log", str(folder / "log.jsonl"), "--max-new-tokens", "8"], folder / "out.txt")
    yield srv
    srv.stop()


@needs_http
@needs_llama
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


@needs_http
@needs_llama
def test_stop_strings_seeds_and_text_parts(server):
    whole = server.chat(PROMPTS[0], max_tokens=8)
    full = whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 8
    cut = full.index(" ", 4)  # a stop string from the middle of the answer, across tokens
    stop = full[cut:cut + 4]
    stopped = server.chat(PROMPTS[0], max_tokens=8, stop=[stop])
    assert stopped["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    conn, response = server.open_stream(PROMPTS[0], max_tokens=8, stop=stop)
    chunks = list(events(response))
    conn.close()
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == full[:full.index(stop)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    parts = server.chat("", messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}],
                        max_tokens=8)
    assert parts["choices"][0]["message"]["content"] == full
    sampled = [server.chat(PROMPTS[0], max_tokens=8, temperature=1.5, seed=seed)["choices"][0]["message"]["content"]
               for seed in (1, 1, 2, 3)]
    assert sampled[0] == sampled[1] and len(set(sampled)) > 1


@needs_http
@needs_llama
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


@needs_http
@needs_llama
def test_chats_from_concurrent_clients_feedback_and_a_stream(tmp_path):
    log = tmp_path / "interactions.jsonl"
    srv = Server([embedded(), "--log", str(log), "--max-new-tokens", "8"], tmp_path / "out.txt")
    try:
        answers: dict[str, tuple[str, str]] = {}  # exchange id -> (prompt, answer)
        def client(k: int) -> None:
            for i in range(5):  # each of the 5 prompts is asked by each client once
                prompt = PROMPTS[(i + k) % len(PROMPTS)]
                body = srv.chat(prompt, max_tokens=8)
                assert body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 10
                answers[body["id"]] = (prompt, body["choices"][0]["message"]["content"])

        concurrently(4, client)
        assert len(answers) == 20
        by_prompt: dict[str, set[str]] = {}
        for prompt, answer in answers.values():
            by_prompt.setdefault(prompt, set()).add(answer)
        assert len(by_prompt) == 5  # greedy: one answer to each prompt, from every client
        assert all(len(a) == 1 and next(iter(a)) for a in by_prompt.values()), by_prompt
        rated = {}
        for n, exchange_id in enumerate(sorted(answers)[:10]):  # feedback on half
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
    finally:
        srv.stop()

    contents = read_logs([log])
    assert (contents.broken_lines, contents.orphan_feedback) == (0, 0)
    answers[streamed_id] = (PROMPTS[0], streamed)
    assert set(contents.exchanges) == set(answers)
    for exchange_id, (prompt, answer) in answers.items():
        ex = contents.exchanges[exchange_id]
        assert (ex.messages, ex.answer, ex.model) == ([{"role": "user", "content": prompt}], answer,
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert ex.record["latency_s"] > 0 and 0 < ex.record["completion_tokens"] <= 8
        assert (ex.rating, ex.correction) == rated.get(exchange_id, (None, None))
        assert ex.record["stream"] is (exchange_id == streamed_id)


@needs_http
@needs_llama
def test_a_client_that_leaves_a_kill_mid_stream_and_a_restart(tmp_path):
    log = tmp_path / "interactions.jsonl"
    srv = Server([embedded(), "--log", str(log), "--max-new-tokens", "48"], tmp_path / "out.txt")
    try:
        conn, response = srv.open_stream(LONG_PROMPT, max_tokens=48)  # a client that leaves mid-stream
        seen = []
        for e in events(response):
            seen.append(e["choices"][0]["delta"].get("content", ""))
            if len(seen) == 4:
                break
        conn.sock.close()
        conn.close()
        whole = srv.chat(LONG_PROMPT, max_tokens=48)  # after the left one ended
        full = whole["choices"][0]["message"]["content"]

        conn, response = srv.open_stream(LONG_PROMPT, max_tokens=48)  # the server dies mid-stream
        stream = events(response)
        next(stream), next(stream)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        conn.close()
    finally:
        srv.stop()

    srv = Server([embedded(), "--log", str(log), "--max-new-tokens", "8"], tmp_path / "out.txt")
    try:
        assert srv.call("POST", "/v1/feedback", {"id": whole["id"], "rating": 1}) == \
            (200, {"id": whole["id"], "recorded": True})
        after = srv.chat(PROMPTS[1], max_tokens=8)
    finally:
        srv.stop()

    contents = read_logs([log])
    assert contents.broken_lines <= 1 and contents.orphan_feedback == 0
    left = [ex for ex in contents.exchanges.values() if ex.record["finish_reason"] == "disconnected"]
    assert len(left) == 1 and left[0].messages[0]["content"] == LONG_PROMPT and left[0].record["stream"] is True
    assert left[0].answer.startswith("".join(seen)) and full.startswith(left[0].answer)
    assert len(left[0].answer) < len(full)  # it stopped generating when the client left
    assert contents.exchanges[whole["id"]].answer == full and contents.exchanges[whole["id"]].rating == 1
    assert contents.exchanges[after["id"]].answer == after["choices"][0]["message"]["content"]
    assert len(contents.exchanges) == 3  # the one killed mid-stream is not logged


@needs_http
def test_no_key_no_start_and_no_auth_only_on_loopback(monkeypatch, capsys):
    from hivetune.cli import main

    # Each refused before the model is looked for: "model.gguf" does not exist.
    monkeypatch.delenv("HIVETUNE_API_KEY", raising=False)
    assert main(["serve", "model.gguf"]) == 2
    assert "no API key: set HIVETUNE_API_KEY (or --api-key KEY)" in capsys.readouterr().err
    assert main(["serve", "model.gguf", "--no-auth", "--host", "0.0.0.0"]) == 2
    assert "serves without a key on 127.0.0.1 / localhost only, not on --host 0.0.0.0" in capsys.readouterr().err
    monkeypatch.setenv("HIVETUNE_API_KEY", KEY)
    assert main(["serve", "model.gguf", "--registry", "x"]) == 2
    assert "--registry: serves the registry's base and current version; give no MODEL" in capsys.readouterr().err
    assert main(["serve", "--registry", "no-such-registry"]) == 2
    assert "--registry no-such-registry: no registry.json in this folder" in capsys.readouterr().err


@needs_http
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
