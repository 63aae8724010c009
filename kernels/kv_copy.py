# Triton kernels take untyped pointer and scalar arguments; only the launchers are typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""KV block gather and scatter between the paged pool and a contiguous buffer.

One kernel family: copy whole KV blocks, every layer, keys and values, for a list of block ids. The worker uses it
to offload blocks to the CPU tier (gather straight into pinned host memory), to restore them (scatter straight from
pinned host memory), and to move blocks between pools.

Layouts (both contiguous)::

    pool    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
             layer ─┘   └ 0 = K, 1 = V
    buffer  [num_ids, num_layers, 2, block_size, num_kv_heads, head_size]
             └ i-th entry of block_ids; each block's bytes are contiguous, so a CPU tier can keep blocks apart

A *chunk* is one ``(layer, K|V, block)`` slab, ``block_size * num_kv_heads * head_size`` elements, contiguous in
both layouts. The grid is ``(cdiv(num_ids * num_layers * 2, UNITS), cdiv(chunk, TILE))``; program ``(u, t)``
copies tile ``t`` of buffer chunks ``u * UNITS ..``, so consecutive programs write (gather) or read (scatter)
consecutive buffer bytes, which keeps PCIe transfers to pinned memory sequential.

Copies are bit-exact: tensors are reinterpreted as same-width integers, so any 1-, 2- or 4-byte dtype works
(bf16, fp16, fp8, fp32).

Requires torch and triton (the ``gpu`` extra); import this module only where they are installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launchable, check_tensor

POOL_NDIM = 6
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

DEFAULT_TILE_NUMEL = 2048
"""Elements of one chunk per program step (4 KiB of bf16)."""
DEFAULT_NUM_WARPS = 8
DEFAULT_UNITS_PER_PROGRAM = 4
"""Chunks per program: 16 KiB in flight per program with the default tile."""
DEFAULT_STREAMING = False


@triton.jit
def _kv_block_copy_kernel(
    pool_ptr,  # [num_layers, 2, num_blocks, chunk_numel] as same-width integers
    buffer_ptr,  # [num_ids, num_layers, 2, chunk_numel]
    block_ids_ptr,  # [num_ids] int32 or int64
    buffer_ids_ptr,  # [num_ids] buffer block of each entry (read only when HAS_BUFFER_IDS)
    num_layers_x2,  # num_layers * 2
    num_units,  # num_ids * num_layers * 2
    num_pool_blocks,
    chunk_numel,  # block_size * num_kv_heads * head_size
    TILE: tl.constexpr,
    UNITS: tl.constexpr,  # chunks per program
    TO_BUFFER: tl.constexpr,  # True: gather pool -> buffer; False: scatter buffer -> pool
    EVEN: tl.constexpr,  # chunk_numel % TILE == 0: no masks needed
    HAS_BUFFER_IDS: tl.constexpr,  # False: entry i is buffer block i
    STREAMING: tl.constexpr,  # evict-first loads and streaming stores: every byte is touched once
):
    # UNITS consecutive buffer chunks per program: their block ids load in parallel, then UNITS * TILE
    # elements are in flight at once.
    units = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS).to(tl.int64)  # [UNITS]
    tile = tl.program_id(1).to(tl.int64)
    unit_mask = units < num_units
    entry = units // num_layers_x2
    layer_kv = units % num_layers_x2
    block_id = tl.load(block_ids_ptr + entry, mask=unit_mask, other=0).to(tl.int64)
    pool_base = (layer_kv * num_pool_blocks + block_id) * chunk_numel
    if HAS_BUFFER_IDS:
        buffer_block = tl.load(buffer_ids_ptr + entry, mask=unit_mask, other=0).to(tl.int64)
    else:
        buffer_block = entry
    buffer_base = (buffer_block * num_layers_x2 + layer_kv) * chunk_numel
    offs = tile * TILE + tl.arange(0, TILE).to(tl.int64)  # [TILE]
    if TO_BUFFER:
        src = pool_ptr + pool_base[:, None] + offs[None, :]
        dst = buffer_ptr + buffer_base[:, None] + offs[None, :]
    else:
        src = buffer_ptr + buffer_base[:, None] + offs[None, :]
        dst = pool_ptr + pool_base[:, None] + offs[None, :]
    if EVEN:
        mask = unit_mask[:, None]
    else:
        mask = unit_mask[:, None] & (offs < chunk_numel)[None, :]
    if STREAMING:
        tl.store(dst, tl.load(src, mask=mask, eviction_policy="evict_first"), mask=mask, cache_modifier=".cs")
    else:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS_DTYPE[tensor.element_size()])


def _check_pool_and_ids(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    check_tensor("kv_pool", kv_pool, ndim=POOL_NDIM, dtypes=SUPPORTED_DTYPES)
    if kv_pool.shape[1] != 2:
        raise ValueError(f"kv_pool: dimension 1 must be 2 (K, V), got shape {tuple(kv_pool.shape)}")
    check_launchable("kv_pool", kv_pool)
    check_tensor("block_ids", block_ids, ndim=1, dtypes=(torch.int32, torch.int64))
    check_launchable("block_ids", block_ids)
    if block_ids.device != kv_pool.device:
        raise ValueError(f"block_ids on {block_ids.device} but kv_pool on {kv_pool.device}")
    if block_ids.device.type == "cpu" and block_ids.numel() > 0:
        # Cheap only without a device sync; on CUDA the range is the caller's invariant.
        low, high = int(block_ids.min()), int(block_ids.max())
        if low < 0 or high >= kv_pool.shape[2]:
            raise ValueError(f"block_ids must lie in [0, {kv_pool.shape[2]}), got range [{low}, {high}]")


def _check_buffer(
    kv_pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, buffer_ids: torch.Tensor | None, name: str
) -> None:
    num_entries = buffer.shape[0] if buffer_ids is not None and buffer.dim() == POOL_NDIM else block_ids.numel()
    expected = (num_entries, kv_pool.shape[0], 2, *kv_pool.shape[3:])
    check_tensor(name, buffer, ndim=POOL_NDIM, dtypes=(kv_pool.dtype,))
    if tuple(buffer.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(buffer.shape)}")
    check_launchable(name, buffer, allow_pinned_host=True)
    if buffer_ids is None:
        return
    check_tensor(f"{name}_block_ids", buffer_ids, ndim=1, dtypes=(torch.int32, torch.int64))
    if buffer_ids.shape != block_ids.shape or buffer_ids.device != block_ids.device:
        raise ValueError(f"{name}_block_ids must match block_ids in length and device")
    if buffer_ids.device.type == "cpu" and buffer_ids.numel() > 0:
        low, high = int(buffer_ids.min()), int(buffer_ids.max())
        if low < 0 or high >= buffer.shape[0]:
            raise ValueError(f"{name}_block_ids must lie in [0, {buffer.shape[0]}), got range [{low}, {high}]")


def _launch(
    kv_pool: torch.Tensor,
    block_ids: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ids: torch.Tensor | None,
    *,
    to_buffer: bool,
    tile_numel: int,
    num_warps: int,
    units_per_program: int,
    streaming: bool,
) -> None:
    for name, value in (("tile_numel", tile_numel), ("units_per_program", units_per_program)):
        if value <= 0 or value & (value - 1):
            raise ValueError(f"{name} must be a positive power of two, got {value}")
    num_ids = block_ids.numel()
    if num_ids == 0:
        return
    num_layers = kv_pool.shape[0]
    chunk_numel = kv_pool.shape[3] * kv_pool.shape[4] * kv_pool.shape[5]
    tile = min(tile_numel, triton.next_power_of_2(chunk_numel))
    num_units = num_ids * num_layers * 2
    grid = (triton.cdiv(num_units, units_per_program), triton.cdiv(chunk_numel, tile))
    _kv_block_copy_kernel[grid](
        pool_ptr=_as_bits(kv_pool),
        buffer_ptr=_as_bits(buffer),
        block_ids_ptr=block_ids,
        buffer_ids_ptr=block_ids if buffer_ids is None else buffer_ids,
        num_layers_x2=num_layers * 2,
        num_units=num_units,
        num_pool_blocks=kv_pool.shape[2],
        chunk_numel=chunk_numel,
        TILE=tile,
        UNITS=units_per_program,
        TO_BUFFER=to_buffer,
        EVEN=chunk_numel % tile == 0,
        HAS_BUFFER_IDS=buffer_ids is not None,
        STREAMING=streaming,
        num_warps=num_warps,
    )


def gather_kv_blocks(
    kv_pool: torch.Tensor,
    block_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_block_ids: torch.Tensor | None = None,
    tile_numel: int = DEFAULT_TILE_NUMEL,
    num_warps: int = DEFAULT_NUM_WARPS,
    units_per_program: int = DEFAULT_UNITS_PER_PROGRAM,
    streaming: bool = DEFAULT_STREAMING,
) -> torch.Tensor:
    """Copy the listed blocks of every layer out of the paged pool into one contiguous buffer.

    Args:
        kv_pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``, contiguous, on CUDA.
        block_ids: ``[num_ids]`` int32/int64 on the pool's device, each in ``[0, num_blocks)``.
        out: ``[num_ids, num_layers, 2, block_size, num_kv_heads, head_size]``, the pool's dtype, contiguous; on
            CUDA or in pinned host memory (the kernel then writes across PCIe directly, no staging copy).
            Allocated on the pool's device when omitted. With ``out_block_ids``, ``out`` is a block pool of
            its own, ``[num_out_blocks, num_layers, 2, ...]`` (the CPU tier's layout).
        out_block_ids: ``[num_ids]`` ids on the pool's device: entry ``i`` goes to ``out[out_block_ids[i]]``
            instead of ``out[i]``.
        tile_numel: elements each program copies (a power of two; clipped to one chunk).
        num_warps: warps per program.
        units_per_program: chunks each program copies (a power of two).
        streaming: cache hints for data touched once (evict-first loads, streaming stores).

    Returns:
        ``out``. The copy is asynchronous on the current CUDA stream: synchronize before reading pinned ``out``
        on the host.

    Raises:
        ValueError: on a wrong shape, dtype, device, contiguity or (for CPU ids) an out-of-range block id.
    """
    _check_pool_and_ids(kv_pool, block_ids)
    if out is None:
        if out_block_ids is not None:
            raise ValueError("out_block_ids needs out")
        out = torch.empty(
            (block_ids.numel(), kv_pool.shape[0], 2, *kv_pool.shape[3:]), dtype=kv_pool.dtype, device=kv_pool.device
        )
    _check_buffer(kv_pool, block_ids, out, out_block_ids, "out")
    _launch(
        kv_pool,
        block_ids,
        out,
        out_block_ids,
        to_buffer=True,
        tile_numel=tile_numel,
        num_warps=num_warps,
        units_per_program=units_per_program,
        streaming=streaming,
    )
    return out


def scatter_kv_blocks(
    kv_pool: torch.Tensor,
    block_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    src_block_ids: torch.Tensor | None = None,
    tile_numel: int = DEFAULT_TILE_NUMEL,
    num_warps: int = DEFAULT_NUM_WARPS,
    units_per_program: int = DEFAULT_UNITS_PER_PROGRAM,
    streaming: bool = DEFAULT_STREAMING,
) -> None:
    """Copy a contiguous buffer of blocks into the listed blocks of the paged pool (in place).

    Args:
        kv_pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``, contiguous, on CUDA;
            written in place.
        block_ids: ``[num_ids]`` int32/int64 on the pool's device, each in ``[0, num_blocks)`` and distinct
            (two entries naming one block race).
        src: ``[num_ids, num_layers, 2, block_size, num_kv_heads, head_size]``, the pool's dtype, contiguous; on
            CUDA or in pinned host memory (read across PCIe directly). With ``src_block_ids``, ``src`` is a
            block pool of its own, ``[num_src_blocks, num_layers, 2, ...]``.
        src_block_ids: ``[num_ids]`` ids on the pool's device: block ``block_ids[i]`` receives
            ``src[src_block_ids[i]]`` instead of ``src[i]``.
        tile_numel: elements each program copies (a power of two; clipped to one chunk).
        num_warps: warps per program.
        units_per_program: chunks each program copies (a power of two).
        streaming: cache hints for data touched once (evict-first loads, streaming stores).

    Raises:
        ValueError: on a wrong shape, dtype, device, contiguity or (for CPU ids) an out-of-range block id.
    """
    _check_pool_and_ids(kv_pool, block_ids)
    _check_buffer(kv_pool, block_ids, src, src_block_ids, "src")
    _launch(
        kv_pool,
        block_ids,
        src,
        src_block_ids,
        to_buffer=False,
        tile_numel=tile_numel,
        num_warps=num_warps,
        units_per_program=units_per_program,
        streaming=streaming,
    )
