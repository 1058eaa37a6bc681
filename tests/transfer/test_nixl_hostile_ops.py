"""NIXL receive path against a sender that crafts its ops (issue #31, item 10 c and d): D checks each op
against its region before the grant, with no wraparound, and checks region indices before using them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from transfer_helpers import pattern

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.nixl import api as nixl_api

if not nixl_api.available():
    pytest.skip(f"nixl not installed: {nixl_api.IMPORT_ERROR}", allow_module_level=True)

from kvferry.transfer.nixl.engine import NixlTransferEngine  # noqa: E402

E = TransferErrorCause
PAGE = 4096


@pytest.fixture
def sides() -> Iterator[tuple[NixlTransferEngine, NixlTransferEngine, np.ndarray, np.ndarray, np.ndarray]]:
    """P with a source region; D with two adjacent regions carved out of one buffer ("nbr" then "dst")."""
    p, d = NixlTransferEngine(), NixlTransferEngine()
    src = pattern(4 * PAGE, 1)
    buf = np.zeros(8 * PAGE, np.uint8)
    nbr, dst = buf[: 4 * PAGE], buf[4 * PAGE :]
    p.register("src", src)
    d.register("nbr", nbr)
    d.register("dst", dst)
    yield p, d, src, nbr, dst
    p.close()
    d.close()


def _refused_fast(fn: object, limit_s: float) -> TransferError:
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        fn()  # type: ignore[operator]
    took = time.monotonic() - t0
    assert info.value.cause is E.REJECTED, info.value
    assert took < limit_s, f"refused after {took:.1f} s"
    return info.value


def test_an_offset_that_wraps_past_2_64_is_refused_and_the_neighbour_is_untouched(sides: tuple) -> None:
    p, d, _, nbr, dst = sides
    token = d.open_grant([ByteRange("dst", 0, dst.nbytes)])
    # dst + len wraps to 0, inside the grant in 64-bit arithmetic; the address wraps to the page below "dst".
    ops = [WriteOp("src", 0, "dst", 2**64 - PAGE, PAGE)]
    _refused_fast(lambda: p.write(d.address, token, ops, time.monotonic() + 10), 5)
    assert d.close_grant(token) == []
    assert not nbr.any() and not dst.any()
    assert d.stats["rejected_writes"] == 1


def test_an_out_of_range_region_index_is_refused_at_once(sides: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, _, nbr, dst = sides
    token = d.open_grant([ByteRange("dst", 0, dst.nbytes)])
    plan = p._plan

    def bad_index(tok: object, ops: object) -> list:
        chunks = plan(tok, ops)  # type: ignore[arg-type]
        chunks[0][1]["ridx"] = 7  # the token names one region
        return chunks

    monkeypatch.setattr(p, "_plan", bad_index)
    deadline = time.monotonic() + 10
    _refused_fast(lambda: p.write(d.address, token, [WriteOp("src", 0, "dst", 0, PAGE)], deadline), 5)
    assert d.close_grant(token) == []
    assert not nbr.any() and not dst.any()
    assert d.stats["rejected_writes"] == 1
