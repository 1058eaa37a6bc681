"""#31 item 4: a KVFERRY_SECRET under 128 bits is refused with a clear error, keys come from HKDF with one
label per use, and `kvferry secret` prints a fresh one."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import random
import secrets
import subprocess
import sys

import pytest

from kvferry.cli import main
from kvferry.connector.auth import TO_PREFILL, Sealer, deployment_secret, derive
from kvferry.transfer.secret import LABELS, WeakSecret, check_secret, derive_key, estimate_bits
from kvferry.transfer.tcp.engine import TcpTransferEngine

WEAK = ["s3cret", "x", "123456", "kvferry-bench-secret", "a" * 64, "password" * 8, "ab" * 40, "0123456789" * 5]


@pytest.mark.parametrize(
    ("secret", "strong"),
    [
        (secrets.token_hex(16), True),  # 32 hex digits: 128 bits (what the harness uses)
        (secrets.token_hex(16)[:31], False),
        (secrets.token_urlsafe(16), True),  # 22 base64url characters: 132 bits
        (secrets.token_urlsafe(16)[:21], False),
        (os.urandom(16), True),  # raw bytes (checked: not valid UTF-8 text)
        *[(w, False) for w in WEAK],
    ],
)
def test_the_entropy_rule(secret: str | bytes, strong: bool) -> None:
    if isinstance(secret, bytes):
        try:
            secret.decode()
            secret = b"\xff" + secret[1:]  # keep it raw bytes
        except UnicodeDecodeError:
            pass
    assert (estimate_bits(secret) >= 128) is strong, secret


@pytest.mark.parametrize("weak", WEAK[:3])
def test_a_weak_secret_is_refused_everywhere(weak: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SECRET", weak)
    with pytest.raises(WeakSecret, match="too weak.*kvferry secret"):
        deployment_secret()
    with pytest.raises(WeakSecret):
        TcpTransferEngine()  # from the env
    with pytest.raises(WeakSecret):
        TcpTransferEngine(secret=weak)
    with pytest.raises(WeakSecret):
        Sealer(weak.encode(), TO_PREFILL)  # no key is ever derived from one, whoever passes it


def test_serve_refuses_a_weak_secret_before_listening() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvferry", "serve", "--port", "0"],
        env={"KVFERRY_SECRET": "s3cret", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "KVFERRY_SECRET is too weak" in run.stderr and "kvferry secret" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_kvferry_secret_prints_a_fresh_strong_one(capsys: pytest.CaptureFixture[str]) -> None:
    made = set()
    for _ in range(2):
        assert main(["secret"]) == 0
        made.add(capsys.readouterr().out.strip())
    assert len(made) == 2
    for s in made:
        assert len(s) == 43 and estimate_bits(s) >= 128, s  # accepted (a random one: never below ~200)


def _hkdf(ikm: bytes, info: bytes, salt: bytes = b"", length: int = 32) -> bytes:
    """RFC 5869 written out, to pin the construction."""
    prk = hmac.digest(salt or bytes(32), ikm, hashlib.sha256)
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.digest(prk, block + info + bytes([i]), hashlib.sha256)
        out += block
    return out[:length]


def test_keys_are_hkdf_with_one_label_per_use() -> None:
    secret = secrets.token_urlsafe(32).encode()
    keys = {label: derive_key(secret, label) for label in LABELS}
    assert len(set(keys.values())) == len(LABELS)  # distinct per use
    for label, key in keys.items():
        assert key == _hkdf(secret, LABELS[label])
    assert derive(secret, "control") == keys["control"] == _hkdf(secret, b"kvferry/2 control mac")
    salted = derive_key(secret, "tcp", salt=b"n" * 32, context=b" th", length=128)
    assert salted == _hkdf(secret, LABELS["tcp"] + b" th", b"n" * 32, 128)


@pytest.mark.parametrize(
    "made",
    [
        "kvferry-prod-secret-123456",  # a template with a 6-digit counter: ~20 bits of guessing
        "kvferry-prod-secret-493817",
        "kvferry-prod-secret-654321-aB3",  # the same, with a few random-looking characters added
        "correct-horse-battery-staple",  # four common words
        "Kvferry.Staging.Secret.2024.07.01",
        "s3cret-from-the-env-0123456789",
    ],
)
def test_a_template_or_passphrase_counts_only_its_guessable_part(made: str) -> None:
    assert estimate_bits(made) < 128, made
    with pytest.raises(WeakSecret, match="words, numbers and separators") as refused:
        check_secret(made)
    assert "kvferry secret" in str(refused.value)


def test_random_material_in_a_template_still_counts() -> None:
    # Words around a full random token: the token alone carries the bits.
    assert estimate_bits("kvferry-prod-" + secrets.token_hex(16)) >= 128
    assert estimate_bits("kvferry-prod-" + secrets.token_urlsafe(32)) >= 128


def test_random_tokens_keep_their_full_count() -> None:
    # A random token holds word-like pieces by chance; they must not cost it its count. Seeded, so a
    # failure names a token that can be looked at again.
    rng = random.Random(39)
    for _ in range(5_000):
        assert estimate_bits(rng.randbytes(16).hex()) == 128
        for size, bits in ((16, 128), (32, 256)):
            token = base64.urlsafe_b64encode(rng.randbytes(size)).rstrip(b"=").decode()  # token_urlsafe's form
            assert estimate_bits(token) >= bits, token
