"""`hivetune data` end to end: synth, validate, stats, split, collect, on small constructed files
with exact expected values, plus one ~30 MB file to show the scans run in bounded memory."""

from __future__ import annotations

import copy
import json
import random
import sys
import tracemalloc
from collections import Counter

import pytest

from conftest import write_jsonl
from hivetune.cli import main
from hivetune.data import dedupe, synth
from hivetune.data.dedupe import FirstSeen, NearDuplicateIndex
from hivetune.data.formats import encode_record
from hivetune.data.scan import DEFAULT_MAX_LENGTH, exact_key, token_lengths
from hivetune.data.split import split_file, stratified_quotas
from hivetune.data.stats import data_stats, percentile
from hivetune.data.synth import near_duplicate_rate, synthesize
from hivetune.data.validate import validate_file
from hivetune.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["data", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def alpaca(instruction: str, output: str = "Run `systemctl restart nginx` as root.", **extra) -> dict:
    return {"instruction": instruction, "input": "", "output": output, **extra}


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- synth -----------------------------------------------------------------------------------

def test_synth_writes_synthesize_output_refuses_existing_and_reports_mix(tmp_path, capsys):
    out = tmp_path / "ops.jsonl"
    code, text, _ = run(capsys, "synth", "--n", 50, "--seed", 3, "--out", out)
    assert code == 0
    assert lines_of(out) == synthesize(50, 3)
    assert "wrote 50 examples" in text
    assert "  selinux                2    4.0%" in text  # 50 over 25 categories: 2 each
    assert "near-duplicate rate (instruction+input word 3-gram Jaccard >= 0.8): 0.00%" in text

    out.write_text("keep me\n")
    code, _, err = run(capsys, "synth", "--n", 10, "--out", out)
    assert code == 2 and err == f"hivetune: error: --out: {out} already exists (pass --force to overwrite it)\n"
    assert out.read_text() == "keep me\n"
    assert run(capsys, "synth", "--n", 10, "--out", out, "--force")[0] == 0
    assert lines_of(out) == synthesize(10, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["ops.jsonl"]  # no temp file left behind


# ---- validate --------------------------------------------------------------------------------

# Thirteen words: 11 word 3-grams. Changing the last word keeps 10 of them: Jaccard 10/12 = 0.83.
NEAR = "how do i make the nginx service restart by itself after it crashes"


def problem_file(tmp_path):
    rows = [
        json.dumps(alpaca("How do I list the block devices on this machine?", "Run `lsblk`.")),  # 1 ok
        '{"instruction": "broken", ',  # 2 malformed JSON
        "",  # 3 blank: skipped
        "[1, 2]",  # 4 not an object
        json.dumps({"instruction": "Where is the output?", "input": ""}),  # 5 missing output
        json.dumps(alpaca("How do I check disk usage?", "   ")),  # 6 empty output
        json.dumps(alpaca("How do I check   disk usage per folder?", "Run `du -sh *`.")),  # 7 ok
        json.dumps(alpaca("How do I check disk usage per folder?", "Run `du -sh *`. ")),  # 8 dup of 7
        json.dumps(alpaca(NEAR, "Set Restart=on-failure.")),  # 9 ok
        json.dumps(alpaca(NEAR.replace("crashes", "fails"), "Use a drop-in.")),  # 10 near dup of 9
        json.dumps(alpaca("how do i make the nginx service start at boot", "Run `systemctl enable nginx`.")),
        json.dumps({"instruction": 7, "output": "x"}),  # 12 wrong type
        json.dumps({"prompt": "what format is this?"}),  # 13 unknown format
    ]
    return write_text(tmp_path / "data.jsonl", "\n".join(rows) + "\n")


def write_text(path, text):
    path.write_text(text)
    return path


def test_validate_reports_every_problem_with_file_line_and_exits_1(tmp_path, capsys):
    path = problem_file(tmp_path)
    report = validate_file(path)
    assert report.records == 12 and report.format == "alpaca"
    assert report.counts == {"schema": 5, "empty": 1, "duplicate": 1, "near_duplicate": 1, "too_long": 0}
    assert report.listed["schema"] == [
        f"{path}:2: malformed JSON (Expecting property name enclosed in double quotes at column 27)",
        f"{path}:4: expected a JSON object, got array",
        f"{path}:5: missing field 'output' for alpaca format",
        f"{path}:12: field 'instruction' must be a string, got number",
        f"{path}:13: missing field 'instruction' for alpaca format",
    ]
    assert report.listed["empty"] == [f"{path}:6: empty output"]
    assert report.listed["duplicate"] == [f"{path}:8: duplicate of line 7"]
    assert report.listed["near_duplicate"] == [f"{path}:10: prompt is a near duplicate of line 9's (similarity 0.83)"]

    code, text, _ = run(capsys, "validate", path)
    assert code == 1
    assert f"  schema errors: 5\n    {path}:2: malformed JSON" in text
    assert "  token lengths: not checked (give --model or --max-length)" in text
    assert text.rstrip().endswith("8 problems")


def test_validate_unknown_format_line_is_a_schema_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}, alpaca("How do I list the block devices here?")])
    report = validate_file(path)
    assert report.listed["schema"] == [f"{path}:1: cannot tell the format (expected 'messages', 'instruction'+"
                                       "'output' or 'text'); set --format to one of alpaca, chat, text, or name "
                                       "the record's columns ('prompt') with --columns"]
    assert report.format == "alpaca" and report.problems == 1


def test_validate_clean_file_exits_0(tmp_path, capsys):
    path = write_jsonl(tmp_path / "ops.jsonl", synthesize(60, 0))
    code, text, _ = run(capsys, "validate", path)
    assert code == 0 and text.rstrip().endswith("clean")
    assert "60 records, format alpaca" in text


def test_validate_lists_20_per_kind_and_counts_all(tmp_path, capsys):
    path = write_text(tmp_path / "bad.jsonl", "{nope\n" * 30 + json.dumps(alpaca("How do I list devices?")) + "\n")
    report = validate_file(path)
    assert report.counts["schema"] == 30 and len(report.listed["schema"]) == 20
    assert report.listed["schema"][-1].startswith(f"{path}:20: malformed JSON")
    code, text, _ = run(capsys, "validate", path)
    assert code == 1 and "    ... and 10 more" in text


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "missing.jsonl: data file not found"),
    (["."], "empty.jsonl: data file is empty"),  # a folder: each of its data files
    (["empty.jsonl"], "empty.jsonl: data file is empty"),
    (["ok.jsonl", "--format", "yaml"], "--format: expected auto, alpaca, chat, text; got 'yaml'"),
    (["ok.jsonl", "--max-length", "0"], "--max-length: must be > 0, got 0"),
    (["ok.jsonl", "--model", "no-such-model"], "no-such-model: model path not found"),
])
def test_validate_unusable_input_is_one_line_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    write_jsonl(tmp_path / "ok.jsonl", [alpaca("How do I list the block devices here?")])
    code, text, err = run(capsys, "validate", *args)
    assert code == 2 and text == "" and err == f"hivetune: error: {message}\n"


def test_validate_too_long_matches_encode_record(tmp_path, tiny_model_dir, tok, capsys):
    records = synthesize(40, 1)
    path = write_jsonl(tmp_path / "ops.jsonl", records)
    lengths = sorted(len(encode_record(r, "alpaca", tok, 10**9, False).ids) for r in records)
    limit = lengths[29]
    expected = sum(n > limit for n in lengths)
    assert 0 < expected <= 10
    report = validate_file(path, str(tiny_model_dir), limit)
    assert report.counts["too_long"] == expected and report.problems == expected
    code, text, _ = run(capsys, "validate", path, "--model", tiny_model_dir, "--max-length", limit)
    assert code == 1 and f"longer than max_length {limit} with {tiny_model_dir}: {expected}" in text


def test_default_max_length_is_the_training_default():
    from hivetune.core.config import TrainConfig

    assert DEFAULT_MAX_LENGTH == TrainConfig.max_length


# ---- duplicates ------------------------------------------------------------------------------

def test_exact_key_normalises_whitespace_and_unicode_not_case():
    a = alpaca("How do I  list\tdevices?", "Run `lsblk`.")
    assert exact_key(a, "alpaca") == exact_key(alpaca(" How do I list devices? ", "Run\u00a0`lsblk`."), "alpaca")
    assert exact_key(a, "alpaca") != exact_key(alpaca("how do I list devices?", "Run `lsblk`."), "alpaca")
    assert exact_key(a, "alpaca") != exact_key({**a, "input": "sda"}, "alpaca")


def test_near_duplicates_agree_with_synth_measure():
    """Every near duplicate synth's all-pairs measure finds, the bounded index finds too."""
    examples = synthesize(300, 2)
    rng = random.Random(0)
    for i in rng.sample(range(300), 40):  # near copies: drop or swap a word of the instruction
        words = examples[i]["instruction"].split()
        j = rng.randrange(len(words))
        words[j:j + 1] = [] if rng.random() < 0.5 else ["really"]
        examples.append({**examples[i], "instruction": " ".join(words), "output": f"answer {i}"})
    oracle = synth._NearDuplicateIndex()
    expected = []
    for e in examples:
        shingles = synth._shingles(f"{e['instruction']}\n{e['input']}")
        expected.append(oracle.is_near_duplicate(shingles))
        oracle.add(shingles)
    index = NearDuplicateIndex()
    found = [index.check_and_add(f"{e['instruction']}\n{e['input']}", n) is not None for n, e in enumerate(examples)]
    assert found == expected
    assert sum(found) == round(near_duplicate_rate(examples) * len(examples)) == 11  # of the 40 copies


def test_near_duplicate_window_forgets_old_prompts():
    index = NearDuplicateIndex(window=4)
    prompt = "how do i make the nginx service restart by itself after it crashes"
    assert index.check_and_add(prompt, 1) is None
    for n in range(2, 6):  # four unrelated prompts push line 1 out of the window
        assert index.check_and_add(f"unrelated question number {n} about {n * 'x'} storage", n) is None
    assert index.check_and_add(prompt, 6) is None
    assert index.check_and_add(prompt + " again", 7) == (6, pytest.approx(11 / 12))


def test_first_seen_across_merges(monkeypatch):
    monkeypatch.setattr(dedupe, "_MERGE_EVERY", 4)
    seen = FirstSeen()
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(3)] + [2**64 - 1, 0, 17]
    for line, key in enumerate(keys * 3, start=1):
        earlier = seen.add(key, line)
        assert earlier == (None if line <= len(keys) else (line - 1) % len(keys) + 1)
    assert len(seen) == len(keys)


# ---- token lengths and stats -----------------------------------------------------------------

def test_token_lengths_match_encode_record_for_every_format(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List GPUs?"},
                         {"role": "assistant", "content": "Run `nvidia-smi -L`."},
                         {"role": "user", "content": "And on ROCm? ünïcødé"},
                         {"role": "assistant", "content": "Run `rocm-smi`. 日本語"}]}
    cases = [(synthesize(30, 4), "alpaca"), ([chat] * 3, "chat"),
             ([{"text": r["output"]} for r in synthesize(10, 5)], "text")]
    for tokenizer in (tok, plain):
        for records, fmt in cases:
            expected = []
            for r in records:
                enc = encode_record(r, fmt, tokenizer, 10**9, train_on_inputs=False)
                expected.append((len(enc.ids) - sum(enc.mask), sum(enc.mask)))
            assert token_lengths(records, fmt, tokenizer) == expected


def test_percentile_is_nearest_rank():
    counts = Counter({1: 1, 2: 1, 3: 1, 4: 1})
    assert [percentile(counts, q) for q in (25, 50, 51, 75, 99, 100)] == [1, 2, 3, 3, 4, 4]
    assert percentile(Counter(), 50) == 0


def test_stats_exact_values_on_constructed_file(tmp_path, tiny_model_dir, tok, capsys):
    # " a" * k is k tokens with the tiny tokenizer, plus the end-of-sequence token: totals 2..101.
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": " a" * k} for k in range(1, 101)])
    assert len(encode_record({"text": " a" * 37}, "text", tok, 10**9, False).ids) == 38
    stats = data_stats(path, str(tiny_model_dir), max_length=90)
    assert stats.examples == 100
    assert stats.summary(stats.total) == {"p50": 51, "p90": 91, "p95": 96, "p99": 100, "max": 101, "mean": 51.5}
    assert stats.summary(stats.prompt)["max"] == 0
    assert stats.covering_99 == 100
    assert stats.truncated == 11  # totals 91..101
    assert stats.tokens_per_epoch == sum(range(2, 91)) + 11 * 90 == 5084
    # Batches of 8 in order, longest truncated to 90: 8*(9+17+...+89) + 8*90 + 4*90.
    assert stats.padded_tokens == 8 * sum(range(9, 90, 8)) + 8 * 90 + 4 * 90 == 5392
    assert stats.packed_tokens == 5084

    code, text, _ = run(capsys, "stats", path, "--model", tiny_model_dir, "--max-length", 90)
    assert code == 0
    assert "total            51       91       96      100      101     51.5" in text
    assert "max_length covering 99% of examples: 100" in text
    assert "tokens per epoch (truncated to max_length): 5,084" in text
    assert "5,392 tokens padded vs 5,084 packed; packing saves 308 (5.7%)" in text
    # Bins of width ceil(102 / 12) = 9: totals 2..8 (7 examples) in the first, 9 in the fullest.
    assert f"  {0:>7}-{8:<7} {'#' * 32:<40} 7\n  {9:>7}-{17:<7} {'#' * 40} 9\n" in text


def test_stats_png_or_clear_note(tmp_path, tiny_model_dir, monkeypatch, capsys):
    path = write_jsonl(tmp_path / "ops.jsonl", synthesize(20, 0))
    png = tmp_path / "lengths.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, text, _ = run(capsys, "stats", path, "--model", tiny_model_dir, "--png", png)
    assert code == 0 and not png.exists()
    assert "histogram PNG skipped: matplotlib is not installed (pip install 'hivetune[plots]')" in text


def test_stats_png_with_matplotlib(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("matplotlib")
    path = write_jsonl(tmp_path / "ops.jsonl", synthesize(20, 0))
    png = tmp_path / "lengths.png"
    assert run(capsys, "stats", path, "--model", tiny_model_dir, "--png", png)[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_stops_at_first_bad_record_with_file_line(tmp_path, tiny_model_dir, capsys):
    path = write_text(tmp_path / "d.jsonl", json.dumps(alpaca("How do I list block devices?")) + "\n{oops\n")
    code, text, err = run(capsys, "stats", path, "--model", tiny_model_dir)
    assert code == 2 and err.startswith(f"hivetune: error: {path}:2: malformed JSON")


def test_validate_and_stats_stream_30mb_in_bounded_memory(tmp_path, tiny_model_dir, tok):
    """A ~30 MB file, scanned with tracemalloc on: the peak stays far below the file's size.

    Each line carries 30 kB in a field training ignores, so the file is large while only ~3 MB is
    tokenised (the tiny tokenizer runs at ~1 MB/s here, and tracemalloc slows Python ~5x)."""
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
             for _ in range(3000)]
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(1000):
            instruction = f"question {i}: " + " ".join(rng.choice(vocab) for _ in range(16))
            output = " ".join(rng.choice(vocab[:200]) for _ in range(60))
            f.write(json.dumps(alpaca(instruction, output, meta="x" * 30_000)) + "\n")
    size = path.stat().st_size
    assert 30e6 < size < 31e6
    bound = 50 * 2**20
    for scan in (lambda: validate_file(path), lambda: data_stats(path, str(tiny_model_dir), 4096)):
        tracemalloc.start()
        try:
            result = scan()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert getattr(result, "records", None) == 1000 or result.examples == 1000
        assert peak < bound, f"peak {peak / 2**20:.1f} MiB"
        assert peak < size / 2


# ---- split -----------------------------------------------------------------------------------

def category_file(tmp_path, sizes: dict) -> tuple:
    records = []
    for category, n in sizes.items():
        for i in range(n):
            extra = {} if category is None else {"category": category}
            records.append(alpaca(f"question {i} about {category}", f"answer {i}", **extra))
    random.Random(5).shuffle(records)
    return write_jsonl(tmp_path / "all.jsonl", records), records


def test_split_stratified_counts_deterministic_and_lossless(tmp_path, capsys):
    path, records = category_file(tmp_path, {"a": 7, "b": 7, "c": 6})
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    code, text, _ = run(capsys, "split", path, "--heldout", 0.25, "--seed", 0,
                        "--out-train", train, "--out-heldout", heldout)
    assert code == 0
    # 5 held out: exact shares 1.75 / 1.75 / 1.5 -> floors 1 / 1 / 1, the two leftovers to a and b.
    assert Counter(r["category"] for r in lines_of(heldout)) == {"a": 2, "b": 2, "c": 1}
    assert Counter(r["category"] for r in lines_of(train)) == {"a": 5, "b": 5, "c": 5}
    assert "  a              5         2" in text
    # Every line lands in exactly one output, byte for byte, in file order.
    source = path.read_text().splitlines(keepends=True)
    out_train, out_heldout = train.read_text().splitlines(True), heldout.read_text().splitlines(True)
    assert sorted(out_train + out_heldout) == sorted(source)
    assert out_train == [line for line in source if line in set(out_train)]
    first = heldout.read_bytes()

    code, _, err = run(capsys, "split", path, "--out-train", train, "--out-heldout", heldout)
    assert code == 2 and "already exists (pass --force" in err
    split_file(path, 0.25, 0, train, heldout, force=True)
    assert heldout.read_bytes() == first
    split_file(path, 0.25, 1, train, heldout, force=True)
    assert heldout.read_bytes() != first  # another seed, another choice
    assert Counter(r["category"] for r in lines_of(heldout)) == {"a": 2, "b": 2, "c": 1}


def test_split_uncategorised_stratum_and_count(tmp_path):
    path, _ = category_file(tmp_path, {"x": 50, "y": 30, None: 20})
    result = split_file(path, 10, 0, tmp_path / "t.jsonl", tmp_path / "h.jsonl")
    assert result.heldout_counts == {"(none)": 2, "x": 5, "y": 3}
    assert result.train_counts == {"(none)": 18, "x": 45, "y": 27}
    assert stratified_quotas({"p": 1, "q": 1, "r": 1}, 2) == {"p": 1, "q": 1, "r": 0}


@pytest.mark.parametrize("heldout, message", [
    (0, "--heldout: expected a fraction in (0, 1) or a whole count >= 1, got 0"),
    (2.5, "--heldout: expected a fraction in (0, 1) or a whole count >= 1, got 2.5"),
    (0.01, "--heldout: 0.01 of 20 records rounds to none; use a larger fraction or a count"),
    (20, "--heldout: 20 held-out records would leave none of the 20 for training"),
])
def test_split_bad_heldout(heldout, message, tmp_path, capsys):
    path, _ = category_file(tmp_path, {"a": 20})
    code, _, err = run(capsys, "split", path, "--heldout", heldout, "--out-train", tmp_path / "t.jsonl",
                       "--out-heldout", tmp_path / "h.jsonl")
    assert code == 2 and err == f"hivetune: error: {message}\n"
    assert not (tmp_path / "t.jsonl").exists()


# ---- collect ---------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are an ops assistant."}


def chat(question, answer, system=False):
    return [SYSTEM] * system + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def log_lines() -> list[str]:
    entries = [
        {"messages": chat("How do I list GPUs?", "Run `nvidia-smi -L`.", system=True)},  # 1 added
        {"request": {"model": "m", "messages": chat("Show disk usage?", "")[:1]},  # 2 added
         "response": {"choices": [{"message": {"role": "assistant", "content": "Run `df -h`."}}]}},
        {"prompt": "Restart nginx?", "content": "Run `systemctl restart nginx`."},  # 3 added
        {"conversations": [{"from": "human", "value": "Check SELinux mode?"},  # 4 added
                           {"from": "gpt", "value": "Run `getenforce`."}]},
        {"transcript": "User: Reload sysctl?\nAssistant: Run\n`sysctl --system`."},  # 5 added
        chat("Free memory?", "Run `free -h`."),  # 6 added: a bare list of messages
        {"messages": chat("How do I list GPUs?", "Run  `nvidia-smi -L`.", system=True)},  # 7 dup of 1
        {"prompt": "Existing question?", "content": "Existing answer."},  # 8 dup of FILE
        {"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "{}"}]},  # 9
        {"messages": chat("No reply?", "")[:1]},  # 10 invalid: no assistant reply
        {"prompt": "Empty reply?", "content": "  "},  # 11 invalid: empty
        {"event": "heartbeat"},  # 13 invalid: not an interaction
        {"messages": chat("Q1?", "A1.") + chat("Q2?", "A2.")},  # 14 added (multi-turn)
        {"request": {"prompt": "Uptime?"}, "response": {"content": "Run `uptime`."}},  # 15 added
        {"messages": chat("Kernel?", "")[:1], "choices": [{"message": {"content": [  # 16 added
            {"type": "text", "text": "Run "}, {"type": "text", "text": "`uname -r`."}]}}]},
    ]
    lines = [json.dumps(e) for e in entries]
    lines.insert(11, "{truncated")  # line 12: malformed JSON
    return lines


def test_collect_appends_new_valid_pairs_and_counts_skips(tmp_path, capsys):
    out = tmp_path / "chats.jsonl"
    existing = {"messages": chat("Existing question?", "Existing answer.")}
    out.write_text(json.dumps(existing))  # no trailing newline: collect adds one
    log = write_text(tmp_path / "server.log.jsonl", "\n".join(log_lines()) + "\n\n")
    code, text, _ = run(capsys, "collect", log, "--out", out)
    assert code == 0
    assert "  added: 9\n  skipped, duplicate: 2\n  skipped, invalid: 5\n" in text
    assert f"    {log}:9: messages[1] has role 'tool' (tool and function turns are not collected)" in text
    assert f"    {log}:10: no assistant reply" in text
    assert f"    {log}:11: empty messages[1].content" in text
    assert f"    {log}:12: malformed JSON" in text
    assert f"    {log}:13: not a recognised interaction" in text
    assert [r["messages"] for r in lines_of(out)] == [
        existing["messages"], chat("How do I list GPUs?", "Run `nvidia-smi -L`.", system=True),
        chat("Show disk usage?", "Run `df -h`."), chat("Restart nginx?", "Run `systemctl restart nginx`."),
        chat("Check SELinux mode?", "Run `getenforce`."), chat("Reload sysctl?", "Run\n`sysctl --system`."),
        chat("Free memory?", "Run `free -h`."), chat("Q1?", "A1.") + chat("Q2?", "A2."),
        chat("Uptime?", "Run `uptime`."), chat("Kernel?", "Run `uname -r`.")]
    assert validate_file(out).problems == 0

    before = out.read_bytes()
    code, text, _ = run(capsys, "collect", log, "--out", out)  # everything is already there
    assert code == 0 and "  added: 0\n  skipped, duplicate: 11\n" in text
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "server.log.jsonl"]


def test_collect_skips_hostile_message_arrays_with_the_data_tools_messages(tmp_path, capsys):
    """A log line holding a bare message array is decoded as the data tools decode JSONL lines
    (formats.parse_json_line): nesting 3,000 deep and a 5,000-digit integer are skipped as
    malformed JSON, where json.loads raised RecursionError / ValueError through the CLI."""
    lines = ["[" * 3000 + "]" * 3000, "[" + "9" * 5000 + "]", '[{"role": "user"',  # cut after 16 characters
             json.dumps(chat("Uptime?", "Run `uptime`."))]
    log = write_text(tmp_path / "log.jsonl", "\n".join(lines) + "\n")
    out = tmp_path / "chats.jsonl"
    code, text, _ = run(capsys, "collect", log, "--out", out)
    assert code == 0 and "  added: 1\n  skipped, duplicate: 0\n  skipped, invalid: 3\n" in text
    assert f"    {log}:1: malformed JSON (nested too deeply)" in text
    assert f"    {log}:2: malformed JSON (Exceeds the limit (4300 digits) for integer string conversion" in text
    assert f"    {log}:3: malformed JSON (Expecting ',' delimiter at column 17)" in text
    assert [r["messages"] for r in lines_of(out)] == [chat("Uptime?", "Run `uptime`.")]


def test_collect_into_alpaca_file_takes_single_turns(tmp_path, capsys):
    out = write_jsonl(tmp_path / "train.jsonl", [alpaca("Existing question?", "Existing answer.")])
    log = write_text(tmp_path / "log.jsonl", "\n".join(log_lines()) + "\n")
    code, text, _ = run(capsys, "collect", log, "--out", out)
    assert code == 0 and "(alpaca)" in text
    assert "  added: 8\n  skipped, duplicate: 2\n  skipped, invalid: 6\n" in text
    assert f"{log}:14: multi-turn conversation; alpaca records hold one question" in text
    added = lines_of(out)[1:]
    assert added[0] == alpaca("How do I list GPUs?", "Run `nvidia-smi -L`.")  # system prompt dropped
    assert [r["instruction"] for r in added] == ["How do I list GPUs?", "Show disk usage?", "Restart nginx?",
                                                 "Check SELinux mode?", "Reload sysctl?", "Free memory?",
                                                 "Uptime?", "Kernel?"]


def test_collect_new_file_and_errors(tmp_path, capsys):
    log = write_jsonl(tmp_path / "log.jsonl", [{"prompt": "Restart nginx?", "content": "Run it."}])
    out = tmp_path / "new.jsonl"
    assert run(capsys, "collect", log, "--out", out)[0] == 0
    assert lines_of(out) == [{"messages": chat("Restart nginx?", "Run it.")}]
    code, _, err = run(capsys, "collect", tmp_path / "nope.jsonl", "--out", out)
    assert code == 2 and err == f"hivetune: error: {tmp_path / 'nope.jsonl'}: log file not found\n"
    text_file = write_jsonl(tmp_path / "text.jsonl", [{"text": "plain"}])
    code, _, err = run(capsys, "collect", log, "--out", text_file)
    assert code == 2 and "holds text records" in err
    broken = write_text(tmp_path / "broken.jsonl", json.dumps({"messages": chat("a?", "b.")}) + "\n{oops\n")
    code, _, err = run(capsys, "collect", log, "--out", broken)
    assert code == 2 and err.startswith(f"hivetune: error: {broken}:2: malformed JSON")


def test_data_without_subcommand_is_exit_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and err.startswith("hivetune: error: data: name a subcommand")

