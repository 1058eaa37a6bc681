"""`kvferry bench transfer`: in-process numpy gather/scatter (memcpy) vs the TCP engine (plain and
authenticated) vs NIXL vs Mooncake TE.

Receivers run in a subprocess so the two sides share no GIL; the backends' repetitions alternate so a
noisy box loads them alike. Mooncake runs in a private network namespace (its listeners bind every
interface). Every byte is verified with xxh3 outside the timed part; GB/s is the median."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvferry.transfer.base import ByteRange, WriteOp

MiB = 1 << 20
GiB = 1 << 30
# (layout, block KiB, total bytes per repetition); "contiguous" is one run of `total` bytes.
LAYOUTS = [("paged", 2, 16 * MiB), ("paged", 16, 64 * MiB), ("paged", 64, 64 * MiB), ("paged", 256, 64 * MiB),
           ("contiguous", 16 * 1024, 16 * MiB)]
REGION = 64 * MiB

Case = tuple[str, int, int]
Result = tuple[float, float]  # median GB/s, CPU seconds per GiB
Sample = tuple[float, float, int]  # seconds, CPU seconds, bytes of one verified repetition
BENCH_SECRET = "kvferry-bench-secret-0f3kQ2pX7vL9mZ4wTq"  # >= 128 bits by transfer.secret's rules


def _plan(case: Case, div: int, rng: np.random.Generator) -> tuple[int, np.ndarray, np.ndarray]:
    """Block size, src ids, dst ids (a contiguous case is a single block)."""
    layout, kib, total = case
    total //= div
    if layout == "contiguous":
        return total, np.zeros(1, np.int64), np.zeros(1, np.int64)
    bs = kib * 1024
    n = total // bs
    return bs, rng.permutation(REGION // bs)[:n], rng.permutation(REGION // bs)[:n]


def _digest(mem: np.ndarray, bs: int, ids: np.ndarray) -> str:
    h = xxhash.xxh3_64()
    for i in ids.tolist():
        h.update(mem[i * bs : (i + 1) * bs].data)
    return str(h.hexdigest())


def _ops(bs: int, si: np.ndarray, di: np.ndarray) -> list[WriteOp]:
    return [WriteOp("src", s * bs, "dst", d * bs, bs) for s, d in zip(si.tolist(), di.tolist(), strict=True)]


def _summary(samples: list[Sample]) -> Result:
    speeds = [n / dt / 1e9 for dt, _, n in samples]
    return statistics.median(speeds), sum(c for _, c, _ in samples) / (sum(n for _, _, n in samples) / GiB)


def _measure(reps: int, once: Callable[[], Sample]) -> Result:
    return _summary([once() for _ in range(reps)])


def _memcpy_once(src: np.ndarray, dst: np.ndarray, bs: int, si: np.ndarray, di: np.ndarray) -> Sample:
    dst.fill(0)
    s2, d2 = src[: REGION // bs * bs].reshape(-1, bs), dst[: REGION // bs * bs].reshape(-1, bs)
    c0, t0 = time.process_time(), time.perf_counter()
    d2[di] = s2[si]
    t1, c1 = time.perf_counter(), time.process_time()
    assert _digest(src, bs, si) == _digest(dst, bs, di), "memcpy bytes differ"
    return t1 - t0, c1 - c0, bs * len(si)


def bench_memcpy(case: Case, reps: int, div: int, seed: int) -> Result:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, REGION, np.uint8)
    dst = np.zeros(REGION, np.uint8)
    return _measure(reps, lambda: _memcpy_once(src, dst, *_plan(case, div, rng)))


def bench_tcp(cases: list[Case], reps: int, div: int, seed: int, secret: str | None = None) -> list[Result]:
    return bench_tcp_modes(cases, reps, div, seed, {"tcp": secret})["tcp"]


def bench_tcp_modes(cases: list[Case], reps: int, div: int, seed: int, modes: dict[str, str | None],
                    memcpy: bool = False, nixl: frozenset[str] = frozenset()) -> dict[str, list[Result]]:
    """One sender engine and receiver process per mode (name → secret or None; `nixl`: the NIXL modes); the
    modes' repetitions alternate (with `memcpy` an in-process copy first), so a noisy box loads them alike."""
    from kvferry.harness.peer import PeerProcess
    from kvferry.transfer.engines import new_engine

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, REGION, np.uint8)
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_SECRET"}
    out: dict[str, list[Result]] = {m: [] for m in (["memcpy"] if memcpy else []) + list(modes)}
    copy_dst = np.zeros(REGION if memcpy else 0, np.uint8)
    with contextlib.ExitStack() as stack:
        ends = {}
        for mode, secret in modes.items():
            transfer = "nixl" if mode in nixl else "tcp"
            engine = stack.enter_context(new_engine(transfer, secret=secret or b""))
            peer_env = {**env, "KVFERRY_SECRET": secret} if secret else env
            peer = stack.enter_context(PeerProcess(REGION, env=peer_env, transfer=transfer))
            engine.register("src", src)
            ends[mode] = (engine, peer)

        def once(mode: str, bs: int, si: np.ndarray, di: np.ndarray) -> Sample:
            engine, peer = ends[mode]
            ops = _ops(bs, si, di)
            peer.call("fill", value=0)
            token = peer.grant([ByteRange("dst", 0, REGION)])
            pc0 = peer.call("stats")["cpu"]
            c0, t0 = time.process_time(), time.perf_counter()
            engine.write(peer.address, token, ops, time.monotonic() + 60)
            t1, c1 = time.perf_counter(), time.process_time()
            pc1 = peer.call("stats")["cpu"]
            peer.close_grant(token)
            pieces = [(d * bs, bs) for d in di.tolist()]
            assert peer.digest(pieces) == _digest(src, bs, si), f"{mode} bytes differ"
            return t1 - t0, (c1 - c0) + (pc1 - pc0), bs * len(si)

        for case in cases:
            samples: dict[str, list[Sample]] = {m: [] for m in out}
            for _ in range(reps):
                bs, si, di = _plan(case, div, rng)
                if memcpy:
                    samples["memcpy"].append(_memcpy_once(src, copy_dst, bs, si, di))
                for mode in modes:
                    samples[mode].append(once(mode, bs, si, di))
            for mode in out:
                out[mode].append(_summary(samples[mode]))
    return out


def _mooncake_worker(cfg: dict[str, Any]) -> list[Result]:
    """Runs inside the namespace: both Mooncake engines in this process."""
    from kvferry.harness.netns import loopback_up
    from kvferry.transfer.mooncake import MooncakeTransferEngine

    loopback_up()
    rng = np.random.default_rng(cfg["seed"])
    src = rng.integers(0, 256, REGION, np.uint8)
    dst = np.zeros(REGION, np.uint8)
    a, b = MooncakeTransferEngine(), MooncakeTransferEngine()
    try:
        a.register("src", src)
        b.register("dst", dst)
        out = []
        for case in cfg["cases"]:

            def once(case: Case = tuple(case)) -> Sample:  # type: ignore[assignment]
                bs, si, di = _plan(case, cfg["div"], rng)
                ops = _ops(bs, si, di)
                dst.fill(0)
                token = b.open_grant([ByteRange("dst", 0, REGION)])
                c0, t0 = time.process_time(), time.perf_counter()
                a.write(b.address, token, ops, time.monotonic() + 60)
                t1, c1 = time.perf_counter(), time.process_time()
                b.close_grant(token)
                assert _digest(src, bs, si) == _digest(dst, bs, di), "mooncake bytes differ"
                return t1 - t0, c1 - c0, bs * len(si)

            out.append(_measure(cfg["reps"], once))
        return out
    finally:
        a.close()
        b.close()


def bench_mooncake(cases: list[Case], reps: int, div: int, seed: int) -> tuple[list[Result] | None, str]:
    from kvferry.harness.netns import unshare_prefix
    from kvferry.transfer import mooncake

    if not mooncake.available():
        return None, "mooncake not installed"
    prefix = unshare_prefix()
    if prefix is None:
        return None, "no private network namespace (unshare) for Mooncake's all-interface listeners"
    cfg = json.dumps({"cases": cases, "reps": reps, "div": div, "seed": seed})
    env = {**os.environ, "GLOG_minloglevel": "3"}
    proc = subprocess.run([*prefix, sys.executable, "-m", "kvferry.bench.transfer", "--mooncake-worker", cfg],
                          capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        return None, f"mooncake worker failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])], ""  # type: ignore[misc]


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    from kvferry.bench.report import report
    from kvferry.transfer.nixl import api as nixl_api

    reps, div = (2, 4) if quick else (5, 1)  # repetitions, divisor of each case's total bytes
    seed = 1234
    cases: list[Case] = list(LAYOUTS)

    modes: dict[str, str | None] = {"tcp": None, "tcp+auth": BENCH_SECRET}
    if nixl_api.available():
        modes["nixl"] = BENCH_SECRET  # authenticated (tags on tokens and notifications, not on bytes)
    results = bench_tcp_modes(cases, reps, div, seed, modes, memcpy=True, nixl=frozenset({"nixl"}))
    mc, why = bench_mooncake(cases, reps, div, seed)
    if mc is not None:
        results["mooncake"] = mc
    rows: list[dict[str, Any]] = []
    for i, (layout, kib, _) in enumerate(cases):
        for backend, res in results.items():
            gbps, cpu = res[i]
            rows.append({"backend": backend, "layout": layout, "block_kib": kib, "GB/s": round(gbps, 3),
                         "cpu_s_per_gib": round(cpu, 3), "x_memcpy": round(gbps / results["memcpy"][i][0], 3),
                         "x_tcp": round(gbps / results["tcp"][i][0], 3) if backend in ("tcp+auth", "nixl")
                         else None,
                         "x_mooncake": round(gbps / mc[i][0], 2) if mc is not None else None})
    report("kvferry bench transfer", rows, json_path)
    if why:
        print(f"mooncake skipped: {why}", file=sys.stderr)
    if "nixl" not in results:
        print(f"nixl skipped: not installed ({nixl_api.IMPORT_ERROR})", file=sys.stderr)
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--mooncake-worker"]:  # bench_mooncake's subprocess
    print(json.dumps(_mooncake_worker(json.loads(sys.argv[2]))))
