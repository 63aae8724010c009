"""The vLLM decode leg never carries a client's own ``kv_transfer_params``: where the prefill answer has none (or
malformed ones, which the gateway passes as ``None``), the decode worker computes the prompt itself instead of
pulling KV from the host, port and blocks a client named."""

from __future__ import annotations

from common.pd_protocol import decode_leg_body

HOSTILE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
           "remote_block_ids": [0, 1, 2], "remote_host": "10.0.0.9", "remote_port": 5600}


def test_a_client_kv_transfer_params_is_dropped_when_the_prefill_answer_has_none():
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "kv_transfer_params": HOSTILE}
    assert decode_leg_body(body, None) == {"model": "m", "prompt": "hi", "max_tokens": 3}
    assert decode_leg_body(body, {}) == {"model": "m", "prompt": "hi", "max_tokens": 3}
    assert body["kv_transfer_params"] is HOSTILE  # the client's body is not changed


def test_the_prefill_answer_params_replace_the_client_ones():
    body = {"model": "m", "prompt": "hi", "kv_transfer_params": HOSTILE}
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1234}
    assert decode_leg_body(body, params) == {"model": "m", "prompt": "hi", "kv_transfer_params": params}
