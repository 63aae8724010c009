"""Test vectors and properties of router.block_hash."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from router.block_hash import (
    DEFAULT_NAMESPACE,
    extend_block_hashes,
    hash_token_blocks,
    make_namespace,
    split_extra_keys,
    tokens_to_bytes,
)

pytestmark = pytest.mark.unit

# Pinned outputs of algorithm v1 (module docstring); a change here is a wire-visible change of the index key.
VECTOR_NAMESPACE_DEFAULT = 4586655727172200848
VECTOR_TOKENS_0_31_BS16 = [14163249308155702232, 12170297788084671611]


def _reference(tokens: list[int], block_size: int, lora: str | None, salt: str | None) -> list[int]:
    """The documented algorithm written out independently with struct-free byte building."""

    def field(value: str | None) -> bytes:
        if value is None:
            return b"\x00"
        raw = value.encode()
        return b"\x01" + len(raw).to_bytes(4, "little") + raw

    seed = xxhash.xxh3_64_intdigest(b"kvgate-block-hash-v1" + field(lora) + field(salt))
    out = []
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block_size])
        seed = xxhash.xxh3_64_intdigest(data, seed)
        out.append(seed)
    return out


def test_vectors():
    assert make_namespace() == VECTOR_NAMESPACE_DEFAULT == DEFAULT_NAMESPACE
    assert hash_token_blocks(list(range(32)), 16) == VECTOR_TOKENS_0_31_BS16
    assert hash_token_blocks(list(range(32)), 16) == _reference(list(range(32)), 16, None, None)


@pytest.mark.parametrize(("lora", "salt"), [(None, None), ("adapter-a", None), (None, "tenant-1"), ("a", "")])
def test_matches_reference_algorithm(lora, salt):
    tokens = [7, 2**32 - 1, 0, 65536, 12, 99, 3, 1, 5]
    ns = make_namespace(lora, salt)
    assert hash_token_blocks(tokens, 4, ns) == _reference(tokens, 4, lora, salt)


@pytest.mark.parametrize("num_blocks", [1, 7, 8, 9, 20])
def test_short_and_bulk_chains_match_reference(num_blocks):
    # Fewer than 8 blocks are sliced one by one, 8 and more cut with numpy: both give the reference chain.
    tokens = [(i * 7919) % 50_000 for i in range(4 * num_blocks)]
    full = _reference(tokens, 4, None, None)
    assert hash_token_blocks(tokens, 4) == full
    assert hash_token_blocks(tokens[4:], 4, parent=full[0]) == full[1:]


def test_namespaces_are_distinct():
    values = {
        make_namespace(None, None),
        make_namespace("a", None),
        make_namespace(None, "a"),
        make_namespace("a", ""),
        make_namespace("", "a"),
        make_namespace("ab", None),
    }
    assert len(values) == 6
    tokens = list(range(16))
    assert hash_token_blocks(tokens, 16, make_namespace("a", None)) != hash_token_blocks(tokens, 16)


def test_partial_block_ignored_and_numpy_equals_list():
    tokens = list(range(37))
    hashes = hash_token_blocks(tokens, 16)
    assert len(hashes) == 2
    assert hash_token_blocks(np.array(tokens, dtype=np.int64), 16) == hashes
    assert hash_token_blocks(np.array(tokens, dtype=np.uint32), 16) == hashes
    assert hash_token_blocks(tokens[:15], 16) == []


def test_incremental_equals_full():
    tokens = list(range(100))
    full = hash_token_blocks(tokens, 8)
    assert extend_block_hashes(full[:5], tokens, 8) == full
    assert extend_block_hashes([], tokens, 8) == full
    assert hash_token_blocks(tokens[40:], 8, parent=full[4]) == full[5:]
    with pytest.raises(ValueError):
        extend_block_hashes(full, tokens[:50], 8)


def test_tokens_as_little_endian_u32():
    assert tokens_to_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert tokens_to_bytes(np.array([1, 256], dtype=np.int32)) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


@pytest.mark.parametrize("bad", [[-1], [2**32], ["x"], np.array([-3]), np.array([1.5]), np.zeros((2, 2))])
def test_bad_tokens_raise_value_error(bad):
    with pytest.raises(ValueError):
        hash_token_blocks(bad, 1)


def test_bad_block_size():
    with pytest.raises(ValueError):
        hash_token_blocks([1, 2], 0)


def test_split_extra_keys_reads_vllm_layout():
    assert split_extra_keys(None, None, 3) == (None, 3)
    assert split_extra_keys([("salt-1",), None, None], None, 3) == ("salt-1", 3)
    assert split_extra_keys([["lora-x", "salt-1"], ["lora-x"], ["lora-x"]], "lora-x", 3) == ("salt-1", 3)
    assert split_extra_keys([("lora-x",), ("lora-x",)], "lora-x", 2) == (None, 2)
    # A multimodal entry in block 1: only block 0 is reproducible from tokens.
    assert split_extra_keys([None, (("mm-hash", 0),), None], None, 3) == (None, 1)
    assert split_extra_keys([("a", "b")], None, 1) == (None, 0)
