"""Start-up time: how long hivetune takes before and around a training run, each figure over N
fresh processes, and one JSON line appended to benchmarks/results/startup-<device>.jsonl.

    python benchmarks/startup.py                       # 5 runs of each, the tiny job included
    python benchmarks/startup.py --runs 10 --no-job    # the imports alone
    python benchmarks/startup.py --cold-pyc            # every process compiles its Python sources

Figures (seconds, median / min / max over the runs):
- python:       `python -c pass`, the interpreter's own start (the floor of every other figure);
- help:         `python -m hivetune --help` (goal: 0.3 s; it imports no torch);
- import_torch: `python -c "import torch"`;
- import_train: `import torch` then the modules a training run imports (hivetune.train.run /
  setup / step / loop, hivetune.workflows.train_job), the whole process;
- train_share:  the same modules timed inside the process after `import torch`: what hivetune
  adds on top of torch (goal: 1.5 s on the GPU machine);
- tokenizer_auto / tokenizer_saved: the tiny model's tokenizer built inside the process after
  `import torch`, by transformers' AutoTokenizer and by hivetune.model.tokenizer.load_saved
  (FolderTokenizer, without transformers: what a folder of a generic tokenizer class and a GGUF
  file's converted tokenizer take);
- job:          `python -m hivetune train` on a tiny random model (2 layers, hidden 64) and 16
  examples with --max-steps 2, the whole process (tokenizer, model, doctor's checks, two
  steps, adapter); job_train_s is the run's own train_seconds (summary.json).
- small_job (with --small-job DIR): `python -m hivetune train --model DIR --epochs 3` on the shipped
  data (360 examples) with its held-out A/B (40 questions, base against tuned), the whole process
  (goal: 8 s on the GPU machine for a 0.5B-shape folder); small_job_train_s and small_job_eval_s
  are its summary.json's training loop and A/B seconds.
- job_model_class: the same job with tokenizer_config.json naming a model-specific class
  (Qwen2Tokenizer, as a Qwen2.5 folder does): the first process converts it through transformers
  into hivetune's cache (a fresh cache folder for the benchmark), the later ones load the
  conversion without transformers (the max is the first run).

--cold-pyc points PYTHONPYCACHEPREFIX at a new empty folder for each process, so that every
module, torch's too, is compiled from source as on a machine whose site-packages keep no
bytecode cache. Children inherit this process's environment (PYTHONPATH included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN_MODULES = ("hivetune.train.run", "hivetune.train.setup", "hivetune.train.step", "hivetune.train.loop",
                 "hivetune.workflows.train_job")
IMPORT_TRAIN = "import torch; " + "; ".join(f"import {m}" for m in TRAIN_MODULES)
TRAIN_SHARE = ("import time, torch; t = time.perf_counter(); " + "; ".join(f"import {m}" for m in TRAIN_MODULES)
               + "; print(time.perf_counter() - t)")
# Modules that a training run's imports must not load (tests/test_imports.py checks the same list).
HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "transformers", "sklearn", "datasets",
         "pyarrow", "matplotlib", "tensorboard", "mlflow", "wandb", "triton", "huggingface_hub", "jinja2", "sympy")
TOKENIZER_AUTO = ("import sys, time, torch; t = time.perf_counter(); from transformers import AutoTokenizer; "
                  "AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True); print(time.perf_counter() - t)")
TOKENIZER_SAVED = ("import sys, time, torch; t = time.perf_counter(); from hivetune.model.tokenizer import load_saved; "
                   "load_saved(sys.argv[1]); print(time.perf_counter() - t)")
LOADED = (IMPORT_TRAIN + "; import sys, json; print(json.dumps(sorted(h for h in " + repr(HEAVY)
          + " if h in sys.modules)))")
CORPUS = ["How do I restart the nginx service? Run systemctl restart nginx as root.",
          "Show the logs of sshd from the last hour with journalctl -u sshd --since '1 hour ago'.",
          "List GPUs with nvidia-smi; podman run --device nvidia.com/gpu=all runs a container on them."]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tiny_job(folder: Path) -> tuple[Path, Path]:
    """A 2-layer, hidden-64 random Llama with a 384-token byte-level BPE tokenizer (HF folder) and
    16 alpaca records; returns (model folder, data file)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model = folder / "tiny-llama"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(str(model))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(str(model))
    data = folder / "data.jsonl"
    services = ["nginx", "sshd", "redis", "podman"]
    data.write_text("".join(json.dumps({"instruction": f"How do I restart {services[i % 4]}? ({i})", "input": "",
                                        "output": f"Run `systemctl restart {services[i % 4]}` as root."}) + "\n"
                            for i in range(16)))
    return model, data


def model_class_copy(model: Path) -> Path:
    """A copy of the tiny model folder whose tokenizer_config.json names Qwen2Tokenizer."""
    import shutil

    copy = model.with_name(model.name + "-qwen2-class")
    shutil.copytree(model, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


def run_once(cmd: list[str], cold_pyc: bool, cwd: Path) -> tuple[float, str]:
    """Wall seconds of one fresh process, and its stdout; exits on a failure."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as pyc:
        if cold_pyc:
            env["PYTHONPYCACHEPREFIX"] = pyc
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
        wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "values": [round(v, 3) for v in values]}


def measure(runs: int, cold_pyc: bool, job: bool, work: Path, small_job: Path | None = None,
            only: tuple[str, ...] = ()) -> dict:
    """Each figure's runs, interleaved (one process of each figure per round) so that a slower
    moment of the machine falls on all of them alike; `only`: these figures alone."""
    py = sys.executable
    commands = {"python": [py, "-c", "pass"], "help": [py, "-m", "hivetune", "--help"],
                "import_torch": [py, "-c", "import torch"], "import_train": [py, "-c", IMPORT_TRAIN],
                "train_share": [py, "-c", TRAIN_SHARE]}
    if job:
        model, data = build_tiny_job(work)
        commands["tokenizer_auto"] = [py, "-c", TOKENIZER_AUTO, str(model)]
        commands["tokenizer_saved"] = [py, "-c", TOKENIZER_SAVED, str(model)]
        commands["job"] = [py, "-m", "hivetune", "train", "--model", str(model), "--data", str(data),
                           "--max-steps", "2", "--quiet", "--output"]
        commands["job_model_class"] = [py, "-m", "hivetune", "train", "--model", str(model_class_copy(model)),
                                       "--data", str(data), "--max-steps", "2", "--quiet", "--output"]
        os.environ["HIVETUNE_CACHE"] = str(work / "cache")  # the children's: empty at the first run
    if small_job is not None:
        commands["small_job"] = [py, "-m", "hivetune", "train", "--model", str(small_job), "--epochs", "3",
                                 "--quiet", "--output"]
    if only:
        unknown = sorted(set(only) - set(commands))
        if unknown:
            sys.exit(f"--only: no figure named {', '.join(unknown)} (figures: {', '.join(commands)})")
        commands = {name: cmd for name, cmd in commands.items() if name in only}
    extra = (["job_train_s"] if "job" in commands else []) + (
        ["small_job_train_s", "small_job_eval_s"] if "small_job" in commands else [])
    values: dict[str, list[float]] = {name: [] for name in [*commands, *extra]}
    for i in range(runs):
        for name, cmd in commands.items():
            if name.startswith(("job", "small_job")):
                out = work / f"{name}{i}"
                wall, _ = run_once(cmd + [str(out)], cold_pyc, work)
                summary = json.loads((out / "summary.json").read_text()) if name != "job_model_class" else {}
                if name in ("job", "small_job"):
                    values[f"{name}_train_s"].append(summary["train_seconds"])
                if name == "small_job":
                    values["small_job_eval_s"].append((summary.get("eval") or {}).get("seconds") or 0.0)
            else:
                wall, stdout = run_once(cmd, cold_pyc, work)
                if name in ("train_share", "tokenizer_auto", "tokenizer_saved"):
                    wall = float(stdout.strip().splitlines()[-1])
            values[name].append(wall)
    figures = {name: spread(v) for name, v in values.items()}
    if "import_train" in figures and "import_torch" in figures:
        figures["train_share_by_difference"] = round(figures["import_train"]["median"]
                                                     - figures["import_torch"]["median"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per figure (default 5)")
    parser.add_argument("--no-job", dest="job", action="store_false",
                        help="skip the tiny model (its tokenizer and its job)")
    parser.add_argument("--cold-pyc", action="store_true", help="every process compiles its sources")
    parser.add_argument("--small-job", metavar="DIR", type=Path,
                        help="an HF model folder: time `hivetune train --model DIR --epochs 3` too (the small job)")
    parser.add_argument("--only", default="", help="comma-separated figures to time, e.g. small_job (default: all)")
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--note", default="", help="free text (what else ran on the machine)")
    args = parser.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        only = tuple(name for name in args.only.split(",") if name)
        figures = measure(args.runs, args.cold_pyc, args.job, Path(tmp), args.small_job, only)
        loaded = json.loads(run_once([sys.executable, "-c", LOADED], False, Path(tmp))[1].strip().splitlines()[-1])
    load_after = os.getloadavg()

    import torch  # the parent's environment record, once the children are done

    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result, device_kind

    cuda = torch.cuda.is_available()
    env = environment(torch.device("cuda" if cuda else "cpu"), args.commit)
    env.update(cpu_count=os.cpu_count(), load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in load_after], note=args.note)
    record = {"workload": "startup", "device": device_kind(torch.cuda.get_device_name() if cuda else None),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": env["commit"],
              "setting": ("cold pyc" if args.cold_pyc else "warm pyc") + f", {args.runs} runs"
              + (f", small job on {args.small_job.name}" if args.small_job else "")
              + (f", only {args.only}" if args.only else ""),
              "environment": env, "runs": args.runs, "figures": figures, "heavy_modules_after_import": loaded}
    path = append_result(Path(args.results), record)
    for name, f in figures.items():
        text = f"{f:.3f}" if isinstance(f, float) else f"{f['median']:.3f} (min {f['min']:.3f}, max {f['max']:.3f})"
        print(f"{name:28s} {text}")
    print(f"heavy modules after the train imports: {loaded or 'none'}; appended to {path}")


if __name__ == "__main__":
    main()
