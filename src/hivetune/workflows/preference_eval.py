"""`hivetune eval` on preference pairs: how much more the tuned model prefers the chosen answer
than the base does.

For each pair, each model's margin is log p(chosen | prompt) - log p(rejected | prompt) (summed
token log-probs, the answers rendered as training renders them: data.pairs). The report gives,
per side, the accuracy (the share of pairs with a positive margin) and the mean margin, and the
headline figure: the share of pairs whose tuned margin exceeds the base's (``preferred_more``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hivetune.core.errors import UserError
from hivetune.data.formats import detect_format, iter_source
from hivetune.data.pairs import EncodedPair, collate_pairs, index_pairs
from hivetune.model.lora import lora_enabled
from hivetune.ops.preference import fused_target_logprobs, sequence_sums

SIDES = ("base", "tuned")


def is_pair_source(source) -> bool:
    """Whether a data source's first record is a preference pair."""
    for _, _, _, _, record in iter_source(source):
        return detect_format(record) == "preference"
    return False


@torch.no_grad()
def pair_logprobs(net, pairs: list[EncodedPair], batch_size: int = 16) -> torch.Tensor:
    """Summed log-probs [P, 2] (chosen, rejected) of each pair under `net` as it is (eval mode),
    each sequence in its own padded row (no [T, T] mask for a long packed row)."""
    device = net.lm_head.weight.device
    out = []
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[start:start + batch_size], shared=False).to(device)
        hidden = net(batch.input_ids, batch.position_ids, batch.layout)
        tokens = fused_target_logprobs(hidden, net.lm_head.weight, batch.target_index, batch.target_ids,
                                       softcap=net.args.final_logit_softcapping)
        out.append(sequence_sums(tokens.float(), batch.target_seq, batch.seq_tokens.shape[0]).view(-1, 2).cpu())
    return torch.cat(out) if out else torch.zeros(0, 2)


def side_summary(logps: torch.Tensor) -> dict:
    margin = logps[:, 0] - logps[:, 1]
    return {"accuracy": float((margin > 0).float().mean()), "mean_margin": float(margin.mean())}


def score_pairs(net, pairs: list[EncodedPair], where: list[str], batch_size: int = 16) -> dict:
    """Base (LoRA off) and tuned margins of every pair; the summary and the rows."""
    was_training = net.training
    net.eval()
    with lora_enabled(net, False):
        base = pair_logprobs(net, pairs, batch_size)
    tuned = pair_logprobs(net, pairs, batch_size)
    net.train(was_training)
    more = (tuned[:, 0] - tuned[:, 1]) > (base[:, 0] - base[:, 1])
    rows = [{"where": w, "base": {"chosen": b[0], "rejected": b[1]}, "tuned": {"chosen": t[0], "rejected": t[1]},
             "preferred_more": bool(m)} for w, b, t, m in zip(where, base.tolist(), tuned.tolist(), more.tolist())]
    return {"pairs": len(pairs), "preferred_more": float(more.float().mean()) if len(pairs) else 0.0,
            "means": {"base": side_summary(base), "tuned": side_summary(tuned)}, "rows": rows}


def evaluate_pairs(net, tokenizer, data_path, out_dir: Path, *, limit: int = 0, batch_size: int = 16,
                   max_length: int = 1024, header: dict | None = None) -> dict:
    """Score the pairs of `data_path` with `net` (LoRA loaded), write eval.json and eval.md."""
    from hivetune.core.fileio import atomic_write_bytes
    import json

    t0 = time.perf_counter()
    index = index_pairs(data_path, tokenizer, max_length)
    n = min(limit, len(index)) if limit else len(index)
    if n == 0:
        raise UserError(f"{data_path}: no preference pairs")
    report = {**(header or {}), "data": str(data_path), "max_length": max_length, "examples": n,
              **score_pairs(net, index.pairs[:n], index.where[:n], min(batch_size, 16))}
    report["seconds"] = {"total": round(time.perf_counter() - t0, 2)}
    report["table"] = pairs_table(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "eval.json", (json.dumps(report, indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / "eval.md", (f"# hivetune eval: preference pairs\n\n- data: `{data_path}`, "
                                             f"{report['pairs']} pairs\n\n{report['table']}\n").encode())
    report["out"] = str(out_dir)
    return report


def pairs_table(report: dict) -> str:
    base, tuned = report["means"]["base"], report["means"]["tuned"]
    return "\n".join([
        "| metric | base | tuned | change |", "|---|---:|---:|---:|",
        f"| prefers chosen (accuracy) | {100 * base['accuracy']:.1f}% | {100 * tuned['accuracy']:.1f}% | "
        f"{100 * (tuned['accuracy'] - base['accuracy']):+.1f} pts |",
        f"| mean margin log p(chosen) - log p(rejected) | {base['mean_margin']:.3f} | {tuned['mean_margin']:.3f} | "
        f"{tuned['mean_margin'] - base['mean_margin']:+.3f} |",
        f"| pairs the tuned model prefers chosen more than the base | | {100 * report['preferred_more']:.1f}% | |"])
