"""Stand-ins for the cycle's tools that this checkout lacks, for tests/workflows/test_cycle.py
(run_cycles' `commands` seam). Each records its argv in REG/fake-calls.jsonl.

    curate ...LOGS --out FILE [--train-data F]...  chat records: the correction, else a liked or
                                                   unrated answer (disliked ones dropped)
    eval --candidate A --against B --data F [--regression F] --out DIR
                                                   compare.json with the losses in REG/fake-eval.json
    train ... --init-adapter DIR ...               the real `hivetune train` without --init-adapter
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def flag(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def record(registry: Path, tool: str, argv: list[str]) -> None:
    with open(registry / "fake-calls.jsonl", "a") as f:
        f.write(json.dumps({"tool": tool, "argv": argv}) + "\n")


def curate(argv: list[str]) -> int:
    from hivetune.data.interaction_log import read_logs

    out = Path(flag(argv, "--out"))
    logs, i = [], 0
    while i < len(argv):
        if argv[i].startswith("--"):
            i += 2
            continue
        logs.append(argv[i])
        i += 1
    record(out.parents[2], "curate", argv)
    lines = []
    for ex in read_logs(logs).exchanges.values():
        if ex.rating == -1 and ex.correction is None:
            continue
        answer = ex.correction or ex.answer
        lines.append(json.dumps({"messages": ex.messages + [{"role": "assistant", "content": answer}]}) + "\n")
    out.write_text("".join(lines))
    return 0


def evaluate(argv: list[str]) -> int:
    out = Path(flag(argv, "--out"))
    registry = out.parents[2]
    record(registry, "eval", argv)
    losses = json.loads((registry / "fake-eval.json").read_text())
    sets = {}
    for name in ("heldout", "regression"):
        if name == "regression" and "--regression" not in argv:
            continue
        cand, against = losses[name]
        sets[name] = {"examples": 4, "candidate": {"loss": cand}, "against": {"loss": against},
                      "wins": {"candidate": 0, "against": 0, "ties": 4}}
    out.mkdir(parents=True)
    (out / "compare.json").write_text(json.dumps({"candidate": flag(argv, "--candidate"),
                                                  "against": flag(argv, "--against"), "sets": sets}))
    return 0


def train(argv: list[str]) -> int:
    out = Path(flag(argv, "--output"))
    record(out.parents[2], "train", argv)
    if "--init-adapter" in argv:
        i = argv.index("--init-adapter")
        argv = argv[:i] + argv[i + 2:]
    os.execv(sys.executable, [sys.executable, "-m", "hivetune", "train", *argv])


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    sys.exit({"curate": curate, "eval": evaluate, "train": train}[tool](args))
