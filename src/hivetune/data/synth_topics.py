"""Building blocks for the synthetic instruction data in :mod:`hivetune.data.synth`.

A :class:`Task` is one thing a user may want to do ("open a port in firewalld"). It carries

* ``goals``: infinitive verb phrases ("open port {port}/{proto} in firewalld") that are combined
  with the generic question forms in :data:`GOAL_FORMS` ("How do I {goal}?"),
* ``questions``: complete, task-specific questions (explain..., my X fails with Y...), each with
  an optional ``input`` text such as an error message,
* ``answers``: one or more answer templates that all teach the same key ``command``,
* ``slots``: the values that fill ``{name}`` placeholders. A slot value is either a string or a
  dict; a dict sets several placeholders at once, which keeps related values consistent (a GPU
  model and its compute capability, a port and its protocol). A value may itself mention other
  placeholders (an error message containing ``{port}``); they are filled in one extra pass.

Every placeholder used by ``command`` must be named by each goal and question (directly, or via a
key of the same dict slot), so the reference command can be derived from the question alone.

Answer convention (used by every template, and checked by the tests): each shell command stands
on its own line starting with ``$ `` (``sudo`` included where root is needed), each Python
statement on its own line starting with ``>>> ``. File contents (unit files, Containerfiles) are
plain lines. The ``command`` of a task is written without ``sudo`` so that it is a verbatim
substring of the ``$ sudo ...`` line.

The tasks are data: ``topics/*.yaml`` beside this module, one file per group of categories, each a
list of ``tasks`` written as :func:`task` takes them. A slot value ``=NAME`` names a pool of values
listed under ``pools`` in the same file or in ``topics/pools.yaml`` (the pools the groups share).
This module holds the format and :func:`load_tasks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOPICS_DIR = Path(__file__).parent / "topics"
TOPIC_FILES = ("system", "ops", "platform", "ml")  # the order fixes each category's task order

@dataclass(frozen=True)
class Task:
    """One user intent with its question templates, answer templates and slot values."""

    key: str  # "<category>.<name>", unique over all tasks
    goals: tuple[str, ...]
    questions: tuple[tuple[str, str], ...]  # (instruction template, input template)
    answers: tuple[str, ...]
    command: str
    slots: tuple[tuple[str, tuple], ...]  # ordered (name, values) pairs; order fixes rng use
    # The short answer of the shipped default dataset, where the derived one
    # (``synth.brief_answer``: the key command line, then one sentence of the answer) reads badly.
    brief: str = ""

    @property
    def category(self) -> str:
        return self.key.split(".", 1)[0]


def task(key: str, *, goals=(), questions=(), answers, command: str, slots=None, brief: str = "") -> Task:
    """Build a :class:`Task`, normalising the convenient literal forms used in topic modules.

    ``questions`` entries may be plain strings (no input) or ``(instruction, input)`` pairs;
    ``answers`` may be a single string; ``slots`` is a dict of name -> sequence of values;
    ``brief`` (optional) is the short answer template of the shipped default dataset.
    """
    if isinstance(answers, str):
        answers = (answers,)
    normalised_questions = tuple((q, "") if isinstance(q, str) else (q[0], q[1]) for q in questions)
    if not goals and not normalised_questions:
        raise ValueError(f"task {key!r} needs at least one goal or question")
    slot_pairs = tuple((name, tuple(values)) for name, values in (slots or {}).items())
    for name, values in slot_pairs:
        if not values:
            raise ValueError(f"task {key!r}: slot {name!r} has no values")
    return Task(key, tuple(goals), normalised_questions, tuple(answers), command, slot_pairs, brief)


# Generic ways to ask for a goal. Each must read naturally with any goal phrase, which is an
# infinitive verb phrase starting in lower case ("open port 8080/tcp in firewalld").
GOAL_FORMS = (
    "How do I {goal}?",
    "How can I {goal}?",
    "What's the command to {goal}?",
    "What command should I run to {goal}?",
    "I need to {goal}. What should I run?",
    "Show me how to {goal}.",
    "What is the correct way to {goal}?",
    "Give me the steps to {goal}.",
    "What's the best way to {goal}?",
    "Quick question: how do I {goal}?",
    "Is there a simple way to {goal}?",
    "Walk me through how to {goal}.",
    "I'm on Fedora. How do I {goal}?",
    "Please explain how to {goal}.",
    "Can you tell me how to {goal}?",
    "I want to {goal}; which commands do I need?",
)

def _frozen(value):
    """YAML's lists and dicts as the tuples and dicts that task templates hold."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _read_yaml(path: Path) -> dict:
    import yaml  # loaded with the topics: only the synthetic-data commands need it
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}


def load_tasks() -> list[Task]:
    """Every task of ``topics/*.yaml``, in file order, with ``=NAME`` slot values resolved."""
    shared = {name: _frozen(v) for name, v in _read_yaml(TOPICS_DIR / "pools.yaml")["pools"].items()}
    tasks = []
    for name in TOPIC_FILES:
        path = TOPICS_DIR / f"{name}.yaml"
        doc = _read_yaml(path)
        pools = {**shared, **{k: _frozen(v) for k, v in (doc.get("pools") or {}).items()}}
        for entry in doc["tasks"]:
            slots = {}
            for slot, values in (entry.get("slots") or {}).items():
                if isinstance(values, str) and values.startswith("="):
                    if values[1:] not in pools:
                        raise ValueError(f"{path}: task {entry['key']!r}: slot {slot!r} names no pool {values[1:]!r}")
                    values = pools[values[1:]]
                slots[slot] = _frozen(values)
            questions = [q if isinstance(q, str) else tuple(q) for q in entry.get("questions", ())]
            tasks.append(task(entry["key"], goals=entry.get("goals", ()), questions=questions,
                              answers=entry["answers"] if isinstance(entry["answers"], str) else tuple(entry["answers"]),
                              command=entry["command"], slots=slots, brief=entry.get("brief", "")))
    return tasks
