"""Where the host's time goes in graphed training steps: cProfile over `fit` after a warm-up.

    python bench/host_profile.py W1 [--steps 200]

Each fit call captures its CUDA graphs again: `_capture` is shown apart in the listing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.bench import WORKLOADS, random_model, workload_examples  # noqa: E402
from hivetune.config import load_config  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.train import assemble, fit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", default="W1", nargs="?")
    parser.add_argument("--steps", type=int, default=200)
    opts = parser.parse_args()
    w = WORKLOADS[opts.workload]
    cfg = load_config(None, {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
                             "max_steps": opts.steps + 3, "batch_size": w.micro_batch or w.examples_per_step,
                             "grad_accum": w.examples_per_step // (w.micro_batch or w.examples_per_step),
                             "lora": w.lora, "eval_prompts": 0, "max_length": 4096, "log_every": 1000})
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    model = random_model(w.args, torch.device("cuda"), torch.bfloat16)
    run = assemble(cfg, model, examples, None, torch.device("cuda"), "bf16", Path(f"/tmp/hostprof-{time.time()}"),
                   Path("random"))
    run.steps, rest = run.steps[:3], run.steps[3:]
    fit(run, progress=False)
    run.steps = rest
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fit(run, progress=False)
    torch.cuda.synchronize()
    prof.disable()
    print(f"{len(rest)} steps in {time.perf_counter() - t0:.2f} s under cProfile")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
