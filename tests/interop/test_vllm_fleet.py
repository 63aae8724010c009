"""kvgate in front of real vLLM (CPU build): tokens, events, predictions, routing, failures, the openai client.

The module's tests share one fleet (``conftest.fleet``: vllm-a publishing on a bound PUB the gateway connects to,
vllm-b connecting to the gateway's bound SUB) and run in file order; each uses prompts of its own, so the KV held
from earlier tests only matters where a test says so. Every request is sequential and waits for the KV events it
caused to reach the gateway before the next one, so each prediction is made on the index vLLM's events describe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, cast

import httpx
import openai
import pytest

from common.tokenization import encode_chat, load_tokenizer, normalize_messages
from tests.interop.client import Served, cacheable_tokens, send, token_ids, wait_events_settled
from tests.interop.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL_DIR,
    MODEL_NAME,
    Fleet,
    OpenAIClients,
    process_family,
    sum_metric,
)

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_gateway_tokens_equal_vllm_tokens(fleet: Fleet) -> None:
    """The gateway's tokenizer.json + chat template give vLLM's own token ids (``/tokenize``)."""
    tokenizer, template = load_tokenizer(MODEL_DIR / "tokenizer.json")
    url = fleet.workers["vllm-a"].url
    prompt = "The router keeps a radix index of which worker holds which prefix.\n\n  Tool result: {\"ok\": 1}"
    got = httpx.post(url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt}, timeout=30.0).json()
    assert got["tokens"] == tokenizer.encode(prompt)
    messages = [
        {"role": "system", "content": "You are terse.\n"},
        {"role": "user", "content": "Hello there!\nList the failing tests."},
        {"role": "assistant", "content": "three tests failed\n\n"},
        {"role": "user", "content": " and the log?"},
    ]
    got = httpx.post(url + "/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30.0).json()
    assert got["tokens"] == encode_chat(tokenizer, template, normalize_messages(messages))


def test_events_from_both_topologies_fill_the_index(fleet: Fleet) -> None:
    """vllm-a (gateway connects) and vllm-b (vLLM connects to the gateway's SUB) both populate the index."""
    gw = fleet.gateway
    for worker_id, seed, num_tokens in (("vllm-a", 1, 200), ("vllm-b", 2, 130)):
        before = gw.index_blocks(worker_id)
        num_event_blocks = gw.stream_counter("num_blocks")
        served = send(gw, "/v1/completions", {"prompt": token_ids(seed, num_tokens), "max_tokens": 1},
                      {"x-kvgate-worker": worker_id})
        assert (served.worker_id, served.predicted, served.reported) == (worker_id, 0, 0)
        # max_tokens 1: vLLM computes the prompt only, so it stores its full blocks and nothing else, and says so
        # in BlockStored events (the subscriber's block count moves only on real events).
        assert gw.stream_counter("num_blocks") == num_event_blocks + num_tokens // BLOCK_SIZE
        assert gw.index_blocks(worker_id) == before + num_tokens // BLOCK_SIZE


def test_predicted_equals_reported_for_every_request_also_after_evictions(fleet: Fleet) -> None:
    """Completions and chats, streamed and not, with hits, full-prompt hits and evictions: predicted == reported."""
    gw = fleet.gateway
    a = token_ids(10, 200)
    system = "You review logs. " * 12
    served: list[Served] = []

    def completion(prompt: list[int], *, stream: bool = False, max_tokens: int = 1, worker: str | None = None
                   ) -> Served:
        forced = {"x-kvgate-worker": worker} if worker else None
        s = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}, forced)
        served.append(s)
        return s

    def chat(user: str, *, stream: bool = False) -> Served:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        s = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": stream})
        served.append(s)
        return s

    first = completion(a)
    assert first.predicted == first.reported == 0
    again = completion(a)
    assert (again.worker_id, again.reported) == (first.worker_id, cacheable_tokens(200, 6))  # 192
    full = completion(a[:128])  # 4 full blocks all cached: vLLM still computes the last token -> 3 blocks
    assert (full.worker_id, full.reported) == (first.worker_id, 96)
    branch = completion(a[:150] + token_ids(11, 60), stream=True)
    assert (branch.worker_id, branch.reported) == (first.worker_id, 128)
    c1 = chat("Summarise the first log.")
    c2 = chat("Summarise the second log, please.", stream=True)
    assert c2.worker_id == c1.worker_id and c2.reported >= 128
    removed_before = gw.index_counter("num_blocks_removed")
    # 10 distinct 300-token prompts, odd seeds forced onto vllm-b: 5 x 9 blocks into each 24-block pool.
    for seed in range(20, 30):
        completion(token_ids(seed, 300), max_tokens=4, worker="vllm-b" if seed % 2 else None)
    removed = gw.index_counter("num_blocks_removed") - removed_before
    assert removed > 0
    # Back to earlier prefixes, now partly or wholly evicted, then hit again right away.
    for prompt in (a, a, token_ids(27, 300), token_ids(29, 300)[:250], token_ids(29, 300)):
        completion(prompt)
    chat("Summarise the first log.", stream=True)
    chat("Summarise the first log.")
    mismatches = [(i, s) for i, s in enumerate(served) if s.predicted != s.reported]
    assert mismatches == [], f"{len(mismatches)} of {len(served)} requests mispredicted: {mismatches}"
    assert sum(1 for s in served if s.reported > 0) >= 8
    assert {s.worker_id for s in served} == {"vllm-a", "vllm-b"}
    assert any(s.worker_id == "vllm-b" and s.reported > 0 for s in served[-7:])  # cache_aware found vllm-b's hit
    text = gw.metrics_text()
    assert sum_metric(text, "kvgate_cached_tokens_checks_total", 'result="mismatch"') == 0
    print(f"honesty: {len(served)} requests, {sum(s.reported for s in served)} cached tokens reported, "
          f"{sum(s.predicted for s in served)} predicted, {removed:.0f} blocks removed")


def test_multi_turn_conversation_lands_on_its_holder(fleet: Fleet) -> None:
    """cache_aware without a session key: every turn goes to the worker holding the conversation; vLLM reports
    the hit in ``usage`` and in ``vllm:prefix_cache_hits_total``."""
    gw = fleet.gateway
    messages: list[dict[str, str]] = [{"role": "system", "content": "Multi-turn agent. " * 10}]
    hits_before = {w: fleet.workers[w].metric("vllm:prefix_cache_hits_total") for w in fleet.workers}
    turns: list[Served] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests and report."})
        s = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 8})
        turns.append(s)
        messages.append({"role": "assistant", "content": s.body["choices"][0]["message"]["content"]})
    holder = turns[0].worker_id
    assert [s.worker_id for s in turns] == [holder] * 4
    assert turns[0].reported == 0
    for prev, s in zip(turns, turns[1:], strict=False):
        assert s.predicted == s.reported > 0
        assert s.num_prompt_tokens > prev.num_prompt_tokens
    hits = {w: fleet.workers[w].metric("vllm:prefix_cache_hits_total") - hits_before[w] for w in fleet.workers}
    assert hits[holder] == sum(s.reported for s in turns)
    assert all(v == 0 for w, v in hits.items() if w != holder)


def test_openai_client_through_the_gateway(fleet: Fleet, openai_client: OpenAIClients) -> None:
    """The official ``openai`` client: chat and completions, streamed and not."""
    gw = fleet.gateway
    tokenizer, template = load_tokenizer(MODEL_DIR / "tokenizer.json")
    client = openai_client(gw.url + "/v1", 60.0)
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Name one test runner."}]
    num_chat_tokens = len(encode_chat(tokenizer, template, normalize_messages(messages)))

    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                                           temperature=0.0)
    chat = raw.parse()
    assert raw.headers["x-kvgate-worker"] in fleet.workers
    assert chat.model == MODEL_NAME and chat.choices[0].finish_reason in ("length", "stop")
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage is not None and chat.usage.prompt_tokens == num_chat_tokens
    assert chat.usage.completion_tokens <= 5

    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == num_chat_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cacheable_tokens(num_chat_tokens, 99)  # same prompt again
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content

    prompt = "Tool result: 200 OK " * 8
    comp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0.0)
    assert comp.usage is not None and comp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert comp.choices[0].finish_reason in ("length", "stop")
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0.0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == comp.choices[0].text
    last = streamed[-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens == cacheable_tokens(last.prompt_tokens, 99)


def test_cache_salt_separates_tenants(fleet: Fleet) -> None:
    """vLLM hashes ``cache_salt`` into a prompt's first block (its events carry it in ``extra_keys``); the gateway
    puts it in the request's namespace: a salted prefix is a hit only for the same salt, on both sides."""
    gw = fleet.gateway
    prompt = token_ids(90, 150)
    first = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    same = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    other = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"},
                 {"x-kvgate-worker": first.worker_id})
    unsalted = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, {"x-kvgate-worker": first.worker_id})
    assert (first.predicted, first.reported) == (0, 0)
    assert (same.worker_id, same.predicted, same.reported) == (first.worker_id, 128, 128)
    assert (other.predicted, other.reported) == (0, 0)
    assert (unsalted.predicted, unsalted.reported) == (0, 0)


def test_worker_killed_mid_stream_then_restarted(fleet: Fleet, openai_client: OpenAIClients) -> None:
    """Kill the session's worker mid-stream: the client gets an error, the session moves; the restarted worker's
    sequence restart is detected and its stale index entries are cleared."""
    gw = fleet.gateway
    messages = [{"role": "system", "content": "Session on vllm-a. " * 8},
                {"role": "user", "content": "Start the long job."}]
    send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, {"x-kvgate-worker": "vllm-a"})
    session = {"x-session-id": "interop-session-1"}
    first = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, session)
    assert first.worker_id == "vllm-a" and first.reported == first.predicted > 0
    stale_blocks = gw.index_blocks("vllm-a")
    assert stale_blocks > 0
    resyncs_before = sum_metric(gw.metrics_text(), "kvgate_index_events_total", 'counter="num_resyncs"')

    client = openai_client(gw.url + "/v1", 60.0)
    max_tokens = MAX_MODEL_LEN - first.num_prompt_tokens - 1
    process = fleet.workers["vllm-a"].process
    assert process is not None and process.popen is not None
    group = process.popen.pid  # vllm-a was started in a process group of its own
    family = process_family(group)
    # The tiny model generates a whole stream in well under a second, faster than a client reads it on a loaded
    # machine: throttle every process of vllm-a (API server and engine core; run 1 ms, stop 199 ms: 0.5% of a
    # core, so even a client that reads its first chunk seconds late finds the stream unfinished), and freeze them
    # for good once the first chunk is here, so the stream is certainly unfinished when they die.
    stop_throttle = threading.Event()

    def signal_family(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole process group vllm-a was started in
            os.killpg(group, signum)
        for pid in family:  # and any descendant that left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def throttle() -> None:
        while not stop_throttle.is_set():
            signal_family(signal.SIGCONT)
            time.sleep(0.001)
            signal_family(signal.SIGSTOP)
            time.sleep(0.199)

    throttler = threading.Thread(target=throttle, daemon=True)
    throttler.start()
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=cast(Any, messages), max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True}, extra_headers=session)
    num_chunks = 0
    finish_reason = None
    t0 = time.monotonic()
    # The gateway relays what vLLM sent, then ends the stream with an OpenAI error event and [DONE] (router.sse):
    # the client raises a clean APIError, never hangs and never mistakes the cut stream for a finished one. On a
    # loaded machine vLLM can still have sent its whole stream before the kill (the client read its first chunk
    # late): then the stream must end complete, with its finish reason, and the rest of the test (the session
    # moves, the restart is detected) holds the same.
    try:
        for chunk in stream:
            num_chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finish_reason = chunk.choices[0].finish_reason
            if num_chunks == 1:
                stop_throttle.set()
                throttler.join()  # its last signal was SIGSTOP: vllm-a generates nothing more
                signal_family(signal.SIGKILL)
                process.kill()
        is_cut = False
    except openai.APIError as exc:
        assert not isinstance(exc, openai.APIConnectionError), "the stream must end with an error event"
        assert exc.message.startswith("the worker's answer broke after its headers: ")
        is_cut = True
    if is_cut:
        assert 1 <= num_chunks < max_tokens and finish_reason is None
    else:
        assert finish_reason == "length", "a stream that ended cleanly must be complete"
    assert time.monotonic() - t0 < 30

    moved = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, session)
    assert moved.worker_id == "vllm-b" and moved.predicted == moved.reported
    again = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, session)
    assert again.worker_id == "vllm-b" and again.reported == again.predicted > 0
    sessions = httpx.get(gw.url + "/admin/sessions").json()["sessions"]
    owners = [e["worker_id"] for e in sessions if e["session_key"].endswith(":interop-session-1")]
    assert owners == ["vllm-b"]  # stored as "<source>:<value>"

    # The restarted vLLM publishes from seq 0 again: the gateway asks vLLM's replay ROUTER whether it still follows
    # the same publisher, sees it does not, and drops everything it knew about vllm-a.
    num_replay_requests = gw.stream_counter("num_replay_requests")
    assert fleet.restart("vllm-a") == 1
    assert gw.stream_counter("num_replay_requests") > num_replay_requests
    assert sum_metric(gw.metrics_text(), "kvgate_index_events_total", 'counter="num_resyncs"') == resyncs_before + 1
    wait_events_settled(gw)
    assert gw.index_blocks("vllm-a") == 64 // BLOCK_SIZE  # only the probe prompt that carried the restart
    after = send(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, {"x-kvgate-worker": "vllm-a"})
    assert after.predicted == after.reported == 0


def test_no_mismatch_over_the_whole_module(fleet: Fleet) -> None:
    """The gateway's own honesty metric over every request of this module that vLLM answered with usage."""
    text = fleet.gateway.metrics_text()
    num_matches = sum_metric(text, "kvgate_cached_tokens_checks_total", 'result="match"')
    num_mismatches = sum_metric(text, "kvgate_cached_tokens_checks_total", 'result="mismatch"')
    predicted = sum_metric(text, "kvgate_predicted_cached_tokens_total")
    reported = sum_metric(text, "kvgate_reported_cached_tokens_total")
    print(f"gateway honesty: {num_matches:.0f} matches, {num_mismatches:.0f} mismatches, "
          f"{predicted:.0f} tokens predicted, {reported:.0f} reported")
    assert num_mismatches == 0
    assert num_matches >= 36  # the module's own requests with usage; the fixture's probes add a few
    assert predicted == reported > 0
