"""`hivetune serve --registry REG`: current.json moves from the base to a LoRA version (hivetune's LoRA
on the embedded model, its lora-adapter.gguf applied by llama.cpp) and /v1/models follows within
seconds while a client keeps chatting; a version that fails to load leaves the old one serving;
the specs of an HF base's versions and current.json's checks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from serve_client import PROMPTS, Server, embedded, needs_http, needs_llama, wait_for_model

from hivetune.data.interaction_log import read_logs


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


@needs_http
@needs_llama
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


def test_registry_specs_for_an_hf_base(tiny_model_dir, tmp_path):
    from hivetune.core.errors import UserError
    from hivetune.workflows.serve_registry import current_version, registry_spec

    reg = tmp_path / "reg"
    (reg / "versions" / "v0001" / "adapter").mkdir(parents=True)
    (reg / "registry.json").write_text(json.dumps({"base": str(tiny_model_dir), "created": "x"}))
    assert current_version(reg) == (None, b"")  # no current.json yet: the base alone
    assert registry_spec(reg, None).model_id == "base"
    with pytest.raises(UserError, match="v0001: no adapter/adapter_config.json"):
        registry_spec(reg, "v0001")
    (reg / "versions" / "v0001" / "adapter" / "adapter_config.json").write_text("{}")
    spec = registry_spec(reg, "v0001")
    assert (spec.model_id, spec.model, spec.adapter, spec.is_gguf) == \
        ("v0001", tiny_model_dir, reg / "versions" / "v0001" / "adapter", False)
    with pytest.raises(UserError, match="version v0009 has no folder"):
        registry_spec(reg, "v0009")
    point(reg, "../../etc")
    with pytest.raises(UserError, match=r'"version" must be a version id \(v0001, ...\) or null'):
        current_version(reg)
