"""Tests for the synthetic instruction data generator and the shipped default dataset."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from hivetune.data import synth
from hivetune.data.synth import (CATEGORIES, DATASET_KEYS, category_counts, extract_commands,
                                 near_duplicate_rate, synthesize, write_default_dataset)
from hivetune.data.synth_topics import task

SHIPPED_DIR = Path(synth.__file__).parent / "default"
PLACEHOLDER = re.compile(r"\{[a-z_][a-z0-9_]*\}")


@lru_cache(maxsize=None)
def _examples(n: int, seed: int) -> tuple:
    # Cached: several tests inspect the same large sample. Tuples keep the cache immutable.
    return tuple(synthesize(n, seed))


def big_sample() -> tuple:
    """1500 examples (the size the requirements name) plus 1500 more for template coverage."""
    return _examples(1500, 0) + _examples(1500, 1)


def _shell_lines(example: dict) -> list[str]:
    return [line[2:] for line in example["output"].splitlines() if line.startswith("$ ")]


# --- determinism ---------------------------------------------------------------------------

def test_same_seed_gives_identical_examples():
    assert synthesize(200, seed=7) == synthesize(200, seed=7)


def test_different_seeds_give_different_examples():
    first = synthesize(200, seed=0)
    second = synthesize(200, seed=1)
    assert first != second
    shared = {e["instruction"] for e in first} & {e["instruction"] for e in second}
    assert len(shared) < 40  # mostly different questions, not just a different order


def test_output_does_not_depend_on_hash_randomisation():
    # Sets and dicts keyed by strings iterate in hash order, which PYTHONHASHSEED changes.
    code = ("import hashlib, json; from hivetune.data.synth import synthesize; "
            "print(hashlib.sha256(json.dumps(synthesize(300, 3)).encode()).hexdigest())")
    src = str(Path(synth.__file__).parents[2])
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=src)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True)
        digests.add(result.stdout.strip())
    expected = hashlib.sha256(json.dumps(synthesize(300, 3)).encode()).hexdigest()
    assert digests == {expected}


# --- size, categories, shape ---------------------------------------------------------------

def test_at_least_24_categories_declared_and_used():
    assert len(CATEGORIES) >= 24
    assert len(set(CATEGORIES)) == len(CATEGORIES)
    assert set(synth.TASKS_BY_CATEGORY) == set(CATEGORIES)


def test_1500_examples_reachable_with_balanced_categories():
    examples = _examples(1500, 0)
    assert len(examples) == 1500
    counts = category_counts(list(examples))
    assert list(counts) == list(CATEGORIES)  # every category present, in declared order
    assert min(counts.values()) >= 1500 // len(CATEGORIES)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_examples_have_the_dataset_keys_in_order():
    for example in _examples(1500, 0):
        assert tuple(example) == DATASET_KEYS
        assert all(isinstance(example[key], str) for key in DATASET_KEYS)
        assert example["category"] in CATEGORIES
        assert example["instruction"] and example["output"] and example["command"]


def test_zero_and_invalid_n():
    assert synthesize(0) == []
    with pytest.raises(ValueError):
        synthesize(-1)
    with pytest.raises(ValueError):
        synthesize(2.5)


def test_unreachable_n_raises_a_clear_value_error(monkeypatch):
    # One fixed question per category: only one distinct example per category exists.
    tiny = {category: (task(f"{category}.only", questions=(f"How do I configure the {category} thing on Fedora?",),
                            answers="Run this:\n$ true", command="true"),)
            for category in CATEGORIES}
    monkeypatch.setattr(synth, "TASKS_BY_CATEGORY", tiny)
    assert len(synthesize(len(CATEGORIES), seed=0)) == len(CATEGORIES)
    with pytest.raises(ValueError, match="ran out of distinct"):
        synthesize(2 * len(CATEGORIES), seed=0)


def test_category_counts_counts_and_orders():
    examples = [{"category": "ssh"}, {"category": "selinux"}, {"category": "ssh"}, {"category": "zzz"}]
    assert list(category_counts(examples).items()) == [("selinux", 1), ("ssh", 2), ("zzz", 1)]


# --- duplicates --------------------------------------------------------------------------------

def test_no_exact_duplicates():
    examples = _examples(1500, 0)
    rows = {tuple(example.values()) for example in examples}
    assert len(rows) == len(examples)
    assert len({example["instruction"] for example in examples}) == len(examples)


def test_near_duplicate_rate_is_low_and_fast():
    examples = list(_examples(1500, 0))
    start = time.perf_counter()
    rate = near_duplicate_rate(examples)
    elapsed = time.perf_counter() - start
    assert rate < 0.01
    assert elapsed < 5.0


def test_near_duplicate_rate_detects_duplicates():
    base = "How do I open port 8080/tcp permanently in firewalld on my Fedora server today"
    examples = [
        {"instruction": base, "input": ""},
        {"instruction": base, "input": ""},  # exact duplicate
        {"instruction": base + " please", "input": ""},  # 13 of 14 shingles shared: near duplicate
        {"instruction": "Which SELinux boolean lets httpd connect to a remote database?", "input": ""},
    ]
    assert near_duplicate_rate(examples) == pytest.approx(0.5)
    assert near_duplicate_rate([]) == 0.0
    assert near_duplicate_rate(examples[3:]) == 0.0


# --- answer convention and lengths ----------------------------------------------------------------

def test_command_appears_verbatim_on_a_command_line():
    for example in big_sample():
        command_lines = extract_commands(example["output"])
        assert command_lines, example
        assert example["command"] in example["output"]
        assert any(example["command"] in line for line in command_lines), example


def test_extract_commands_reads_both_prefixes():
    output = "Do this:\n$ sudo dnf install htop\nand in Python:\n>>> import torch\n$x is not a command"
    assert extract_commands(output) == ["sudo dnf install htop", "import torch"]


def test_no_unfilled_placeholders():
    for example in big_sample():
        for key in ("instruction", "input", "output", "command"):
            assert not PLACEHOLDER.search(example[key]), (key, example)


def test_instruction_and_answer_lengths():
    examples = _examples(1500, 0)
    for example in examples:
        assert 8 <= len(example["instruction"].split()) <= 40, example["instruction"]
    answer_words = [len(example["output"].split()) for example in examples]
    assert min(answer_words) >= 15 and max(answer_words) <= 160
    typical = sum(30 <= words <= 120 for words in answer_words) / len(answer_words)
    assert typical >= 0.85


def test_diverse_question_forms_and_multi_step_answers():
    examples = _examples(1500, 0)
    openings = Counter(" ".join(example["instruction"].split()[:2]) for example in examples)
    assert len(openings) >= 40
    assert openings.most_common(1)[0][1] / len(examples) < 0.15
    multi_step = sum(len(extract_commands(example["output"])) >= 2 for example in examples)
    assert multi_step / len(examples) >= 0.4
    with_input = sum(bool(example["input"]) for example in examples)
    assert 0 < with_input / len(examples) < 0.2  # input is usually empty, but not always


def test_every_question_determines_the_reference_command():
    # "Does the reference command appear in the answer?" is only fair if the question names every
    # slot value the command uses: {port} in the command needs the port in the question. A dict
    # slot counts as named when any of its keys is used (a service name fixes its SELinux type);
    # a slot with a single value is a fixed convention.
    problems = []
    for tasks in synth.TASKS_BY_CATEGORY.values():
        for topic_task in tasks:
            fixed, groups = set(), []
            for name, values in topic_task.slots:
                keys = set()
                for value in values:
                    keys |= set(value) if isinstance(value, dict) else {name}
                groups.append(keys)
                if len(values) == 1:
                    fixed |= keys
            needed = set(PLACEHOLDER.findall(topic_task.command))
            templates = list(topic_task.goals) + [q + " " + i for q, i in topic_task.questions]
            for template in templates:
                named = {p[1:-1] for p in PLACEHOLDER.findall(template)}
                known = named | fixed
                for keys in groups:
                    if keys & named:
                        known |= keys
                missing = {p[1:-1] for p in needed} - known
                if missing:
                    problems.append((topic_task.key, sorted(missing), template))
    assert problems == []


# --- spot checks of command correctness -----------------------------------------------------------

def test_firewall_ports_have_protocol_and_permanent_rules_are_reloaded():
    seen_add_port = 0
    for example in big_sample():
        output = example["output"]
        for port_spec in re.findall(r"--add-port=(\S+)", output):
            seen_add_port += 1
            assert re.fullmatch(r"\d+(-\d+)?/(tcp|udp)", port_spec), output
        for line in _shell_lines(example):
            if "firewall-cmd --permanent" in line:
                rest = output[output.index(line):]
                assert "firewall-cmd --reload" in rest, output
    assert seen_add_port > 20


JOURNALCTL_FLAGS = {"-u", "-f", "-n", "-p", "-b", "-e", "-k", "-g", "-o", "-t", "-x", "--since",
                    "--until", "--no-pager", "--disk-usage", "--vacuum-size", "--vacuum-time",
                    "--list-boots", "--user"}
JOURNALCTL_VALUE_FLAGS = {"-u", "-n", "-p", "-g", "-o", "-t", "--since", "--until"}


def _journalctl_flags(text_after: str) -> list[str]:
    """Flags of one journalctl invocation, read until the first token that is not a flag/value."""
    segment = text_after.split("|")[0]
    try:
        tokens = shlex.split(segment)
    except ValueError:  # prose with an apostrophe
        tokens = segment.split()
    flags, index = [], 0
    while index < len(tokens) and tokens[index].startswith("-"):
        flag = tokens[index].rstrip(".,;").split("=")[0]
        flags.append(flag)
        index += 1
        if flag in JOURNALCTL_VALUE_FLAGS:
            index += 1
        elif flag == "-b" and index < len(tokens) and re.fullmatch(r"-?\d+", tokens[index]):
            index += 1
    return flags


def test_journalctl_uses_real_flags_only():
    checked = 0
    for example in big_sample():
        for match in re.finditer(r"\bjournalctl\b", example["output"]):
            line_rest = example["output"][match.end():].split("\n")[0]
            for flag in _journalctl_flags(line_rest):
                checked += 1
                assert flag in JOURNALCTL_FLAGS, (flag, example["output"])
    assert checked > 100


def test_journalctl_flag_parser_rejects_fake_flags():
    assert _journalctl_flags(' -u nginx --since "1 hour ago" -p err') == ["-u", "--since", "-p"]
    assert _journalctl_flags(" --last-hour nginx") == ["--last-hour"]
    assert "--last-hour" not in JOURNALCTL_FLAGS


def test_selinux_fcontext_rules_are_persistent_and_applied():
    checked = 0
    for example in big_sample():
        for path in re.findall(r'semanage fcontext -a -t \w+ "([^"(]+)\(/\.\*\)\?"', example["output"]):
            checked += 1
            assert f"restorecon -Rv {path}" in example["output"]
        assert "chcon -t" not in example["output"]
    assert checked > 10


def test_subcommands_are_real():
    allowed = {
        "rpm-ostree": {"status", "install", "uninstall", "upgrade", "rollback", "rebase", "kargs",
                       "override", "cleanup", "db", "reset"},
        "bootc": {"status", "upgrade", "switch", "rollback", "container"},
        "dnf": {"install", "search", "provides", "upgrade", "history", "copr", "info",
                "system-upgrade", "repoquery", "versionlock", "clean"},
        "systemctl": {"enable", "start", "restart", "status", "reload", "edit", "mask", "unmask",
                      "set-property", "show", "daemon-reload", "disable", "is-enabled",
                      "list-timers", "reset-failed", "--failed", "reboot"},
    }
    seen = Counter()
    for example in big_sample():
        for line in _shell_lines(example):
            for segment in re.split(r"\||&&", line):
                words = [w for w in segment.split() if w != "sudo"]
                if not words or words[0] not in allowed:
                    continue
                args = [w for w in words[1:] if w not in ("--user",)]
                assert args and args[0] in allowed[words[0]], line
                seen[words[0]] += 1
    assert all(seen[tool] > 0 for tool in allowed), seen


def test_gpu_tool_flags_are_real():
    nvidia_fields = {"name", "index", "uuid", "memory.used", "memory.total", "memory.free",
                     "utilization.gpu", "temperature.gpu", "power.draw", "power.limit", "driver_version"}
    rocm_smi_flags = {"--showmeminfo", "--showtemp", "--showpower", "--showuse", "--showfan",
                      "--showclocks", "--showpids", "--showproductname", "--showdriverversion",
                      "--showmemuse", "-d"}
    for example in big_sample():
        output = example["output"]
        for fields in re.findall(r"--query-gpu=(\S+)", output):
            assert set(fields.split(",")) <= nvidia_fields, output
            assert "--format=csv" in output
        for line in _shell_lines(example):
            if line.startswith("rocm-smi") or line.startswith("watch -n 1 rocm-smi"):
                flags = {w for w in line.split() if w.startswith("-") and w not in ("-n",)}
                assert flags <= rocm_smi_flags, line
            for device in re.findall(r"--device[ =](\S+)", line):
                assert re.fullmatch(r"nvidia\.com/gpu=(all|\d+)|/dev/kfd|/dev/dri(/renderD\d+)?", device), line


def test_llm_server_flags_are_real():
    llama_flags = {"-m", "-hf", "--port", "--host", "-ngl", "-c", "-np", "--api-key"}
    vllm_flags = {"--port", "--tensor-parallel-size", "--gpu-memory-utilization", "--max-model-len",
                  "--enable-lora", "--lora-modules", "--max-lora-rank", "--dtype",
                  "--served-model-name", "--api-key", "--quantization"}
    for example in big_sample():
        for line in _shell_lines(example):
            if line.startswith("llama-server "):
                assert {w for w in line.split() if w.startswith("-")} <= llama_flags, line
                assert " -m " in line or " -hf " in line
            if line.startswith("vllm serve "):
                assert {w for w in line.split() if w.startswith("-")} <= vllm_flags, line


def test_no_shell_typos():
    for example in big_sample():
        output = example["output"]
        assert "sudo sudo" not in output and "$ $" not in output
        assert "\n\n\n" not in output
        assert output == output.strip()


# --- shipped dataset ----------------------------------------------------------------------------

def test_shipped_files_match_the_generator_byte_for_byte(tmp_path):
    written = write_default_dataset(tmp_path / "out")
    assert set(written) == {"train", "heldout", "readme"}
    for name in ("train.jsonl", "heldout.jsonl", "README.md"):
        assert (tmp_path / "out" / name).read_bytes() == (SHIPPED_DIR / name).read_bytes(), name


def _read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    for line, record in zip(lines, records):
        assert list(record) == list(DATASET_KEYS)
        assert json.dumps(record, ensure_ascii=False) == line  # compact, not ASCII-escaped
    return records


def test_shipped_split_sizes_and_stratification():
    train = _read_jsonl(SHIPPED_DIR / "train.jsonl")
    heldout = _read_jsonl(SHIPPED_DIR / "heldout.jsonl")
    assert len(train) == 360 and len(heldout) == 40
    heldout_counts = category_counts(heldout)
    assert set(heldout_counts) == set(CATEGORIES)
    assert set(heldout_counts.values()) <= {1, 2}  # 40 over 25 categories: as even as possible
    assert category_counts(train + heldout) == category_counts([e for e, _ in synth.default_records()])


def test_readme_documents_the_one_liner():
    readme = (SHIPPED_DIR / "README.md").read_text(encoding="utf-8")
    assert ("python -c \"from hivetune.data.synth import write_default_dataset; "
            "write_default_dataset('src/hivetune/data/default')\"") in readme


def test_heldout_is_new_but_answerable_from_train():
    train = _read_jsonl(SHIPPED_DIR / "train.jsonl")
    heldout = _read_jsonl(SHIPPED_DIR / "heldout.jsonl")
    train_instructions = {example["instruction"] for example in train}
    assert not train_instructions & {example["instruction"] for example in heldout}
    assert near_duplicate_rate(train + heldout) == 0.0
    # Every held-out example asks a task that train teaches several times (the default run
    # learns a task's command from its train examples: one or two were too few).
    records = synth.default_records()
    split_train, split_heldout = synth._split_stratified(records, synth.DEFAULT_HELDOUT)
    assert split_train == train and split_heldout == heldout
    task_of = {example["instruction"]: task_key for example, task_key in records}
    train_per_task = Counter(task_of[example["instruction"]] for example in train)
    assert len(train_per_task) == synth.DEFAULT_TASKS_PER_CATEGORY * len(CATEGORIES)
    for example in heldout:
        assert train_per_task[task_of[example["instruction"]]] >= 4, example["instruction"]
    # The README's count of held-out commands that train also contains verbatim is the real one.
    same = sum(e["command"] in {t["command"] for t in train} for e in heldout)
    readme = (SHIPPED_DIR / "README.md").read_text(encoding="utf-8")
    assert f"{same} of its {len(heldout)} reference commands also occur verbatim in train" in " ".join(readme.split())
    assert 0 < same < len(heldout)  # some held-out questions need arguments train never used


def test_shipped_answers_are_brief_and_start_with_the_command():
    for example in _read_jsonl(SHIPPED_DIR / "train.jsonl") + _read_jsonl(SHIPPED_DIR / "heldout.jsonl"):
        lines = example["output"].splitlines()
        assert 1 <= len(lines) <= 2, example["output"]
        assert lines[0].startswith(("$ ", ">>> ")) and example["command"] in lines[0], example["output"]
        assert len(lines) == 1 or not lines[1].startswith(("$ ", ">>> ")), example["output"]
        assert not PLACEHOLDER.search(example["output"]), example["output"]


def test_brief_answer_puts_the_command_first_and_keeps_one_sentence():
    answer = ("Check the free space first:\n$ sudo vgs data\nThen extend it; -r resizes the filesystem too:\n"
              "$ sudo lvextend -r -l +100%FREE /dev/data/root\nConfirm with df -h. It takes a second.")
    # The first prose sentence, its colon made a full stop; "Check the..." has 5 words.
    assert synth.brief_answer(answer, "lvextend -r -l +100%FREE /dev/data/root") == (
        "$ sudo lvextend -r -l +100%FREE /dev/data/root\nCheck the free space first.")
    # Step numbers go; short lead-ins ("Verify it:") and connectives do not count as sentences.
    assert synth.brief_answer("1. Verify it:\n$ getenforce\nand back with setenforce 1. SELinux is on or off.",
                              "getenforce") == "$ getenforce\nSELinux is on or off."
    # A line in lower case continues the command only right after it; indented lines are file content.
    assert synth.brief_answer("$ free -h\nshows memory in human units.", "free -h") == (
        "$ free -h\nshows memory in human units.")
    assert synth.brief_answer("$ ls\n$ free -h\nshows memory in human units.", "ls") == "$ ls"
    assert synth.brief_answer("$ cat unit\n    ExecStart=/usr/bin/long running server here.", "cat unit") == "$ cat unit"
    # e.g. does not end a sentence.
    assert synth.brief_answer(">>> f()\nPass a flag, e.g. --fast, to skip the slow checks. More text.", "f()") == (
        ">>> f()\nPass a flag, e.g. --fast, to skip the slow checks.")


def test_brief_templates_start_with_the_command():
    briefs = [t for tasks in synth.TASKS_BY_CATEGORY.values() for t in tasks if t.brief]
    assert briefs  # the shipped tasks whose derived brief answer read badly
    for topic_task in briefs:
        first = topic_task.brief.splitlines()[0]
        assert first.startswith(("$ ", ">>> ")) and topic_task.command in first, topic_task.key
