from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvferry.harness.peer import PeerProcess
from kvferry.transfer.tcp.engine import TcpTransferEngine


@pytest.fixture
def engines() -> Iterator[Callable[..., TcpTransferEngine]]:
    """Factory of in-process engines, all closed at teardown."""
    made: list[TcpTransferEngine] = []

    def make(**kw: object) -> TcpTransferEngine:
        e = TcpTransferEngine(**kw)  # type: ignore[arg-type]
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def peers() -> Iterator[Callable[..., PeerProcess]]:
    """Factory of receiver processes; every one is stopped by pid at teardown (even if frozen)."""
    made: list[PeerProcess] = []

    def make(size: int = 1 << 20, **kw: object) -> PeerProcess:
        p = PeerProcess(size, **kw)  # type: ignore[arg-type]
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()
