"""`hivetune data stats`: token lengths of a data file, and what they mean for training.

Lengths are counted as training counts them (``scan.token_lengths``): the model's chat template
applied, prompt = tokens without loss, response = loss targets, total = both, before truncation.
Only a histogram (length -> count) is kept, so percentiles are exact and memory is bounded by the
number of distinct lengths, not the number of records.

Percentiles use the nearest-rank rule: p_q is the smallest length L with at least q% of the
examples <= L. So "max_length covering 99%" is p99 of the total.

Padding vs packing: batches of 8 consecutive examples in file order, each example truncated to
max_length. Padded, a batch costs 8 * (its longest example) tokens (the last batch, k < 8
examples, k * longest); packed, it costs the sum of its lengths. The difference is the padding
that packing saves.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.data.formats import check_record, detect_format
from hivetune.data.scan import (DEFAULT_MAX_LENGTH, TOKENIZE_BATCH, check_format_name, resolve_model, stream_lines,
                                token_lengths)
from hivetune.core.errors import UserError
from hivetune.data.sources import DataSource, as_source

PERCENTILES = (50, 90, 95, 99)
PAD_BATCH = 8
HISTOGRAM_BINS = 12
HISTOGRAM_WIDTH = 40


@dataclass
class LengthStats:
    path: Path
    format: str
    model: str
    max_length: int
    examples: int = 0
    prompt: Counter = field(default_factory=Counter)  # length -> examples
    response: Counter = field(default_factory=Counter)
    total: Counter = field(default_factory=Counter)
    tokens_per_epoch: int = 0  # after truncation to max_length
    truncated: int = 0  # examples longer than max_length
    padded_tokens: int = 0  # batches of PAD_BATCH in file order, padded to their longest
    png: Path | None = None
    png_note: str = ""

    @property
    def packed_tokens(self) -> int:
        return self.tokens_per_epoch

    @property
    def covering_99(self) -> int:
        return percentile(self.total, 99)

    def summary(self, counts: Counter) -> dict[str, float]:
        out = {f"p{q}": percentile(counts, q) for q in PERCENTILES}
        out["max"] = max(counts) if counts else 0
        out["mean"] = sum(k * v for k, v in counts.items()) / max(1, sum(counts.values()))
        return out


def percentile(counts: Counter, q: float) -> int:
    """Nearest rank: the smallest value with at least q% of the observations at or below it."""
    n = sum(counts.values())
    if n == 0:
        return 0
    rank = max(1, math.ceil(q / 100 * n))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def data_stats(path: str | Path | DataSource, model: str | None = None, max_length: int | None = None,
               png: str | Path | None = None, fmt: str = "auto") -> LengthStats:
    """Measure every record of `path` (stopping at the first bad one: run `data validate` for a
    full list) and write the PNG histogram if asked. Raises UserError on bad input."""
    from hivetune.model.tokenizer import load_tokenizer

    source = as_source(path)
    path = Path(source.spec)
    chosen = check_format_name(fmt)
    max_length = DEFAULT_MAX_LENGTH if max_length is None else max_length
    if max_length <= 0:
        raise UserError(f"--max-length: must be > 0, got {max_length}")
    if png is not None and Path(png).suffix.lower() != ".png":
        raise UserError(f"--png: expected a .png path, got {png}")
    model = resolve_model(model)
    tokenizer = load_tokenizer(model)
    stats = LengthStats(path, chosen or "", model, max_length)
    batch: list[dict] = []
    window: list[int] = []  # truncated lengths of the current padding batch
    for line in stream_lines(source):
        where = line.where
        if line.error:
            raise UserError(f"{where}: {line.error}")
        if not stats.format:
            stats.format = detect_format(line.record) or ""
            if not stats.format:
                raise UserError(f"{where}: cannot tell the format; set --format, or name its columns with --columns")
        check_record(line.record, stats.format, where)
        batch.append(line.record)
        if len(batch) >= TOKENIZE_BATCH:
            _measure(stats, batch, tokenizer, window)
    if batch:
        _measure(stats, batch, tokenizer, window)
    if window:
        stats.padded_tokens += len(window) * max(window)
    if png is not None:
        stats.png, stats.png_note = write_png(stats, Path(png))
    return stats


def _measure(stats: LengthStats, batch: list[dict], tokenizer, window: list[int]) -> None:
    for prompt, response in token_lengths(batch, stats.format, tokenizer):
        total = prompt + response
        stats.examples += 1
        stats.prompt[prompt] += 1
        stats.response[response] += 1
        stats.total[total] += 1
        kept = min(total, stats.max_length)
        stats.truncated += total > stats.max_length
        stats.tokens_per_epoch += kept
        window.append(kept)
        if len(window) == PAD_BATCH:
            stats.padded_tokens += PAD_BATCH * max(window)
            window.clear()
    batch.clear()


def histogram_bins(counts: Counter, bins: int = HISTOGRAM_BINS) -> list[tuple[int, int, int]]:
    """(low, high, examples) for equal-width bins from 0 to the longest, both ends inclusive."""
    if not counts:
        return []
    width = max(1, math.ceil((max(counts) + 1) / bins))
    out = [[i * width, (i + 1) * width - 1, 0] for i in range(math.ceil((max(counts) + 1) / width))]
    for value, n in counts.items():
        out[value // width][2] += n
    return [tuple(b) for b in out]


def format_stats(stats: LengthStats) -> str:
    rows = [f"{stats.path}: {stats.examples:,} examples, format {stats.format}, tokenizer {stats.model}",
            "",
            f"{'tokens':<10}" + "".join(f"{name:>9}" for name in ("p50", "p90", "p95", "p99", "max", "mean"))]
    for name in ("prompt", "response", "total"):
        s = stats.summary(getattr(stats, name))
        rows.append(f"{name:<10}" + "".join(f"{s[k]:>9,}" for k in ("p50", "p90", "p95", "p99", "max"))
                    + f"{s['mean']:>9,.1f}")
    rows += ["", "total tokens per example:"]
    bins = histogram_bins(stats.total)
    most = max((n for _, _, n in bins), default=1) or 1
    for low, high, n in bins:
        bar = "#" * math.ceil(HISTOGRAM_WIDTH * n / most) if n else ""
        rows.append(f"  {low:>7,}-{high:<7,} {bar:<{HISTOGRAM_WIDTH}} {n:,}")
    saved = stats.padded_tokens - stats.packed_tokens
    share = saved / stats.padded_tokens if stats.padded_tokens else 0.0
    rows += ["",
             f"max_length covering 99% of examples: {stats.covering_99:,}",
             f"longer than max_length {stats.max_length:,} (truncated in training): {stats.truncated:,}",
             f"tokens per epoch (truncated to max_length): {stats.tokens_per_epoch:,}",
             f"padding, batches of {PAD_BATCH} in file order: {stats.padded_tokens:,} tokens padded vs "
             f"{stats.packed_tokens:,} packed; packing saves {saved:,} ({share:.1%})"]
    if stats.png is not None:
        rows.append(f"histogram: {stats.png}")
    elif stats.png_note:
        rows.append(stats.png_note)
    return "\n".join(rows)


def write_png(stats: LengthStats, out: Path) -> tuple[Path | None, str]:
    """Prompt / response / total histograms as a PNG (matplotlib's Agg canvas, no pyplot state).

    Without matplotlib: no file, and a note saying how to get it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None, "histogram PNG skipped: matplotlib is not installed (pip install 'hivetune[plots]')"
    from hivetune.core.fileio import atomic_write_with

    fig = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, name in zip(axes, ("prompt", "response", "total")):
        counts = getattr(stats, name)
        values = sorted(counts)
        ax.hist(values, bins=min(50, max(1, len(values))), weights=[counts[v] for v in values], color="#4c72b0")
        if name == "total":
            ax.axvline(stats.max_length, color="#c44e52", linestyle="--", label=f"max_length {stats.max_length}")
            ax.legend()
        ax.set_title(f"{name} tokens (p99 {percentile(counts, 99):,})")
        ax.set_xlabel("tokens")
        ax.set_ylabel("examples")
    fig.suptitle(f"{stats.path.name}: {stats.examples:,} examples")
    try:
        atomic_write_with(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    except OSError as e:
        raise UserError(f"{out}: cannot write the PNG ({e.strerror})") from None
    return out, ""
