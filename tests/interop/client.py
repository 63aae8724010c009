"""Requests through the gateway for the interop suite: deterministic prompts, and what each request was
predicted and reported to hit."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx

from tests.interop.conftest import BLOCK_SIZE, MODEL_NAME, Gateway, sum_metric

FIRST_ID = 16
"""Prompt token ids are drawn from ``FIRST_ID .. 511`` (below are the special tokens)."""


def token_ids(seed: int, num_tokens: int) -> list[int]:
    """A deterministic prompt of ``num_tokens`` ids; different seeds differ from the first token on."""
    rng = random.Random(seed)
    return [FIRST_ID + seed % 400] + [rng.randrange(FIRST_ID, 512) for _ in range(num_tokens - 1)]


def cacheable_tokens(num_prompt_tokens: int, num_hit_blocks: int) -> int:
    """vLLM's rule: a hit never covers the last prompt token, so at most ``(n - 1) // block_size`` blocks count."""
    return min(num_hit_blocks, (num_prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE


class Served:
    """One request through the gateway: what it predicted for the serving worker and what vLLM reported."""

    def __init__(self, worker_id: str, predicted: int, reported: int, num_prompt_tokens: int, body: Any) -> None:
        self.worker_id = worker_id
        self.predicted = predicted
        self.reported = reported
        self.num_prompt_tokens = num_prompt_tokens
        self.body = body

    def __repr__(self) -> str:
        return (f"Served({self.worker_id}, predicted={self.predicted}, reported={self.reported}, "
                f"prompt={self.num_prompt_tokens})")


def wait_events_settled(gateway: Gateway, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
    """Wait until the gateway's index has applied no new event batch for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last = -1.0
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        n = sum_metric(gateway.metrics_text(), "kvgate_index_events_total", 'counter="num_batches"')
        if n != last:
            last, last_change = n, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            return
        time.sleep(0.1)


def send(gateway: Gateway, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         *, settle: bool = True) -> Served:
    """POST through the gateway (streamed or not), return the served worker, prediction and vLLM's report."""
    body = {"model": MODEL_NAME, **body}
    with httpx.Client(base_url=gateway.url, timeout=120.0) as client:
        if body.get("stream"):
            body.setdefault("stream_options", {"include_usage": True})
            with client.stream("POST", path, json=body, headers=headers or {}) as resp:
                assert resp.status_code == 200, resp.read()
                events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
                hdrs = resp.headers
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            parsed: Any = events
        else:
            resp = client.post(path, json=body, headers=headers or {})
            assert resp.status_code == 200, resp.text
            hdrs = resp.headers
            parsed = resp.json()
            usage = parsed["usage"]
    if settle:
        wait_events_settled(gateway)
    return Served(hdrs["x-kvgate-worker"], int(hdrs["x-kvgate-predicted-cached-tokens"]),
                  int(usage["prompt_tokens_details"]["cached_tokens"]), int(usage["prompt_tokens"]), parsed)
