"""Preference pairs: {prompt | messages, chosen, rejected} records as token ids, their micro-batches,
pairs made from the interaction log's feedback, and the shipped pair set's generator.

A pair is rendered with the model's chat template: the prompt as the conversation up to the
generation prompt, each answer as what the template adds after it (its end-of-turn token too).
Both answers share the prompt's token ids, so a row [prompt, chosen, rejected] and the two rows
[prompt, chosen], [prompt, rejected] hold the same sequences.

Micro-batches (collate_pairs), per pair j of P, sequences 2j (chosen) and 2j+1 (rejected):
- shared (the fast path): one packed row [p_0, c_0, r_0, p_1, c_1, r_1, ...]; the rejected
  answer's positions restart after its prompt, and the attention (ops.shared_prompt) lets each
  answer see its prompt and itself only: the prompt runs once.
- plain (the reference): 2P right-padded rows, prompt + answer each.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes
from hivetune.data.formats import checked_source, pair_answer_text, render_chat
from hivetune.data.sources import DataSource
from hivetune.ops.preference import shared_prompt_mask
from hivetune.ops.shared_prompt import PairSegments, SharedPrompt, pair_segments, row_parts

PAIR_FILES = ("preference-train.jsonl", "preference-heldout.jsonl")  # in data/default/, from train / heldout


@dataclass
class EncodedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated: bool = False

    @property
    def n_targets(self) -> int:
        return 1  # the loss is a mean over pairs: a step's normaliser is its pair count

    def __len__(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


def prompt_messages(record: dict) -> list[dict]:
    prompt = record["prompt"] if "prompt" in record else record["messages"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def answer_messages(value) -> list[dict]:
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else list(value)


def pair_texts(record: dict, tokenizer) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as text: the prompt rendered up to the generation prompt, each
    answer as the text the template adds to it."""
    messages = prompt_messages(record)
    prompt = render_chat(tokenizer, messages, add_generation_prompt=True)
    answers = []
    for name in ("chosen", "rejected"):
        full = render_chat(tokenizer, messages + answer_messages(record[name]), add_generation_prompt=False)
        if not full.startswith(prompt):
            raise UserError("the chat template does not render the prompt as a prefix of the conversation")
        answers.append(full[len(prompt):])
    return prompt, answers[0], answers[1]


def encode_pair(record: dict, tokenizer, max_length: int) -> EncodedPair:
    """Token ids of a checked pair. Each sequence (prompt + answer) keeps at most max_length tokens:
    a prompt longer than half of it keeps its last max_length // 2 tokens, answers are cut after."""
    prompt, chosen, rejected = (tokenizer(text, add_special_tokens=False)["input_ids"]
                                for text in pair_texts(record, tokenizer))
    truncated = False
    if len(prompt) + max(len(chosen), len(rejected)) > max_length:
        truncated = True
        if len(prompt) > max_length // 2:
            prompt = prompt[-(max_length // 2):]
        room = max_length - len(prompt)
        chosen, rejected = chosen[:room], rejected[:room]
    return EncodedPair(prompt, chosen, rejected, truncated)


def pair_prompt(record: dict) -> str:
    """A pair's question, for near duplicates: the prompt, or its user turns."""
    return "\n".join(m["content"] for m in prompt_messages(record) if m["role"] == "user")


def pair_key(record: dict) -> int:
    """64-bit hash of the normalised prompt, chosen and rejected: equal keys are duplicate pairs."""
    from hivetune.data.scan import normalise

    parts = [f"{m['role']}:{m['content']}" for m in prompt_messages(record)]
    parts += [pair_answer_text(record[name]) for name in ("chosen", "rejected")]
    joined = "\x1f".join(normalise(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(joined.encode("utf-8"), digest_size=8).digest(), "little")


def pair_lengths(records: list[dict], tokenizer) -> list[tuple[int, int]]:
    """(prompt tokens, the longer answer's tokens) of each pair, untruncated."""
    out = []
    for record in records:
        e = encode_pair(record, tokenizer, 1 << 62)
        out.append((len(e.prompt), max(len(e.chosen), len(e.rejected))))
    return out


@dataclass
class PairIndex:
    """Preference pairs held tokenised in memory, with the interface of data.dataset.DatasetIndex."""

    path: Path
    pairs: list[EncodedPair]
    where: list[str] = field(default_factory=list)  # file:line of each pair
    format: str = "preference"
    skipped_no_target: int = 0

    def __post_init__(self):
        self.lengths = [len(p) for p in self.pairs]
        self.n_targets = [p.n_targets for p in self.pairs]
        self.truncated = sum(p.truncated for p in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    def example(self, i: int) -> EncodedPair:
        return self.pairs[i]


def index_pairs(source: str | Path | DataSource, tokenizer, max_length: int, fmt: str = "auto") -> PairIndex:
    """Read, check and tokenise every pair of a data source; a record of another format is an error."""
    pairs, where_of = [], []
    for _, where, _, _, record, chosen in checked_source(source, fmt):
        if chosen != "preference":
            raise UserError(f"{where}: method dpo / orpo needs preference pairs (prompt, chosen, rejected), "
                            f"got format {chosen}")
        try:
            pairs.append(encode_pair(record, tokenizer, max_length))
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        where_of.append(where)
    spec = source.spec if isinstance(source, DataSource) else source
    return PairIndex(Path(spec), pairs, where_of)


@dataclass
class PairBatch:
    """A micro-batch of P pairs: targets as flat indices into the [B*T] hidden states, each with its
    sequence (2j chosen, 2j+1 rejected of pair j)."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    target_index: torch.Tensor  # [N]
    target_ids: torch.Tensor  # [N]
    target_seq: torch.Tensor  # [N]
    seq_tokens: torch.Tensor  # [2P] target tokens of each sequence
    n_examples: int  # pairs
    n_tokens: int  # tokens run through the model (no padding)
    parts: tuple | None = None  # shared: (pair, part) of each token, the attention mask's source
    dropout_seeds: torch.Tensor | None = None
    segments: PairSegments | None = None  # shared: the flash path's query / key segments

    @property
    def layout(self) -> SharedPrompt | None:
        """shared: the prompt-sharing mask [1, 1, T, T], built once where the parts are, with the
        positions a sliding window counts (an answer's restart after its prompt) and the flash
        path's segments (ops.shared_prompt); plain: None."""
        if self.parts is None:
            return None
        if getattr(self, "_layout", None) is None:
            self._layout = SharedPrompt(shared_prompt_mask(*self.parts), self.position_ids, self.segments)
        return self._layout

    def to(self, device) -> "PairBatch":
        moved = [t.to(device, non_blocking=True) for t in (self.input_ids, self.position_ids, self.target_index,
                                                          self.target_ids, self.target_seq, self.seq_tokens)]
        parts = tuple(t.to(device, non_blocking=True) for t in self.parts) if self.parts is not None else None
        seeds = self.dropout_seeds.to(device, non_blocking=True) if self.dropout_seeds is not None else None
        segments = self.segments.to(device) if self.segments is not None else None
        return PairBatch(*moved, self.n_examples, self.n_tokens, parts, seeds, segments)


def collate_pairs(pairs: list[EncodedPair], pad_id: int = 0, shared: bool = True) -> PairBatch:
    """The micro-batch of these pairs: one row sharing each prompt (shared), or 2P padded rows."""
    index, targets, seqs, counts = [], [], [], []
    if shared:
        ids, positions = [], []
        for j, e in enumerate(pairs):
            start, p, c = len(ids), len(e.prompt), len(e.chosen)
            ids += e.prompt + e.chosen + e.rejected
            positions += list(range(p + c)) + list(range(p, p + len(e.rejected)))
            # answer token k is predicted at the token before it: the prompt's last for k = 0
            for seq, first, answer in ((2 * j, start + p, e.chosen), (2 * j + 1, start + p + c, e.rejected)):
                index += [start + p - 1] + list(range(first, first + len(answer) - 1))
                targets += answer
                seqs += [seq] * len(answer)
                counts.append(len(answer))
        lengths = [(len(e.prompt), len(e.chosen), len(e.rejected)) for e in pairs]
        parts, segments = row_parts(lengths), pair_segments(lengths)
        return PairBatch(torch.tensor([ids]), torch.tensor([positions]), torch.tensor(index), torch.tensor(targets),
                         torch.tensor(seqs), torch.tensor(counts, dtype=torch.float32), len(pairs), len(ids), parts,
                         segments=segments)
    rows = [(e.prompt, answer) for e in pairs for answer in (e.chosen, e.rejected)]
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for r, (p, a) in enumerate(rows):
        input_ids[r, :len(p) + len(a)] = torch.tensor(p + a)
        index += range(r * width + len(p) - 1, r * width + len(p) + len(a) - 1)
        targets += a
        seqs += [r] * len(a)
        counts.append(len(a))
    positions = torch.arange(width).expand(len(rows), -1).contiguous()
    return PairBatch(input_ids, positions, torch.tensor(index), torch.tensor(targets), torch.tensor(seqs),
                     torch.tensor(counts, dtype=torch.float32), len(pairs), sum(len(p) + len(a) for p, a in rows))


def pairs_from_logs(paths: list[str | Path], out: str | Path, force: bool = False) -> dict:
    """`hivetune data pairs`: every exchange rated bad (-1) with a correction becomes a pair
    {messages, chosen: the correction, rejected: the answer, id, source}; written atomically."""
    from hivetune.data.interaction_log import read_logs
    from hivetune.data.scan import check_output_path

    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"{path}: interaction log not found")
    out = check_output_path(out, force)
    logs = read_logs(paths)
    records, counts = [], {"exchanges": len(logs.exchanges), "rated_bad": 0, "no_correction": 0,
                           "same_answer": 0, "pairs": 0, "broken_lines": logs.broken_lines}
    for ex in logs.exchanges.values():
        if ex.rating != -1:
            continue
        counts["rated_bad"] += 1
        if ex.correction is None:
            counts["no_correction"] += 1
        elif ex.correction.strip() == ex.answer.strip() or not ex.answer.strip():
            counts["same_answer"] += 1
        else:
            records.append({"messages": ex.messages, "chosen": ex.correction, "rejected": ex.answer, "id": ex.id,
                            "source": ex.source})
    counts["pairs"] = len(records)
    atomic_write_bytes(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    return {"out": str(out), **counts}


def format_pairs(result: dict) -> str:
    return (f"{result['out']}: {result['pairs']} pairs from {result['rated_bad']} exchanges rated bad "
            f"(of {result['exchanges']}); skipped: {result['no_correction']} without a correction, "
            f"{result['same_answer']} whose correction is the answer; {result['broken_lines']} unreadable lines")


def default_pair_records(records: list[dict], seed: int = 0) -> list[dict]:
    """Pairs from the shipped ops examples: prompt = the instruction (and input), chosen = its
    reference answer, rejected = the answer of another example of another category, drawn by a
    seeded generator (a wrong answer in the same style)."""
    rng = random.Random(f"pairs:{seed}")
    out = []
    for k, r in enumerate(records):
        others = [o for o in records if o["category"] != r["category"]]
        wrong = others[rng.randrange(len(others))]
        prompt = f"{r['instruction']}\n\n{r['input']}" if r.get("input") else r["instruction"]
        out.append({"prompt": prompt, "chosen": r["output"], "rejected": wrong["output"], "category": r["category"]})
    return out


def write_default_pairs(folder: str | Path, seed: int = 0) -> list[Path]:
    """data/default/preference-{train,heldout}.jsonl from train.jsonl / heldout.jsonl (byte for byte)."""
    folder = Path(folder)
    written = []
    for name, source in zip(PAIR_FILES, ("train.jsonl", "heldout.jsonl")):
        records = [json.loads(line) for line in (folder / source).read_text().splitlines() if line.strip()]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in default_pair_records(records, seed))
        atomic_write_bytes(folder / name, text.encode())
        written.append(folder / name)
    return written
