"""The gathered KV handoff (``workers.model.kv_handoff``): exact blocks land in the reserved destination blocks, on
both paths, chunked, on the CPU here and on CUDA where one exists (tests/gpu runs it on the device)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")

from workers.model.kv_handoff import KVHandoff, copy_per_block  # noqa: E402

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pools(device: str, num_src: int = 12, num_dst: int = 10):
    gen = torch.Generator().manual_seed(1)
    src = torch.randn((2, 2, num_src, 4, 2, 8), generator=gen).to(torch.bfloat16).to(device)
    dst = torch.zeros((2, 2, num_dst, 4, 2, 8), dtype=torch.bfloat16, device=device)
    return src, dst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["device", "host"])
def test_send_moves_exactly_the_listed_blocks(device: str, path: str) -> None:
    src, dst = pools(device)
    handoff = KVHandoff(src, dst, path=path, chunk_blocks=2)  # 5 blocks: chunks of 2, 2, 1
    src_ids, dst_ids = [7, 0, 11, 3, 5], [9, 2, 4, 0, 6]
    event = handoff.send(src_ids, dst_ids)
    if event is not None:
        event.synchronize()
    assert torch.equal(dst[:, :, dst_ids].view(torch.int16), src[:, :, src_ids].view(torch.int16))
    untouched = [b for b in range(10) if b not in dst_ids]
    assert int(dst[:, :, untouched].abs().sum()) == 0
    assert handoff.block_bytes == 2 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_per_block_baseline_matches(device: str) -> None:
    src, dst = pools(device)
    copy_per_block(src, [1, 2], dst, [3, 4])
    assert torch.equal(dst[:, :, [3, 4]], src[:, :, [1, 2]])
    with pytest.raises(ValueError, match="2 source blocks, 1 destination"):
        copy_per_block(src, [1, 2], dst, [3])


def test_refuses_mismatched_pools() -> None:
    src, _ = pools("cpu")
    with pytest.raises(ValueError, match="block shapes differ"):
        KVHandoff(src, torch.zeros((2, 2, 3, 4, 2, 4), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="path must be"):
        KVHandoff(src, src, path="nvlink")  # type: ignore[arg-type]
