"""`hivetune data split`: a deterministic train / held-out split, stratified by ``category``.

Two streaming passes over the file, so memory holds the per-category counts and the held-out
positions, not the records:

1. count the records of each category (records without one form their own stratum);
2. give each category its share of the held-out total by largest remainder: category c with n_c
   of n records gets floor(H * n_c / n), and the H - sum(floors) records left over go to the
   largest fractional parts (ties: the larger category, then the name);
3. choose that many positions within each category with ``random.Random(seed)``, categories in
   sorted order, and copy every line to the file it belongs to, keeping the file order.

JSONL lines are copied byte for byte; a JSON array input is written out as JSONL.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hivetune.data.scan import check_output_path, stream_lines
from hivetune.core.errors import UserError
from hivetune.data.sources import DataSource, as_source
from hivetune.core.fileio import atomic_write_with

UNCATEGORISED = "(none)"


@dataclass
class SplitResult:
    train: Path
    heldout: Path
    train_counts: dict[str, int]  # category -> records
    heldout_counts: dict[str, int]

    @property
    def n_train(self) -> int:
        return sum(self.train_counts.values())

    @property
    def n_heldout(self) -> int:
        return sum(self.heldout_counts.values())


def category_of(record: dict) -> str:
    value = record.get("category")
    if value is None:
        return UNCATEGORISED
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def heldout_total(heldout: float, n: int) -> int:
    """A fraction in (0, 1) of n (rounded half up), or a whole count >= 1."""
    if 0 < heldout < 1:
        total = math.floor(heldout * n + 0.5)
    elif heldout >= 1 and float(heldout).is_integer():
        total = int(heldout)
    else:
        raise UserError(f"--heldout: expected a fraction in (0, 1) or a whole count >= 1, got {heldout:g}")
    if total == 0:
        raise UserError(f"--heldout: {heldout:g} of {n} records rounds to none; use a larger fraction or a count")
    if total >= n:
        raise UserError(f"--heldout: {total} held-out records would leave none of the {n} for training")
    return total


def stratified_quotas(counts: dict[str, int], total: int) -> dict[str, int]:
    """Held-out records per category, summing to `total` (largest remainder, deterministic)."""
    n = sum(counts.values())
    exact = {c: total * k / n for c, k in counts.items()}
    quotas = {c: math.floor(x) for c, x in exact.items()}
    order = sorted(counts, key=lambda c: (-(exact[c] - quotas[c]), -counts[c], c))
    for c in order[: total - sum(quotas.values())]:
        quotas[c] += 1
    return quotas


def split_file(path: str | Path | DataSource, heldout: float, seed: int, out_train: str | Path, out_heldout: str | Path,
               force: bool = False) -> SplitResult:
    source = as_source(path)
    path = Path(source.spec)
    train_path = check_output_path(out_train, force, "--out-train")
    heldout_path = check_output_path(out_heldout, force, "--out-heldout")
    if train_path.resolve() == heldout_path.resolve():
        raise UserError("--out-train and --out-heldout are the same file")
    if path.resolve() in (train_path.resolve(), heldout_path.resolve()):
        raise UserError(f"{path}: the input cannot also be an output")

    counts: Counter[str] = Counter()
    for line in stream_lines(source):
        if line.error:
            raise UserError(f"{line.where}: {line.error}")
        counts[category_of(line.record)] += 1
    quotas = stratified_quotas(counts, heldout_total(heldout, sum(counts.values())))
    rng = random.Random(seed)
    chosen = {c: set(rng.sample(range(counts[c]), quotas[c])) for c in sorted(counts)}

    seen: Counter[str] = Counter()
    train_counts: Counter[str] = Counter()
    heldout_counts: Counter[str] = Counter()

    def write_both(train_tmp: Path, heldout_tmp: Path) -> None:
        with open(train_tmp, "wb") as train_f, open(heldout_tmp, "wb") as heldout_f:
            for line in stream_lines(source):
                if line.error:  # the file changed since the first pass
                    raise UserError(f"{line.where}: {line.error}")
                category = category_of(line.record)
                position = seen[category]
                seen[category] += 1
                into_heldout = position in chosen.get(category, ())
                (heldout_counts if into_heldout else train_counts)[category] += 1
                raw = line.raw if line.raw is not None else json.dumps(line.record, ensure_ascii=False).encode()
                (heldout_f if into_heldout else train_f).write(raw if raw.endswith(b"\n") else raw + b"\n")
        if seen != counts:
            raise UserError(f"{path}: the file changed during the split")

    atomic_write_with(train_path, lambda train_tmp: atomic_write_with(
        heldout_path, lambda heldout_tmp: write_both(Path(train_tmp), Path(heldout_tmp))))
    order = sorted(counts)
    return SplitResult(train_path, heldout_path, {c: train_counts[c] for c in order},
                       {c: heldout_counts[c] for c in order})


def format_split(result: SplitResult) -> str:
    width = max(len("category"), *(len(c) for c in result.train_counts))
    lines = [f"train: {result.n_train:,} -> {result.train}", f"held-out: {result.n_heldout:,} -> {result.heldout}"]
    if list(result.train_counts) != [UNCATEGORISED]:
        lines.append(f"  {'category':<{width}} {'train':>7} {'held-out':>9}")
        lines += [f"  {c:<{width}} {result.train_counts[c]:>7,} {result.heldout_counts[c]:>9,}"
                  for c in result.train_counts]
    return "\n".join(lines)
