"""Time one daily `hivetune cycle` on a day of collected exchanges and append its figures to
benchmarks/results/cycle-<device>.jsonl.

    python benchmarks/cycle.py                                  # embedded SmolLM2 GGUF, this CPU
    python benchmarks/cycle.py --device cuda --model DIR        # any HF folder, on the GPU
    python benchmarks/cycle.py --exchanges 1000 --keep /tmp/REG --train-set max_steps=20

The day's log is written with hivetune.data.interaction_log from the shipped data
(src/hivetune/data/default/train.jsonl): each exchange asks one of its 360 questions (drawn at
random, so questions repeat as users repeat them) and is answered with its reference answer, or
1 in 5 with another question's answer (a wrong one). About half are rated: a right answer +1, a
wrong one -1, half of the wrong ones with the reference answer as the correction. 1 in 20
questions carries a planted secret (a GitHub or OpenAI token, an AWS key id, a password, an
e-mail address, an IP address); 1 in 30 exchanges is sent twice (the same question, answer and
rating). The regression set is the shipped held-out data (data/default/heldout.jsonl, 40
questions the log never asks). The registry's base is --model (default: the embedded GGUF).

The line holds the seconds of each stage (REG/cycles/<id>/report.json) and of the whole cycle,
the counts (exchanges, rated, corrected, curated examples kept, train / held-out / regression
examples), curate's printed report, how many planted secrets reach curated.jsonl (0 expected),
the gate's figures, and the versions and load average of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The default recipe's settings (src/hivetune/recipes/default.yaml): they fit this data on a CPU.
TRAIN_SET = ["lr=0.005", "lora.r=16", "lora.alpha=32", "max_length=512", "max_new_tokens=64"]


def random_text(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def planted_secret(rng: random.Random, i: int) -> tuple[str, str]:
    """(sentence with a secret in it, the secret)."""
    kind = i % 6
    if kind == 0:
        s = "ghp_" + random_text(rng, 36)
        return f"My GitHub token is {s}, if that matters.", s
    if kind == 1:
        s = "sk-proj-" + random_text(rng, 40)
        return f"I call it with OPENAI_API_KEY={s} set.", s
    if kind == 2:
        s = "AKIA" + random_text(rng, 16, string.ascii_uppercase + string.digits)
        return f"The instance role uses access key {s}.", s
    if kind == 3:
        s = random_text(rng, 12) + "!9"
        return f"The database is set up with DB_PASSWORD={s} in the env file.", s
    if kind == 4:
        s = f"{random_text(rng, 8, string.ascii_lowercase)}.{random_text(rng, 6, string.ascii_lowercase)}@example.com"
        return f"Send the output to {s} please.", s
    s = f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    return f"The server is at {s}.", s


def question_of(record: dict) -> str:
    return record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")


def write_day_log(path: Path, n: int, seed: int) -> dict:
    """The day's interaction log (see the module docstring); what was planted."""
    from hivetune.core.embedded import default_train_data
    from hivetune.data.interaction_log import InteractionLog

    records = [json.loads(line) for line in default_train_data().read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    log = InteractionLog(path)
    secrets, counts = [], {"exchanges": 0, "rated": 0, "corrected": 0, "resent": 0, "wrong": 0}
    last = None
    for i in range(n):
        if last is not None and rng.random() < 1 / 30:
            question, answer, feedback = last  # sent twice
            counts["resent"] += 1
        else:
            rec = rng.choice(records)
            question = question_of(rec)
            if rng.random() < 0.05:
                sentence, secret = planted_secret(rng, len(secrets))
                question = f"{question} {sentence}"
                secrets.append(secret)
            wrong = rng.random() < 0.2
            answer = rng.choice(records)["output"] if wrong else rec["output"]
            counts["wrong"] += wrong
            feedback = None
            if rng.random() < 0.5:
                feedback = (-1, rec["output"] if rng.random() < 0.5 else None) if wrong else (1, None)
        ex = log.exchange("base", [{"role": "user", "content": question}], answer, 0.05 + rng.random(),
                          len(question.split()), len(answer.split()))
        if feedback is not None:
            log.feedback(ex, *feedback)
            counts["rated"] += 1
            counts["corrected"] += feedback[1] is not None
        counts["exchanges"] += 1
        last = (question, answer, feedback)
    log.close()
    return {**counts, "secrets": secrets}


def curate_report(log: Path) -> list[str]:
    """What `data curate` printed (CYCLE/curate.log without the command line)."""
    return [line.rstrip() for line in log.read_text().splitlines() if line.strip() and not line.startswith("$ ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="base model: HF folder or .gguf (default: the embedded GGUF)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda: where training and the comparison run")
    parser.add_argument("--exchanges", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-set", action="append", default=None, metavar="KEY=VALUE",
                        help="the cycle's training config keys (default: the default recipe's lr, LoRA and lengths)")
    parser.add_argument("--keep", default="", metavar="DIR", help="build the registry here and keep it")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--note", default="", help="free text (what else was running)")
    args = parser.parse_args()
    # the cycle's tools run as `python -m hivetune` subprocesses: from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(ROOT / "src"))

    import torch

    from hivetune.core.embedded import default_heldout_data, embedded_model_path
    from hivetune.data.interaction_log import utc_now
    from hivetune.workflows import registry as reg
    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result, device_kind
    from hivetune.workflows.cycle import CycleOptions, run_cycles

    device = torch.device(args.device)
    base = args.model or str(embedded_model_path())
    train_set = (args.train_set if args.train_set is not None else TRAIN_SET) + [f"device={args.device}"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or Path(tmp) / "REG")
        reg.init_registry(root, base)
        (root / "regression.jsonl").write_bytes(default_heldout_data().read_bytes())
        t0 = time.perf_counter()
        planted = write_day_log(root / "logs" / f"interactions-{utc_now()[:10]}.jsonl", args.exchanges, args.seed)
        log_seconds = time.perf_counter() - t0
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        reports = run_cycles(root, CycleOptions(train_set=train_set, seed=args.seed))
        cycle_seconds = time.perf_counter() - t0
        load_after = os.getloadavg()
        report = reports[-1]
        folder = Path(report["folder"])
        curated = (folder / "curated.jsonl").read_text()
        secrets_left = sum(s in curated for s in planted["secrets"])
        curate_lines = curate_report(folder / "curate.log")
        regression = sum(1 for line in (root / "regression.jsonl").read_text().splitlines() if line.strip())
    env = environment(device, args.commit)
    env.update(load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in load_after], cpu_count=os.cpu_count(), note=args.note)
    kind = device_kind(env.get("gpu"))
    record = {
        "workload": "cycle", "device": kind, "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "commit": env["commit"], "setting": f"{args.exchanges} exchanges, {Path(base).name}, {args.device}",
        "environment": env, "base": base, "train_set": train_set,
        "command": "python benchmarks/cycle.py " + " ".join(sys.argv[1:]),
        "hivetune": {"status": report["status"], "cycle_seconds": round(cycle_seconds, 2),
                     "stage_seconds": report.get("stage_seconds"), "log_seconds": round(log_seconds, 2),
                     "exchanges": report.get("exchanges"), "rated": planted["rated"],
                     "corrected": planted["corrected"], "resent": planted["resent"],
                     "examples_kept": report.get("curated"), "train": report.get("train"),
                     "heldout": report.get("heldout"), "regression": regression, "steps": report.get("steps"),
                     "secrets_planted": len(planted["secrets"]), "secrets_left": secrets_left,
                     "figures": report.get("figures"), "reasons": report.get("reasons"),
                     "curate_report": curate_lines}}
    path = append_result(Path(args.results), record)
    print(json.dumps(record["hivetune"], indent=2))
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
