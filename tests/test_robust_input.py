"""Hostile input, fuzzed with hypothesis and by hand: data files of random bytes, broken UTF-8,
truncated or deeply nested JSON, huge numbers, NaN, wrong types, lone surrogates; config files and
overrides of any shape; chat templates that try to escape the Jinja sandbox. Every case ends in
success or a one-line UserError naming the file (and line), never a traceback; through the CLI,
exit 2 and one line on stderr.

Cost: about 25 s on the 2-core CI machine (max_examples 40-150 per property), plus the shared
tiny-model fixture."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ops_records, write_jsonl
from hivetune.cli import main
from hivetune.core.config import TrainConfig, load_config, parse_overrides
from hivetune.data.dataset import index_dataset
from hivetune.data.formats import encode_record, iter_records, parse_jsonl_line, render_chat
from hivetune.data.scan import parse_line
from hivetune.core.errors import UserError
from hivetune.model.tokenizer import load_tokenizer

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORK = Path(tempfile.mkdtemp(prefix="hivetune-fuzz-"))

# ---------------------------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
anything = json_values | st.text(max_size=30)
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "USER"]) | json_values
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": anything}) | json_values, max_size=4)
records = st.one_of(
    st.fixed_dictionaries({"instruction": anything, "output": anything}, optional={"input": anything}),
    st.fixed_dictionaries({"messages": messages | anything}),
    st.fixed_dictionaries({"text": anything}),
    st.sampled_from(ops_records(4)),
    st.dictionaries(st.text(max_size=10), json_values, max_size=4),
)


def dump(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _corrupt(line: bytes, data) -> bytes:
    """Cut a line short, or splice in bytes that are not UTF-8."""
    cut = data.draw(st.integers(0, len(line)))
    if data.draw(st.booleans()):
        return line[:cut]
    junk = data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xe2\x82", b"\\ud800"]))
    return line[:cut] + junk + line[cut:]


@st.composite
def hostile_lines(draw):
    kind = draw(st.sampled_from(["record", "record", "value", "bytes", "corrupt", "deep", "bigint", "surrogate"]))
    if kind == "record":
        return dump(draw(records))
    if kind == "value":
        return dump(draw(json_values))
    if kind == "bytes":
        return draw(st.binary(max_size=60))
    if kind == "corrupt":
        return _corrupt(dump(draw(records)), draw(st.data()))
    if kind == "deep":
        n = draw(st.integers(1, 3000))
        return b'{"text": ' + b"[" * n + b"]" * n + b"}"
    if kind == "bigint":
        return b'{"text": "a", "n": 1' + b"0" * draw(st.integers(4290, 4400)) + b"}"
    return b'{"instruction": "a\\ud83d", "output": "b"}'


@st.composite
def hostile_files(draw) -> bytes:
    lines = draw(st.lists(hostile_lines(), max_size=6))
    if draw(st.integers(0, 4)) == 0:  # a JSON array file
        return b"[" + b",\n".join(lines) + b"]"
    body = b"\n".join(lines)
    return body + (b"\n" if draw(st.booleans()) else b"")


def write(content: bytes, name: str = "data.jsonl") -> Path:
    path = WORK / name
    path.write_bytes(content)
    return path


def assert_one_line_about(error: UserError, path: Path) -> None:
    text = str(error)
    assert "\n" not in text and "\r" not in text, text
    assert text.startswith(f"{path}:"), text


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


# ---------------------------------------------------------------------------------- data files

@FUZZ
@given(content=hostile_files())
def test_training_reader_gives_records_or_one_line_naming_the_file(tok, content):
    path = write(content)
    try:
        index = index_dataset(path, "auto", tok, 64, False)
    except UserError as e:
        assert_one_line_about(e, path)
    else:
        assert len(index) >= 1 and all(0 < n <= 64 for n in index.lengths)
        for i in range(len(index)):  # re-reading by offset gives what indexing measured
            assert len(index.example(i).ids) == index.lengths[i]


@FUZZ
@given(line=hostile_lines())
def test_both_line_parsers_agree(line):
    """Training (iter_records) and the data tools (scan.parse_line) share parse_jsonl_line."""
    record, error = parse_jsonl_line(line)
    assert (record is None) != (error is None)
    parsed = parse_line(7, line)
    assert (parsed.record, parsed.error) == (record, error)
    if error:
        assert "\n" not in error


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=hostile_files())
def test_cli_data_validate_exits_0_1_or_2_with_one_line(content):
    path = write(content, "validate.jsonl")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["data", "validate", str(path)])
    assert code in (0, 1, 2)
    if code == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"hivetune: error: {path}"), lines


HOSTILE = {
    "random_bytes": (b"\x8b\x08\x00\xff\xfe" * 40, "{p}:1: not valid UTF-8 (byte 0)"),
    "deep_nesting": (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "{p}:1: malformed JSON (nested too deeply)"),
    "deep_array_file": (b"[" * 100_000 + b"]" * 100_000, "{p}: malformed JSON (nested too deeply)"),
    "huge_integer": (b'{"text": "a", "n": 1' + b"0" * 5000 + b"}\n",
                     "{p}:1: malformed JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    "nan_field": (b'{"instruction": NaN, "output": "b"}\n', "{p}:1: field 'instruction' must be a string, got NaN"),
    "infinity_content": (b'{"messages": [{"role": "user", "content": Infinity}]}\n',
                         "{p}:1: messages[0].content must be a string"),
    "lone_surrogate": (b'{"instruction": "ok \\udc80", "output": "b"}\n',
                       "{p}:1: field 'instruction' holds an unpaired surrogate ('\\udc80' at character 3), which is "
                       "not text"),
    "truncated_last_line": (json.dumps(ops_records(1)[0]).encode() + b'\n{"instruction": "a", "outp',
                            "{p}:2: malformed JSON (Unterminated string starting at column 22)"),
    "unclosed_object_end_of_line": (b'{"text": "a"\n', "{p}:1: malformed JSON (Expecting ',' delimiter at column 13)"),
    "huge_line": (b'{"text": "' + b"a" * (8 << 20) + b'"\n',  # an 8 MiB line, its brace missing
                  "{p}:1: malformed JSON (Expecting ',' delimiter at column 8388620)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_cli_train_on_hostile_data_exits_2_with_one_line(case, tiny_model_dir, tmp_path, capsys):
    content, expected = HOSTILE[case]
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out),
                 "--device", "cpu", "--precision", "fp32", "--max-steps", "1", "--quiet"]) == 2
    # (fp32: a CPU without AMX / AVX512-BF16 would print the auto precision's note first)
    assert capsys.readouterr().err.strip().splitlines() == ["hivetune: error: " + expected.format(p=data)]
    assert not out.exists()


def test_a_record_changed_under_a_running_job(tok, tmp_path):
    """Records are re-read by byte offset during training: a line replaced by garbage is one line."""
    path = write_jsonl(tmp_path / "d.jsonl", ops_records(3))
    index = index_dataset(path, "auto", tok, 64, False, keep_records_below=0)
    raw = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(raw[0] + b"[" * 50_000 + b"\n" + raw[2])
    with pytest.raises(UserError) as e:
        index.example(1)
    assert str(e.value) == f"{path}:2: record changed during the run (malformed JSON (nested too deeply))"
    path.unlink()
    with pytest.raises(UserError) as e:
        index.example(2)
    assert str(e.value) == f"{path}: data file disappeared during the run"


# A 100 MB line, in a fresh process: its peak memory is its own, and a hang is a timeout. The
# child indexes a valid record with a 100 MB answer (cut to max_length, counted as truncated,
# re-read by byte offset as training does), then runs `hivetune train` on 100 MB of a string that
# never closes, with no newline (a file cut short). Before the prefix-only encoding, the valid
# record was tokenised whole: ~19 GB and minutes (+770 MB and 11 s at 4 MB).
HUGE_LINE_CHILD = r"""
import contextlib, io, json, resource, sys, time
from hivetune.cli import main
from hivetune.data.dataset import index_dataset
from hivetune.model.tokenizer import load_tokenizer

model, valid, broken = sys.argv[1:4]
tok = load_tokenizer(model)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
index = index_dataset(valid, "auto", tok, 64, False)
example = index.example(1)
t1 = time.perf_counter()
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["train", "--model", model, "--data", broken, "--output", broken + ".run", "--device", "cpu",
                 "--precision", "fp32", "--max-steps", "1", "--quiet"])
print(json.dumps({"lengths": list(index.lengths), "truncated": index.truncated, "kept_records": len(index.records),
                  "example": [len(example.ids), sum(example.mask)], "index_s": t1 - t0,
                  "broken_s": time.perf_counter() - t1, "code": code, "stderr": err.getvalue(),
                  "peak_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}))
"""


def write_huge_line(path: Path, head: bytes, size: int, tail: bytes, first: bytes = b"") -> None:
    """first + head + size bytes of shell-like text + tail, written a MiB at a time."""
    chunk = (b"systemctl restart nginx; " * 42000)[:1 << 20]
    with open(path, "wb") as f:
        f.write(first + head)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.write(tail)


def test_a_100_mb_line_is_cut_to_max_length_or_one_line_in_bounded_memory(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    valid, broken = tmp_path / "valid.jsonl", tmp_path / "broken.jsonl"
    first = json.dumps(ops_records(1)[0]).encode() + b"\n"
    write_huge_line(valid, b'{"instruction": "Restart nginx, many times", "output": "', 100 << 20, b'"}\n', first)
    write_huge_line(broken, b'{"text": "', 100 << 20, b"", first)
    proc = subprocess.run([sys.executable, "-c", HUGE_LINE_CHILD, str(tiny_model_dir), str(valid), str(broken)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["lengths"][1] == 64 and got["truncated"] == 1 and got["kept_records"] == 0  # > 64 MiB: re-read
    assert got["example"][0] == 64 and got["example"][1] > 32  # the answer's first tokens are targets
    assert got["code"] == 2
    assert got["stderr"].splitlines() == [f"hivetune: error: {broken}:2: malformed JSON (Unterminated string "
                                          f"starting at column 10)"]
    assert not (tmp_path / "broken.jsonl.run").exists()
    # json.loads holds the line as bytes, str and the parsed string (~400 MB): linear, not more
    assert got["peak_growth"] < 1.5 * 2**30, got
    assert got["index_s"] < 60 and got["broken_s"] < 60, got  # ~2 s each on the 2-core CI machine


# Records longer than the prefix encode_record tokenises: each shape gives the first max_length
# tokens and targets of the whole record (encoded with no limit, then cut).
_LONG = "Run `systemctl restart nginx` as root; journalctl -u nginx shows why. " * 300  # 21000 characters
LONG_RECORDS = {
    "text": ({"text": _LONG}, "text"),
    "one_long_word": ({"text": "a" * 40_000}, "text"),
    "alpaca_long_answer": ({"instruction": "Restart nginx?", "output": _LONG}, "alpaca"),
    "alpaca_long_instruction": ({"instruction": _LONG, "input": "now", "output": "ok"}, "alpaca"),
    "chat_many_turns": ({"messages": [{"role": "system", "content": "Be brief."}]
                         + [{"role": ("user", "assistant")[i % 2], "content": _LONG[:i]} for i in range(300)]},
                        "chat"),
    "chat_answer_after_the_prefix": ({"messages": [{"role": "user", "content": _LONG},
                                                   {"role": "assistant", "content": "ok"}]}, "chat"),
}


@pytest.mark.parametrize("max_length", [1, 64, 300])
@pytest.mark.parametrize("template", [True, False])
@pytest.mark.parametrize("case", list(LONG_RECORDS))
def test_a_long_record_encodes_as_its_whole_cut_to_max_length(case, template, max_length, tok):
    import copy

    record, fmt = LONG_RECORDS[case]
    if not template:
        tok = copy.deepcopy(tok)
        tok.chat_template = None
    for train_on_inputs in (False, True):
        whole = encode_record(record, fmt, tok, 1 << 62, train_on_inputs)
        cut = encode_record(record, fmt, tok, max_length, train_on_inputs)
        assert len(whole.ids) > 2 * max_length + 64  # long enough to be cut
        assert (cut.ids, cut.mask, cut.truncated) == (whole.ids[:max_length], whole.mask[:max_length], True)


def test_a_conversation_of_200k_turns_is_not_quadratic(tok, tmp_path):
    """chat_spans renders once per assistant turn: over every turn, 2000 short ones took 11 s and
    a 7 MB line of 200 000 turns hours; encode_record renders only the turns within its prefix."""
    import time

    turns = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(200_000)]
    path = write_jsonl(tmp_path / "long_chat.jsonl", [{"messages": turns}])
    t0 = time.perf_counter()
    index = index_dataset(path, "auto", tok, 64, False)
    assert time.perf_counter() - t0 < 30  # ~1 s
    assert list(index.lengths) == [64] and index.truncated == 1
    assert list(index.n_targets) == [encode_record({"messages": turns[:40]}, "chat", tok, 64, False).n_targets] != [0]


# ---------------------------------------------------------------------------------- config

config_keys = st.sampled_from([f.name for f in TrainConfig.__dataclass_fields__.values()] + ["lora", "lora_r", "x"])


@settings(max_examples=150, deadline=None)
@given(values=st.dictionaries(config_keys, json_values | st.dictionaries(st.sampled_from(["r", "alpha", "targets", "q"]),
                                                                          json_values, max_size=3), max_size=5))
def test_config_of_any_shape_is_valid_or_a_user_error(values):
    try:
        cfg = load_config(None, values)
    except UserError as e:
        assert str(e)
    else:
        assert isinstance(cfg, TrainConfig)


@settings(max_examples=40, deadline=None)  # PyYAML needs ~0.1 s to reach the recursion limit: few deep cases
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
)
def test_config_file_of_any_bytes_is_valid_or_one_user_error(content):
    path = write(content, "config.yaml")
    try:
        load_config(path)
    except UserError as e:
        assert str(e)


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.text(max_size=30), max_size=2))
def test_overrides_of_any_text_parse_or_raise_user_error(pairs):
    try:
        parse_overrides(pairs)
    except UserError as e:
        assert str(e)


def test_config_nested_too_deeply_is_one_user_error(tmp_path):
    """PyYAML recurses per nesting level (and takes seconds to hit the limit: not fuzzed)."""
    path = tmp_path / "deep.yaml"
    path.write_text("lr: " + "[" * 2000)
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: invalid YAML (nested too deeply)"
    with pytest.raises(UserError) as e:
        parse_overrides(["lr=" + "[" * 2000])
    assert str(e.value) == "override lr: value nested too deeply"


# ---------------------------------------------------------------------------------- chat templates

ESCAPES = {
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__['os'].system('touch /tmp/hivetune-pwned') }}",
    "cycler": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "mutate": "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ x }}",
}


@pytest.mark.parametrize("case", list(ESCAPES))
def test_chat_template_cannot_escape_the_sandbox(case, tok):
    """transformers renders templates in jinja2's ImmutableSandboxedEnvironment: these raise
    SecurityError (or fail on the missing attribute), which becomes one UserError line."""
    sandboxed = tok.__class__.from_pretrained(tok.name_or_path)
    sandboxed.chat_template = ESCAPES[case]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(UserError) as e:
        render_chat(sandboxed, msgs, add_generation_prompt=False)
    text = str(e.value)
    assert text.startswith("the model's chat template failed (") and "\n" not in text
    if case in ("mro", "mutate"):
        assert "SecurityError" in text
    assert msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert not Path("/tmp/hivetune-pwned").exists()


def test_chat_template_errors_name_the_record(tok, tmp_path):
    bad = tok.__class__.from_pretrained(tok.name_or_path)
    bad.chat_template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif %}"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                               {"role": "assistant", "content": "b"}]}])
    with pytest.raises(UserError) as e:
        index_dataset(path, "auto", bad, 64, False)
    assert str(e.value) == f"{path}:1: the model's chat template failed (TemplateError: a system turn comes first)"
    bad.chat_template = "{% if %}"
    with pytest.raises(UserError) as e:
        encode_record({"instruction": "a", "output": "b"}, "alpaca", bad, 64, False)
    assert str(e.value) == ("the model's chat template failed (TemplateSyntaxError: Expected an expression, got "
                            "'end of statement block')")


def test_iter_records_column_is_the_lines_own():
    """An error at the end of a line names that line's column (the line break is not part of it)."""
    path = write(b'{"text": "a"\n')
    with pytest.raises(UserError) as e:
        list(iter_records(path))
    assert str(e.value) == f"{path}:1: malformed JSON (Expecting ',' delimiter at column 13)"


def test_deep_nesting_is_judged_the_same_at_any_stack_depth():
    """Nesting past formats.MAX_NESTING is refused before json.loads, whose RecursionError came at
    a depth that depended on the caller's stack (hypothesis: a line ~990 deep parsed in one parser
    and failed in the other)."""
    from hivetune.data.formats import MAX_NESTING

    def line(depth):
        return b'{"text": ' + b"[" * depth + b"]" * depth + b"}"

    def at_stack_depth(frames, depth):
        return at_stack_depth(frames - 1, depth) if frames else parse_jsonl_line(line(depth))

    for depth in (MAX_NESTING - 1, MAX_NESTING, 990):  # the record's own braces are one more level
        answers = {parse_jsonl_line(line(depth))[1], parse_line(7, line(depth)).error, at_stack_depth(400, depth)[1]}
        assert answers == ({None} if depth < MAX_NESTING else {"malformed JSON (nested too deeply)"}), depth
    assert parse_jsonl_line(b'{"text": "' + b"[" * 900 + b'"}')[0] == {"text": "[" * 900}  # in a string: text
