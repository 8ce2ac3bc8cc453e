"""`hivetune generate`, `chat`, `eval`, `report` and `export`: use and ship a trained model."""

from __future__ import annotations


from hivetune.core.errors import UserError


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="greedy generation from a model, optionally with an adapter")
    gen.add_argument("prompt", help="the prompt (chat template applied when the model has one)")
    gen.add_argument("--model", default="", metavar="PATH", help="HF folder or .gguf (default: embedded model)")
    gen.add_argument("--adapter", default="", metavar="RUN", help="run folder or adapter folder")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--no-chat", action="store_true", help="raw continuation, no chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--precision", default="auto")


def run_generate(ns) -> int:
    from hivetune.workflows.generate import generate

    if ns.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens: must be > 0, got {ns.max_new_tokens}")
    print(generate(model=ns.model, prompt=ns.prompt, adapter=ns.adapter, max_new_tokens=ns.max_new_tokens,
                   chat=not ns.no_chat, device=ns.device, precision=ns.precision))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="base vs tuned, or two versions A/B, on held-out data: loss, answers, scores",
                        description="Score the base model (LoRA off) and the tuned one (adapter on) on prompt/"
                                    "response data: response loss and perplexity, greedy answers with exact "
                                    "match, token F1, ROUGE-L and command hits. Writes eval.json and eval.md. "
                                    "With --candidate A --against B: the two versions side by side, with per-"
                                    "example wins by token F1, into compare.json and compare.md.")
    ev.add_argument("--adapter", default="", metavar="RUN", help="run folder or adapter folder")
    ev.add_argument("--candidate", default="", metavar="A",
                    help="A/B: run folder, adapter folder, merged HF folder, .gguf file or base")
    ev.add_argument("--against", default="", metavar="B", help="A/B: what A is compared with (same kinds as A)")
    ev.add_argument("--regression", default="", metavar="FILE",
                    help="A/B: a second set to score both on (e.g. the earlier training data)")
    ev.add_argument("--model", default="", metavar="PATH",
                    help="base model (default: the one the adapter names, else the embedded model)")
    ev.add_argument("--data", default="", metavar="FILE", help="alpaca / chat data: a file, folder or Hub dataset "
                                                                "(its test split; default: the shipped held-out set)")
    ev.add_argument("--max-new-tokens", type=int, default=0,
                    help="most tokens per answer (default: the run's max_new_tokens, else 96)")
    ev.add_argument("--limit", type=int, default=0, metavar="K", help="first K examples only (0: all)")
    ev.add_argument("--out", default="", metavar="DIR", help="folder for eval.json and eval.md (default: RUN/eval; "
                                                             "A/B: compare.json / compare.md, default A/compare)")
    ev.add_argument("--force", action="store_true", help="overwrite an existing eval.json / eval.md")
    ev.add_argument("--batch-size", type=int, default=96, help="most prompts generated together")
    ev.add_argument("--max-length", type=int, default=1024, help="token limit for the loss (as in training)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--precision", default="auto")
    ev.add_argument("--engine", default="hivetune", choices=["hivetune", "llama.cpp"],
                    help="A/B: score with hivetune's decoder (default) or, for .gguf models, with llama.cpp as it "
                         "serves them (the GGUF's own quant blocks and the LoRA GGUF)")


def run_eval(ns) -> int:
    from hivetune.workflows.eval_report import means_table
    from hivetune.workflows.evaluate import evaluate

    if ns.candidate or ns.against:
        return run_compare(ns)
    if not ns.adapter:
        raise UserError("eval: give --adapter RUN, or --candidate A --against B")
    report = evaluate(model=ns.model, adapter=ns.adapter, data=ns.data, max_new_tokens=ns.max_new_tokens,
                      limit=ns.limit, out=ns.out, force=ns.force, batch_size=ns.batch_size,
                      max_length=ns.max_length, device=ns.device, precision=ns.precision)
    print(means_table(report))
    print(f"\n{report['examples']} examples in {report['seconds']['total']:.1f} s; "
          f"wrote {report['out']}/eval.json and eval.md")
    return 0


def run_compare(ns) -> int:
    from hivetune.workflows.compare import compare, means_table

    if ns.adapter:
        raise UserError("eval: --adapter is for base vs tuned; with --candidate / --against leave it out")
    report = compare(ns.candidate, ns.against, data=ns.data, regression=ns.regression, out=ns.out, model=ns.model,
                     force=ns.force, max_new_tokens=ns.max_new_tokens, limit=ns.limit, batch_size=ns.batch_size,
                     max_length=ns.max_length, device=ns.device, precision=ns.precision, engine=ns.engine)
    for name, entry in report["sets"].items():
        print(f"{name} ({entry['examples']} examples): candidate {ns.candidate} vs against {ns.against}")
        print(means_table(entry) + "\n")
    print(f"{report['seconds']:.1f} s; wrote {report['out']}/compare.json and compare.md")
    return 0


def add_report_parser(sub) -> None:
    rep = sub.add_parser("report", help="one self-contained HTML page with the run's charts, A/B table and config",
                         description="Draw a run folder's loss / validation loss, learning rate, grad norm, "
                                     "tokens/s and memory, the planner's memory breakdown (plan.json) and the "
                                     "A/B table (eval/eval.json) into report.html (images inlined) and PNGs.")
    rep.add_argument("run", metavar="RUN", help="run folder")
    rep.add_argument("--out", default="", metavar="DIR", help="folder for report.html and the PNGs (default: RUN/report)")


def run_report(ns) -> int:
    from hivetune.workflows.report import report

    result = report(ns.run, ns.out)
    print(f"wrote {result['html']} and {len(result['pngs'])} PNGs ({', '.join(result['pngs'])})")
    return 0


def add_export_parser(sub) -> None:
    ex = sub.add_parser("export", help="a run as a PEFT adapter, a merged HF folder, or GGUF for llama.cpp / Ollama",
                        description="Export a trained run: --format adapter (PEFT files + model card), merged (HF "
                                    "folder with the LoRA merged in) or gguf (merged model, LoRA-only adapter, Ollama "
                                    "Modelfile, llama-server command). Written into a temp folder, renamed at the end.")
    ex.add_argument("run", metavar="RUN", help="run folder (or adapter folder)")
    ex.add_argument("--format", required=True, help="adapter | merged | gguf")
    ex.add_argument("--dtype", default=None, help="merged: f32 (default) | f16 | bf16; gguf: f16 (default) | bf16 | q8_0 | f32")
    ex.add_argument("--quant", default=None, help="gguf: q4_k_m | q5_k_m | q6_k | q4_0 (llama.cpp's quantizer on the f16 "
                                                  "file; needs llama-cpp-python) | q8_0 | f16 | bf16 | f32")
    ex.add_argument("--imatrix", default="", metavar="DATA",
                    help="with a llama.cpp --quant: weigh each tensor's rounding by its inputs on DATA (a data "
                         "file, folder or Hub dataset; `train`: the run's training data)")
    ex.add_argument("--out", required=True, metavar="DIR", help="folder to create")
    ex.add_argument("--force", action="store_true", help="replace an existing --out")
    ex.add_argument("--model", default="", metavar="PATH", help="base model (default: the one the adapter names)")


def run_export(ns) -> int:
    from hivetune.workflows.export import export

    result = export(ns.run, ns.format, ns.out, dtype=ns.dtype, force=ns.force, model=ns.model, quant=ns.quant,
                    imatrix=ns.imatrix)
    dtype = f" ({result.dtype})" if result.dtype else ""
    print(f"exported {ns.run} as {result.format}{dtype} to {result.out}: {', '.join(result.files)}")
    if result.commands:
        print(result.commands)
    return 0


def add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="talk to a model on stdin / stdout (base, + adapter, merged folder or GGUF)",
                          description="Each input line is a user message; the conversation is kept and rendered with "
                                      "the model's chat template. /reset starts over; /exit or end of input ends.")
    chat.add_argument("--model", default="", metavar="PATH", help="HF folder or .gguf (default: embedded model)")
    chat.add_argument("--adapter", default="", metavar="RUN", help="run folder or adapter folder")
    chat.add_argument("--system", default="", help="system message")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--device", default="auto")
    chat.add_argument("--precision", default="auto")


def run_chat(ns) -> int:
    from hivetune.workflows.chat import chat

    chat(model=ns.model, adapter=ns.adapter, system=ns.system, max_new_tokens=ns.max_new_tokens,
         device=ns.device, precision=ns.precision)
    return 0


COMMANDS = {"generate": (add_generate_parser, run_generate), "chat": (add_chat_parser, run_chat),
            "eval": (add_eval_parser, run_eval), "report": (add_report_parser, run_report),
            "export": (add_export_parser, run_export)}
