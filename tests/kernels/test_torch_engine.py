"""The torch engine behind the engine seam, on the CPU with the tiny model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")

from workers.engines.base import BlockCopy, DecodeSeq, PrefillChunk, SamplingParams, ScheduledStep  # noqa: E402
from workers.engines.torch_engine import TorchEngineConfig, build_torch_engine  # noqa: E402

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0)


def make_engine(num_cpu_blocks=8):
    config = TorchEngineConfig(preset="tiny", device="cpu", seed=5)
    return build_torch_engine(config, num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks, block_size=4)


def generate(engine, prompt, blocks, num_tokens):
    step = ScheduledStep(prefills=(PrefillChunk("r", tuple(prompt), 0, blocks, True, GREEDY),))
    out = [engine.execute(step).sampled_token_ids["r"]]
    for i in range(num_tokens - 1):
        dec = DecodeSeq("r", out[-1], len(prompt) + i, blocks, GREEDY)
        out.append(engine.execute(ScheduledStep(decodes=(dec,))).sampled_token_ids["r"])
    return out


def test_greedy_generation_through_the_seam_is_deterministic():
    prompt = list(range(10, 19))
    blocks = (0, 1, 2, 3)
    assert generate(make_engine(), prompt, blocks, 5) == generate(make_engine(), prompt, blocks, 5)


def test_store_and_restore_jobs_are_reported_and_restored_prefix_gives_same_token():
    engine = make_engine()
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks + 1
    first = engine.execute(ScheduledStep(prefills=(PrefillChunk("a", tuple(prompt), 0, (0, 1, 2, 3), True, GREEDY),)))
    stored = engine.execute(ScheduledStep(stores=(BlockCopy(7, (0, 1, 2), (5, 6, 7)),)))
    assert stored.finished_store_job_ids == (7,)
    engine.gpu_pool.normal_()  # GPU copies evicted and overwritten
    restored = engine.execute(ScheduledStep(restores=(BlockCopy(8, (5, 6, 7), (9, 10, 11)),)))
    assert restored.finished_restore_job_ids == (8,)
    assert not engine.has_pending_copies()
    chunk = PrefillChunk("b", tuple(prompt[12:]), 12, (9, 10, 11, 12), True, GREEDY)
    again = engine.execute(ScheduledStep(prefills=(chunk,)))
    assert again.sampled_token_ids["b"] == first.sampled_token_ids["a"]


def test_sampling_with_temperature_is_a_function_of_seed_and_position():
    engine = make_engine(0)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    step = ScheduledStep(prefills=(PrefillChunk("s", (1, 2, 3), 0, (0,), True, params),))
    assert engine.execute(step).sampled_token_ids == engine.execute(step).sampled_token_ids


def test_copy_without_cpu_pool_is_an_invariant_error():
    engine = make_engine(0)
    with pytest.raises(RuntimeError, match="no CPU pool"):
        engine.execute(ScheduledStep(stores=(BlockCopy(1, (0,), (0,)),)))
