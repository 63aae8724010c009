"""Builders for loadgen test objects."""

from __future__ import annotations

from pathlib import Path

from loadgen.client import RequestRecord
from loadgen.traces import TraceRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_TRACE = str(REPO_ROOT / "loadgen" / "data" / "conversation_trace_head.jsonl")
"""The first 1,000 requests of Mooncake's conversation_trace.jsonl, shipped with the demo."""
AGENTIC_TRACE = str(REPO_ROOT / "tests" / "fixtures" / "traces" / "kv_cache_tester_trace_0003.json")
"""One kv-cache-tester agentic session file (with sub-agents)."""



def make_request(
    hash_ids, num_prompt_tokens=None, *, block_size=512, arrival_s=0.0, namespace="", session_id="", out=8, think=0.0
):
    ids = tuple(hash_ids)
    return TraceRequest(
        arrival_s=arrival_s,
        num_prompt_tokens=num_prompt_tokens if num_prompt_tokens is not None else len(ids) * block_size,
        num_output_tokens=out,
        hash_ids=ids,
        block_size=block_size,
        namespace=namespace,
        session_id=session_id,
        think_time_s=think,
    )


def make_record(index, *, worker="w0", prompt=100, cached=0, predicted=None, ttft=0.1, itl=(), out=4, error=None):
    return RequestRecord(
        index=index,
        session_id=f"s{index}",
        start_s=float(index),
        num_prompt_tokens=prompt,
        num_reported_prompt_tokens=prompt,
        num_output_tokens=out,
        num_cached_tokens=cached,
        num_predicted_cached_tokens=predicted,
        worker=worker,
        ttft_s=ttft,
        e2e_s=1.0,
        itl_s=list(itl),
        error_kind=error,
    )
