"""The deployment secret (`KVFERRY_SECRET`): how strong it must be, and the keys derived from it.

A secret must carry at least 128 bits, estimated conservatively from its spelling, because anyone who
sees one MAC can test guesses offline: 4 bits a hex digit, 6 a base64(url) or other text character, 8 a
raw non-UTF-8 byte; and it must not look hand-made (at least 6 distinct characters, not one piece
repeated). Text is also read as a pattern a guesser would try (`pattern_bits`: words, numbers and
separators), which counts only when at least `PATTERN_SLACK_BITS` cheaper than the spelling, so a random
token's chance word-like pieces rarely cost it. Keys: HKDF-SHA256 with one `info` label per use, so a
MAC made for one protocol is never valid in another (`LABELS`)."""

from __future__ import annotations

import math
import os
import re
import secrets
import string
import sys
from dataclasses import dataclass

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MIN_BITS = 128
MIN_DISTINCT = 6
ENV = "KVFERRY_SECRET"
# Every HKDF `info` label kvferry derives a key under (docs/security.md lists them).
LABELS = {
    "control": b"kvferry/2 control mac",  # sealed ZMQ control messages
    "prompt": b"kvferry/2 prompt digest",  # the keyed prompt digest P compares with D's
    "bootstrap": b"kvferry/2 bootstrap",  # P's bootstrap answers
    "tcp": b"kvferry/2 tcp data plane",  # the TCP data plane's handshake proofs and AES-GCM keys
    "block": b"kvferry/2 block digest",  # + transfer id + grant: the keyed per-block digest D checks
    "nixl": b"kvferry/2 nixl",  # + " token" / " p2d" / " d2p": the NIXL engine's token and notification tags
}
WORD_BITS = 13.0  # one word of an 8,000-word list: a guesser's cost of a dictionary word
PATTERN_SLACK_BITS = 40.0  # what a random token's chance word-like pieces save, with odds ~10^-5
_HEX = frozenset(string.hexdigits)
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_")


class WeakSecret(ValueError):
    """A secret with fewer than 128 bits by `estimate_bits`."""


@dataclass(frozen=True)
class Estimate:
    bits: int
    pattern: str = ""  # what the secret reads as, when that is what counted ("3 words, a 6-digit number")


def estimate_bits(secret: str | bytes) -> int:
    """A conservative estimate of the secret's entropy."""
    return estimate(secret).bits


def estimate(secret: str | bytes) -> Estimate:
    """`estimate_bits`, with the pattern the secret reads as when that reading counted."""
    if isinstance(secret, str) and any("\udc80" <= c <= "\udcff" for c in secret):
        secret = secret.encode(errors="surrogateescape")  # raw bytes from the environment
    if isinstance(secret, bytes):
        try:
            secret = secret.decode("utf-8")
        except UnicodeDecodeError:
            return Estimate(_guarded(secret, 8 * len(secret)))
    if set(secret) <= _HEX:
        text, rate = secret, 4
    elif set(secret.rstrip("=")) <= _BASE64:
        text, rate = secret.rstrip("="), 6
    else:
        text, rate = secret, 6  # any other text
    spelled = _guarded(text, rate * len(text))
    if not text or not spelled:
        return Estimate(spelled)
    bits, reads_as = pattern_bits(text, rate)
    if bits <= spelled - PATTERN_SLACK_BITS:
        return Estimate(int(bits), reads_as)
    return Estimate(spelled)


# A piece: the characters between two separators (ASCII punctuation or whitespace).
_PIECES = re.compile(r"[^" + re.escape(string.punctuation + string.whitespace) + r"]+|.", re.DOTALL)
_RUNS = re.compile(r"[A-Za-z]+|[0-9]+|.", re.DOTALL)
_UNPRONOUNCEABLE = re.compile(r"[^aeiouy]{4,}|[aeiou]{4,}")
_DIGIT_BITS = math.log2(10)
_LETTER_BITS = math.log2(26)
_KIND_BITS = 2.0  # which of word, number, word and number, or random characters a piece is
_CASE_BITS = math.log2(3)  # lower, Capitalized or UPPER
_SEPARATOR_BITS = 5.0  # one of ~32 ASCII punctuation marks and the space
_REPEATED_SEPARATOR_BITS = 1.0  # the separator before it again (or not)


def pattern_bits(text: str, rate: float) -> tuple[float, str]:
    """What guessing `text` as a pattern costs (this module's docstring), and what it reads as."""
    pieces = _PIECES.findall(text)
    costs = [_piece_bits(piece) if not _is_separator(piece) else None for piece in pieces]
    bits, previous, words, numbers = 0.0, "", 0, []
    for i, (piece, cost) in enumerate(zip(pieces, costs, strict=True)):
        if not _is_separator(piece):
            bits += _KIND_BITS
            if cost is None:  # random-looking: its characters count in full
                bits += rate * len(piece)
                continue
            bits += cost
            runs = _RUNS.findall(piece)
            words += sum(1 for run in runs if run.isalpha())
            numbers += [len(run) for run in runs if run.isdigit()]
            continue
        # A separator between words and numbers is a template's; next to random characters, one of them.
        beside = [costs[j] for j in (i - 1, i + 1) if 0 <= j < len(pieces) and not _is_separator(pieces[j])]
        if all(c is not None for c in beside):
            bits += _REPEATED_SEPARATOR_BITS if piece == previous else _SEPARATOR_BITS
        else:
            bits += rate
        previous = piece
    parts = [f"{words} word{'s' * (words != 1)}"] if words else []
    parts += [f"a {n}-digit number" for n in numbers]
    return bits, ", ".join(parts)


def _is_separator(piece: str) -> bool:
    return len(piece) == 1 and piece in string.punctuation + string.whitespace


def _piece_bits(piece: str) -> float | None:
    """A word, a number, or a word and a number (either order): its cost; None for anything else."""
    runs = _RUNS.findall(piece)
    if len(runs) > 2 or (len(runs) == 2 and runs[0].isdigit() == runs[1].isdigit()):
        return None
    bits = 0.0
    for run in runs:
        if run.isdigit() and run.isascii():
            bits += _number_bits(run)
        elif run.isalpha() and run.isascii() and (word := _word_bits(run)) is not None:
            bits += word
        else:
            return None
    return bits


def _number_bits(run: str) -> float:
    """log2 10 a digit; a repeated or counting run (`123456`) only its first digit, direction and length."""
    steps = {ord(b) - ord(a) for a, b in zip(run, run[1:], strict=False)}
    if len(run) >= 3 and len(steps) == 1 and steps <= {-1, 0, 1}:
        return _DIGIT_BITS + math.log2(3) + math.log2(len(run))
    return _DIGIT_BITS * len(run)


def _word_bits(run: str) -> float | None:
    """A word's cost: one case (or Capitalized), a vowel, no cluster no word has; None otherwise."""
    lower = run.lower()
    if run != lower and run != run.upper() and run != run.capitalize():
        return None
    if not set(lower) & set("aeiouy") or _UNPRONOUNCEABLE.search(lower):
        return None
    words = math.ceil(len(run) / 8)  # a long run is words written together
    return _CASE_BITS + min(_LETTER_BITS * len(run), WORD_BITS * words)


def _guarded(s: str | bytes, bits: int) -> int:
    """`bits`, or 0 for a secret with few distinct characters or one piece repeated."""
    n = len(s)
    if len(set(s)) < MIN_DISTINCT:
        return 0
    for period in range(1, n // 2 + 1):
        if n % period == 0 and s[:period] * (n // period) == s:
            return 0
    return bits


def check_secret(secret: str | bytes) -> bytes:
    """The secret as bytes, or WeakSecret (with how to make a good one) when it is too weak."""
    found = estimate(secret)
    if found.bits < MIN_BITS:
        why = (f": it reads as words, numbers and separators ({found.pattern}), which a guesser tries long "
               "before random characters" if found.pattern else "")
        raise WeakSecret(
            f"{ENV} is too weak: about {found.bits} bits{why}; kvferry needs at least {MIN_BITS} (32 hex "
            "digits, 22 base64 characters or 16 random bytes, not words, a template or a repeated piece). "
            "Make one with `kvferry secret` and set the same value on every instance."
        )
    return secret.encode(errors="surrogateescape") if isinstance(secret, str) else secret


def env_ok(prog: str) -> bool:
    """False, after saying why on stderr, when KVFERRY_SECRET is set but too weak."""
    try:
        from_env()
    except WeakSecret as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    return True


def from_env() -> bytes | None:
    """The deployment's secret (env KVFERRY_SECRET), checked; None when unset or empty."""
    value = os.environ.get(ENV)
    return check_secret(value) if value else None


def derive_key(secret: bytes, label: str, salt: bytes | None = None, context: bytes = b"", length: int = 32) -> bytes:
    """HKDF-SHA256 of the secret under `LABELS[label]` + `context`. A weak secret is refused here too, so
    no key ever comes from one."""
    check_secret(secret)
    hkdf = HKDF(algorithm=SHA256(), length=length, salt=salt, info=LABELS[label] + context)
    return hkdf.derive(secret)


def new_secret() -> str:
    """A fresh secret: 256 random bits, base64url (what `kvferry secret` prints)."""
    return secrets.token_urlsafe(32)
