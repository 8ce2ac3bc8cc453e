"""The interaction log: whole lines, a cut line skipped and ended, feedback joined."""

import json
import threading

from hivetune.data.interaction_log import InteractionLog, read_logs


def test_exchanges_and_latest_feedback_read_back(tmp_path):
    log = InteractionLog(tmp_path / "log.jsonl")
    a = log.exchange("v1", [{"role": "user", "content": "hi"}], "hello", 0.25, 3, 2)
    b = log.exchange("v1", [{"role": "user", "content": "df?"}], "ls", 0.5, 4, 1)
    log.feedback(a, 1)
    log.feedback(b, -1, "df -h")
    log.feedback(a, -1, "  ")  # the later rating wins; a blank correction is none
    log.feedback("ex-unknown", 1)
    log.close()
    got = read_logs([tmp_path / "log.jsonl"])
    assert list(got.exchanges) == [a, b]
    assert (got.exchanges[a].rating, got.exchanges[a].correction) == (-1, None)
    assert (got.exchanges[b].rating, got.exchanges[b].correction) == (-1, "df -h")
    assert got.exchanges[b].messages == [{"role": "user", "content": "df?"}]
    assert got.exchanges[a].source == f"{tmp_path / 'log.jsonl'}:1"
    assert (got.broken_lines, got.orphan_feedback) == (0, 1)


def test_a_cut_line_is_skipped_and_the_next_writer_starts_a_new_line(tmp_path):
    path = tmp_path / "log.jsonl"
    log = InteractionLog(path)
    first = log.exchange("v1", [{"role": "user", "content": "a"}], "b", 0.1, 1, 1)
    log.close()
    with open(path, "ab") as f:  # a kill mid-write: half a record, no newline
        f.write(b'{"type": "exchange", "id": "ex-cut", "mess')
    log = InteractionLog(path)
    second = log.exchange("v1", [{"role": "user", "content": "c"}], "d", 0.1, 1, 1)
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == b'{"type": "exchange", "id": "ex-cut", "mess'
    assert json.loads(lines[2])["id"] == second
    got = read_logs([path])
    assert list(got.exchanges) == [first, second]
    assert got.broken_lines == 1


def test_threads_never_interleave_lines(tmp_path):
    log = InteractionLog(tmp_path / "log.jsonl")
    text = "x" * 20000  # far above one pipe buffer

    def work():
        for _ in range(25):
            log.exchange("v1", [{"role": "user", "content": text}], text, 0.1, 1, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    got = read_logs([tmp_path / "log.jsonl"])
    assert len(got.exchanges) == 100 and got.broken_lines == 0
