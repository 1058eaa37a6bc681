"""D's last gate per block is keyed with the secret (#31 item 1): a digest an attacker computes without
the key (xxh64, whose second preimages are cheap, or a MAC under another pull's key or at another
position) is refused; without a secret the digest stays xxh64."""

from __future__ import annotations

import time

import numpy as np
import xxhash

from kvferry.connector.decode.dealer import Dealer, Dealers
from kvferry.connector.decode.landed import Landed
from kvferry.connector.decode.pulls import Outbox, PullMeta, PullSpec, PullTask
from kvferry.connector.digest import block_key
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.transfer.tcp.engine import TcpTransferEngine

SPEC = KVCacheSpec(num_blocks=16, num_layers=2, num_kv_heads=4, block_size=4, head_dim=8)
SECRET = b"560ec6cb1c58da7f86b35152ea2ba433"  # a fixed random secret (128 bits)
HEADS = (0, 4)
BLOCKS = [3, 7, 1, 12]


def _layout() -> PagedKVLayout:
    kv = np.random.default_rng(5).standard_normal(SPEC.shape, dtype=np.float32)
    kv[7] = kv[3]  # blocks 3 and 7 hold the same bytes: a swap of their digests goes unseen by xxh64
    return PagedKVLayout(SPEC, kv)


def _judge(layout: PagedKVLayout, key: bytes | None, digests: list[int]) -> list[int]:
    """The indices of BLOCKS that D refuses, given every byte landed and P's claimed digests."""
    with TcpTransferEngine() as engine:
        task = PullTask(0, 0, HEADS, "tcp://127.0.0.1:1", bytes(16), digest_key=key, checksums=digests)
        task.written = [r for b in BLOCKS for r in layout.block_runs(b, HEADS)]  # all landed
        spec = PullSpec("r", "xfer-1", BLOCKS, "p", "127.0.0.1:1", len(BLOCKS) * SPEC.block_size)
        pull = PullMeta(spec, time.monotonic(), time.monotonic() + 10, [task])
        return Landed(Outbox(), layout, {0: engine}, True, Dealers(_no_dealer)).bad_blocks(pull, pull.tasks)


def test_keyed_digests_pass_and_unkeyed_ones_are_refused() -> None:
    layout = _layout()
    key = block_key(SECRET, "xfer-1", "ab" * 16)
    assert key is not None
    p_side = [layout.checksum(b, HEADS, key, i) for i, b in enumerate(BLOCKS)]  # what P sends
    assert _judge(layout, key, p_side) == []
    attacker = [layout.checksum(b, HEADS) for b in BLOCKS]  # no key: xxh64 of the bytes
    assert attacker == [
        xxhash.xxh64(b"".join(layout._byte_views[r.region][r.offset : r.end] for r in layout.block_runs(b, HEADS))).intdigest()
        for b in BLOCKS
    ]
    assert _judge(layout, key, attacker) == [0, 1, 2, 3]
    for other in (block_key(SECRET, "xfer-2", "ab" * 16), block_key(SECRET, "xfer-1", "cd" * 16)):
        assert other is not None  # another transfer's or another grant's key
        assert _judge(layout, key, [layout.checksum(b, HEADS, other, i) for i, b in enumerate(BLOCKS)]) == [0, 1, 2, 3]
    swapped = [p_side[1], p_side[0], *p_side[2:]]  # blocks 3 and 7 have the same bytes: position counts
    assert _judge(layout, key, swapped) == [0, 1]


def test_without_a_secret_the_digest_stays_xxh64() -> None:
    layout = _layout()
    assert block_key(None, "xfer-1", "ab" * 16) is None
    unkeyed = [layout.checksum(b, HEADS) for b in BLOCKS]
    assert _judge(layout, None, unkeyed) == []
    assert _judge(layout, None, [unkeyed[0] ^ 1, *unkeyed[1:]]) == [0]


def _no_dealer(addr: str, receiver: bytes) -> Dealer:
    raise AssertionError("no pull here reaches P")
