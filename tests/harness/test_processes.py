"""The harness never mistakes one server for another: ports are not handed out twice, and a child counts
as healthy only when /health comes from that very child (CI once saw D fail to bind P's port while P
answered D's health checks and requests)."""

from __future__ import annotations

import pytest

from kvferry.harness.processes import free_port
from procs import running, serve


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_child_that_cannot_bind_is_not_healthy_though_its_url_answers() -> None:
    p = serve(None, "--role", "prefill", "--num-blocks", "64")
    with running(p):
        port = int(p.url.rsplit(":", 1)[1])
        d = serve(port, "--role", "decode", "--num-blocks", "64")  # P already holds this port
        try:
            with pytest.raises(RuntimeError, match="exited with"):
                d.wait_healthy(timeout=30)
        finally:
            d.stop()
