"""The report of `hivetune eval`: eval.json (every row and the means) and eval.md.

eval.md holds the means, base vs tuned (``means_table``), and a few examples side by side;
``format_value``, ``fenced`` and ``table_cell`` are the Markdown pieces that compare.md uses too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def write_eval(report: dict, out_dir: Path, report_examples: int = 3) -> None:
    """eval.json (the report) and eval.md (means and a few examples), each written atomically."""
    from hivetune.core.fileio import atomic_write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "eval.json", (json.dumps(report, indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / "eval.md", markdown_report(report, report_examples).encode())


def format_value(value, kind: str) -> str:
    """A score as the tables show it: pct a percentage to one decimal, num four decimals; None n/a."""
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" if kind == "pct" else f"{value:.4f}"


def means_table(report: dict) -> str:
    """The means as a Markdown table: metric | base | tuned | change."""
    if "pairs" in report:  # preference pairs (workflows.preference_eval)
        return report["table"]
    base, tuned = report["means"]["base"], report["means"]["tuned"]
    metrics = [("response loss", "loss", "num"), ("perplexity", "perplexity", "num"),
               ("exact match", "exact_match", "pct"), ("token F1", "f1", "pct"), ("ROUGE-L", "rouge_l", "pct")]
    lines = ["| metric | base | tuned | change |", "|---|---:|---:|---:|"]
    for label, key, kind in metrics:
        b, t = base[key], tuned[key]
        change = "n/a" if b is None or t is None else (
            f"{100 * (t - b):+.1f} pts" if kind == "pct" else f"{t - b:+.4f}")
        lines.append(f"| {label} | {format_value(b, kind)} | {format_value(t, kind)} | {change} |")
    n = base["command_examples"]
    if n:
        lines.append(f"| command hit | {format_value(base['command_hit'], 'pct')} ({base['command_hits']}/{n}) | "
                     f"{format_value(tuned['command_hit'], 'pct')} ({tuned['command_hits']}/{n}) | "
                     f"{100 * (tuned['command_hit'] - base['command_hit']):+.1f} pts |")
    return "\n".join(lines)


def fenced(text: str) -> str:
    """A code block whose fence is longer than any backtick run inside the text."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def table_cell(text: str) -> str:
    """Text as one Markdown table cell: markup characters escaped, line breaks as <br>."""
    text = re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", text)
    return "<br>".join(text.splitlines()) or " "


def markdown_report(report: dict, n_examples: int) -> str:
    """eval.md: the run's settings, the means table, and the first `n_examples` rows side by side."""
    s = report["seconds"]
    parts = [
        "# hivetune eval: base vs tuned", "",
        f"- model: `{report['model']}`", f"- adapter: `{report['adapter']}`",
        f"- data: `{report['data']}`, {report['examples']} examples",
        f"- greedy, at most {report['max_new_tokens']} new tokens; {report['device']}, {report['precision']}; "
        f"{s['total']:.1f} s (generation: base {s['base_generate']:.1f} s, tuned {s['tuned_generate']:.1f} s)", "",
        means_table(report), "",
        "Response loss: mean -log p over the response tokens (training's mask), token-weighted over the "
        "file; perplexity = exp(loss). Exact match, token F1 and ROUGE-L compare SQuAD-normalised "
        "tokens (lower case, no punctuation or articles) with the reference. Command hit: every "
        "reference command appears in the answer, whitespace collapsed.",
    ]
    for row in report["rows"][:n_examples]:
        b, t = row["base"], row["tuned"]
        hit = {None: "n/a", True: "yes", False: "no"}
        parts += ["", f"## {row['where']}", "", "**Question**", "", fenced(row["question"]), "",
                  "**Reference**", "", fenced(row["reference"]), "",
                  "| | base | tuned |", "|---|---|---|",
                  f"| answer | {table_cell(b['generation'])} | {table_cell(t['generation'])} |",
                  f"| loss | {format_value(b['loss'], 'num')} | {format_value(t['loss'], 'num')} |",
                  f"| token F1 | {format_value(b['f1'], 'pct')} | {format_value(t['f1'], 'pct')} |",
                  f"| ROUGE-L | {format_value(b['rouge_l'], 'pct')} | {format_value(t['rouge_l'], 'pct')} |",
                  f"| command hit | {hit[b['command_hit']]} | {hit[t['command_hit']]} |"]
    return "\n".join(parts) + "\n"
