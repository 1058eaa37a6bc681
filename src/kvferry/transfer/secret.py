"""The deployment secret (`KVFERRY_SECRET`): how strong it must be, and the keys derived from it.

A secret must carry at least 128 bits, estimated conservatively from how it is spelled, since
anyone who sees one MAC (a bootstrap answer, a control message) can test guesses offline:

- only hex digits: 4 bits a character, so at least 32 (`secrets.token_hex(16)`);
- only the base64 / base64url alphabet (`=` padding ignored): 6 bits a character, at least 22;
- any other text: 6 bits a character too (a passphrase is worth less than its alphabet says), at
  least 22 characters;
- raw bytes that are not text (UTF-8): 8 bits a byte, at least 16 bytes;

and, whatever its length, it must not look made by hand: at least 6 distinct characters, and not
one shorter piece repeated (`aaaa…`, `passwordpassword…`). A random secret of the lengths above fails
these with odds under 10^-12. `kvferry secret` prints one (`new_secret`: 256 bits, base64url).

Keys: HKDF (RFC 5869, SHA-256, pyca `cryptography`) over the secret, one `info` label per use, so a
MAC made for one protocol is never valid in another (`LABELS`).
"""

from __future__ import annotations

import os
import secrets
import string
import sys

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
_HEX = frozenset(string.hexdigits)
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_")


class WeakSecret(ValueError):
    """A secret with fewer than 128 bits by `estimate_bits`."""


def estimate_bits(secret: str | bytes) -> int:
    """A conservative estimate of the secret's entropy (the rules in this module's docstring)."""
    if isinstance(secret, str) and any("\udc80" <= c <= "\udcff" for c in secret):
        secret = secret.encode(errors="surrogateescape")  # raw bytes from the environment
    if isinstance(secret, bytes):
        try:
            secret = secret.decode("utf-8")
        except UnicodeDecodeError:
            return _guarded(secret, 8 * len(secret))
    if set(secret) <= _HEX:
        return _guarded(secret, 4 * len(secret))
    body = secret.rstrip("=")
    if set(body) <= _BASE64:
        return _guarded(body, 6 * len(body))
    return _guarded(secret, 6 * len(secret))  # any other text


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
    bits = estimate_bits(secret)
    if bits < MIN_BITS:
        raise WeakSecret(
            f"{ENV} is too weak: about {bits} bits, kvferry needs at least {MIN_BITS} (32 hex digits, 22 "
            "base64 characters or 16 random bytes, not a word or a repeated piece). Make one with "
            "`kvferry secret` and set the same value on every instance."
        )
    return secret.encode(errors="surrogateescape") if isinstance(secret, str) else secret


def env_ok(prog: str) -> bool:
    """False, after saying why on stderr, when KVFERRY_SECRET is set but too weak (a command's check
    before anything listens)."""
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
    """HKDF-SHA256 of the secret under `LABELS[label]` (+ `context`), `length` bytes. A weak secret is
    refused here too, so no key ever comes from one, whoever passed it."""
    check_secret(secret)
    hkdf = HKDF(algorithm=SHA256(), length=length, salt=salt, info=LABELS[label] + context)
    return hkdf.derive(secret)


def new_secret() -> str:
    """A fresh secret: 256 random bits, base64url (what `kvferry secret` prints)."""
    return secrets.token_urlsafe(32)
