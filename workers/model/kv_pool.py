# torch.cuda.Stream and torch.cuda.Event are unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""The model's paged KV pool, its CPU tier in pinned host memory, and block copies between them.

Layouts (see :mod:`kernels.kv_copy`)::

    GPU pool  [num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_size]    (2 = K, V)
    CPU pool  [num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_size]    pinned; one block contiguous

Copies between them (:class:`KVTransfer`) run on a side CUDA stream:

- **offload** (store, GPU -> CPU): the side stream first waits for the compute stream, so the source blocks hold
  the KV computed so far; the gather kernel then writes straight into the pinned CPU pool (one pass, no staging).
  Compute issued later waits for the copy before it may overwrite the source blocks (``fence_compute``).
- **restore** (CPU -> GPU): the scatter kernel reads straight from the pinned CPU pool into GPU blocks reserved
  for it, beside the compute; the owner waits for the job's event before it reads them.

``mode="staged"`` instead moves chunks through device staging buffers with the copy engine, overlapped with the
gather/scatter of the next chunk (two streams); it is the fallback where direct PCIe access from a kernel is
slow. On the CPU (no CUDA), copies are plain torch indexing and complete at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

TransferMode = Literal["direct", "staged"]


def allocate_gpu_pool(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_size)
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_cpu_pool(gpu_pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A host pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]``, pinned when CUDA exists."""
    shape = (num_blocks, gpu_pool.shape[0], 2, *gpu_pool.shape[3:])
    return torch.zeros(shape, dtype=gpu_pool.dtype, pin_memory=torch.cuda.is_available())


@dataclass
class _StagingBuffers:
    buffers: list[torch.Tensor]
    free_events: list[torch.cuda.Event | None]


class KVTransfer:
    """Offload and restore of KV blocks between a GPU pool and a pinned host pool, on a side stream.

    Args:
        gpu_pool: ``[num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_size]``.
        mode: ``"direct"`` (kernels read/write pinned memory over PCIe) or ``"staged"`` (copy engine + staging).
        chunk_blocks: blocks per staging chunk (``"staged"`` only).
    """

    def __init__(self, gpu_pool: torch.Tensor, *, mode: TransferMode = "direct", chunk_blocks: int = 256) -> None:
        if mode not in ("direct", "staged"):
            raise ValueError(f"mode must be 'direct' or 'staged', got {mode!r}")
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        self.gpu_pool = gpu_pool
        self.mode = mode
        self.chunk_blocks = chunk_blocks
        self.is_cuda = gpu_pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=gpu_pool.device) if self.is_cuda else None
        self._copy_stream = torch.cuda.Stream(device=gpu_pool.device) if self.is_cuda and mode == "staged" else None
        self._staging: _StagingBuffers | None = None
        self._last_offload: torch.cuda.Event | None = None

    def _ids(self, block_ids: torch.Tensor | list[int] | tuple[int, ...]) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            return block_ids.to(self.gpu_pool.device, non_blocking=True)
        pinned = torch.tensor(block_ids, dtype=torch.int64, pin_memory=self.is_cuda)
        return pinned.to(self.gpu_pool.device, non_blocking=True)

    def offload(
        self,
        gpu_block_ids: torch.Tensor | list[int] | tuple[int, ...],
        cpu_pool: torch.Tensor,
        cpu_block_ids: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.cuda.Event | None:
        """Copy GPU blocks into the CPU pool (entry ``i`` to ``cpu_block_ids[i]``, or to ``i`` when omitted).

        Returns:
            An event recorded when the copy is complete (``None`` on the CPU, where it already is).
        """
        if not self.is_cuda:
            from kernels.reference import gather_kv_blocks_ref

            ids = torch.as_tensor(gpu_block_ids, dtype=torch.int64)
            dst = torch.arange(ids.numel()) if cpu_block_ids is None else torch.as_tensor(cpu_block_ids)
            cpu_pool[dst.long()] = gather_kv_blocks_ref(self.gpu_pool, ids).to(cpu_pool.device)
            return None
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.gpu_pool.device))
        with torch.cuda.stream(self._stream):
            ids = self._ids(gpu_block_ids)
            dst_ids = None if cpu_block_ids is None else self._ids(cpu_block_ids)
            if self.mode == "direct":
                from kernels.kv_copy import gather_kv_blocks

                gather_kv_blocks(self.gpu_pool, ids, cpu_pool, out_block_ids=dst_ids)
            else:
                self._staged(ids, cpu_pool, dst_ids, to_host=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._last_offload = event
        return event

    def restore(
        self,
        gpu_block_ids: torch.Tensor | list[int] | tuple[int, ...],
        cpu_pool: torch.Tensor,
        cpu_block_ids: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.cuda.Event | None:
        """Copy CPU-pool blocks (``cpu_block_ids[i]``, or ``i``) into GPU blocks ``gpu_block_ids[i]``.

        Returns:
            An event recorded when the GPU blocks hold the data (``None`` on the CPU).
        """
        if not self.is_cuda:
            from kernels.reference import scatter_kv_blocks_ref

            ids = torch.as_tensor(gpu_block_ids, dtype=torch.int64)
            src = torch.arange(ids.numel()) if cpu_block_ids is None else torch.as_tensor(cpu_block_ids)
            self.gpu_pool.copy_(scatter_kv_blocks_ref(self.gpu_pool, ids, cpu_pool[src.long()]))
            return None
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.gpu_pool.device))
        with torch.cuda.stream(self._stream):
            ids = self._ids(gpu_block_ids)
            src_ids = None if cpu_block_ids is None else self._ids(cpu_block_ids)
            if self.mode == "direct":
                from kernels.kv_copy import scatter_kv_blocks

                scatter_kv_blocks(self.gpu_pool, ids, cpu_pool, src_block_ids=src_ids)
            else:
                self._staged(ids, cpu_pool, src_ids, to_host=False)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def fence_compute(self) -> None:
        """Make the compute stream wait for the last offload, so it cannot overwrite blocks still being read."""
        if self._last_offload is not None:
            torch.cuda.current_stream(self.gpu_pool.device).wait_event(self._last_offload)
            self._last_offload = None

    def _staging_buffers(self) -> _StagingBuffers:
        if self._staging is None:
            pool = self.gpu_pool
            shape = (self.chunk_blocks, pool.shape[0], 2, *pool.shape[3:])
            self._staging = _StagingBuffers(
                [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(2)], [None, None]
            )
        return self._staging

    def _staged(self, ids: torch.Tensor, host: torch.Tensor, host_ids: torch.Tensor | None, *, to_host: bool) -> None:
        """Chunked copy through two device staging buffers; runs on (and is ordered after) the side stream."""
        from kernels.kv_copy import gather_kv_blocks, scatter_kv_blocks

        assert self._stream is not None and self._copy_stream is not None
        if host_ids is not None:
            raise ValueError("staged mode copies to or from consecutive host entries only")
        staging = self._staging_buffers()
        for index, start in enumerate(range(0, ids.numel(), self.chunk_blocks)):
            chunk = ids[start : start + self.chunk_blocks]
            slot = index % 2
            buf = staging.buffers[slot][: chunk.numel()]
            host_chunk = host[start : start + chunk.numel()]
            free_event = staging.free_events[slot]
            if to_host:
                if free_event is not None:
                    self._stream.wait_event(free_event)
                gather_kv_blocks(self.gpu_pool, chunk, buf)
                self._copy_stream.wait_stream(self._stream)
                with torch.cuda.stream(self._copy_stream):
                    host_chunk.copy_(buf, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._copy_stream)
                staging.free_events[slot] = done
            else:
                if free_event is not None:
                    self._copy_stream.wait_event(free_event)
                with torch.cuda.stream(self._copy_stream):
                    buf.copy_(host_chunk, non_blocking=True)
                    loaded = torch.cuda.Event()
                    loaded.record(self._copy_stream)
                self._stream.wait_event(loaded)
                scatter_kv_blocks(self.gpu_pool, chunk, buf)
                done = torch.cuda.Event()
                done.record(self._stream)
                staging.free_events[slot] = done
        self._stream.wait_stream(self._copy_stream)
