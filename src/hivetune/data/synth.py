"""Deterministic synthetic alpaca-style instruction data about Linux, Fedora Atomic and GPU ops.

``synthesize(n, seed)`` returns ``n`` examples, each a dict with the keys (in this order)
``instruction``, ``input`` (usually ""), ``output``, ``category`` and ``command``. ``command`` is
the single most important command of the answer and appears verbatim in ``output``, so an
evaluation can check "does the reference command appear in the model's answer".

How an example is made: pick a category (balanced round robin), a task of that category (a
shuffled deck, so every task gets used), slot values, and either a generic question form around
one of the task's goals or one of its specific questions; then fill the answer template with the
same slot values. The per-category templates live in ``topics/*.yaml``; the answer
convention (``$ `` shell lines, ``>>> `` Python lines) is described in :mod:`synth_topics`.

Everything random goes through one ``random.Random(seed)``; sets are only used for membership
tests, so the result never depends on hash order.

The shipped default dataset (``write_default_dataset``) is made the same way from a subset of the
tasks (the first ``DEFAULT_TASKS_PER_CATEGORY`` of each category) with brief answers
(``brief_answer``): in one epoch, a 135M model fine-tuned for a few minutes on a 2-core CPU sees
each of 50 tasks about seven times. With all 254 tasks, one or two examples each, it learnt the
answer format but not the commands (1 command hit on 40 held-out questions after two epochs).

Near duplicates are measured on ``instruction + input``: lower-cased alphanumeric words, word
3-gram shingles, Jaccard similarity; a pair with similarity >= 0.8 is a near duplicate. The
generator rejects a candidate that is a near duplicate of (or identical in instruction to) any
example it already accepted, and one whose instruction is outside 8-40 words.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter, defaultdict
from pathlib import Path

from hivetune.data.synth_topics import GOAL_FORMS, Task, load_tasks

CATEGORIES = (
    "selinux", "cgroups", "gpu_containers", "rocm", "cuda", "ostree", "bootc", "systemd",
    "journald", "networking", "storage", "kernel_sysctl", "monitoring", "redis", "llama_cpp",
    "vllm", "transformers_peft", "onnx", "python_env", "dnf", "users_permissions", "ssh",
    "backups", "performance", "troubleshooting",
)

MIN_INSTRUCTION_WORDS = 8
MAX_INSTRUCTION_WORDS = 40
NEAR_DUPLICATE_THRESHOLD = 0.8
SHINGLE_SIZE = 3
# Share of draws that use a task's specific question rather than a generic form around a goal.
QUESTION_SHARE = 0.35
# Tasks whose questions carry an input (an error message, a log line) are mostly asked that way:
# "here is my error, what now?" is the natural form for them, and it keeps inputs from being rare.
QUESTION_SHARE_WITH_INPUT = 0.7
# Consecutive rejected candidates for one example before we declare the category exhausted.
MAX_ATTEMPTS_PER_EXAMPLE = 400

DEFAULT_SEED = 0
DEFAULT_TOTAL = 400
DEFAULT_HELDOUT = 40
DEFAULT_TASKS_PER_CATEGORY = 2
DATASET_KEYS = ("instruction", "input", "output", "category", "command")

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE_BREAK = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+")
_STEP_NUMBER = re.compile(r"^\d+\.\s+")
_CONNECTIVE = re.compile(r"^(and|or|then|but|which|so)\b")
BRIEF_NOTE_MIN_WORDS = 5


def _collect_tasks() -> dict[str, tuple[Task, ...]]:
    """Group the tasks of all topic files by category, checking keys and categories."""
    by_category: dict[str, list[Task]] = {category: [] for category in CATEGORIES}
    seen_keys: set[str] = set()
    for topic_task in load_tasks():
        if topic_task.category not in by_category:
            raise ValueError(f"task {topic_task.key!r} has unknown category")
        if topic_task.key in seen_keys:
            raise ValueError(f"duplicate task key {topic_task.key!r}")
        seen_keys.add(topic_task.key)
        by_category[topic_task.category].append(topic_task)
    empty = [category for category, tasks in by_category.items() if not tasks]
    if empty:
        raise ValueError(f"categories without tasks: {empty}")
    return {category: tuple(tasks) for category, tasks in by_category.items()}


TASKS_BY_CATEGORY = _collect_tasks()


def _fill(template: str, values: dict[str, str], task_key: str) -> str:
    """Replace ``{name}`` placeholders; other braces (JSON, Go templates) are left alone."""
    def lookup(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"task {task_key!r}: no slot value for placeholder {{{name}}}")
        return values[name]
    return _PLACEHOLDER.sub(lookup, template)


def _is_command_line(line: str) -> bool:
    return line.startswith(("$ ", ">>> "))


def brief_answer(answer: str, command: str) -> str:
    """An answer template cut to the line holding ``command`` followed by one sentence of it.

    The sentence is the answer's first prose sentence (step numbers dropped) of at least
    ``BRIEF_NOTE_MIN_WORDS`` words that ends like a sentence; a lead-in's final colon becomes a
    full stop ("Verify it:" is too short to count). A sentence starting in lower case, or with a
    connective (and, or, then...), continues something the brief answer no longer has, so it is
    skipped, except for the line right after the command ("$ getenforce" / "prints Enforcing,
    ..."). Indented lines (file contents) are not prose. No such sentence: the command line alone.
    """
    lines = answer.splitlines()
    key = next(i for i, line in enumerate(lines) if _is_command_line(line) and command in line)
    for i, line in enumerate(lines):
        if _is_command_line(line) or not line.strip() or line != line.lstrip():
            continue
        for j, sentence in enumerate(_SENTENCE_BREAK.split(_STEP_NUMBER.sub("", line.strip()))):
            sentence = sentence.strip()
            continues_command = i == key + 1 and j == 0
            if (sentence[:1].islower() and not continues_command) or _CONNECTIVE.match(sentence):
                continue
            if sentence.endswith(":"):
                sentence = sentence[:-1] + "."
            if len(sentence.split()) >= BRIEF_NOTE_MIN_WORDS and sentence.endswith((".", ")")):
                return f"{lines[key]}\n{sentence}"
    return lines[key]


def _draw(topic_task: Task, rng: random.Random, brief: bool = False) -> dict[str, str]:
    """Draw one example for ``topic_task``: slot values, question wording and answer variant;
    with ``brief``, the answer is the task's brief template or ``brief_answer`` of the variant."""
    values: dict[str, str] = {}
    for name, options in topic_task.slots:
        choice = rng.choice(options)
        if isinstance(choice, dict):
            values.update(choice)
        else:
            values[name] = choice
    # A slot value may refer to other slots (an error message mentioning {port}); resolve once.
    values = {name: _fill(value, values, topic_task.key) for name, value in values.items()}
    has_input = any(input_text for _question, input_text in topic_task.questions)
    share = QUESTION_SHARE_WITH_INPUT if has_input else QUESTION_SHARE
    use_question = topic_task.questions and (not topic_task.goals or rng.random() < share)
    if use_question:
        instruction, input_text = rng.choice(topic_task.questions)
    else:
        instruction = rng.choice(GOAL_FORMS).replace("{goal}", rng.choice(topic_task.goals))
        input_text = ""
    answer = rng.choice(topic_task.answers)
    if brief:
        answer = topic_task.brief or brief_answer(answer, topic_task.command)
    example = {
        "instruction": _fill(instruction, values, topic_task.key),
        "input": _fill(input_text, values, topic_task.key),
        "output": _fill(answer, values, topic_task.key),
        "category": topic_task.category,
        "command": _fill(topic_task.command, values, topic_task.key),
    }
    if example["command"] not in example["output"]:
        raise RuntimeError(f"task {topic_task.key!r}: command {example['command']!r} "
                           f"is not in the answer")
    return example


def _dedup_text(example: dict) -> str:
    """The text near duplicates are judged on: what the model sees as the question."""
    return f"{example['instruction']}\n{example.get('input', '')}"


def _shingles(text: str) -> frozenset[str]:
    """Word 3-gram shingles of the lower-cased alphanumeric words of ``text``."""
    words = _WORD.findall(text.lower())
    if len(words) < SHINGLE_SIZE:
        return frozenset({" ".join(words)})
    return frozenset(" ".join(words[i:i + SHINGLE_SIZE]) for i in range(len(words) - SHINGLE_SIZE + 1))


class _NearDuplicateIndex:
    """Shingle sets with an inverted index, so a lookup only compares sets sharing a shingle."""

    def __init__(self, threshold: float = NEAR_DUPLICATE_THRESHOLD):
        self.threshold = threshold
        self._sets: list[frozenset[str]] = []
        self._postings: dict[str, list[int]] = defaultdict(list)

    def is_near_duplicate(self, shingles: frozenset[str]) -> bool:
        shared_counts: Counter[int] = Counter()
        for shingle in shingles:
            shared_counts.update(self._postings.get(shingle, ()))
        for index, shared in shared_counts.items():
            union = len(shingles) + len(self._sets[index]) - shared
            if shared / union >= self.threshold:
                return True
        return False

    def add(self, shingles: frozenset[str]) -> None:
        index = len(self._sets)
        self._sets.append(shingles)
        for shingle in shingles:
            self._postings[shingle].append(index)


def near_duplicate_rate(examples: list[dict], threshold: float = NEAR_DUPLICATE_THRESHOLD) -> float:
    """Fraction of examples whose instruction+input is a near duplicate of an earlier example.

    Measure: lower-case, keep alphanumeric words, take word 3-gram shingles; two examples are near
    duplicates when the Jaccard similarity of their shingle sets is >= ``threshold`` (exact
    duplicates have similarity 1). An inverted index keeps this fast (well under a second for
    n=1500). Returns 0.0 for an empty list.
    """
    if not examples:
        return 0.0
    index = _NearDuplicateIndex(threshold)
    duplicates = 0
    for example in examples:
        shingles = _shingles(_dedup_text(example))
        if index.is_near_duplicate(shingles):
            duplicates += 1
        index.add(shingles)
    return duplicates / len(examples)


def category_counts(examples: list[dict]) -> dict[str, int]:
    """Examples per category, known categories first in :data:`CATEGORIES` order."""
    counts = Counter(example["category"] for example in examples)
    ordered = [category for category in CATEGORIES if category in counts]
    ordered += sorted(category for category in counts if category not in CATEGORIES)
    return {category: counts[category] for category in ordered}


def extract_commands(output: str) -> list[str]:
    """The commands of an answer: ``$ `` shell lines and ``>>> `` Python lines, prefix removed."""
    commands = []
    for line in output.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
        elif line.startswith(">>> "):
            commands.append(line[4:])
    return commands


def _generate(n: int, seed: int, tasks_by_category: dict[str, tuple[Task, ...]] | None = None,
              brief: bool = False) -> list[tuple[dict, str]]:
    """Generate ``n`` (example, task key) pairs; the task key is used for the held-out split.
    ``tasks_by_category``: the tasks to draw from (default: all); ``brief``: brief answers."""
    tasks_by_category = tasks_by_category or TASKS_BY_CATEGORY
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(seed)
    base_quota, remainder = divmod(n, len(CATEGORIES))
    quotas = {category: base_quota for category in CATEGORIES}
    lucky = list(CATEGORIES)
    rng.shuffle(lucky)
    for category in lucky[:remainder]:
        quotas[category] += 1

    decks: dict[str, list[Task]] = {category: [] for category in CATEGORIES}
    produced: Counter[str] = Counter()
    seen_instructions: set[str] = set()
    index = _NearDuplicateIndex()
    records: list[tuple[dict, str]] = []

    for _ in range(max(quotas.values(), default=0)):
        round_order = [category for category in CATEGORIES if produced[category] < quotas[category]]
        rng.shuffle(round_order)
        for category in round_order:
            for _attempt in range(MAX_ATTEMPTS_PER_EXAMPLE):
                if not decks[category]:
                    # A shuffled deck rather than independent draws: every task gets used
                    # about equally often, which the held-out split relies on.
                    decks[category] = list(tasks_by_category[category])
                    rng.shuffle(decks[category])
                topic_task = decks[category].pop()
                example = _draw(topic_task, rng, brief)
                n_words = len(example["instruction"].split())
                if not MIN_INSTRUCTION_WORDS <= n_words <= MAX_INSTRUCTION_WORDS:
                    continue
                if example["instruction"] in seen_instructions:
                    continue
                shingles = _shingles(_dedup_text(example))
                if index.is_near_duplicate(shingles):
                    continue
                seen_instructions.add(example["instruction"])
                index.add(shingles)
                produced[category] += 1
                records.append((example, topic_task.key))
                break
            else:
                raise ValueError(
                    f"cannot synthesize n={n} examples with seed={seed}: category {category!r} "
                    f"ran out of distinct, non-near-duplicate examples after {produced[category]} "
                    f"(needed {quotas[category]}); use a smaller n")
    return records


def synthesize(n: int, seed: int = 0) -> list[dict]:
    """Return ``n`` distinct synthetic examples, deterministic for a given ``seed``.

    Categories are balanced (they differ by at most one example). Raises ValueError if ``n`` is
    negative or cannot be reached without exact or near duplicates.
    """
    return [example for example, _task_key in _generate(n, seed)]


def _split_stratified(records: list[tuple[dict, str]], heldout_size: int):
    """Split records into (train, heldout) lists of examples, stratified by category.

    Every category gets ``heldout_size // n_categories`` held-out examples and the larger
    categories (ties: :data:`CATEGORIES` order) one more, until ``heldout_size`` is reached.
    Within a category we take the latest-generated examples whose task still has another example
    left in train (so held-out questions are answerable from train patterns), preferring
    different tasks. Both lists keep generation order.
    """
    indices_by_category: dict[str, list[int]] = defaultdict(list)
    for position, (example, _task_key) in enumerate(records):
        indices_by_category[example["category"]].append(position)
    categories = [c for c in CATEGORIES if c in indices_by_category]
    categories += sorted(c for c in indices_by_category if c not in CATEGORIES)
    if heldout_size > len(records) - len(categories):
        raise ValueError(f"held-out size {heldout_size} too large for {len(records)} records")
    base, extra = divmod(heldout_size, len(categories))
    ranked = sorted(categories, key=lambda c: (-len(indices_by_category[c]), categories.index(c)))
    quotas = {c: base + (1 if rank < extra else 0) for rank, c in enumerate(ranked)}

    chosen: set[int] = set()
    for category in categories:
        positions = indices_by_category[category]
        left_in_train = Counter(records[p][1] for p in positions)
        picked_tasks: set[str] = set()
        picked = 0
        # Pass 0: distinct tasks that keep a sibling in train; pass 1: allow repeated tasks;
        # pass 2: anything (only reached for tiny categories).
        for strictness in (0, 1, 2):
            for position in reversed(positions):
                if picked >= quotas[category]:
                    break
                task_key = records[position][1]
                if position in chosen:
                    continue
                if strictness < 2 and left_in_train[task_key] < 2:
                    continue
                if strictness < 1 and task_key in picked_tasks:
                    continue
                chosen.add(position)
                picked_tasks.add(task_key)
                left_in_train[task_key] -= 1
                picked += 1
    train = [example for p, (example, _k) in enumerate(records) if p not in chosen]
    heldout = [example for p, (example, _k) in enumerate(records) if p in chosen]
    return train, heldout


def _write_jsonl(path: Path, examples: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for example in examples:
            ordered = {key: example[key] for key in DATASET_KEYS}
            handle.write(json.dumps(ordered, ensure_ascii=False) + "\n")


def _readme_text(train: list[dict], heldout: list[dict]) -> str:
    train_counts = category_counts(train)
    heldout_counts = category_counts(heldout)
    rows = "\n".join(f"| {c} | {train_counts.get(c, 0)} | {heldout_counts.get(c, 0)} |"
                     for c in CATEGORIES)
    n_tasks = sum(len(tasks) for tasks in default_tasks().values())
    train_commands = {example["command"] for example in train}
    same_command = sum(example["command"] in train_commands for example in heldout)
    return f"""# Default dataset

Synthetic alpaca-style instruction data about Linux, Fedora Atomic (rpm-ostree, bootc), GPU
operations (CUDA, ROCm, containers) and LLM tooling. It is small on purpose: the default training
run fine-tunes a 135M model on a 2-core CPU within a few minutes, so the data teaches a few tasks
well rather than many once.

- {n_tasks} tasks, the first {DEFAULT_TASKS_PER_CATEGORY} of each of the {len(CATEGORIES)} categories of
  `src/hivetune/data/topics/*.yaml` (`hivetune data synth` draws from all of them).
- `train.jsonl`: {len(train)} examples, each task asked several times in different words and
  with different arguments (service, path, port...).
- `heldout.jsonl`: {len(heldout)} examples, stratified by category. What is held out is the
  question, not the task: every held-out example asks a task that train also teaches, in words
  no train instruction uses (no identical instruction, no near duplicate: word 3-gram Jaccard
  < {NEAR_DUPLICATE_THRESHOLD}). {same_command} of its {len(heldout)} reference commands also occur verbatim in train (a
  task whose command takes no arguments, or the same arguments); the other {len(heldout) - same_command} need
  arguments that only the question gives.
- Answers are brief: the key command line first, then one sentence of explanation
  (`brief_answer` in `synth.py`, or a task's own `brief` template). The long multi-step answers
  of `hivetune data synth` cost about 1.4 times the tokens per example and put the key command
  later in the answer.

## How the files were made

Generated, not hand-written. From the repository root:

```
python -c "from hivetune.data.synth import write_default_dataset; write_default_dataset('src/hivetune/data/default')"
```

This calls `default_records()` (`{DEFAULT_TOTAL}` examples of the tasks above, seed {DEFAULT_SEED}) from
`src/hivetune/data/synth.py` and splits the result deterministically. Rerunning it reproduces these
files byte for byte (a test checks this); edit the templates in `topics/*.yaml` and
regenerate instead of editing here.

## Format

One JSON object per line with the keys `instruction`, `input` (usually empty), `output`,
`category` and `command`. In `output`, shell commands are lines starting with `$ ` and Python
statements lines starting with `>>> `. `command` is the key command of the answer without
`sudo`; it appears verbatim in `output`, for a simple "did the model produce the command" check.

## Examples per category

| category | train | held-out |
|---|---|---|
{rows}
"""


def default_tasks() -> dict[str, tuple[Task, ...]]:
    """The tasks of the shipped dataset: the first DEFAULT_TASKS_PER_CATEGORY of each category."""
    return {category: tasks[:DEFAULT_TASKS_PER_CATEGORY] for category, tasks in TASKS_BY_CATEGORY.items()}


def default_records() -> list[tuple[dict, str]]:
    """The shipped dataset before its split, as (example, task key) pairs: DEFAULT_TOTAL
    examples of ``default_tasks`` with brief answers, seed DEFAULT_SEED."""
    return _generate(DEFAULT_TOTAL, DEFAULT_SEED, default_tasks(), brief=True)


def write_default_dataset(directory: str | os.PathLike) -> dict[str, Path]:
    """Write the shipped dataset (train.jsonl, heldout.jsonl, README.md) into ``directory``.

    Uses ``default_records()`` and a deterministic split stratified by category with 40
    held-out examples. Returns the paths written, keyed "train", "heldout" and "readme".
    """
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    records = default_records()
    train, heldout = _split_stratified(records, DEFAULT_HELDOUT)
    paths = {"train": target / "train.jsonl", "heldout": target / "heldout.jsonl",
             "readme": target / "README.md"}
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["heldout"], heldout)
    with open(paths["readme"], "w", encoding="utf-8", newline="\n") as handle:
        handle.write(_readme_text(train, heldout))
    return paths
