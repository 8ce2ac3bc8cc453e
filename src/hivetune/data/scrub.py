"""Secrets and personal data taken out of text before it becomes training data (`data curate`).

Each rule is a regular expression and what replaces its match; the rules run in the order of
RULES, so that a longer form is replaced before a shorter rule could take part of it (a private
key block before the base64 inside it, ``user:pass@`` in a URL before an e-mail address):

  kind          what                                                  becomes
  private_key   -----BEGIN ... PRIVATE KEY----- ... -----END ...-----   <PRIVATE_KEY> (an unended
                                                                        block: to the end of the text)
  url_password  scheme://user:pass@host                                 scheme://user:<PASSWORD>@host
  jwt           eyJ....eyJ....sig (three base64url parts)               <SECRET>
  token         OpenAI sk-..., GitHub ghp_/gho_/ghu_/ghs_/ghr_/github_pat_, AWS AKIA/ASIA...,
                Slack xox?-..., Google AIza..., Hugging Face hf_...    <SECRET>
  bearer        Authorization: Bearer X                                 Bearer <SECRET>
  cli_password  --password X / --password=X, mysql -pX, sshpass -p X,
                curl / wget -u user:pass                                <PASSWORD> (the user kept)
  password      PASSWORD=X, db_password: "X", passwd=X ...              NAME=<PASSWORD>
  key_value     api_key= / token= / secret= / access_key: ... followed
                by 16+ characters of [A-Za-z0-9+/=_.~-], a digit among
                them, not a path (key: /etc/ssh/host_key stays)         NAME=<SECRET>
  email         local@domain.tld (not git@host)                         <EMAIL>
  ipv6          an address ipaddress.IPv6Address accepts, not ::1 / ::  <IP>
  ipv4          a dotted quad of 0-255, not 127.x.x.x, 0.0.0.0 or a
                255.x netmask, not after "v" / "version", not inside a
                longer dotted run of numbers                            <IP>

Ordinary text stays: `ls -la /etc`, `mkdir -p /tmp/x`, `ssh -p 2222 host`, versions of three
parts (1.2.3) or after "version" / "v" (version 1.2.3.4), times (10:30:15), MAC addresses,
`std::vector`, 127.0.0.1 and 0.0.0.0.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

_Q = r"""["']?"""  # an optional quote around a value

_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----[\s\S]*?"
                          r"(?:-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|\Z)")
_URL_PASSWORD = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^\s/:@]+):([^\s/@]+)@")
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}")
_TOKEN = re.compile(
    r"\b(?:sk-(?:proj-|ant-|svcacct-)?[A-Za-z0-9_-]{20,}"  # OpenAI (and Anthropic's sk-ant-)
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key id
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AIza[0-9A-Za-z_-]{30,}"  # Google API key
    r"|hf_[A-Za-z0-9]{30,})"  # Hugging Face
    r"(?![A-Za-z0-9_-])")
_BEARER = re.compile(r"\b([Bb]earer\s+)[A-Za-z0-9._~+/=-]{8,}")
_CLI_PASSWORD = [
    # --password X, --password=X, --passwd X, --pass X (sshpass --pass is not a flag; harmless)
    re.compile(r"(--(?:password|passwd|pass|pwd)(?:\s+|=))(" + _Q + r")([^\s\"']+)\2", re.IGNORECASE),
    # mysql / mysqldump / mysqladmin -pX or -p'X' (a bare -p asks for it: no value follows)
    re.compile(r"(\bmysql(?:dump|admin|import|show|check)?\b[^\n]*?\s-p)(" + _Q + r")([^\s\"']+)\2"),
    # sshpass -p X
    re.compile(r"(\bsshpass\b[^\n]*?\s-p\s*)(" + _Q + r")([^\s\"']+)\2"),
]
# curl / wget -u user:pass, --user user:pass, --user=user:pass: the user kept
_USER_PASS = re.compile(r"(\b(?:curl|wget|http)\b[^\n]*?\s(?:-u\s*|--user[=\s]\s*))(" + _Q + r")([^\s:\"']+):"
                        r"([^\s\"']+)\2")
_PASSWORD = re.compile(r"(\b\w*(?:password|passwd|passphrase|pwd)\w*)(" + _Q + r"\s*[=:]\s*)"
                       r"(?:\"([^\"\n]+)\"|'([^'\n]+)'|(?!<)([^\s\"',;&]+))", re.IGNORECASE)
_KEY_VALUE = re.compile(r"(\b[\w-]*(?:api[_-]?key|apikey|key|token|secret|auth|credential)s?)(" + _Q + r"\s*[=:]\s*)"
                        r"(" + _Q + r")(?![/~.])(?=[^\s\"']*\d)([A-Za-z0-9+/_.~-]{16,}={0,2})\3", re.IGNORECASE)
_EMAIL = re.compile(r"(?<![\w.%+-])(?!git@)[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}\b")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:.])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(r"(?<![\w.])(?<!\bv)(?<!version )(?<!Version )(?<!VERSION )"
                   rf"({_OCTET})\.{_OCTET}\.{_OCTET}\.{_OCTET}(?![\w]|\.\d)")

PLACEHOLDERS = ("<EMAIL>", "<IP>", "<SECRET>", "<PRIVATE_KEY>", "<PASSWORD>")


def _kept_ipv6(text: str) -> bool:
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        return True  # not an address: a time, a MAC, C++ scope
    return address.is_loopback or address.is_unspecified


def _kept_ipv4(text: str) -> bool:
    first = text.split(".", 1)[0]
    return text == "0.0.0.0" or first in ("127", "255")


def _password_value(m: re.Match) -> str:
    quote = '"' if m.group(3) is not None else "'" if m.group(4) is not None else ""
    value = m.group(3) or m.group(4) or m.group(5)
    if value.startswith("<"):  # already a placeholder
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{quote}<PASSWORD>{quote}"


def _sub(pattern: re.Pattern, repl, text: str, kind: str, counts: Counter) -> str:
    def replace(m: re.Match) -> str:
        out = repl(m) if callable(repl) else m.expand(repl)
        if out != m.group(0):
            counts[kind] += 1
        return out

    return pattern.sub(replace, text)


def scrub(text: str, counts: Counter | None = None) -> str:
    """`text` with every secret and personal datum of the table above replaced; `counts`, if
    given, gets one per replacement by kind."""
    counts = Counter() if counts is None else counts
    text = _sub(_PRIVATE_KEY, "<PRIVATE_KEY>", text, "private_key", counts)
    text = _sub(_URL_PASSWORD, r"\1:<PASSWORD>@", text, "password", counts)
    text = _sub(_JWT, "<SECRET>", text, "secret", counts)
    text = _sub(_TOKEN, "<SECRET>", text, "secret", counts)
    text = _sub(_BEARER, r"\1<SECRET>", text, "secret", counts)
    text = _sub(_USER_PASS, r"\1\2\3:<PASSWORD>\2", text, "password", counts)
    for pattern in _CLI_PASSWORD:
        text = _sub(pattern, lambda m: m.group(0) if m.group(3).startswith("<") else f"{m.group(1)}<PASSWORD>",
                    text, "password", counts)
    text = _sub(_PASSWORD, _password_value, text, "password", counts)
    text = _sub(_KEY_VALUE, r"\1\2\3<SECRET>\3", text, "secret", counts)
    text = _sub(_EMAIL, "<EMAIL>", text, "email", counts)
    text = _sub(_IPV6, lambda m: m.group(0) if _kept_ipv6(m.group(0)) else "<IP>", text, "ip", counts)
    text = _sub(_IPV4, lambda m: m.group(0) if _kept_ipv4(m.group(0)) else "<IP>", text, "ip", counts)
    return text
