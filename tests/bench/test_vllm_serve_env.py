"""The vllm-serve benches run their servers from the vllm-serve environment, whose kvferry is an
editable install of whichever checkout built it last: one that is not this checkout's is refused with
the command that fixes it, never measured silently."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import kvferry
from kvferry.bench.vllm.servers import vllm_exe


def fake_venv(root: Path, kvferry_file: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").touch()
    python = root / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho '{kvferry_file}'\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return root


def test_an_environment_with_another_checkouts_kvferry_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_VLLM_SERVE_VENV", str(fake_venv(tmp_path, "/gone/clone/src/kvferry/__init__.py")))
    with pytest.raises(SystemExit) as exc:
        vllm_exe("kvferry bench vllm --hogs")
    assert "/gone/clone/src/kvferry" in str(exc.value) and "bash .ci/vllm-serve.sh --env-only" in str(exc.value)


def test_this_checkouts_environment_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_VLLM_SERVE_VENV", str(fake_venv(tmp_path, kvferry.__file__)))
    assert vllm_exe("kvferry bench vllm") == tmp_path / "bin" / "vllm"
    assert os.access(tmp_path / "bin" / "python", os.X_OK)
