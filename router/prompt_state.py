"""The tokenized and hashed state of a prompt prefix, extended block by block (``router.request_view`` and
``router.text_prefix`` build on it)."""

from __future__ import annotations

import msgspec
import xxhash

from router.block_hash import BlockHash, Namespace, hash_token_blocks, tokens_to_bytes


class PromptState(msgspec.Struct, frozen=True, gc=False):
    """Tokenized and hashed prefix of a prompt.

    Attributes:
        num_tokens: tokens in the prefix.
        block_hashes: chained hashes of its full blocks, root-most first (``num_tokens // block_size`` items).
        tail: the tokens after the last full block (fewer than ``block_size``).
        opening_hash: identity of the conversation's opening (system prompt and first user message): the
            chained hash of its last full block, else an xxh3-64 of its tokens seeded by the namespace; ``None``
            until the opening is complete.
    """

    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    tail: tuple[int, ...]
    opening_hash: int | None = None


EMPTY_STATE = PromptState(0, (), ())

SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
"""xxh3 seeds are unsigned 64-bit: ``hash()`` values are masked to it."""


def extend_state(
    state: PromptState, token_ids: list[int] | tuple[int, ...], block_size: int, namespace: Namespace
) -> PromptState:
    """Append ``token_ids`` to ``state``, hashing only the blocks they complete.

    Args:
        state: the prefix so far.
        token_ids: the new tokens.
        block_size: tokens per block.
        namespace: chain seed (used when ``state`` has no full block yet).

    Returns:
        The extended state.
    """
    if not token_ids:
        return state
    combined = state.tail + tuple(token_ids) if state.tail else tuple(token_ids)
    num_full = len(combined) // block_size * block_size
    if num_full == 0:
        return PromptState(state.num_tokens + len(token_ids), state.block_hashes, combined, state.opening_hash)
    parent = state.block_hashes[-1] if state.block_hashes else None
    new_hashes = hash_token_blocks(combined[:num_full], block_size, namespace, parent)
    return PromptState(
        state.num_tokens + len(token_ids), state.block_hashes + tuple(new_hashes), combined[num_full:],
        state.opening_hash,
    )


def with_opening_hash(state: PromptState, namespace: Namespace) -> PromptState:
    """``state`` with ``opening_hash`` set from its current end (see ``PromptState``)."""
    if state.block_hashes:
        opening: int = state.block_hashes[-1]
    else:
        opening = xxhash.xxh3_64_intdigest(tokens_to_bytes(state.tail), namespace)
    return PromptState(state.num_tokens, state.block_hashes, state.tail, opening)
