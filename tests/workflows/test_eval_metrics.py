"""The text scores of `hivetune eval` (exact match, token F1, ROUGE-L) and its command hits, exact
values on hand-worked examples."""

from __future__ import annotations

import pytest

from hivetune.core.errors import UserError
from hivetune.workflows.eval_examples import reference_commands
from hivetune.workflows.eval_metrics import command_hit, exact_match, lcs_length, normalize_answer, rouge_l, token_f1


def test_text_metrics_exact_values():
    assert normalize_answer("The  Quick, brown\tfox!") == "quick brown fox"
    assert exact_match("The cat.", "cat") == 1.0 and exact_match("cat", "dog") == 0.0
    # pred "cat sat on mat" (4), ref "cat sat" (2): overlap 2, P 1/2, R 1 -> F1 2/3
    assert token_f1("the cat sat on the mat", "a cat sat") == pytest.approx(2 / 3)
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)  # multiset overlap: 1 x + 1 y
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("x", "y") == 0.0
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    assert rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    assert rouge_l("x y z w", "x z") == pytest.approx(2 / 3)  # LCS 2: P 1/2, R 1
    # order matters for ROUGE-L, not for F1: LCS 1 of 4 tokens -> 1/4
    assert token_f1("d c b x", "x b c d") == 1.0
    assert rouge_l("d c b x", "x b c d") == pytest.approx(0.25)
    assert rouge_l("same words here", "Same words, here.") == 1.0


def test_command_hit_rule():
    answer = "Run this:\n$ sudo  systemctl restart\tnginx\nthen `journalctl -u nginx`"
    assert command_hit(answer, ["systemctl restart nginx"]) is True
    assert command_hit(answer, ["systemctl restart nginx", "journalctl -u nginx"]) is True
    assert command_hit(answer, ["systemctl restart nginx", "systemctl status nginx"]) is False
    assert command_hit(answer, ["Systemctl restart nginx"]) is False  # commands are case-sensitive
    assert command_hit(answer, []) is None
    reference = "First:\n$ dnf  upgrade\nthen\n$ reboot\n  $ not a command line"
    assert reference_commands({}, reference, "f:1") == ["dnf  upgrade", "reboot"]
    assert reference_commands({"command": "dnf upgrade"}, reference, "f:1") == ["dnf upgrade"]
    assert reference_commands({"command": ["a", "b"]}, reference, "f:1") == ["a", "b"]
    with pytest.raises(UserError, match="^f:3: field 'command'"):
        reference_commands({"command": 3}, reference, "f:3")
