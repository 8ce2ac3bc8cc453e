"""Text scores of a generated answer against its reference, and their means over a file.

Exact match, token F1 and ROUGE-L compare SQuAD-normalised whitespace tokens
(``normalize_answer``); a command hit checks that every reference command appears verbatim in
the answer. ``mean_metrics`` turns the rows of ``eval_scoring.score_model`` into the means that
eval.json and compare.json report: the loss token-weighted, the text scores plain means.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, drop punctuation, drop a/an/the, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1: overlap = multiset intersection of normalised tokens,
    P = overlap / |pred|, R = overlap / |ref|, F1 = 2PR / (P + R); both empty counts as 1."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    if overlap == 0:
        return 0.0
    p, r = overlap / len(pred), overlap / len(ref)
    return 2 * p * r / (p + r)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence, dynamic programming over two rows: O(|a| |b|) time."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (beta = 1) on normalised tokens: P = LCS / |pred|, R = LCS / |ref|,
    F = 2PR / (P + R); both empty counts as 1, one empty as 0."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2 * p * r / (p + r)


def command_hit(generation: str, commands: list[str]) -> bool | None:
    """True when every command appears verbatim in the generation once runs of whitespace are
    collapsed to one space in both (case and quoting count: a command is exact text). A
    ``$ sudo cmd`` line or an inline `cmd` both contain ``cmd``. None: nothing to check."""
    if not commands:
        return None
    text = " ".join(generation.split())
    return all(" ".join(c.split()) in text for c in commands)


def mean_metrics(rows: list[dict]) -> dict:
    """Token-weighted loss (and its perplexity); plain means of the text scores; command hit
    rate over the examples that have commands (None when none has)."""
    tokens = sum(r["response_tokens"] for r in rows)
    loss = sum(r["loss_sum"] for r in rows) / tokens if tokens else None
    hits = [r["command_hit"] for r in rows if r["command_hit"] is not None]
    n = len(rows)
    return {
        "loss": loss, "perplexity": math.exp(loss) if loss is not None else None, "response_tokens": tokens,
        "exact_match": sum(r["exact_match"] for r in rows) / n, "f1": sum(r["f1"] for r in rows) / n,
        "rouge_l": sum(r["rouge_l"] for r in rows) / n,
        "command_hit": sum(hits) / len(hits) if hits else None, "command_hits": sum(hits),
        "command_examples": len(hits), "generated_tokens": sum(r["generated_tokens"] for r in rows) / n,
    }
