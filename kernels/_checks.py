"""Argument checks shared by the kernel launchers.

Every launcher validates its inputs with real exceptions (``ValueError``) before it launches, because a Triton
kernel given a wrong shape or a non-contiguous view reads or writes out of bounds silently. Nothing here imports
torch or triton at module import time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INTERPRET_ENV = "TRITON_INTERPRET"
"""Environment variable that makes Triton run kernels on the CPU in its Python interpreter."""


def is_interpreter() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def check_launchable(name: str, tensor: torch.Tensor, *, allow_pinned_host: bool = False) -> None:
    """Check that a kernel can address ``tensor``.

    On CUDA a tensor must live on the GPU, or (when ``allow_pinned_host``) in pinned host memory, which the GPU
    addresses directly through unified virtual addressing. Under the interpreter every tensor is on the CPU.

    Raises:
        ValueError: the tensor is somewhere the kernel cannot read or write.
    """
    if is_interpreter():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: the Triton interpreter needs CPU tensors, got {tensor.device}")
        return
    if tensor.device.type == "cuda":
        return
    if allow_pinned_host and tensor.device.type == "cpu" and tensor.is_pinned():
        return
    where = "a CUDA tensor or pinned host memory" if allow_pinned_host else "a CUDA tensor"
    raise ValueError(f"{name}: expected {where} (or TRITON_INTERPRET=1), got {tensor.device}")


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    contiguous: bool = True,
) -> None:
    """Check rank, dtype and contiguity of one launcher argument.

    Raises:
        ValueError: naming the argument and what was wrong with it.
    """
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {tensor.dtype} not in {tuple(dtypes)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Check that tensors share one device.

    Raises:
        ValueError: listing each argument's device.
    """
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k}={v.device}" for k, v in tensors.items())
        raise ValueError(f"tensors must share one device: {listing}")
