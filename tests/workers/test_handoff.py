"""The prefill/decode handoff in the scheduler: parked blocks with two readers, decode-side reservations with
refusal at the bound, received blocks registered as cached, and the leg rules of ``classify_leg``."""

from __future__ import annotations

import random

import pytest

from common.errors import InvalidRequestError
from common.pd_protocol import BootstrapRequest, decode_leg_body, new_bootstrap_room, prefill_leg_body
from events.types import BlockStored
from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.handoff import Leg, classify_leg, transfer_s
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, RequestStatus, Scheduler

pytestmark = pytest.mark.unit

BS = 4


def make_sched(num_gpu: int = 16, num_cpu: int = 0, max_seqs: int = 8) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, block_size=BS))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64), kv, eos_token_id=None)
    return sched, SimEngine(TimingProfile(), BS, [7, 8, 9], None)


def step(sched: Scheduler, engine: SimEngine) -> None:
    sched.update(engine.execute(sched.schedule()))


def prefill_leg(sched: Scheduler, engine: SimEngine, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, 1, SamplingParams(seed=1), park_on_finish=True)
    sched.add_request(req)
    while req.status is not RequestStatus.FINISHED:
        step(sched, engine)
    return req


def ref_counts(sched: Scheduler, block_ids: list[int]) -> list[int]:
    return [sched.kv.gpu.blocks[b].ref_cnt for b in block_ids]


@pytest.mark.parametrize("transfer_first", [True, False])
def test_parked_blocks_are_freed_only_after_the_transfer_and_the_store(transfer_first: bool) -> None:
    sched, engine = make_sched(num_gpu=16, num_cpu=16)
    req = prefill_leg(sched, engine, "p1", list(range(10)))  # 3 blocks: 2 full (cached, stored to CPU) + 1 partial
    assert req.finish_reason == "length" and req.kv.block_ids == [0, 1, 2]
    assert sched.parked == {"p1": req} and req.is_transfer_pending
    assert len(req.store_job_ids) == 1  # the CPU store of blocks 0 and 1, not landed yet
    assert ref_counts(sched, [0, 1, 2]) == [1, 1, 1] and sched.kv.gpu.num_free_blocks == 13
    assert sched.num_parked_blocks == 3
    if transfer_first:
        assert sched.release_transfer_reader("p1")
        assert not sched.release_transfer_reader("p1")  # one transfer reader
        assert ref_counts(sched, [0, 1, 2]) == [1, 1, 1]  # the store still reads them
        step(sched, engine)  # issues the store and runs until it lands
        while sched.kv.cpu is not None and sched.kv.cpu.num_stored_blocks < 2:
            step(sched, engine)
        assert sched.parked == {} and ref_counts(sched, [0, 1, 2]) == [0, 0, 0]
    else:
        while req.store_job_ids:
            step(sched, engine)
        assert sched.kv.cpu is not None and sched.kv.cpu.num_stored_blocks == 2
        assert sched.parked == {"p1": req} and ref_counts(sched, [0, 1, 2]) == [1, 1, 1]  # the transfer reads
        assert sched.release_transfer_reader("p1")
        assert sched.parked == {} and ref_counts(sched, [0, 1, 2]) == [0, 0, 0]
    assert sched.kv.gpu.num_free_blocks == 16
    # the prefix stays cached after the free: the next turn hits it
    assert sched.kv.gpu.get_cached_block(req.kv.block_hashes[0]) == 0


def test_an_aborted_or_stopped_prefill_leg_is_never_parked() -> None:
    sched, engine = make_sched()
    req = Request("p2", list(range(10)), 5, SamplingParams(seed=1), park_on_finish=True)
    sched.add_request(req)
    step(sched, engine)
    sched.finish_request("p2", "abort")
    assert sched.parked == {} and sched.kv.gpu.num_free_blocks == 16


def test_decode_reservation_refuses_at_the_bound_and_takes_the_local_prefix() -> None:
    sched, engine = make_sched(num_gpu=8)
    a = Request("d1", list(range(20)), 2, SamplingParams(seed=1))  # 5 blocks
    assert sched.add_receiving(a)
    assert a.status is RequestStatus.RECEIVING and a.kv.block_ids == [0, 1, 2, 3, 4]
    assert sched.num_receiving_blocks == 5 and sched.kv.gpu.num_free_blocks == 3
    b = Request("d2", list(range(100, 120)), 2, SamplingParams(seed=1))
    assert not sched.add_receiving(b)  # 5 needed, 3 free: refused, nothing changed
    assert sched.receiving == {"d1": a} and sched.kv.gpu.num_free_blocks == 3 and "d2" not in sched.requests
    assert not sched.has_work()  # a receiving request needs no step
    # the KV landed: the 5 full blocks are registered and the last prompt token is recomputed
    assert sched.finish_receiving("d1")
    events = [e for e in sched.kv.take_events() if isinstance(e, BlockStored)]
    hashes = extend_block_hashes([], namespace_root(None, None), list(range(20)), BS)
    assert [h for e in events for h in e.block_hashes] == [to_engine_hash(h) for h in hashes]
    first = sched.schedule()
    assert [(p.token_ids, p.start_pos, p.sample) for p in first.prefills] == [((19,), 19, True)]
    sched.update(engine.execute(first))
    while a.status is not RequestStatus.FINISHED:
        step(sched, engine)
    assert a.all_token_ids[20:] == [engine.sample(1, 20), engine.sample(1, 21)]
    # next turn on the same decode worker: the first 5 blocks are local, only the rest would be pulled
    c = Request("d3", list(range(20)) + [50, 51, 52, 53, 54], 2, SamplingParams(seed=1))
    assert sched.add_receiving(c)
    assert c.num_computed_tokens == 20 and c.num_cached_tokens == 20 and c.kv.block_ids[:5] == [0, 1, 2, 3, 4]
    sched.finish_request("d3", "abort")  # a failed pull releases the reservation
    assert sched.receiving == {} and sched.kv.gpu.num_free_blocks == 8


def test_decode_reservation_counts_against_max_num_seqs() -> None:
    sched, _ = make_sched(num_gpu=64, max_seqs=1)
    assert sched.add_receiving(Request("d1", list(range(8)), 2, SamplingParams()))
    assert not sched.add_receiving(Request("d2", list(range(8)), 2, SamplingParams()))
    assert sched.num_running == 1


def test_transfer_time_is_bytes_over_link_plus_latency() -> None:
    p = TimingProfile()
    assert transfer_s(p, 16, 512) == pytest.approx(5e-4 + 512 * 16 * 131072 / 25e9)


def test_leg_rules() -> None:
    none = BootstrapRequest()
    remote = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "p0",
        "remote_request_id": "r1",
        "remote_host": "127.0.0.1",
        "remote_port": 8100,
        "tp_size": 1,
    }
    assert classify_leg("both", None, none) is Leg.PLAIN
    assert classify_leg("prefill", prefill_leg_body({})["kv_transfer_params"], none) is Leg.VLLM_PREFILL
    assert classify_leg("decode", remote, none) is Leg.VLLM_DECODE
    with pytest.raises(InvalidRequestError, match="role 'decode'"):
        classify_leg("decode", {"do_remote_decode": True}, none)
    with pytest.raises(InvalidRequestError, match="role 'prefill'"):
        classify_leg("prefill", remote, none)
    with pytest.raises(InvalidRequestError, match="need remote_block_ids"):
        classify_leg("decode", {**remote, "remote_port": None}, none)
    with pytest.raises(InvalidRequestError, match="invalid kv_transfer_params"):
        classify_leg("decode", {"remote_block_ids": "x"}, none)
    # vLLM 0.32's shape (NIXL connector version 14): one list per KV cache group, and more fields
    v032 = {**remote, "remote_block_ids": [[1, 2]], "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull"}
    assert classify_leg("decode", v032, none) is Leg.VLLM_DECODE
    with pytest.raises(InvalidRequestError, match="mixes block ids and per-group lists"):
        classify_leg("decode", {**remote, "remote_block_ids": [1, [2]]}, none)
    room = BootstrapRequest("127.0.0.1", 8998, 7)
    assert classify_leg("prefill", None, room) is Leg.SGLANG_PREFILL
    assert classify_leg("decode", None, room) is Leg.SGLANG_DECODE
    with pytest.raises(InvalidRequestError, match="--role prefill or --role decode"):
        classify_leg("both", None, room)


def test_body_rewrites_follow_the_reference_proxy() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    body["min_tokens"] = 2
    assert prefill_leg_body(body) == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body["max_tokens"] == 9 and body["min_tokens"] == 2  # not changed
    assert decode_leg_body(body, {"do_remote_prefill": True})["kv_transfer_params"] == {"do_remote_prefill": True}
    assert "kv_transfer_params" not in decode_leg_body(body, None)
    rooms = {new_bootstrap_room(random.Random(1)) for _ in range(3)}
    assert rooms == {new_bootstrap_room(random.Random(1))} and 0 <= rooms.pop() <= 2**63 - 1


def test_cli_role_and_kv_transfer_flags() -> None:
    import argparse

    from workers.cli import add_arguments, config_from_args
    from workers.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--role", "decode", "--kv-transfer-abort-timeout-s", "5", "--kv-transfer-host", "10.0.0.2"]
    )
    cfg = config_from_args(args)
    assert cfg.role == "decode" and cfg.kv_transfer.abort_request_timeout_s == 5.0
    assert cfg.kv_transfer.advertise_host == "10.0.0.2" and cfg.kv_transfer.pull_timeout_s == 30.0
    with pytest.raises(ConfigError, match="role"):
        config_from_args(parser.parse_args(["--role", "router"]))
