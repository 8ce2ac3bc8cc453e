"""`hivetune serve`: a model (or a registry's current version) behind an OpenAI-compatible HTTP API,
every exchange appended to the interaction log that `data curate` / `data pairs` read.

A .gguf runs in llama.cpp (llama-cpp-python), an HF folder in hivetune's own decoder
(serve_engine). With ``--registry REG`` the server serves REG/registry.json's base with the
version REG/current.json names, polls current.json about once a second, loads a new version in the
background and swaps only once it loaded: requests in flight finish on the engine they started on,
and a version that fails to load is reported while the old one keeps serving. The HTTP app is in
serve_app, the registry and log files in serve_registry; docs/serve.md is the user's guide.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.workflows.serve_engine import Engine
from hivetune.workflows.serve_registry import (ModelSpec, RegistryWatcher, current_version, direct_spec,
                                               open_log, registry_spec)

# The shared key as an environment variable, so that it stays out of shell history and `ps`.
API_KEY_ENV = "HIVETUNE_API_KEY"


@dataclass
class EngineOptions:
    ctx: int = 4096  # llama.cpp context (prompt + answer tokens)
    threads: int = 0  # llama.cpp threads for prompt and decoding; 0: half the CPUs
    device: str = "auto"  # HF folders: hivetune's device and precision
    precision: str = "auto"


def load_engine(spec: ModelSpec, options: EngineOptions) -> Engine:
    from hivetune.workflows.serve_engine import HFBackend, LlamaBackend

    start = time.perf_counter()
    if spec.is_gguf:
        backend = LlamaBackend(spec.model, spec.adapter, options.ctx, options.threads)
    else:
        backend = HFBackend(spec.model, spec.adapter, options.device, options.precision)
    return Engine(spec.model_id, backend, time.perf_counter() - start)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_auth(api_key: str, no_auth: bool, host: str) -> str | None:
    """The shared key (--api-key, else HIVETUNE_API_KEY); None only with --no-auth on a loopback host."""
    key = api_key or os.environ.get(API_KEY_ENV, "")
    if no_auth:
        if key:
            raise UserError(f"--no-auth: a key is set (--api-key or {API_KEY_ENV}); drop one of them")
        if not is_loopback(host):
            raise UserError(f"--no-auth: serves without a key on 127.0.0.1 / localhost only, not on --host {host}")
        return None
    if not key:
        raise UserError(f"serve: no API key: set {API_KEY_ENV} (or --api-key KEY); "
                        "--no-auth serves without one, on 127.0.0.1 only")
    if len(key) < 8:
        raise UserError("--api-key: at least 8 characters")
    return key


def serve(model: str = "", adapter: str = "", registry: str = "", host: str = "127.0.0.1", port: int = 8000,
          api_key: str = "", no_auth: bool = False, log: str = "", max_new_tokens: int = 256,
          options: EngineOptions | None = None, poll_s: float = 1.0) -> None:
    """Load the model, then serve until interrupted (SIGINT / SIGTERM end it gracefully)."""
    try:
        import uvicorn  # optional dependencies (extra "serve")

        from hivetune.workflows.serve_app import ServerState, create_app
    except ImportError as e:
        raise UserError(f"serve: {e.name} is not installed: pip install 'hivetune[serve]'") from None

    options = options or EngineOptions()
    key = check_auth(api_key, no_auth, host)
    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens: must be > 0, got {max_new_tokens}")
    if not 0 <= port <= 65535:
        raise UserError(f"--port: 0..65535, got {port}")
    reg = Path(registry) if registry else None
    if reg is not None:
        if model or adapter:
            raise UserError("--registry: serves the registry's base and current version; give no MODEL or --adapter")
        version, seen = current_version(reg)
        spec = registry_spec(reg, version)
    else:
        spec, seen = direct_spec(model, adapter), b""
    engine = load_engine(spec, options)
    print(f"hivetune serve: {spec.model_id} loaded in {engine.load_s:.1f} s", file=sys.stderr, flush=True)
    logs = open_log(log, reg)
    state = ServerState(engine, logs, max_new_tokens)
    watcher = None
    if reg is not None:
        watcher = RegistryWatcher(reg, seen, lambda v: swap_to(state, reg, v, options), poll_s)
        watcher.start()
    app = create_app(state, key)
    where = logs.path if hasattr(logs, "path") else log
    print(f"hivetune serve: http://{host}:{port}/v1 (log: {where}; auth: {'bearer key' if key else 'none'})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10,
                                      server_header=False)).run()
    finally:
        if watcher is not None:
            watcher.stop()
        state.engine.retire()
        state.engine.worker.join(timeout=30)
        logs.close()


def swap_to(state, registry: Path, version: str | None, options: EngineOptions) -> None:
    """Load `version` beside the engine serving now; swap once it loaded (raises when it does not)."""
    spec = registry_spec(registry, version)
    if spec.model_id == state.engine.model_id:
        return
    print(f"hivetune serve: loading {spec.model_id} (serving {state.engine.model_id} meanwhile)",
          file=sys.stderr, flush=True)
    engine = load_engine(spec, options)
    state.swap(engine)
    print(f"hivetune serve: now serving {spec.model_id} (loaded in {engine.load_s:.1f} s)", file=sys.stderr, flush=True)
