"""The model's side of `hivetune eval`: response losses and greedy answers, scored per example.

``losses_and_answers`` takes each batch of examples through the model once: the loss pass over
prompt + reference keeps the prompts' keys and values, and greedy decoding starts from them.
``score_model`` turns losses and answers into one row per example (``eval_metrics``);
``score_base_and_tuned`` scores both sides on one model carrying LoRA, switched off for the
base and merged into the weights for the tuned side (``merged_lora``).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from hivetune.data.formats import Encoded
from hivetune.model.decoder import CausalLM
from hivetune.ops.loss import target_loss_sum
from hivetune.workflows.eval_examples import EvalExample
from hivetune.workflows.eval_metrics import command_hit, exact_match, mean_metrics, rouge_l, token_f1
from hivetune.workflows.generate import greedy_ids

SIDES = ("base", "tuned")


@torch.no_grad()
def response_losses(model: CausalLM, examples: list[Encoded], batch_size: int) -> list[tuple[float, int]]:
    """(sum of -log p over the response tokens, their count) per example.

    Up to `batch_size` examples go through the model packed in one row (training's
    ``collate_packed``), so no pad token is computed: 200 eval examples of SmolLM2 are 27.5k
    tokens, 33.8k when right-padded in batches of 96 sorted by length. An example's targets are
    a contiguous run of the batch's, in example order; ``target_loss_sum`` takes each run.
    (Batches are still sorted by length: attention runs on a padded view of the row.)
    """
    from hivetune.data.batch import collate_packed

    device = model.lm_head.weight.device
    out: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))  # attention pads to the longest
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = collate_packed([examples[i] for i in chunk]).to(device)
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        for i, loss in zip(chunk, example_losses(model, hidden, batch, [examples[i] for i in chunk])):
            out[i] = loss
    return out


def example_losses(model: CausalLM, hidden: torch.Tensor, batch, examples: list[Encoded]) -> list[tuple[float, int]]:
    """(loss sum, target count) of each example of a packed batch: its targets are a contiguous
    run of the batch's, in example order; ``target_loss_sum`` takes each run."""
    out, first = [], 0
    for e in examples:
        n = e.n_targets
        total = target_loss_sum(hidden, model.lm_head.weight, batch.target_index[first:first + n],
                                batch.target_ids[first:first + n], softcap=model.args.final_logit_softcapping)
        out.append((float(total), n))
        first += n
    assert first == batch.target_ids.numel()
    return out


def even_batches(order: list[int], batch_size: int) -> list[list[int]]:
    """`order` cut into batches as even as `batch_size` allows (200 at 96: 3 x 67, not 2 x 96 + 8)."""
    size = math.ceil(len(order) / math.ceil(len(order) / batch_size)) if order else 1
    return [order[start:start + size] for start in range(0, len(order), size)]


@torch.no_grad()
def losses_and_answers(model: CausalLM, examples: list[EvalExample], max_new_tokens: int, stop_ids: set[int],
                       batch_size: int, seconds: dict) -> tuple[list[tuple[float, int]], list[list[int]]]:
    """``response_losses`` and ``generate_sorted`` in one pass per batch of examples.

    The loss pass over prompt + reference computes each prompt's keys and values on the way:
    ``KVCache.prefix`` keeps them, and greedy decoding starts from there (``greedy_decode``), so
    no prompt goes through the model twice. The 200 eval prompts of SmolLM2 are 10.9k of the
    38.4k tokens the two passes took apart (a 12-14 s forward per side on the 2-core CPU).
    Examples whose encoding does not begin with their prompt take the two passes apart.
    `seconds` gets loss (the packed forward and the losses) and generate (the decode steps).
    """
    from hivetune.data.batch import collate_packed
    from hivetune.workflows.generate import greedy_decode
    from hivetune.model.decoder import KVCache

    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    losses: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    answers: list[list[int]] = [[] for _ in examples]
    shared = [i for i, e in enumerate(examples) if e.encoded.ids[:len(e.prompt_ids)] == e.prompt_ids]
    apart = sorted(set(range(len(examples))) - set(shared))
    t_loss = t_generate = 0.0
    for chunk in even_batches(sorted(shared, key=lambda i: len(examples[i].prompt_ids)), batch_size):
        t0 = time.perf_counter()
        batch = collate_packed([examples[i].encoded for i in chunk]).to(device)
        prefix = tuple(len(examples[i].prompt_ids) for i in chunk)
        cache = KVCache(model.args, len(chunk), max(prefix) + max_new_tokens, device, dtype)
        cache.prefix = prefix
        hidden = model(batch.input_ids, batch.position_ids, batch.layout, cache)
        for i, loss in zip(chunk, example_losses(model, hidden, batch, [examples[i].encoded for i in chunk])):
            losses[i] = loss
        ends = batch.layout.cu_seqlens[:-1].long() + torch.tensor(prefix, device=device) - 1  # each prompt's last
        first = model.logits(hidden[0].index_select(0, ends)).argmax(-1)
        t1 = time.perf_counter()
        for i, ids in zip(chunk, greedy_decode(model, cache, prefix, first, max_new_tokens, stop_ids)):
            answers[i] = ids
        t_loss, t_generate = t_loss + t1 - t0, t_generate + time.perf_counter() - t1
    if apart:
        t0 = time.perf_counter()
        for i, loss in zip(apart, response_losses(model, [examples[i].encoded for i in apart], batch_size)):
            losses[i] = loss
        t1 = time.perf_counter()
        for i, ids in zip(apart, generate_sorted(model, [examples[i].prompt_ids for i in apart], max_new_tokens,
                                                 stop_ids, batch_size)):
            answers[i] = ids
        t_loss, t_generate = t_loss + t1 - t0, t_generate + time.perf_counter() - t1
    seconds.update(loss=t_loss, generate=t_generate)
    return losses, answers


def generate_sorted(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    batch_size: int) -> list[list[int]]:
    """Greedy continuations in batches of prompts of similar length (sorted by length, so left
    padding stays short), returned in input order (see ``hivetune.workflows.generate.greedy_ids``).

    Batches are as even as `batch_size` allows (200 prompts at 96: 3 x 67, not 2 x 96 + 8).
    Big batches pay on the CPU because a decode step's cost grows much less than its rows: the
    base SmolLM2's 96-token answers to 200 prompts took 90.5 s in 5 batches of 40, 68.7 s in 3
    of 67, 68.5 s in 2 of 100 and 70.0 s in one of 200 (2-core CPU, bf16; one batch pads every
    prompt to the longest).
    """
    out: list[list[int]] = [[] for _ in prompts]
    for chunk in even_batches(sorted(range(len(prompts)), key=lambda i: len(prompts[i])), batch_size):
        for i, ids in zip(chunk, greedy_ids(model, [prompts[i] for i in chunk], max_new_tokens, stop_ids)):
            out[i] = ids
    return out


def score_model(model: CausalLM, tokenizer, examples: list[EvalExample], max_new_tokens: int,
                batch_size: int, seconds: dict | None = None) -> list[dict]:
    """One row per example: response loss, greedy answer and its scores against the reference.
    `seconds`, if given, receives the time of the loss and of the generation pass."""
    from hivetune.model.tokenizer import eos_ids

    parts: dict = {}
    losses, answers = losses_and_answers(model, examples, max_new_tokens, eos_ids(tokenizer, model.args),
                                         batch_size, parts)
    if seconds is not None:
        seconds.update(parts)
    return score_rows(tokenizer, examples, losses, answers)


def score_rows(tokenizer, examples: list[EvalExample], losses: list[tuple[float, int]],
               answers: list[list[int]]) -> list[dict]:
    """score_model's rows from each example's (summed response loss, tokens) and greedy answer ids."""
    rows = []
    for e, (loss_sum, n), ids in zip(examples, losses, answers):
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        loss = loss_sum / n if n else None
        rows.append({
            "loss": loss, "perplexity": math.exp(loss) if loss is not None else None,
            "loss_sum": loss_sum, "response_tokens": n,
            "generation": text, "generated_tokens": len(ids),
            "exact_match": exact_match(text, e.reference), "f1": token_f1(text, e.reference),
            "rouge_l": rouge_l(text, e.reference), "command_hit": command_hit(text, e.commands),
        })
    return rows


@contextmanager
def merged_lora(net: CausalLM):
    """The tuned model with each LoRA update merged into its base weight, W' = W + s B A
    (computed in fp32, stored in W's dtype), and the LoRA path switched off; the weights are
    put back on exit. One matmul per layer instead of three: on the 2-core CPU, SmolLM2 with
    r 16 on all seven projections generated at about half the speed of the base model unmerged.
    Written in place: after lora.fuse_projections (training) q/k/v and gate/up's weights are row
    views of one joined tensor, which the forward reads; a new tensor would bypass it. A
    quantized base (model.quant) is left as it is, LoRA switched on."""
    from hivetune.model.lora import lora_enabled, lora_modules
    from hivetune.model.quant import is_quantized

    if is_quantized(net):  # packed weights cannot take the update: LoRA runs beside them
        yield net
        return
    modules = [m for _, m in lora_modules(net)]
    originals = [m.base_layer.weight.detach().clone() for m in modules]
    with torch.no_grad():
        for m in modules:
            w = m.base_layer.weight
            w.copy_(w.float() + (m.lora_B.weight.float() @ m.lora_A.weight.float()) * m.scaling)
    try:
        with lora_enabled(net, False):
            yield net
    finally:
        with torch.no_grad():
            for m, w in zip(modules, originals):
                m.base_layer.weight.copy_(w)


def score_base_and_tuned(net: CausalLM, tokenizer, examples: list[EvalExample], max_new_tokens: int,
                         batch_size: int) -> dict:
    """Both sides on a model carrying LoRA: switched off for the base, merged into the weights
    for the tuned side (``merged_lora``). Returns the examples count, the seconds of each pass,
    the means and every row."""
    from hivetune.model.lora import lora_enabled

    was_training = net.training
    net.eval()
    seconds, rows = {}, {}
    t0 = time.perf_counter()
    for side in SIDES:
        parts: dict = {}
        with (merged_lora(net) if side == "tuned" else lora_enabled(net, False)):
            rows[side] = score_model(net, tokenizer, examples, max_new_tokens, batch_size, parts)
        seconds.update({f"{side}_{k}": round(v, 2) for k, v in parts.items()})
    seconds["scoring"] = round(time.perf_counter() - t0, 2)
    net.train(was_training)
    return {
        "examples": len(examples), "seconds": seconds,
        "means": {side: mean_metrics(rows[side]) for side in SIDES},
        "rows": [{"where": e.where, "question": e.question, "reference": e.reference, "commands": e.commands,
                  "truncated": e.encoded.truncated, "base": b, "tuned": t}
                 for e, b, t in zip(examples, rows["base"], rows["tuned"])],
    }
