"""`hivetune data synth`: the synthetic ops dataset (``synth.synthesize``) written to a JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hivetune.data.scan import check_output_path
from hivetune.data.synth import (DATASET_KEYS, NEAR_DUPLICATE_THRESHOLD, category_counts, near_duplicate_rate,
                                 synthesize)
from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes


@dataclass
class SynthResult:
    path: Path
    examples: int
    categories: dict[str, int]
    near_duplicate_rate: float


def write_synthetic(n: int, seed: int, out: str | Path, force: bool = False) -> SynthResult:
    """synthesize(n, seed) as JSONL at `out`, written atomically; an existing file needs force."""
    if n <= 0:
        raise UserError(f"--n: must be > 0, got {n}")
    out = check_output_path(out, force)
    try:
        examples = synthesize(n, seed)
    except ValueError as e:
        raise UserError(f"--n: {e}") from None
    text = "".join(json.dumps({k: e[k] for k in DATASET_KEYS}, ensure_ascii=False) + "\n" for e in examples)
    atomic_write_bytes(out, text.encode("utf-8"))
    return SynthResult(out, len(examples), category_counts(examples), near_duplicate_rate(examples))


def format_synth(result: SynthResult) -> str:
    width = max(len(c) for c in result.categories)
    lines = [f"wrote {result.examples:,} examples to {result.path}", "categories:"]
    lines += [f"  {c:<{width}} {k:>6,}  {k / result.examples:6.1%}" for c, k in result.categories.items()]
    lines.append(f"near-duplicate rate (instruction+input word 3-gram Jaccard >= "
                 f"{NEAR_DUPLICATE_THRESHOLD}): "
                 f"{result.near_duplicate_rate:.2%}")
    return "\n".join(lines)
