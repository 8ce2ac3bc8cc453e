"""`hivetune eval`: the base model (LoRA off) against the tuned one (adapter on) on held-out data.

For each prompt/response example, and for each of base and tuned:
- response loss: summed -log p over the response tokens / their count, with training's own
  encoding and mask (``encode_record``) and loss op (``target_loss_sum``); the mean over the
  file is token-weighted, sum(loss sums) / sum(token counts), and perplexity = exp(mean loss);
- a greedy answer (KV cache, left-padded batches of prompts of similar length), scored
  against the reference by exact match, token F1 and ROUGE-L (all on SQuAD-normalised
  whitespace tokens), and by a command hit (``command_hit``).

Results go to ``eval.json`` (every row and the means) and ``eval.md`` (the means, base vs tuned,
and a few examples side by side), by default in the run folder's ``eval/``.
"""

from __future__ import annotations

import json
import math
import re
import string
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hivetune.data.formats import (ALPACA_PROMPT, ALPACA_PROMPT_INPUT, Encoded, alpaca_messages, checked_records,
                                   encode_record, render_chat)
from hivetune.data.sources import held_out_source
from hivetune.core.errors import UserError
from hivetune.workflows.generate import greedy_ids, resolve_adapter_folder, trained_base_quant
from hivetune.model.decoder import CausalLM
from hivetune.ops.loss import target_loss_sum

SIDES = ("base", "tuned")


# ---------------------------------------------------------------- text metrics

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


# ---------------------------------------------------------------- examples


@dataclass
class EvalExample:
    where: str  # file:line, for the report
    question: str  # the last user message
    reference: str  # the last assistant message
    commands: list[str]  # what a command hit looks for (see reference_commands)
    prompt_ids: list[int]  # the prompt as training renders it, ending where the answer starts
    encoded: Encoded  # the training encoding: ids and loss mask


def reference_commands(record: dict, reference: str, where: str) -> list[str]:
    """The record's ``command`` field (a string or a list of strings) when present, else the
    ``$ `` / ``>>> `` lines of the reference (``hivetune.data.synth.extract_commands``)."""
    from hivetune.data.synth import extract_commands

    value = record.get("command")
    if value is None:
        return extract_commands(reference)
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v.strip() for v in values):
        raise UserError(f"{where}: field 'command' must be a non-empty string or a list of them")
    return values


def prompt_text(record: dict, fmt: str, tokenizer) -> tuple[str, str, str]:
    """(prompt as the model sees it, last user message, reference answer), rendered as
    ``encode_record`` renders the part before the (last) answer."""
    if fmt == "alpaca" and not getattr(tokenizer, "chat_template", None):
        template = ALPACA_PROMPT_INPUT if record.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
        return prompt, alpaca_messages(record)[0]["content"], record["output"]
    messages = alpaca_messages(record) if fmt == "alpaca" else record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    return render_chat(tokenizer, messages[:last], add_generation_prompt=True), question, messages[last]["content"]


def read_examples(path: Path, tokenizer, max_length: int, limit: int = 0) -> list[EvalExample]:
    """Check and encode the first `limit` (0: all) records; errors name file:line."""
    examples = []
    for where, _, _, record, fmt in checked_records(path, setting=None):
        if fmt == "text":
            raise UserError(f"{where}: eval needs prompt/response records (alpaca or chat), not text")
        prompt, question, reference = prompt_text(record, fmt, tokenizer)
        try:
            encoded = encode_record(record, fmt, tokenizer, max_length, train_on_inputs=False)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        examples.append(EvalExample(where, question, reference, reference_commands(record, reference, where),
                                    tokenizer(prompt, add_special_tokens=False)["input_ids"], encoded))
        if len(examples) == limit:
            break
    return examples


# ---------------------------------------------------------------- model passes


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


# ---------------------------------------------------------------- the command


def default_out_dir(adapter_arg: str | Path, adapter_folder: Path) -> Path:
    """RUN/eval for a run folder (or its adapter/ folder); ADAPTER/eval for any other adapter
    folder (a checkpoint's step-N/, say), so results sit beside what they measured."""
    if Path(adapter_arg).resolve() != adapter_folder.resolve() or adapter_folder.name == "adapter":
        return adapter_folder.parent / "eval"
    return adapter_folder / "eval"


DEFAULT_MAX_NEW_TOKENS = 96


def run_max_new_tokens(adapter_folder: Path) -> int:
    """The max_new_tokens of the run the adapter belongs to (RUN/config.yaml beside RUN/adapter),
    so that `hivetune eval --adapter RUN` answers as long as the run's own A/B did (64 in the
    default job); DEFAULT_MAX_NEW_TOKENS for any other adapter folder."""
    from hivetune.core.config import read_yaml

    config = adapter_folder.parent / "config.yaml"
    if adapter_folder.name != "adapter" or not config.is_file():
        return DEFAULT_MAX_NEW_TOKENS
    value = read_yaml(config).get("max_new_tokens")
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_NEW_TOKENS


def base_model_path(model: str, adapter_folder: Path) -> Path:
    """--model, else the base the adapter names (base_model_name_or_path), else the embedded model."""
    from hivetune.core.hub import model_path, split_hub_id

    if model:
        return model_path(model)
    config = adapter_folder / "adapter_config.json"
    try:
        named = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{config}: unreadable adapter config ({e})") from None
    if named and not Path(named).exists() and split_hub_id(named) is None:
        raise UserError(f"{config}: base model {named} not found; pass --model PATH")
    return model_path(named)


def evaluate(model: str = "", adapter: str = "", data: str = "", max_new_tokens: int = 0, limit: int = 0,
             out: str = "", force: bool = False, batch_size: int = 96, max_length: int = 1024,
             device: str = "auto", precision: str = "auto", report_examples: int = 3) -> dict:
    """`hivetune eval`: score base and tuned on `data`; write eval.json and eval.md; return the
    eval.json content. max_new_tokens 0: the run's (``run_max_new_tokens``). Everything is
    checked before a weight is loaded."""
    from hivetune.core.device import DTYPES, resolve_device, resolve_precision
    from hivetune.core.embedded import default_heldout_data
    from hivetune.model.load import load_model
    from hivetune.model.lora import fuse_projections, load_adapter
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.preference_eval import evaluate_pairs, is_pair_source

    for name, value, low in (("max_new_tokens", max_new_tokens, 0), ("limit", limit, 0),
                             ("batch_size", batch_size, 1), ("max_length", max_length, 2)):
        if value < low:
            raise UserError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if not adapter:
        raise UserError("eval: give --adapter RUN (a run folder or an adapter folder)")
    t_start = time.perf_counter()
    adapter_folder = resolve_adapter_folder(adapter)
    max_new_tokens = max_new_tokens or run_max_new_tokens(adapter_folder)
    model_path = base_model_path(model, adapter_folder)
    data_path = held_out_source(data) if data else default_heldout_data()  # a file, folder or Hub dataset
    out_dir = Path(out) if out else default_out_dir(adapter, adapter_folder)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out: {out_dir} is a file, expected a folder")
    existing = [p.name for p in (out_dir / "eval.json", out_dir / "eval.md") if p.exists()]
    if existing and not force:
        raise UserError(f"--out: {out_dir} already holds {' and '.join(existing)}; pass --force to overwrite")
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    tokenizer = load_tokenizer(str(model_path))
    pairs = is_pair_source(data_path)  # preference pairs: workflows.preference_eval scores them
    examples = [] if pairs else read_examples(data_path, tokenizer, max_length, limit)

    quant = trained_base_quant(adapter_folder, model_path)  # the base the adapter trained on
    net = load_model(model_path, dtype=DTYPES[prec], device=dev, base_quant=quant)
    load_adapter(net, adapter_folder, param_dtype=DTYPES[prec])
    # q/k/v and gate/up as one matmul each (base off, or merged: both plain linears): SmolLM2's
    # five projections, bf16 on the 2-core CPU, 1.09 -> 0.96 ms at 67 rows, 24.9 -> 21.4 at 4,000.
    if quant == "none":
        fuse_projections(net)
    load_seconds = time.perf_counter() - t_start
    if pairs:
        return evaluate_pairs(net, tokenizer, data_path, out_dir, limit=limit, batch_size=batch_size,
                              max_length=max_length, header={"model": str(model_path), "adapter": str(adapter_folder)})
    report = score_base_and_tuned(net, tokenizer, examples, max_new_tokens, batch_size)
    report["seconds"] = {"load": round(load_seconds, 2), **report["seconds"],
                         "total": round(time.perf_counter() - t_start, 2)}
    report = {"model": str(model_path), "adapter": str(adapter_folder), "data": str(data_path), "device": str(dev),
              "precision": prec, "max_new_tokens": max_new_tokens, "max_length": max_length,
              "batch_size": batch_size, **report}
    write_eval(report, out_dir, report_examples)
    report["out"] = str(out_dir)
    return report


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


def write_eval(report: dict, out_dir: Path, report_examples: int = 3) -> None:
    """eval.json (the report) and eval.md (means and a few examples), each written atomically."""
    from hivetune.core.fileio import atomic_write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "eval.json", (json.dumps(report, indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / "eval.md", markdown_report(report, report_examples).encode())


def heldout_ab(net: CausalLM, tokenizer, data_path: Path, out_dir: Path, *, model_path: Path, adapter_folder: Path,
               device: torch.device, precision: str, max_new_tokens: int = 96, limit: int = 200,
               batch_size: int = 96, max_length: int = 1024) -> dict:
    """The end of `hivetune train`: `hivetune eval` on the model still in memory (no reload),
    into out_dir (RUN/eval). The LoRA weights are cast to the base's dtype first, as
    `hivetune eval` loads them, so both give the same numbers for the same run."""
    from hivetune.model.lora import lora_modules

    t_start = time.perf_counter()
    dtype = net.lm_head.weight.dtype
    for _, module in lora_modules(net):
        module.lora_A.to(dtype)
        module.lora_B.to(dtype)
    examples = read_examples(data_path, tokenizer, max_length, limit)
    report = score_base_and_tuned(net, tokenizer, examples, max_new_tokens, batch_size)
    report["seconds"]["total"] = round(time.perf_counter() - t_start, 2)
    report = {"model": str(model_path), "adapter": str(adapter_folder), "data": str(data_path), "device": str(device),
              "precision": precision, "max_new_tokens": max_new_tokens, "max_length": max_length,
              "batch_size": batch_size, **report}
    write_eval(report, out_dir)
    report["out"] = str(out_dir)
    return report


# ---------------------------------------------------------------- eval.md


def _fmt(value, kind: str) -> str:
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
        lines.append(f"| {label} | {_fmt(b, kind)} | {_fmt(t, kind)} | {change} |")
    n = base["command_examples"]
    if n:
        lines.append(f"| command hit | {_fmt(base['command_hit'], 'pct')} ({base['command_hits']}/{n}) | "
                     f"{_fmt(tuned['command_hit'], 'pct')} ({tuned['command_hits']}/{n}) | "
                     f"{100 * (tuned['command_hit'] - base['command_hit']):+.1f} pts |")
    return "\n".join(lines)


def _fenced(text: str) -> str:
    """A code block whose fence is longer than any backtick run inside the text."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _cell(text: str) -> str:
    """Text as one Markdown table cell: markup characters escaped, line breaks as <br>."""
    text = re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", text)
    return "<br>".join(text.splitlines()) or " "


def markdown_report(report: dict, n_examples: int) -> str:
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
        parts += ["", f"## {row['where']}", "", "**Question**", "", _fenced(row["question"]), "",
                  "**Reference**", "", _fenced(row["reference"]), "",
                  "| | base | tuned |", "|---|---|---|",
                  f"| answer | {_cell(b['generation'])} | {_cell(t['generation'])} |",
                  f"| loss | {_fmt(b['loss'], 'num')} | {_fmt(t['loss'], 'num')} |",
                  f"| token F1 | {_fmt(b['f1'], 'pct')} | {_fmt(t['f1'], 'pct')} |",
                  f"| ROUGE-L | {_fmt(b['rouge_l'], 'pct')} | {_fmt(t['rouge_l'], 'pct')} |",
                  f"| command hit | {hit[b['command_hit']]} | {hit[t['command_hit']]} |"]
    return "\n".join(parts) + "\n"
