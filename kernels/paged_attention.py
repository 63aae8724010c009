"""Paged attention over the KV pool: prefill of a chunk of new tokens, and split-context decode.

One kernel family: attention whose keys and values are read through a block table from one layer's half of the
paged pool, with grouped-query attention (``num_heads = group * num_kv_heads``) and variable lengths in one batch.
This module gathers its public names; each part lives in its own module:

- :mod:`kernels.paged_tiles`: the cache layout, the ``@triton.jit`` tile helpers both kernels run (tile offsets
  through the block table, one online-softmax step), the launchers' checks;
- :mod:`kernels.paged_prefill`: :func:`paged_prefill_attention` (:class:`PrefillConfig`);
- :mod:`kernels.paged_decode`: :func:`paged_decode_attention` (:class:`DecodeConfig`), split and merge kernels.

Softmax runs in base 2 (``exp2`` with ``scale * log2(e)`` folded in), accumulators in float32. Under the CPU
interpreter, dot operands are upcast to float32 (``UPCAST_DOT``) because its bf16 ``tl.dot`` is wrong.

Requires torch and triton (the ``gpu`` extra); import this module only where they are installed.
"""

from __future__ import annotations

from kernels.paged_decode import DecodeConfig, paged_decode_attention
from kernels.paged_prefill import PrefillConfig, paged_prefill_attention
from kernels.paged_tiles import LOG2_E, MIN_DOT_ROWS, SUPPORTED_DTYPES

__all__ = [
    "LOG2_E",
    "MIN_DOT_ROWS",
    "SUPPORTED_DTYPES",
    "DecodeConfig",
    "PrefillConfig",
    "paged_decode_attention",
    "paged_prefill_attention",
]
