"""The proxy's connections to P (issue 22.3): a connection whose answer was read in full serves the next
request (no connect per request), a cancelled request closes its own connection (that is how P learns to
abort) and never goes back to the idle set, and close() closes every idle one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvferry.serving.proxy_attempt import PrefillConnections

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class FakeP:
    """A minimal HTTP/1.1 server: answers every request on a connection with `{}`, except POST /hang
    (never answered); records each connection and when it closes."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed = 0
        self.hanging = 0
        self.changed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.changed.set()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST /hang"):
                    self.hanging += 1
                    self.changed.set()
                    await reader.read()  # until the proxy closes the connection
                    break
                writer.write(_OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            self.changed.set()
            writer.close()

    async def wait(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


def test_connections_are_reused_closed_on_cancel_and_closed_at_the_end() -> None:
    async def main() -> None:
        p = FakeP()
        url = await p.start()
        conns = PrefillConnections()
        try:
            for _ in range(3):
                assert (await conns.post(f"{url}/v1/completions", {"prompt": [1]})).status_code == 200
            assert (p.accepted, conns.idle()) == (1, 1)  # one connection served all three

            hung = asyncio.create_task(conns.post(f"{url}/hang", {}))
            await p.wait(lambda: p.hanging == 1)  # on the idle connection: the next request connects anew
            assert (await conns.post(f"{url}/v1/completions", {})).status_code == 200
            assert p.accepted == 2
            hung.cancel()
            await asyncio.gather(hung, return_exceptions=True)
            await p.wait(lambda: p.closed == 1)  # P sees the cancelled request's connection close
            assert conns.idle() == 1
        finally:
            await conns.close()
        await p.wait(lambda: p.closed == 2)  # and every idle one once the proxy stops
        assert p.server is not None
        p.server.close()

    asyncio.run(main())
