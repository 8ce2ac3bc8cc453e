"""How close a quantized GGUF export stays to the f16 one: perplexity on held-out answers and how
far the greedy answers agree, both scored by llama.cpp (llama-cpp-python), appended as one line
to benchmarks/results/quant-agreement-<device>.jsonl.

    python benchmarks/quant_agreement.py                  # trains the default job first (~3 min, 2-core CPU)
    python benchmarks/quant_agreement.py --run runs/ops --quant q5_k_m
    python benchmarks/quant_agreement.py --run runs/ops --imatrix train   # the quantizer calibrated

The run's adapter is merged into its base and written as f16 and as --quant (llama.cpp's own
quantizer on that f16 file, as `hivetune export --format gguf --quant` does). Each file scores
the run's held-out examples (default: the shipped 40): the reference answers' perplexity from
every position's logits, and a greedy answer of --tokens tokens at most (top-k 1). Agreement is
counted four ways: answers identical to f16's, their first 8 tokens equal, their first token
equal, and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def score(path: Path, examples, tokens: int, stop: set[int]) -> tuple[float, list[list[int]]]:
    """(perplexity of the reference answers, the greedy answers) of one GGUF file."""
    from hivetune.workflows.eval_llama import losses_and_answers

    losses, answers = losses_and_answers(path, None, examples, tokens, stop)
    return math.exp(sum(s for s, _ in losses) / sum(n for _, n in losses)), answers


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(reference, other)]
    return {"identical": sum(a == b for a, b in zip(reference, other)),
            "first_8_equal": sum(a[:8] == b[:8] for a, b in zip(reference, other)),
            "first_token_equal": sum(a[:1] == b[:1] for a, b in zip(reference, other)),
            "mean_common_prefix": round(sum(prefix) / len(prefix), 2), "prompts": len(reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a finished run folder (default: train the default job first)")
    parser.add_argument("--quant", default="q4_k_m", help="the quantized type to compare with f16 (default q4_k_m)")
    parser.add_argument("--imatrix", default="", help="export --imatrix for the quantized file (train: the run's data)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy answer length at most (default 32)")
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()

    import torch

    from hivetune.core.config import load_config
    from hivetune.model.tokenizer import eos_ids, load_tokenizer
    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result
    from hivetune.workflows.eval_examples import read_examples
    from hivetune.core.embedded import default_heldout_data
    from hivetune.workflows.export import base_model_path, export

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run, t0 = args.run, time.perf_counter()
        if run is None:
            from hivetune.workflows.train_job import train

            run = tmp / "run"
            cfg = load_config(None, {"output_dir": str(run), "eval_prompts": 0})  # the default job
            train(cfg, progress=False)
        train_s = time.perf_counter() - t0
        files = {}
        for name, kw in (("f16", {"dtype": "f16"}), (args.quant, {"quant": args.quant, "imatrix": args.imatrix})):
            out = export(run, "gguf", tmp / name, **kw)
            files[name] = out.out / f"model-{name}.gguf"
        config = load_config(run / "config.yaml", {})
        tokenizer = load_tokenizer(str(base_model_path(run / "adapter", config.model)))
        heldout = config.val_data or str(default_heldout_data())
        examples = read_examples(heldout, tokenizer, max_length=config.max_length)
        stop = eos_ids(tokenizer)
        t1 = time.perf_counter()
        ppl, answers = {}, {}
        for name, path in files.items():
            ppl[name], answers[name] = score(path, examples, args.tokens, stop)
        sizes = {name: path.stat().st_size for name, path in files.items()}
        score_s = time.perf_counter() - t1
    env = environment(torch.device("cpu"), args.commit)
    env.update(cpu_count=os.cpu_count(), load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in os.getloadavg()])
    figures = {"perplexity": {k: round(v, 4) for k, v in ppl.items()},
               "perplexity_change": round(ppl[args.quant] / ppl["f16"] - 1, 4),
               "greedy": agreement(answers["f16"], answers[args.quant]), "answer_tokens": args.tokens,
               "file_mib": {k: round(v / 2**20, 1) for k, v in sizes.items()},
               "train_s": round(train_s, 1), "score_s": round(score_s, 1)}
    record = {"workload": "quant-agreement", "device": "cpu",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": env["commit"],
              "setting": f"{args.quant}{' with --imatrix ' + args.imatrix if args.imatrix else ''} against f16, "
                         f"{'the default job' if args.run is None else args.run.name}, "
                         f"{len(examples)} held-out prompts", "environment": env, "figures": figures}
    path = append_result(Path(args.results), record)
    g = figures["greedy"]
    print(f"perplexity f16 {ppl['f16']:.3f}, {args.quant} {ppl[args.quant]:.3f} ({figures['perplexity_change']:+.1%}); "
          f"greedy answers of {args.tokens} tokens: identical {g['identical']}/{g['prompts']}, first 8 tokens "
          f"equal {g['first_8_equal']}, first token equal {g['first_token_equal']}, common prefix "
          f"{g['mean_common_prefix']:.1f} tokens on average -> {path}")


if __name__ == "__main__":
    sys.exit(main())
