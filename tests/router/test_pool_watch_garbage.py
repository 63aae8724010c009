"""The pool watcher against a master admin port that answers garbage (a real HTTP server on loopback): keys with
non-ASCII digits, bytes that are not UTF-8, counters that are NaN or infinite. Each sweep completes, counts the
garbage as foreign keys and keeps the keys it understands; the watcher's loop never dies of one."""

from __future__ import annotations

from aiohttp import web

from router.index import PrefixIndex
from router.index.config import IndexConfig
from router.pool_watch import PoolWatcher, parse_counters, parse_pool_key
from router.pool_watch_config import PoolWatchConfig

H = "ab" * 24 + "0123456789abcdef"


def test_keys_with_non_ascii_digits_or_a_huge_group_are_foreign():
    assert parse_pool_key("kvgate/v1/ckpt/3/" + H) == (3, 0x0123456789ABCDEF)
    assert parse_pool_key("kvgate/v1/ckpt/\u00b2/" + H) is None  # "²".isdigit() is True, int("²") raises
    assert parse_pool_key("m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:\u0663@" + H) is None  # Arabic-Indic 3
    assert parse_pool_key("kvgate/v1/ckpt/" + "9" * 5000 + "/" + H) is None  # int() refuses 4,300+ digits
    assert parse_pool_key("kvgate/v1/" + "\u0661" * 64) is None


def test_non_finite_counters_are_left_out():
    assert parse_counters("master_evicted_key_count NaN\na_total +Inf\nb_total 3\n") == {"b_total": 3.0}


async def test_a_sweep_of_a_garbage_listing_completes_and_counts_it():
    listing = b"\n".join([
        ("kvgate/v1/ckpt/\u00b2/" + H).encode(), b"\xff\xfe" + H.encode(), ("kvgate/v1/" + H).encode(), b"junk",
    ])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=b"master_evicted_key_count NaN\nmaster_put_start_requests_total 5\n")

    async def keys(_: web.Request) -> web.Response:
        return web.Response(body=listing, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/get_all_keys", keys)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    config = PoolWatchConfig(admin_url=f"http://127.0.0.1:{port}", lease_ttl_s=2.0, entry_ttl_s=2.0,
                             interval_s=0.5, request_timeout_s=1.0)
    watcher = PoolWatcher(config, {"m": PrefixIndex(IndexConfig(block_size=4))}, clock=lambda: 0.0)
    await watcher.open()
    try:
        for _ in range(2):
            assert await watcher.sweep() is True
        assert watcher.is_master_up and watcher.num_sweeps == 2
        assert watcher.master_key_count == 4 and watcher.num_foreign_keys == 2 * 3
        assert watcher.master_evicted_key_count == 0
    finally:
        await watcher.close()
        await runner.cleanup()
