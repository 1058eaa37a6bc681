"""A `KVLayout` over vLLM's per-layer KV cache tensors, so kvferry moves vLLM's KV blocks without knowing
vLLM's memory layout: a block's byte runs come from the tensors' strides, so any layout works as long as
P and D use the same one. A layer dense in memory is its own region; interleaved layers share one region
per backing storage.

Device KV caches are staged through a host mirror with the same shapes, strides and storage sharing, so
byte runs and checksums match host memory: P copies device → mirror before reading (`stage_out`), D
copies mirror → device before the scheduler sees the blocks (`stage_in`). Both wait for their copies
before returning, because the next reader (P's data plane, vLLM's forward on its own stream) reads the
result from elsewhere."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from kvferry.connector.layout import KVLayout, LayoutDescription, StridedSegment, strided_block_runs
from kvferry.integrations.vllm.groups import KVGroups
from kvferry.transfer.base import ByteRange


class UnsupportedKVCacheError(ValueError):
    pass


class DeviceCopies:
    """Launches staging copies; `launch` returns a function that blocks until they complete. This base
    runs them synchronously (CPU tensors, the `meta` device)."""

    def launch(self, copies: Sequence[Callable[[], object]]) -> Callable[[], None]:
        for copy in copies:
            copy()
        return lambda: None


class CudaCopies(DeviceCopies):
    """Copies on a dedicated non-blocking CUDA stream, so they neither wait for the model's kernels nor
    the model for them; complete when an event recorded after them is."""

    def __init__(self, device: Any) -> None:
        import torch

        self.stream = torch.cuda.Stream(device=device)

    def launch(self, copies: Sequence[Callable[[], object]]) -> Callable[[], None]:
        import torch

        with torch.cuda.stream(self.stream):
            for copy in copies:
                copy()
            done = torch.cuda.Event()
            done.record(self.stream)
        # An event per launch, not stream.synchronize(): send threads launch on this stream
        # concurrently, and each waits only for its own copies.
        return done.synchronize  # type: ignore[no-any-return]


class BarrierCopies(DeviceCopies):
    """Another accelerator: copies on its current stream, then the whole device synchronized."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def launch(self, copies: Sequence[Callable[[], object]]) -> Callable[[], None]:
        import torch

        for copy in copies:
            copy()
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            return functools.partial(accelerator.synchronize, self.device)
        return functools.partial(getattr(torch, self.device.type).synchronize, self.device)


def device_copies(device: Any) -> DeviceCopies:
    """How staging copies on `device` are launched and waited for."""
    kind = getattr(device, "type", "cpu")
    if kind in ("cpu", "meta"):
        return DeviceCopies()
    if kind == "cuda":
        return CudaCopies(device)
    return BarrierCopies(device)


class VllmKVLayout(KVLayout):
    """Regions and block runs of vLLM's per-layer KV cache tensors. `num_blocks` is the scheduler's count;
    a layer tensor may hold a whole multiple of it (kernel blocks smaller than manager blocks)."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int, block_size: int,
                 staging: bool | None = None, tp_rank: int = 0, tp_size: int = 1, replicated: bool = False,
                 groups: KVGroups | None = None) -> None:
        """`staging`: None stages device tensors; True always; False never (a device tensor is refused).
        The tensors hold rank `tp_rank`'s slice of the KV heads, unless `replicated` (MLA's latent cache)."""
        if not kv_caches:
            raise UnsupportedKVCacheError("no KV cache tensors to register")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._regions: dict[str, Any] = {}
        self._storages: dict[int, str] = {}  # storage base address → region name
        first = next(iter(kv_caches.values()))
        self._ratio = max(1, int(getattr(first, "shape", (num_blocks,))[0]) // max(1, num_blocks))
        self._names = sorted(kv_caches)
        on_device = any(getattr(getattr(t, "device", None), "type", "cpu") != "cpu" for t in kv_caches.values())
        self.staged = on_device if staging is None else staging
        registered = host_mirror(kv_caches) if self.staged else kv_caches
        # (KV cache tensor, the host tensor registered for it): the same tensor when not staged.
        self._pairs = [(kv_caches[name], registered[name]) for name in self._names]
        devices = {str(getattr(t, "device", "cpu")) for t in kv_caches.values()}
        if self.staged and len(devices) > 1:
            raise UnsupportedKVCacheError(f"KV cache tensors on several devices {sorted(devices)}; one worker, one device")
        # How staging copies run and are waited for (tests replace it with one that completes late).
        self.copies = device_copies(getattr(first, "device", None)) if self.staged else DeviceCopies()
        self._layers = [self._add_layer(name, registered[name]) for name in self._names]
        heads = {layer.dims[0][0] for layer in self._layers}
        if len(heads) != 1:
            raise UnsupportedKVCacheError(f"layers disagree on the number of KV heads: {sorted(heads)}")
        held = heads.pop()
        if not 0 <= tp_rank < tp_size:
            raise UnsupportedKVCacheError(f"tensor parallel rank {tp_rank} out of range for size {tp_size}")
        self.replicated = replicated
        self.num_kv_heads = held if replicated else held * tp_size
        first_head = 0 if replicated else tp_rank * held
        self._block_bytes = sum(
            self._ratio * math.prod(size for size, _ in layer.dims) * layer.itemsize for layer in self._layers
        )
        self._description = LayoutDescription(num_blocks, self._ratio, self._layers, first_head,
                                              self.num_kv_heads, replicated=replicated)
        self._set_groups(groups)

    def _set_groups(self, groups: KVGroups | None) -> None:
        """vLLM's KV cache groups: block id g * pool_blocks + b is block b of group g's layers."""
        self.groups, self.pool_blocks = groups, self.num_blocks
        self._group_pairs = [self._pairs]  # per group: its layers' (KV cache, host tensor)
        if groups is None or not groups.hybrid:
            return
        of = {name: g for g, group in enumerate(groups.groups) for name in group.layer_names}
        missing = sorted(set(self._names) - set(of))
        if missing:
            raise UnsupportedKVCacheError(f"KV cache tensors of layers in no KV cache group: {missing[:3]}")
        n = len(groups.groups)
        self.num_blocks = n * self.pool_blocks
        self._block_bytes //= n  # a (virtual) block is one group's layers: the mean, for byte counts
        self._group_pairs = [[pair for name, pair in zip(self._names, self._pairs, strict=True) if of[name] == g]
                             for g in range(n)]
        self._description = msgspec.structs.replace(self._description, num_blocks=self.num_blocks, groups=n,
                                                    segment_groups=[of[name] for name in self._names])

    def blocks_for(self, num_tokens: int) -> int:
        return super().blocks_for(num_tokens) if self.groups is None else self.groups.blocks_for(num_tokens)

    def pull_positions(self, num_tokens: int, first_block: int) -> list[int]:
        if self.groups is None:
            return super().pull_positions(num_tokens, first_block)
        return self.groups.pull_positions(num_tokens, first_block)

    def _add_layer(self, name: str, cache: Any) -> StridedSegment:
        import torch

        if not isinstance(cache, torch.Tensor):
            raise UnsupportedKVCacheError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
        if cache.device.type != "cpu":
            raise UnsupportedKVCacheError(
                f"{name}: KV cache on {cache.device} with staging off; kvferry's transfer engines move "
                "host memory (staging \"auto\" or \"always\" copies through a host mirror)"
            )
        if cache.dim() < 3:
            raise UnsupportedKVCacheError(f"{name}: expected a [blocks, heads, ...] view, got shape {tuple(cache.shape)}")
        if any(s < 0 for s in cache.stride()):
            raise UnsupportedKVCacheError(f"{name}: negative strides are not supported")
        if cache.shape[0] != self.num_blocks * self._ratio:
            raise UnsupportedKVCacheError(
                f"{name}: {cache.shape[0]} blocks, expected {self.num_blocks} x {self._ratio} kernel blocks")
        isz = cache.element_size()
        order = sorted(range(cache.dim()), key=lambda i: cache.stride(i), reverse=True)
        dense = cache.permute(order)
        if dense.is_contiguous():
            region, base = name, 0
            self._regions[name] = dense.view(torch.uint8).reshape(-1).numpy()
        else:
            storage = cache.untyped_storage()
            region = self._storages.get(storage.data_ptr(), "")
            if not region:
                region = self._storages[storage.data_ptr()] = f"storage{len(self._storages)}"
                flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                self._regions[region] = flat.numpy()
            base = cache.data_ptr() - storage.data_ptr()
        dims = [(int(cache.shape[i]), cache.stride(i) * isz) for i in range(1, cache.dim())]
        return StridedSegment(region, base, cache.stride(0) * isz, dims, isz)

    def regions(self) -> dict[str, Any]:
        return dict(self._regions)

    def host_tensors(self) -> dict[str, Any]:
        """The host tensor registered for each layer: its mirror when staged, else the KV cache itself."""
        return {name: host for name, (_, host) in zip(self._names, self._pairs, strict=True)}

    def stage_out(self, block_ids: Sequence[int]) -> None:
        """Device → mirror; returns once the mirror holds the blocks (the data plane reads it next)."""
        self._stage(block_ids, lambda cache, host, index: host.index_copy_(
            0, index, cache.index_select(0, index.to(cache.device)).cpu()))

    def stage_in(self, block_ids: Sequence[int]) -> None:
        """Mirror → device; returns once the KV cache holds the blocks (vLLM's forward may read them next)."""
        self._stage(block_ids, lambda cache, host, index: cache.index_copy_(
            0, index.to(cache.device), host.index_select(0, index).to(cache.device)))

    def _stage(self, block_ids: Sequence[int], copy: Callable[[Any, Any, Any], object]) -> None:
        """`copy(KV cache, host tensor, kernel block index)` for every layer; returns once all are done."""
        if not self.staged or not block_ids:
            return
        wait = self.copies.launch([functools.partial(copy, cache, host, index)
                                   for pairs, index in self._by_group(block_ids) for cache, host in pairs])
        wait()

    def _by_group(self, block_ids: Sequence[int]) -> list[tuple[list[tuple[Any, Any]], Any]]:
        """(the group's (KV cache, host) tensor pairs, kernel block index) per KV cache group of `block_ids`."""
        by: dict[int, list[int]] = {}
        for v in block_ids:
            if not 0 <= v < self.num_blocks:
                raise ValueError(f"block id {v} out of range [0, {self.num_blocks})")
            g, b = divmod(v, self.pool_blocks)
            by.setdefault(g, []).append(b)
        return [(self._group_pairs[g], self._kernel_index(ids)) for g, ids in by.items()]

    def _kernel_index(self, block_ids: Sequence[int]) -> Any:
        import torch

        r = self._ratio
        return torch.tensor([b * r + k for b in block_ids for k in range(r)], dtype=torch.long)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def layer_names(self) -> list[str]:
        return list(self._names)

    def describe(self) -> LayoutDescription:
        return self._description

    def block_runs(self, block_id: int, heads: tuple[int, int]) -> list[ByteRange]:
        h0, h1 = heads
        if not 0 <= h0 < h1 <= self.num_kv_heads:
            raise ValueError(f"heads {heads} out of range for {self.num_kv_heads} KV heads")
        return strided_block_runs(self._description, block_id, heads)


def host_mirror(kv_caches: Mapping[str, Any]) -> dict[str, Any]:
    """Host tensors with the shapes, strides and storage sharing of `kv_caches`, pinned when CUDA is up."""
    import torch

    pin = torch.cuda.is_available()
    storages: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for name, cache in kv_caches.items():
        if not isinstance(cache, torch.Tensor):
            raise UnsupportedKVCacheError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
        storage = cache.untyped_storage()
        if storage.data_ptr() not in storages:
            flat = torch.zeros(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            storages[storage.data_ptr()] = flat.untyped_storage()
        host = torch.empty(0, dtype=cache.dtype)
        out[name] = host.set_(storages[storage.data_ptr()], cache.storage_offset(), cache.shape, cache.stride())
    return out
