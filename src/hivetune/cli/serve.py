"""`hivetune serve`: an OpenAI-compatible HTTP server that logs every exchange for the learning loop."""

from __future__ import annotations


def add_serve_parser(sub) -> None:
    srv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (chat completions, streaming, feedback), every exchange logged",
        description="Serve MODEL (a .gguf in llama.cpp, or an HF folder in hivetune) with an optional adapter, or "
                    "a registry's current version (swapped live when current.json changes). Endpoints: "
                    "/v1/chat/completions, /v1/models, /v1/feedback, /health. Every request but /health needs "
                    "'Authorization: Bearer KEY'; the key comes from HIVETUNE_API_KEY (or --api-key). "
                    "See docs/serve.md.")
    srv.add_argument("model", nargs="?", default="", metavar="MODEL",
                     help=".gguf file, HF folder or Hub id (default: the embedded model; none with --registry)")
    which = srv.add_mutually_exclusive_group()
    which.add_argument("--adapter", default="", metavar="DIR",
                       help=".gguf model: lora-adapter.gguf or the `export --format gguf` folder; "
                            "HF model: a run folder or adapter folder")
    which.add_argument("--registry", default="", metavar="DIR",
                       help="serve the registry's base + current version; logs go to DIR/logs")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default="", metavar="KEY",
                     help="the shared bearer key (prefer the environment variable HIVETUNE_API_KEY)")
    srv.add_argument("--no-auth", action="store_true", help="serve without a key (only with --host 127.0.0.1)")
    srv.add_argument("--log", default="", metavar="PATH",
                     help="interaction log: a FILE.jsonl, or a folder for daily interactions-DATE.jsonl "
                          "(default: REGISTRY/logs, else ./logs)")
    srv.add_argument("--max-new-tokens", type=int, default=256,
                     help="most tokens per answer: the default and the cap of a request's max_tokens")
    srv.add_argument("--ctx", type=int, default=4096, help="llama.cpp context length in tokens")
    srv.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: half the CPUs); on a busy machine, fewer than the free cores")
    srv.add_argument("--device", default="auto", help="HF models: device")
    srv.add_argument("--precision", default="auto", help="HF models: precision")


def run_serve(ns) -> int:
    from hivetune.core.errors import UserError
    from hivetune.workflows.serve import EngineOptions, serve

    if ns.ctx <= 0 or ns.threads < 0:
        raise UserError("--ctx must be > 0 and --threads >= 0")
    serve(model=ns.model, adapter=ns.adapter, registry=ns.registry, host=ns.host, port=ns.port, api_key=ns.api_key,
          no_auth=ns.no_auth, log=ns.log, max_new_tokens=ns.max_new_tokens,
          options=EngineOptions(ctx=ns.ctx, threads=ns.threads, device=ns.device, precision=ns.precision))
    return 0


COMMANDS = {"serve": (add_serve_parser, run_serve)}
