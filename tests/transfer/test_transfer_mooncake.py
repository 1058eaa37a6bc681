"""The Mooncake backend, exercised in a private network namespace (its listeners bind every interface)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine")

from kvferry.harness.netns import unshare_prefix  # noqa: E402
from kvferry.transfer.mooncake import decode_token, encode_token  # noqa: E402


def test_token_round_trip() -> None:
    regions = {"dst": (0x7F0000001000, 1 << 20), "odd,name=x": (1, 2)}
    assert decode_token(encode_token(regions)) == regions


def test_mooncake_backend_in_a_private_netns() -> None:
    prefix = unshare_prefix()
    if prefix is None:
        pytest.skip("no private network namespace available (unshare --net)")
    script = Path(__file__).with_name("mooncake_check.py")
    proc = subprocess.Popen(
        [*prefix, sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GLOG_minloglevel": "3"},
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # by pid
            proc.wait()
    assert proc.returncode == 0 and "MOONCAKE-OK" in out, (proc.returncode, out[-2000:], err[-4000:])
