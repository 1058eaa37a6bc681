"""Smoke test of the transfer bench's building blocks on a tiny layout (the full bench takes ~10 s)."""

from __future__ import annotations

from kvferry.bench import transfer as bench


def test_bench_memcpy_and_tcp_verify_and_report() -> None:
    cases = [("paged", 16, 1 << 20), ("contiguous", 1024, 1 << 20)]
    for case in cases:
        gbps, cpu = bench.bench_memcpy(case, reps=1, div=1, seed=0)
        assert gbps > 0 and cpu >= 0
    for gbps, cpu in bench.bench_tcp(cases, reps=2, div=1, seed=0):
        assert gbps > 0 and cpu > 0
    modes = bench.bench_tcp_modes(cases, reps=1, div=1, seed=0, modes={"tcp": None, "tcp+auth": bench.BENCH_SECRET})
    assert all(gbps > 0 for mode in modes.values() for gbps, _ in mode)


def test_memcpy_rounds_alternate_with_tcp() -> None:
    out = bench.bench_tcp_modes(
        [("paged", 16, 1 << 20)], reps=1, div=1, seed=0, modes={"tcp": None}, memcpy=True
    )
    assert list(out) == ["memcpy", "tcp"] and all(r[0][0] > 0 for r in out.values())


def test_nixl_rounds_alternate_with_memcpy_and_tcp() -> None:
    from kvferry.transfer.nixl import api as nixl_api

    if not nixl_api.available():
        import pytest

        pytest.skip("nixl not installed")
    out = bench.bench_tcp_modes(
        [("paged", 16, 1 << 20)], reps=1, div=1, seed=0, modes={"tcp": None, "nixl": bench.BENCH_SECRET}, memcpy=True,
        nixl=frozenset({"nixl"}),
    )
    assert list(out) == ["memcpy", "tcp", "nixl"] and all(r[0][0] > 0 for r in out.values())
