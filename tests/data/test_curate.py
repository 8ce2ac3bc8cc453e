"""hivetune data curate: selection by rating and correction, scrubbing of every planted secret,
exact counts, dedup against the training data, the replay share, bad input."""

from __future__ import annotations

import json

import pytest

from conftest import write_jsonl
from hivetune.cli import main
from hivetune.data.curate import curate, format_curate
from hivetune.data.interaction_log import InteractionLog
from hivetune.data.scrub import scrub

# (planted text, the secret in it that must not survive)
PLANTED = [
    ("mail me at jane.doe+ops@example.co.uk please", "jane.doe+ops@example.co.uk"),
    ("the host is 192.168.10.42 on the lan", "192.168.10.42"),
    ("ssh to 2001:db8:85a3::8a2e:370:7334 now", "2001:db8:85a3::8a2e:370:7334"),
    ("full form fe80:0000:0000:0000:0202:b3ff:fe1e:8329 too", "fe80:0000:0000:0000:0202:b3ff:fe1e:8329"),
    ("OPENAI_API_KEY is sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"),
    ("token ghp_16CharsOfRandomStuff1234567890abcdef here", "ghp_16CharsOfRandomStuff1234567890abcdef"),
    ("pat github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz", "github_pat_11ABCDEFG0123456789_abcdefghij"),
    ("aws key AKIAIOSFODNN7EXAMPLE in the config", "AKIAIOSFODNN7EXAMPLE"),
    ("slack xoxb-123456789012-1234567890123-AbCdEfGhIjKl", "xoxb-123456789012-1234567890123-AbCdEfGhIjKl"),
    ("google AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7 key", "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7"),
    ("hf token hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    ("curl -H 'Authorization: Bearer abc123def456ghi789' https://api", "abc123def456ghi789"),
    ("set api_key=0123456789abcdef0123456789abcdef in env", "0123456789abcdef0123456789abcdef"),
    ("secret: Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA== was leaked", "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA=="),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7bq98\nQWERTYkeybody==\n-----END RSA PRIVATE KEY-----",
     "MIIEpAIBAAKCAQEA7bq98"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
     "b3BlbnNzaC1rZXktdjEAAAAA"),
    ("psql --password hunter2pw -h db", "hunter2pw"),
    ("mysql -u root -p'Sup3rS3cret' shop", "Sup3rS3cret"),
    ("mysqldump -uroot -pTopSecret42 shop > dump.sql", "TopSecret42"),
    ("sshpass -p 'letmein77' ssh admin@box", "letmein77"),
    ("curl -u alice:wonderland99 https://example.org/api", "wonderland99"),
    ("git clone https://bob:s3cretpass@git.example.org/repo.git", "s3cretpass"),
    ("export PASSWORD=CorrectHorse9 && run", "CorrectHorse9"),
    ('{"db_password": "Tr0ub4dor&3"}', "Tr0ub4dor"),
]
ORDINARY = ["ls -la /etc", "version 1.2.3", "upgrade to version 10.0.19041.1", "mkdir -p /tmp/x",
            "ssh -p 2222 host", "listen on 127.0.0.1:8080 or 0.0.0.0", "at 10:30:15", "std::vector<int>",
            "MAC 00:1a:2b:3c:4d:5e", "key: /etc/ssh/ssh_host_ed25519_key", "mysql -u root -p shop",
            "git@github.com:org/repo.git", "netmask 255.255.255.0", "python3.11 -m venv .venv"]


def test_scrub_removes_every_planted_secret_and_keeps_ordinary_text():
    for text, secret in PLANTED:
        out = scrub(text)
        assert secret not in out, (text, out)
        assert any(p in out for p in ("<EMAIL>", "<IP>", "<SECRET>", "<PRIVATE_KEY>", "<PASSWORD>")), out
    for text in ORDINARY:
        assert scrub(text) == text
    assert scrub("curl -u alice:wonderland99 https://x") == "curl -u alice:<PASSWORD> https://x"
    assert scrub("mysql -u root -p'Sup3rS3cret' shop") == "mysql -u root -p<PASSWORD> shop"
    assert scrub("host 10.0.0.1 and v1.2.3.4") == "host <IP> and v1.2.3.4"
    assert scrub("PASSWORD=x1 and api_key=abcdefabcdef123456") == "PASSWORD=<PASSWORD> and api_key=<SECRET>"


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def log_path(tmp_path):
    """Exchanges: 3 rated good (one repeats another, one repeats it with other spacing), 2 with a
    correction (one rated -1, one rated +1), 2 rated bad, 2 unrated, 1 invalid (no user turn),
    1 already in the training data, and one of each planted secret (rated good)."""
    log = InteractionLog(tmp_path / "log.jsonl")

    def ex(question, answer, rating=None, correction=None):
        i = log.exchange("v1", ask(question), answer, 0.1, 3, 4)
        if rating is not None:
            log.feedback(i, rating, correction)

    ex("restart nginx?", "systemctl restart nginx", 1)
    ex("restart nginx?", "systemctl restart nginx", 1)  # exact duplicate
    ex("restart  nginx?", "systemctl  restart nginx", 1)  # duplicate once normalised
    ex("disk usage?", "ls", -1, "df -h")
    ex("free memory?", "free -h", 1, "free -m")
    ex("list pods?", "rm -rf /", -1)
    ex("list nodes?", "I do not know", -1)
    ex("uptime?", "uptime")
    ex("who?", "whoami")
    i = log.exchange("v1", [{"role": "system", "content": "be brief"}], "hi", 0.1, 1, 1)
    log.feedback(i, 1)
    ex("kernel version?", "uname -r", 1)  # in train.jsonl
    for n, (text, _) in enumerate(PLANTED):
        ex(f"question {n}: {text}", f"answer {n}: {text}", 1)
    log.close()
    return tmp_path / "log.jsonl"


@pytest.fixture
def train_path(tmp_path):
    records = [{"instruction": "kernel version?", "input": "", "output": "uname -r"}]
    records += [{"instruction": f"old question {i}", "input": "", "output": f"old answer {i}"} for i in range(20)]
    return write_jsonl(tmp_path / "train.jsonl", records)


def read_out(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_counts_are_exact_and_no_secret_survives(log_path, train_path, tmp_path):
    out = tmp_path / "curated.jsonl"
    result = curate([log_path], out, train_data=train_path, seed=1)
    n_planted = len(PLANTED)
    assert result.exchanges == 11 + n_planted
    assert dict(result.kept) == {"rated_good": 4 + n_planted, "corrected": 2}
    assert dict(result.dropped) == {"rated_bad": 2, "unrated": 2, "invalid": 1, "duplicate": 1,
                                    "duplicate_normalised": 1, "duplicate_train": 1}
    assert result.new == 3 + n_planted and result.replayed == 0
    records = read_out(out)
    assert len(records) == result.new
    answers = {r["messages"][0]["content"]: r["messages"][-1]["content"] for r in records}
    assert answers["disk usage?"] == "df -h" and answers["free memory?"] == "free -m"
    assert answers["restart nginx?"] == "systemctl restart nginx"
    text = out.read_text()
    for _, secret in PLANTED:
        assert secret not in text
    assert "rm -rf" not in text and "whoami" not in text
    assert result.scrubbed_records == n_planted
    report = format_curate(result)
    assert "      2  rated bad without a correction" in report
    assert f"wrote {3 + n_planted} records ({3 + n_planted} new, 0 replayed)" in report


def test_keep_unrated_and_length_limit(log_path, tmp_path):
    out = tmp_path / "curated.jsonl"
    result = curate([log_path], out, keep_unrated=True, max_length=40)
    assert result.kept["unrated"] == 2 and "unrated" not in result.dropped
    records = read_out(out)
    assert all(sum(len(m["content"]) for m in r["messages"]) <= 40 for r in records)
    assert result.dropped["too_long"] == sum(result.kept.values()) - result.new - 2  # 2 duplicates
    assert {"uptime?", "who?"} <= {r["messages"][0]["content"] for r in records}


def test_token_length_limit_counts_with_the_tokenizer(log_path, tmp_path, tiny_model_dir):
    from hivetune.data.scan import token_lengths
    from hivetune.model.tokenizer import load_tokenizer

    out = tmp_path / "curated.jsonl"
    result = curate([log_path], out, max_length=30, model=str(tiny_model_dir))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = read_out(out)
    assert result.length_unit == "tokens" and result.dropped["too_long"] > 0
    assert all(p + r <= 30 for p, r in token_lengths(records, "chat", tokenizer))


def test_replay_share_is_exact_and_seeded(log_path, train_path, tmp_path):
    first = curate([log_path], tmp_path / "a.jsonl", train_data=train_path, replay=0.3, seed=3)
    # 28 new records: round(0.3 * 28 / 0.7) = 12 replayed, 12 / 40 of the output
    assert first.new == 3 + len(PLANTED)
    assert first.replayed == round(0.3 * first.new / 0.7) == 12
    old = [r for r in read_out(tmp_path / "a.jsonl") if r["messages"][0]["content"].startswith(("old question", "kernel"))]
    assert len(old) == 12 and len(read_out(tmp_path / "a.jsonl")) == 40
    again = curate([log_path], tmp_path / "b.jsonl", train_data=train_path, replay=0.3, seed=3)
    assert again.replayed == 12 and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_replay_share_exact_when_divisible(tmp_path):
    log = InteractionLog(tmp_path / "log.jsonl")
    for i in range(7):
        log.feedback(log.exchange("v1", ask(f"q{i}"), f"a{i}", 0.1, 1, 1), 1)
    log.close()
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": ask(f"t{i}") + [{"role": "assistant",
                                                                                  "content": f"r{i}"}]}
                                                   for i in range(10)])
    result = curate([tmp_path / "log.jsonl"], tmp_path / "out.jsonl", train_data=train, replay=0.3)
    records = read_out(tmp_path / "out.jsonl")
    assert (result.new, result.replayed, len(records)) == (7, 3, 10)
    assert sum(r["messages"][0]["content"].startswith("t") for r in records) / len(records) == 0.3


def test_dedup_against_train_data_normalised(tmp_path):
    log = InteractionLog(tmp_path / "log.jsonl")
    log.feedback(log.exchange("v1", ask("How do I  list files?"), "ls -la", 0.1, 1, 1), 1)
    log.feedback(log.exchange("v1", ask("new one"), "answer", 0.1, 1, 1), 1)
    log.close()
    train = write_jsonl(tmp_path / "train.jsonl", [{"instruction": "How do I list files?", "output": "ls -la"}])
    result = curate([tmp_path / "log.jsonl"], tmp_path / "out.jsonl", train_data=train)
    assert dict(result.dropped) == {"duplicate_normalised_train": 1} and result.new == 1


@pytest.mark.parametrize("argv, message", [
    (["data", "curate", "missing.jsonl", "--out", "o.jsonl"], "missing.jsonl: interaction log not found"),
    (["data", "curate", "LOG", "--out", "o.jsonl", "--replay", "1"], "--replay: expected a fraction in [0, 1), got 1"),
    (["data", "curate", "LOG", "--out", "o.jsonl", "--replay", "-0.1"],
     "--replay: expected a fraction in [0, 1), got -0.1"),
    (["data", "curate", "LOG", "--out", "o.jsonl", "--replay", "0.3"],
     "--replay: needs --train-data FILE to take earlier records from"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, log_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [str(log_path) if a == "LOG" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"hivetune: error: {message}"
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_prints_counts(log_path, tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    assert main(["data", "curate", str(log_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"read {11 + len(PLANTED)} exchanges" in printed and "      2  unrated" in printed
    assert main(["data", "curate", str(log_path), "--out", str(out)]) == 2  # exists, no --force
