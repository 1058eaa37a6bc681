"""`VllmKVLayout`: the byte runs it names for a block are exactly that block's bytes, for vLLM's physical
KV cache layouts (layer- or block-outermost, heads inside or outside the block) and any head split."""

from __future__ import annotations

from typing import Any

import pytest

torch: Any = pytest.importorskip("torch")

from kvferry.integrations.vllm.layout import UnsupportedKVCacheError, VllmKVLayout, host_mirror  # noqa: E402

L, B, H, N, C = 3, 5, 4, 4, 8  # layers, blocks, KV heads, tokens per block, K|V content (elements)


def layer_views(layout: str, blocks: int = B, H: int = H) -> dict[str, Any]:  # noqa: N803
    """Per-layer [B, H, N, C] views of one allocation, strided as vLLM's layouts are."""
    raw = torch.zeros(L * blocks * H * N * C, dtype=torch.float16)
    if layout == "LBNHC":  # layer-outermost, tokens outside heads: each layer one dense region
        views = [raw.view(L, blocks, N, H, C)[i].permute(0, 2, 1, 3) for i in range(L)]
    elif layout == "LBHNC":
        views = [raw.view(L, blocks, H, N, C)[i] for i in range(L)]
    elif layout == "LHBNC":  # heads outside blocks: a block is one run per head
        views = [raw.view(L, H, blocks, N, C)[i].permute(1, 0, 2, 3) for i in range(L)]
    elif layout == "BLHNC":  # block-outermost: layers interleave, one region for the allocation
        views = [raw.view(blocks, L, H, N, C)[:, i] for i in range(L)]
    else:
        raise ValueError(layout)
    return {f"layers.{i}.attn": v for i, v in enumerate(views)}


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLHNC"])
@pytest.mark.parametrize("heads", [(0, H), (0, 2), (1, 3), (3, 4)])
def test_runs_are_exactly_the_blocks_bytes(layout: str, heads: tuple[int, int]) -> None:
    caches = layer_views(layout)
    kv = VllmKVLayout(caches, num_blocks=B, block_size=N)
    assert kv.num_kv_heads == H and kv.block_bytes == L * H * N * C * 2
    regions = {name: buf for name, buf in kv.regions().items()}
    for block in range(B):
        for buf in regions.values():
            buf[:] = 0
        runs = kv.block_runs(block, heads)
        for r in runs:
            assert regions[r.region][r.offset : r.end].sum() == 0, "runs overlap"
            regions[r.region][r.offset : r.end] = 1
        h0, h1 = heads
        for view in caches.values():
            marked = view.view(torch.uint8) == 1
            assert marked[block, h0:h1].all()
            assert int(marked.sum()) == marked[block, h0:h1].numel()
        if heads == (0, H) and layout in ("LBNHC", "LBHNC"):
            assert len(runs) == L  # one run per layer for whole blocks
        if layout == "BLHNC" and heads == (0, H):
            assert len(runs) == 1  # all layers of a block are one contiguous page


def test_kernel_blocks_split_a_manager_block() -> None:
    caches = layer_views("LBNHC", blocks=2 * B)
    kv = VllmKVLayout(caches, num_blocks=B, block_size=2 * N)
    region = kv.regions()["layers.0.attn"]
    region[:] = 0
    for r in kv.block_runs(1, (0, H)):
        region[r.offset : r.end] = 1
    marked = caches["layers.0.attn"].view(torch.uint8) == 1
    assert marked[2:4].all() and int(marked.sum()) == marked[2:4].numel()


def test_checksums_match_between_identical_layouts() -> None:
    a, b = layer_views("LBNHC"), layer_views("LBNHC")
    for name in a:
        a[name].normal_()
        b[name].copy_(a[name])
    ka, kb = VllmKVLayout(a, B, N), VllmKVLayout(b, B, N)
    assert [ka.checksum(i, (0, H)) for i in range(B)] == [kb.checksum(i, (0, H)) for i in range(B)]
    b["layers.1.attn"][2, 0, 0, 0] += 1
    assert ka.checksum(2, (0, H)) != kb.checksum(2, (0, H)) and ka.checksum(1, (0, H)) == kb.checksum(1, (0, H))


def test_rejects_what_it_cannot_move() -> None:
    with pytest.raises(UnsupportedKVCacheError):
        VllmKVLayout({}, B, N)
    with pytest.raises(UnsupportedKVCacheError, match="blocks"):
        VllmKVLayout(layer_views("LBNHC", blocks=B + 1), B, N)
    with pytest.raises(UnsupportedKVCacheError, match="torch.Tensor"):
        VllmKVLayout({"x": [1, 2, 3]}, B, N)


def kv_first_views(blocks: int = B) -> dict[str, Any]:
    """K and V outside the block dim (`[2, B, ...]` per layer, as FlashAttention's shape): the V half's
    offset depends on the pool size."""
    raw = torch.zeros(L * 2 * blocks * H * N * (C // 2), dtype=torch.float16)
    per = raw.view(L, 2, blocks, H, N, C // 2)
    return {f"layers.{i}.attn": per[i].permute(1, 2, 3, 0, 4) for i in range(L)}


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "KV-first"])
@pytest.mark.parametrize(("p_blocks", "d_blocks"), [(B, 2 * B + 3), (2 * B + 3, B)])
def test_p_writes_into_a_d_pool_of_another_size(layout: str, p_blocks: int, d_blocks: int) -> None:
    """D describes its own memory; P's write ops put every byte of its block in D's block, for any pool sizes."""
    from kvferry.connector.layout import write_ops

    def make(blocks: int) -> dict[str, Any]:
        return kv_first_views(blocks) if layout == "KV-first" else layer_views(layout, blocks)

    p_caches, d_caches = make(p_blocks), make(d_blocks)
    for view in p_caches.values():
        view.normal_()
    p = VllmKVLayout(p_caches, p_blocks, N)
    d = VllmKVLayout(d_caches, d_blocks, N)
    assert p.peer_mismatch(d.describe()) is None
    src, dst = [1, 4, 0], [d_blocks - 1, 2, 3]
    for heads in [(0, H), (1, 3)]:
        ops = write_ops(p, src, dst, heads, d_blocks, d.describe())
        p_regions, d_regions = p.regions(), d.regions()
        for op in ops:  # what the TCP engine does with each op
            d_regions[op.dst_region][op.dst_offset : op.dst_offset + op.length] = \
                p_regions[op.src_region][op.src_offset : op.src_offset + op.length]
        h0, h1 = heads
        for name in p_caches:
            for s, t in zip(src, dst, strict=True):
                assert torch.equal(d_caches[name][t, h0:h1], p_caches[name][s, h0:h1])
        assert [d.checksum(t, heads) for t in dst] == [p.checksum(s, heads) for s in src]
    written = sum(int((v != 0).sum()) for v in d_caches.values())
    assert written == sum(int(v[src].numel()) for v in p_caches.values())  # nothing outside the blocks


def test_a_peer_with_another_layout_is_refused_with_a_reason() -> None:
    p = VllmKVLayout(layer_views("LBNHC"), B, N)
    assert "differently" in (p.peer_mismatch(VllmKVLayout(layer_views("LHBNC"), B, N).describe()) or "")
    small = {k: v[:, :2] for k, v in layer_views("LBHNC").items()}
    assert "shape" in (p.peer_mismatch(VllmKVLayout(small, B, N).describe()) or "")


def filled(caches: dict[str, Any]) -> dict[str, Any]:
    for view in caches.values():
        view.normal_()
    return caches


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLHNC"])
def test_staged_layout_registers_a_mirror_and_copies_exactly_the_named_blocks(layout: str) -> None:
    caches = filled(layer_views(layout))
    original = {name: view.clone() for name, view in caches.items()}
    kv = VllmKVLayout(caches, B, N, staging=True)
    plain = VllmKVLayout(layer_views(layout), B, N)
    assert kv.staged and not plain.staged
    assert [r.length for r in kv.block_runs(3, (0, H))] == [r.length for r in plain.block_runs(3, (0, H))]
    for region in kv.regions().values():
        assert not region.any(), "the mirror starts empty: registered memory is not the KV cache"
    kv.stage_out([3, 1])
    views = kv.host_tensors()
    assert all(views[name].data_ptr() != caches[name].data_ptr() for name in caches)
    for name in caches:
        assert torch.equal(views[name][[1, 3]], caches[name][[1, 3]])
        assert not views[name][[0, 2, 4]].any()
    assert kv.checksum(3, (0, H)) == VllmKVLayout(original, B, N).checksum(3, (0, H))

    for name in caches:  # D: blocks arrive in the mirror, and reach the KV cache only when staged in
        views[name][2] = 7.0
    kv.stage_in([2])
    for name in caches:
        assert (caches[name][2] == 7.0).all()
        assert torch.equal(caches[name][[0, 1, 3, 4]], original[name][[0, 1, 3, 4]])


def test_staging_respects_kernel_blocks_and_refuses_unknown_blocks() -> None:
    caches = filled(layer_views("LBNHC", blocks=2 * B))
    kv = VllmKVLayout(caches, num_blocks=B, block_size=2 * N, staging=True)
    kv.stage_out([1])
    region = kv.regions()["layers.0.attn"]
    for r in kv.block_runs(1, (0, H)):
        assert region[r.offset : r.end].any()
    assert not kv.regions()["layers.0.attn"][: kv.block_runs(1, (0, H))[0].offset].any()
    with pytest.raises(ValueError, match="out of range"):
        kv.stage_out([B])


def test_a_device_cache_with_staging_off_is_refused_with_the_way_out() -> None:
    caches = {name: view.to("meta") for name, view in layer_views("LBHNC").items()}
    with pytest.raises(UnsupportedKVCacheError, match="staging"):
        VllmKVLayout(caches, B, N, staging=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kv_cache_is_staged_through_pinned_host_memory() -> None:
    p_caches = {name: view.to("cuda").normal_() for name, view in layer_views("LBNHC").items()}
    d_caches = {name: torch.zeros_like(view) for name, view in p_caches.items()}
    p, d = VllmKVLayout(p_caches, B, N), VllmKVLayout(d_caches, B, N)
    assert p.staged and d.staged
    assert all(region.is_pinned() for region in host_mirror(p_caches).values())
    p.stage_out([0, 4])
    for name, src in p.host_tensors().items():
        d.host_tensors()[name].copy_(src)  # what the transfer engine does between the two mirrors
    d.stage_in([4])
    for name in p_caches:
        assert torch.equal(d_caches[name][4], p_caches[name][4]) and not d_caches[name][0].any()



def pull_and_read_at_once(device: str) -> None:
    """P and D with KV caches on `device`, staged through host mirrors, over kvferry's TCP data plane
    (PDConnector's worker roles, driven as vLLM's model runner drives KVFerryConnector): the moment D
    reports the request as received, its blocks hold P's bytes. On CUDA they are read from another
    stream (vLLM's forward runs on its own) while the legacy default stream is kept busy, as a model would
    keep it: staging must neither wait behind that work nor leave its copies queued there."""
    import contextlib
    import time
    import uuid

    from kvferry.connector.base import ConnectorRole
    from kvferry.connector.config import PDConfig
    from kvferry.connector.decode.pulls import PullSpec
    from kvferry.connector.facade import PDConnector
    from kvferry.connector.metadata import PDMetadata, SendSpec
    from procs import free_port

    cuda = device == "cuda"
    layers, blocks, heads, tokens, content = 8, 64, 8, 16, 128  # 16 MiB of fp16 per side

    def caches(fill: bool) -> dict[str, Any]:
        raw = torch.zeros(layers * blocks * tokens * heads * content, dtype=torch.float16, device=device)
        if fill:
            raw.normal_()
        per = raw.view(layers, blocks, tokens, heads, content)  # LBNHC, as vLLM lays it out by default
        return {f"layers.{i}.attn": per[i].permute(0, 2, 1, 3) for i in range(layers)}

    p_caches, d_caches = caches(True), caches(False)
    p_layout = VllmKVLayout(p_caches, blocks, tokens, staging=True)
    d_layout = VllmKVLayout(d_caches, blocks, tokens, staging=True)
    src, dst = list(range(0, 64, 2)), list(range(63, 31, -1))
    want = {name: cache[src].cpu() for name, cache in p_caches.items()}
    port = free_port()
    p = PDConnector(ConnectorRole.WORKER, PDConfig(role="prefill", engine_id="p", bootstrap_port=port,
                                                   block_size=tokens, abort_timeout_s=20.0))
    d = PDConnector(ConnectorRole.WORKER, PDConfig(role="decode", engine_id="d", bootstrap_port=free_port(),
                                                   block_size=tokens, kv_load_deadline_s=30.0))
    sleep = getattr(torch.cuda, "_sleep", None) if cuda else None
    busy = torch.cuda.Event() if cuda else None
    if busy is not None:
        busy.record(torch.cuda.default_stream())
    forward = torch.cuda.Stream() if cuda else None  # where vLLM's model would read the blocks
    try:
        p.register_kv_layout(p_layout)
        d.register_kv_layout(d_layout)
        transfer_id = f"xfer-{uuid.uuid4()}"
        num_tokens = len(src) * tokens
        p.start_load_kv(PDMetadata(to_send=[SendSpec(transfer_id=transfer_id, request_id="p-req", block_ids=src,
                                                     num_tokens=num_tokens)]))
        p.get_finished(set())
        d.start_load_kv(PDMetadata(to_pull=[PullSpec(request_id="d-req", transfer_id=transfer_id, block_ids=dst,
                                                     engine_id="p", bootstrap_addr=f"127.0.0.1:{port}",
                                                     num_tokens=num_tokens)]))
        deadline = time.monotonic() + 30.0
        while True:
            assert time.monotonic() < deadline, "D never reported the pull"
            if sleep is not None and busy is not None and busy.query():  # one "model kernel" of a few ms pending
                sleep(5_000_000)
                busy.record(torch.cuda.default_stream())
            p.start_load_kv(PDMetadata())
            p.get_finished(set())
            _, received = d.get_finished(set())
            if "d-req" in received:
                break
            time.sleep(0.001)
        with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
            got = {name: d_caches[name][dst].clone() for name in d_caches}  # as a forward launched right now
        if forward is not None:
            forward.synchronize()
        assert not [load for load in d.take_load_reports() if load.cause or load.block_ids]
        for name in d_caches:
            assert torch.equal(got[name].cpu(), want[name]), f"{name}: D's blocks were not in place when reported"
        untouched = [b for b in range(blocks) if b not in dst]
        assert not any(bool(d_caches[name][untouched].any()) for name in d_caches)
    finally:
        if cuda:
            torch.cuda.synchronize()
        d.close()
        p.close()


def test_pulled_blocks_are_in_d_kv_cache_when_reported() -> None:
    pull_and_read_at_once("cpu")  # CPU tensors, staging forced: the same path without a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pulled_blocks_are_in_d_kv_cache_when_reported() -> None:
    pull_and_read_at_once("cuda")


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLHNC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 1), (1, 2), (1, 4), (4, 2), (2, 4)])
def test_tp_ranks_with_different_head_slices_move_exactly_their_heads(layout: str, p_tp: int, d_tp: int) -> None:
    """P and D with different tensor parallel sizes (a rank may hold one head, whose head stride says
    nothing): every D rank gets exactly its heads of the model's KV from the P ranks that hold them,
    whatever the layout cuts each side's runs into."""
    from kvferry.connector.layout import overlap, p_ranks_for, write_ops

    full = torch.randn(L, B, H, N, C).to(torch.float16)  # the model's KV, all heads
    p_views = [layer_views(layout, H=H // p_tp) for _ in range(p_tp)]
    for r, views in enumerate(p_views):
        for i, view in enumerate(views.values()):
            view.copy_(full[i, :, r * H // p_tp:(r + 1) * H // p_tp])
    p_kv = [VllmKVLayout(v, B, N, tp_rank=r, tp_size=p_tp) for r, v in enumerate(p_views)]
    d_views = [layer_views(layout, blocks=B + 2, H=H // d_tp) for _ in range(d_tp)]
    d_kv = [VllmKVLayout(v, B + 2, N, tp_rank=r, tp_size=d_tp) for r, v in enumerate(d_views)]
    src, dst = [3, 0], [5, 1]
    for d in range(d_tp):
        for p in p_ranks_for(H, p_tp, d_tp, d):
            heads = overlap(H, p_tp, p, d_tp, d)
            assert heads is not None and p_kv[p].peer_mismatch(d_kv[d].describe()) is None
            p_regions, d_regions = p_kv[p].regions(), d_kv[d].regions()
            for op in write_ops(p_kv[p], src, dst, heads, B + 2, d_kv[d].describe()):
                d_regions[op.dst_region][op.dst_offset:op.dst_offset + op.length] = (
                    p_regions[op.src_region][op.src_offset:op.src_offset + op.length])
            for b_src, b_dst in zip(src, dst, strict=True):
                assert p_kv[p].checksum(b_src, heads) == d_kv[d].checksum(b_dst, heads)
        per = H // d_tp
        for i, view in enumerate(d_views[d].values()):
            for b_src, b_dst in zip(src, dst, strict=True):
                assert torch.equal(view[b_dst], full[i, b_src, d * per:(d + 1) * per])
