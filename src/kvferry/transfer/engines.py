"""The `--transfer` factory: each engine is imported only when named, so a missing optional library
matters only to whoever asks for it."""

from __future__ import annotations

from kvferry.transfer.base import TransferEngine


def new_engine(name: str, host: str = "127.0.0.1", port: int = 0, secret: str | bytes | None = None,
               advertise: str | None = None) -> TransferEngine:
    """The engine called `name`, listening on host:port (0: the kernel picks) and dialed at `advertise`.
    Mooncake takes only the host; any other name but "nixl" is the built-in TCP engine."""
    if name == "mooncake":
        from kvferry.transfer.mooncake import MooncakeTransferEngine

        return MooncakeTransferEngine(host)
    if name == "nixl":
        from kvferry.transfer.nixl.engine import NixlTransferEngine

        return NixlTransferEngine(host, port, secret=secret, advertise=advertise)
    from kvferry.transfer.tcp.engine import TcpTransferEngine

    return TcpTransferEngine(host, port, secret=secret, advertise=advertise)
