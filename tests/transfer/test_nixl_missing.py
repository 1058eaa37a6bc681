"""Without nixl installed: a clear error from the engine and from `kvferry serve --transfer nixl`."""

from __future__ import annotations

import argparse

import pytest

from kvferry import cli
from kvferry.transfer.base import TransferError, TransferErrorCause
from kvferry.transfer.nixl import api as nixl_api


def test_engine_and_serve_say_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(nixl_api, "_api", None)
    monkeypatch.setattr(nixl_api, "IMPORT_ERROR", "No module named 'nixl'")
    from kvferry.transfer.nixl.engine import NixlTransferEngine, available

    assert not available()
    with pytest.raises(TransferError) as info:
        NixlTransferEngine()
    assert info.value.cause is TransferErrorCause.INVALID and "kvferry[nixl]" in info.value.message
    args = argparse.Namespace(transfer="nixl", role="decode", host="127.0.0.1", insecure=False)
    assert not cli._check_nixl(args)
    assert "kvferry[nixl]" in capsys.readouterr().err
    assert cli._check_nixl(argparse.Namespace(transfer="nixl", role="both", host="127.0.0.1", insecure=False))
