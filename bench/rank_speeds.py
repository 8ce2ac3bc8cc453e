"""Each rank's relative speed from a DDP step timeline (issue 10): 1 / the median GPU time of its
steps' micro-batches (steps 2 on: after the capture and the plan), the fastest rank at 1. Prints
them apart by commas, for HIVETUNE_RANK_SPEEDS (bench/ddp_timeline_run.sh: a variant's "auto").

    python bench/rank_speeds.py "$OUT/timelines/defaults-1"
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def micro_batch_medians(folder: Path) -> list[float]:
    medians = []
    for path in sorted(folder.glob("timeline-rank*.json"), key=lambda p: int(p.stem.removeprefix("timeline-rank"))):
        marks = json.loads(path.read_text())["marks"]
        starts = [m["gpu_s"] for m in marks if m["what"] == "start"]
        reduces = [m["gpu_s"] for m in marks if m["what"] == "reduce"]
        medians.append(statistics.median(r - s for s, r in list(zip(starts, reduces))[2:]))
    return medians


if __name__ == "__main__":
    medians = micro_batch_medians(Path(sys.argv[1]))
    print(",".join(f"{min(medians) / m:.4f}" for m in medians))
