"""The cost model's online calibration against a sim worker twice slower than the profile the gateway believes.

Both workers declare the default H200 profile (``workers.config.TimingProfile``) and the gateway's ``cache_aware``
constants are that profile's; ``w0`` actually runs with every compute constant doubled. The gateway is
told each worker's ``time_scale`` (wall seconds per simulated second), so the TTFT it calibrates with is in the
workers' simulated seconds, like the cost model's constants; real time (1.0) keeps wall-clock noise unamplified.
"""

from __future__ import annotations

import time

import pytest

from tests.router.sim_fleet import MODEL, Gw, SimWorker, connected, make_config, running
from workers.config import TimingProfile

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIME_SCALE = 1.0
DECLARED = TimingProfile()
SLOW = {
    "step-overhead-s": 2 * DECLARED.step_overhead_s,
    "prefill-s-per-token": 2 * DECLARED.prefill_s_per_token,
    "attention-s-per-token-pair": 2 * DECLARED.attention_s_per_token_pair,
}
POLICY = {
    "name": "cache_aware",
    # the declared profile in the cost model's terms: prefill(n) = n / r_lin + n**2 / r_quad
    "prefill_linear_tokens_per_s": 1.0 / DECLARED.prefill_s_per_token,
    "prefill_quadratic_tokens_sq_per_s": 2.0 / DECLARED.attention_s_per_token_pair,
    "overhead_s": DECLARED.step_overhead_s,
    "per_running_request_s": 0.0,
    "per_waiting_request_s": 0.0,
}
NUM_PROMPT_TOKENS = 4000
MAX_CALIBRATION_REQUESTS = 8


def fresh_prompt(i: int) -> str:
    """A prompt sharing no block with any other (its first character differs)."""
    return chr(ord("A") + i % 26) + chr(ord("a") + i // 26) + "x" * (NUM_PROMPT_TOKENS - 2)


async def streamed_ttft_s(g: Gw, prompt: str) -> tuple[str, float]:
    """(worker, time to the first streamed chunk in the workers' simulated seconds)."""
    assert g.session is not None
    t0 = time.perf_counter()
    async with g.session.post(g.url + "/v1/completions",
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}) as resp:
        assert resp.status == 200
        await resp.content.readany()
        ttft_s = (time.perf_counter() - t0) / TIME_SCALE
        await resp.read()
        return resp.headers["x-kvgate-worker"], ttft_s


async def test_a_worker_twice_slower_than_declared_is_learned_and_avoided():
    ws_ = [SimWorker("w0", timing=SLOW, time_scale=TIME_SCALE), SimWorker("w1", time_scale=TIME_SCALE)]
    async with running(*ws_) as ws:
        extra = {w.worker_id: {"time_scale": TIME_SCALE} for w in ws}
        async with Gw(make_config(ws, worker_extra=extra, policy=POLICY)) as g:
            await connected(g, ws)
            calibrator = g.gw.holder.calibrator
            assert calibrator is not None
            # as declared, both are equal: the tie goes to the first in configuration order
            worker, _ = await streamed_ttft_s(g, fresh_prompt(0))
            assert worker == "w0"
            await g.admin("POST", "/admin/workers/w1/drain")
            for i in range(1, MAX_CALIBRATION_REQUESTS):
                worker, _ = await streamed_ttft_s(g, fresh_prompt(i))
                assert worker == "w0"
            # its predicted TTFT is now within 20 % of what it shows (median of three, against scheduling noise)
            pairs = []
            for i in range(3):
                worker, observed_s = await streamed_ttft_s(g, fresh_prompt(100 + i))
                assert worker == "w0"
                pairs.append((g.gw.router.recent[-1].scores["w0"], observed_s))
            predicted_s, observed_s = sorted(pairs, key=lambda p: p[1])[1]
            assert abs(predicted_s - observed_s) <= 0.2 * observed_s, pairs
            assert 1.6 <= calibrator.speed_factor("w0") <= 2.4
            # and traffic shifts away from it
            await g.admin("POST", "/admin/workers/w1/undrain")
            served = [(await streamed_ttft_s(g, fresh_prompt(200 + i)))[0] for i in range(6)]
            assert served == ["w1"] * 6
            assert 0.8 <= calibrator.speed_factor("w1") <= 1.25
