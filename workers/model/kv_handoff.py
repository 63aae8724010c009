# torch.cuda.Stream and torch.cuda.Event are unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""The bytes of a prefill -> decode KV handoff: gathered into few large transfers, scattered on arrival.

A request's KV lives in the paged pool as one slab per ``(layer, K|V, block)``::

    pool    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]

so copying it slab by slab costs ``num_blocks * num_layers * 2`` small copies (``copy_per_block``, the slow path
the handoff avoids; for a 32K-token prompt of a Llama-3-8B shape with 16-token blocks: 131,072 copies of 32 KiB).
The handoff instead **gathers** the blocks with the gather kernel (``kernels.kv_copy``) into a contiguous buffer
``[n, num_layers, 2, block_size, num_kv_heads, head_size]``, moves it in chunks of ``chunk_blocks`` blocks (one
large copy each), and **scatters** each chunk into the blocks the receiving side reserved. Two paths:

* ``"device"``: gather into a device buffer on the sender, one ``copy_`` per chunk to a buffer on the receiver's
  device (peer copy across GPUs, a device copy on one GPU), scatter there. Chunks alternate between two buffer
  pairs, so a chunk's gather overlaps the previous chunk's copy and scatter.
* ``"host"``: the sender gathers straight into pinned host memory (``KVTransfer.offload``: the kernel writes across
  PCIe, no staging), the receiver reads it back in runs through the copy engine and scatters it
  (``KVTransfer.restore``; the host ids are consecutive, so every chunk is one run). This is the path when the two
  workers share a host but no device link, and the shape of an RDMA transfer from registered host memory.

On the CPU (no CUDA) both paths are plain indexing and complete at once.
"""

from __future__ import annotations

from typing import Literal

import torch

from workers.model.kv_pool import DEFAULT_CHUNK_BLOCKS, KVTransfer

HandoffPath = Literal["device", "host"]


def _as_ids(block_ids: torch.Tensor | list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.int64).to(device, non_blocking=True)


def copy_per_block(
    src_pool: torch.Tensor, src_block_ids: list[int], dst_pool: torch.Tensor, dst_block_ids: list[int]
) -> None:
    """The slow path: one ``copy_`` per ``(layer, K|V, block)`` slab, on the current stream (baseline only)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks, {len(dst_block_ids)} destination blocks")
    for layer in range(src_pool.shape[0]):
        for kv in range(2):
            src = src_pool[layer, kv]
            dst = dst_pool[layer, kv]
            for s, d in zip(src_block_ids, dst_block_ids, strict=True):
                dst[d].copy_(src[s], non_blocking=True)


class KVHandoff:
    """Moves blocks of one pool into reserved blocks of another (module docstring).

    Args:
        src_pool: the sender's pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``.
        dst_pool: the receiver's pool, same shape apart from ``num_blocks``, same dtype (any device).
        path: ``"device"`` or ``"host"``.
        chunk_blocks: blocks per transfer chunk.

    Raises:
        ValueError: pools of different dtypes or block shapes, an unknown path, a non-positive chunk.
    """

    def __init__(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        *,
        path: HandoffPath = "device",
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
    ) -> None:
        if src_pool.dtype != dst_pool.dtype or src_pool.shape[:2] != dst_pool.shape[:2]:
            raise ValueError(
                f"pools differ: {src_pool.dtype}{tuple(src_pool.shape)} vs {dst_pool.dtype}{tuple(dst_pool.shape)}"
            )
        if src_pool.shape[3:] != dst_pool.shape[3:]:
            raise ValueError(f"block shapes differ: {tuple(src_pool.shape[3:])} vs {tuple(dst_pool.shape[3:])}")
        if path not in ("device", "host"):
            raise ValueError(f"path must be 'device' or 'host', got {path!r}")
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        self.src_pool = src_pool
        self.dst_pool = dst_pool
        self.path: HandoffPath = path
        self.chunk_blocks = chunk_blocks
        self.is_cuda = src_pool.device.type == "cuda" and dst_pool.device.type == "cuda"
        block_shape = (src_pool.shape[0], 2, *src_pool.shape[3:])
        self._bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: torch.Tensor | None = None
        if self.is_cuda and path == "device":
            for _ in range(2):
                a = torch.empty((chunk_blocks, *block_shape), dtype=src_pool.dtype, device=src_pool.device)
                b = a if dst_pool.device == src_pool.device else torch.empty_like(a, device=dst_pool.device)
                self._bufs.append((a, b))
            self._src_stream = torch.cuda.Stream(device=src_pool.device)
            self._dst_stream = torch.cuda.Stream(device=dst_pool.device)
        elif self.is_cuda:
            self._src_transfer = KVTransfer(src_pool, mode="direct")
            self._dst_transfer = KVTransfer(dst_pool, mode="auto", chunk_blocks=chunk_blocks)
        self._block_shape = block_shape

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer, K and V."""
        return int(self.src_pool[:, :, 0].numel() * self.src_pool.element_size())

    def _host_buffer(self, num_blocks: int) -> torch.Tensor:
        if self._host is None or len(self._host) < num_blocks:
            self._host = torch.empty(
                (num_blocks, *self._block_shape), dtype=self.src_pool.dtype, pin_memory=self.is_cuda
            )
        return self._host

    def send(self, src_block_ids: list[int], dst_block_ids: list[int]) -> torch.cuda.Event | None:
        """Copy ``src_pool[.., src_block_ids[i]]`` into ``dst_pool[.., dst_block_ids[i]]`` for every ``i``.

        Ordered after the work already issued on both devices' current streams; the receiver's current stream
        waits for the copy (work issued there later sees the blocks).

        Returns:
            An event on the receiver's device recorded when the destination blocks hold the data (``None`` on the
            CPU, where the copy is done on return).

        Raises:
            ValueError: id lists of different lengths.
        """
        n = len(src_block_ids)
        if n != len(dst_block_ids):
            raise ValueError(f"{n} source blocks, {len(dst_block_ids)} destination blocks")
        if not self.is_cuda:
            src = _as_ids(src_block_ids, self.src_pool.device)
            dst = _as_ids(dst_block_ids, self.dst_pool.device)
            self.dst_pool[:, :, dst] = self.src_pool[:, :, src].to(self.dst_pool.device)
            return None
        if self.path == "host":
            host = self._host_buffer(n)
            host_ids = list(range(n))
            offloaded = self._src_transfer.offload(src_block_ids, host, host_ids)
            assert offloaded is not None
            current = torch.cuda.current_stream(self.dst_pool.device)
            current.wait_event(offloaded)
            restored = self._dst_transfer.restore(dst_block_ids, host, host_ids)
            assert restored is not None
            current.wait_event(restored)
            return restored
        return self._send_device(src_block_ids, dst_block_ids)

    def _send_device(self, src_block_ids: list[int], dst_block_ids: list[int]) -> torch.cuda.Event:
        from kernels.kv_copy import gather_kv_blocks, scatter_kv_blocks

        src_s, dst_s = self._src_stream, self._dst_stream
        src_s.wait_stream(torch.cuda.current_stream(self.src_pool.device))
        dst_s.wait_stream(torch.cuda.current_stream(self.dst_pool.device))
        src_ids = _as_ids(src_block_ids, self.src_pool.device)
        dst_ids = _as_ids(dst_block_ids, self.dst_pool.device)
        freed: list[torch.cuda.Event | None] = [None, None]
        for index, start in enumerate(range(0, len(src_block_ids), self.chunk_blocks)):
            slot = index % 2
            a, b = self._bufs[slot]
            chunk_src = src_ids[start : start + self.chunk_blocks]
            chunk_dst = dst_ids[start : start + self.chunk_blocks]
            m = chunk_src.numel()
            with torch.cuda.stream(src_s):
                previous = freed[slot]
                if previous is not None:
                    src_s.wait_event(previous)
                gather_kv_blocks(self.src_pool, chunk_src, a[:m])
                gathered = torch.cuda.Event()
                gathered.record(src_s)
            with torch.cuda.stream(dst_s):
                dst_s.wait_event(gathered)
                if b is not a:
                    b[:m].copy_(a[:m], non_blocking=True)
                scatter_kv_blocks(self.dst_pool, chunk_dst, b[:m])
                done = torch.cuda.Event()
                done.record(dst_s)
            freed[slot] = done
        event = torch.cuda.Event()
        event.record(dst_s)
        torch.cuda.current_stream(self.dst_pool.device).wait_stream(dst_s)
        return event
