"""Long agentic turns: ``python -m benchmarks long_turns``.

Requests carry a 32K / 100K / 200K-token conversation plus a new turn of about 1,500 tokens, tokenized with a
Llama-3-shaped byte-level BPE trained locally (``benchmarks._bpe``: Llama-3's pre-tokenizer and special tokens,
vocabulary asked for 128,256). Two parts:

(a) **Proxies** (separate processes, one fake backend, the same bodies to each, measured in turn): ``direct`` (the
backend), ``bare`` (aiohttp + uvloop + msgspec pass-through, ``benchmarks.gateway``), ``kvgate`` (``kvgate serve``,
``cache_aware``, the BPE as the model's tokenizer), ``sglang`` and ``vllm`` (their routers with ``cache_aware``,
from the venvs ``scripts/setup-peers`` makes; skipped with the reason when absent). For each size, **first turns**
(every request a new conversation) and **following turns** (``concurrency`` sessions, each warmed by its first turn,
then ``--turns`` more turns each), text prompts (``/v1/completions``) or chats (``--kinds chat``), streaming or not,
at each concurrency: the proxy's CPU per request (its kernel CPU clock) and client-side p50/p99 (nearest rank) with
the added p50 against ``direct``. A peer whose venv is missing, or whose router exits or does not answer within 60 s,
is skipped with the reason (printed, and in the summary).

(b) **The event loop** (in this process): the gateway's own routing steps for ``concurrency`` concurrent
conversations: ``parse_request_async`` (a long body parsed in a worker thread, as the gateway does), the request
view (``router.api.prompt_view``: long text tokenized and hashed in its worker threads, a prompt over
``OFF_LOOP_PLAN_CHARS`` planned there too, as the gateway does), ``PrefixIndex.match``
and the chosen worker's approximate insertion (``router.sliced_insert.SlicedInsert``, as ``IndexTicket`` makes it
for a worker without events: root-first in slices, the first before the decision counts as made, the rest on the
next turns of the loop), with a probe task that sleeps 1 ms in a loop and records how late it wakes, and the
decision time of first and following turns. The lateness is the event loop's: the longest stretch in which it ran
no timer, which is at least the longest synchronous step of any one request's routing (the slices included), plus
the steps of every other request ready in the same turn of the loop and the time the loop waited for the GIL
behind the parse and tokenizer threads; uvloop's timers have millisecond resolution, so a sample can read up to
about 1 ms late on an idle loop, and on a shared host the lag also counts the time other processes held the core.
``--loop-steps`` runs this part on the standard asyncio loop instead, with every callback timed (wall and this
thread's CPU): the longest single step of the loop (one request's synchronous routing step, one slice of an
insertion, a probe's wake-up), which other processes cannot inflate in CPU time, named (a task's step by the
coroutines it suspended in after it, ``session:N>prompt_view:N>...``; an insertion's slice as
``SlicedInsert._step``). The worst lateness is split (``benchmarks._loop_probe``) into the loop thread's own CPU
time, its time runnable without a core (Linux schedstat: the process's other threads or other processes held the
cores) and the rest, its waits for the GIL; ``over 5 ms`` sums the lateness of every interval later than 5 ms and
gives those parts' shares. At each concurrency ``c``, ``max(c, --first-requests)`` conversations run, ``c`` at a
time.

``--kinds text,chat`` runs both parts for both kinds of request. A summary at the end gives, against issue 21's
targets: each size's first-turn decision time at the lowest concurrency (20 ms), the loop's lag at each
concurrency (5 ms), and the CPU per request against the bare proxy (1.2x following turns).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from benchmarks._bpe import LLAMA3_VOCAB_SIZE, llama3_shaped_tokenizer
from benchmarks._loop_probe import LAG_BUDGET_S, LagProbe, LagSummary
from benchmarks.gateway import _cpu_s, _free_ports, _spawn, _wait_port
from common.allocator import ALLOCATORS, JEMALLOC_PATHS, allocator_env, find_jemalloc

PEERS_DIR = Path(os.environ.get("KVGATE_PEERS_DIR", Path.home() / ".cache" / "kvgate" / "peers"))
CACHE_DIR = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
NEW_TURN_TOKENS = 1500


class Corpus:
    """Lines of this repository's sources and documents, and the BPE's characters per token on them."""

    def __init__(self, tokenizer_path: Path) -> None:
        from benchmarks._bpe import repository_corpus
        from common.tokenization import HFTokenizer

        root = Path(__file__).resolve().parent.parent
        self.lines = [ln for text in repository_corpus(root) for ln in text.splitlines() if ln.strip()]
        self.tokenizer = HFTokenizer(tokenizer_path)
        sample = "\n".join(self.lines[:4000])
        self.chars_per_token = len(sample) / len(self.tokenizer.encode(sample))

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """About ``num_tokens`` tokens of consecutive lines from a random place."""
        want = int(num_tokens * self.chars_per_token)
        out: list[str] = []
        n = 0
        i = rng.randrange(len(self.lines))
        while n < want:
            line = self.lines[i % len(self.lines)]
            out.append(line)
            n += len(line) + 1
            i += 1
        return "\n".join(out) + "\n"


def conversation(corpus: Corpus, session: int, num_tokens: int, num_turns: int, seed: int) -> list[str]:
    """Text prompts of one session: turn 0 is the history plus a new turn, each next turn appends one more."""
    rng = random.Random(seed * 1_000_003 + session)
    prompt = f"<|begin_of_text|>session {seed}-{session}: you are a coding agent.\n" + corpus.text(rng, num_tokens)
    prompts = []
    for t in range(num_turns + 1):
        prompt += f"USER (turn {t}):\n" + corpus.text(rng, NEW_TURN_TOKENS) + "ASSISTANT:\n"
        prompts.append(prompt)
        prompt += corpus.text(rng, 60)  # the answer, part of the next turn's prompt
    return prompts


def chat_conversation(corpus: Corpus, session: int, num_tokens: int, num_turns: int, seed: int) -> list[list[dict[
        str, str]]]:
    """Chats of one session: the history as messages of about 2,000 tokens, one new user message per turn."""
    rng = random.Random(seed * 1_000_003 + session)
    messages = [{"role": "system", "content": f"session {seed}-{session}: you are a coding agent."}]
    for i in range(max(1, num_tokens // 2000)):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": corpus.text(rng, 2000)})
    chats = []
    for t in range(num_turns + 1):
        messages = [*messages, {"role": "user", "content": f"turn {t}\n" + corpus.text(rng, NEW_TURN_TOKENS)}]
        chats.append(messages)
        messages = [*messages, {"role": "assistant", "content": corpus.text(rng, 60)}]
    return chats


def _body(prompt: str | list[dict[str, str]], stream: bool) -> bytes:
    key = "prompt" if isinstance(prompt, str) else "messages"
    return msgspec.json.encode({"model": "m", key: prompt, "max_tokens": 4, "stream": stream})


# -- (a) proxies --------------------------------------------------------------------------------------------


async def _send(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: status {r.status}")
    return time.perf_counter() - t0


async def _run_sessions(port: int, path: str, bodies: list[list[bytes]], first: int) -> list[float]:
    """Each session sends its bodies ``[first:]`` in order, all sessions at once; returns the latencies."""
    url = f"http://127.0.0.1:{port}{path}"
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(seq: list[bytes]) -> None:
            for b in seq[first:]:
                latencies.append(await _send(s, url, b))

        await asyncio.gather(*(one(seq) for seq in bodies))
    return latencies


def _model_config(tokenizer_path: Path, prompt_cache_mib: int | None) -> dict[str, Any]:
    """The benchmark's model: block size 16, the BPE, the gateway's prompt-cache budget unless one is given."""
    model: dict[str, Any] = {"name": "m", "block_size": 16, "tokenizer_path": str(tokenizer_path)}
    if prompt_cache_mib is not None:
        model["prompt_cache_max_bytes"] = prompt_cache_mib << 20
    return model


def _gateway_config(tmp: Path, port: int, worker_ports: list[int], tokenizer_path: Path,
                    prompt_cache_mib: int | None = None) -> list[str]:
    cfg = {"listen": {"host": "127.0.0.1", "port": port, "max_body_bytes": 64 * 1024 * 1024},
           "models": [_model_config(tokenizer_path, prompt_cache_mib)],
           "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "m", "load_path": None,
                        "snapshot_path": None} for i, p in enumerate(worker_ports)],
           "policy": {"name": "cache_aware"}, "admin": {"disable_auth": True}, "health": {"interval_s": 60}}
    path = tmp / "gateway.yaml"
    path.write_text(json.dumps(cfg))
    return [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--log-level", "WARNING"]


def _peer_args(peer: str, port: int, worker_ports: list[int]) -> list[str] | str:
    """The command of a peer router with ``cache_aware``, or why it is skipped."""
    module = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}[peer]
    py = PEERS_DIR / f"{peer}-router" / "bin" / "python"
    if not py.exists():
        return f"no venv at {py.parent.parent} (run scripts/setup-peers)"
    args = [str(py), "-m", module, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
            *(f"http://127.0.0.1:{p}" for p in worker_ports), "--policy", "cache_aware", "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(_free_ports(1)[0]), "--log-level",
            "warn" if peer == "sglang" else "warning",
            "--max-payload-size", str(64 * 1024 * 1024)]
    return args


def _p99(ordered: list[float]) -> float:
    """The 99th percentile of sorted samples, by nearest rank (the largest of fewer than 100)."""
    return ordered[min(len(ordered), math.ceil(len(ordered) * 0.99)) - 1]


async def _wait_peer(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 60.0) -> str | None:
    """``None`` once a peer router answers ``/health``, else why not (it exited, or did not answer in time)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"exited with status {proc.returncode}"
            try:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status < 500:
                        return None
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    return f"no answer on /health within {timeout_s:.0f} s"


async def bench_proxies(args: argparse.Namespace, tokenizer_path: Path, corpus: Corpus, kind: str,
                        summary: Summary) -> None:
    worker_ports = _free_ports(args.num_workers)
    bare, gate, sgl, vll = _free_ports(4)
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-long-"))
    py = sys.executable
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["direct"] = _spawn([py, "-m", "benchmarks.gateway", "--role", "backend", "--ports",
                                  ",".join(map(str, worker_ports))])
        await _wait_port(worker_ports[0])
        procs["bare"] = _spawn([py, "-m", "benchmarks.gateway", "--role", "bare", "--ports", str(bare),
                                "--upstream", f"http://127.0.0.1:{worker_ports[0]}"])
        procs["kvgate"] = _spawn(_gateway_config(tmp, gate, worker_ports, tokenizer_path, args.prompt_cache_mib),
                                 env=allocator_env(args.allocator))
        ports = {"direct": worker_ports[0], "bare": bare, "kvgate": gate}
        for peer, port in (("sglang", sgl), ("vllm", vll)):
            if peer not in args.targets:
                continue
            cmd = _peer_args(peer, port, worker_ports)
            if isinstance(cmd, str):
                print(f"{peer}: skipped ({cmd})")
                summary.skipped[peer] = cmd
                continue
            procs[peer] = _spawn(cmd)
            ports[peer] = port
        await _wait_port(gate)
        await _wait_port(bare, "/v1/completions")
        for peer in ("sglang", "vllm"):
            if peer in ports:
                why = await _wait_peer(procs[peer], ports[peer])
                if why is not None:
                    print(f"{peer}: skipped (did not come up: {why})")
                    summary.skipped[peer] = f"did not come up: {why}"
                    del ports[peer]
        targets = [t for t in ("direct", "bare", "kvgate", "sglang", "vllm") if t in ports and t in args.targets]
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        seed = 0
        print(f"\n{'kind':>6} {'tokens':>7} {'turn':>9} {'stream':>6} {'c':>3} {'target':8} {'n':>4} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'+p50 ms':>8} {'CPU us/req':>11} {'/bare':>6}")
        for num_tokens in args.tokens:
            for stream in args.stream:
                for c in args.concurrency:
                    for turn in ("first", "following"):
                        seed += 1
                        num_turns = args.turns if turn == "following" else 0
                        sessions = c if turn == "following" else max(c, args.first_requests)
                        make = chat_conversation if kind == "chat" else conversation
                        bodies = [[_body(p, stream) for p in make(corpus, s, num_tokens, num_turns, seed)]
                                  for s in range(sessions)]
                        if turn == "first":  # c connections share the first turns of `sessions` conversations
                            flat = [b[0] for b in bodies]
                            bodies = [flat[i::c] for i in range(c)]
                        results: dict[str, tuple[float, float, float, int]] = {}
                        for name in targets:
                            if turn == "following":
                                await _run_sessions(ports[name], path, [b[:1] for b in bodies], 0)  # warm
                            pid = procs[name].pid if name != "direct" else None
                            cpu0 = _cpu_s(pid) if pid else 0.0
                            lat = await _run_sessions(ports[name], path, bodies, 1 if turn == "following" else 0)
                            cpu = (_cpu_s(pid) - cpu0) / len(lat) * 1e6 if pid else float("nan")
                            lat.sort()
                            results[name] = (statistics.median(lat) * 1e3, _p99(lat) * 1e3, cpu, len(lat))
                        base = results.get("bare", (0.0, 0.0, float("nan"), 0))[2]
                        direct = results.get("direct", (0.0, 0.0, 0.0, 0))[0]
                        summary.proxies[(kind, num_tokens, turn, stream, c)] = {
                            name: (cpu, p50 - direct) for name, (p50, _, cpu, _) in results.items()}
                        for row_name, (p50, p99, cpu, n) in results.items():
                            print(f"{kind:>6} {num_tokens:7d} {turn:>9} {str(stream):>6} {c:3d} {row_name:8} {n:4d} "
                                  f"{p50:8.2f} {p99:8.2f} {p50 - direct:8.2f} {cpu:11.0f} {cpu / base:6.2f}",
                                  flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=10)


# -- (b) the event loop -------------------------------------------------------------------------------------


async def bench_loop(args: argparse.Namespace, tokenizer_path: Path, corpus: Corpus, kind: str,
                     summary: Summary) -> None:
    from router.config import ModelConfig
    from router.index import IndexConfig, PrefixIndex
    from router.request_view import ModelTokenizer
    from router.serve import GIL_SWITCH_INTERVAL_S

    switch_s = GIL_SWITCH_INTERVAL_S if args.switch_interval_s is None else args.switch_interval_s
    sys.setswitchinterval(switch_s)  # as in a gateway process, unless asked otherwise
    model = ModelTokenizer(msgspec.convert(_model_config(tokenizer_path, args.prompt_cache_mib), ModelConfig))
    index = PrefixIndex(IndexConfig(block_size=16))
    steps_on = args.loop_steps
    # As ``router.serve`` does once the app is built: what lives for good (the corpus, the tokenizer's tables) is
    # out of the collector's generations, so a full collection on the loop does not walk it.
    gc.freeze()
    where = "asyncio, every step timed" if steps_on else "uvloop"
    print(f"\nevent loop ({'chat' if kind == 'chat' else 'completions'}, {where}, GIL switch interval "
          f"{switch_s * 1e3:g} ms): "
          "decision = parse + view + match + insert; lag = how late a 1 ms sleeper wakes")
    steps = _StepTimer() if steps_on else None
    print("lag split = the worst lateness's parts: the loop thread on CPU / runnable without a core / waiting for "
          "the GIL (ms),\n  then the process's CPU per second of it (cores busy); over "
          f"{LAG_BUDGET_S * 1e3:.0f} ms = the lateness past {LAG_BUDGET_S * 1e3:.0f} ms summed, and its parts' shares")
    print(f"{'tokens':>7} {'c':>3} {'first p50 ms':>13} {'first max':>10} {'next p50 ms':>12} {'next max':>9} "
          f"{'lag max ms':>11} {'lag p99 ms':>11} {'lag split':>16} {'over 5 ms':>16}"
          + (" | longest step CPU ms : which" if steps else ""))
    for num_tokens in args.tokens:
        for c in args.concurrency:
            make = chat_conversation if kind == "chat" else conversation
            convs = [[_body(p, False) for p in make(corpus, s, num_tokens, args.turns, 1000 + c)]
                     for s in range(max(c, args.first_requests))]
            if steps is not None:
                steps.start()
            first, following, probe = await _loop_point(model, index, "chat" if kind == "chat" else "completions",
                                                        convs, c)
            lag = probe.summary()
            extra = ""
            longest: tuple[float, str] | None = None
            if steps is not None:
                _, _, max_cpu_s, name = steps.stop()
                extra = f" | {max_cpu_s * 1e3:8.2f} : {name}"
                longest = (max_cpu_s, name)
            summary.loops[(kind, num_tokens, c)] = (statistics.median(first), lag, longest)
            print(f"{num_tokens:7d} {c:3d} {statistics.median(first) * 1e3:13.2f} {max(first) * 1e3:10.2f} "
                  f"{statistics.median(following) * 1e3:12.3f} {max(following) * 1e3:9.3f} "
                  f"{lag.max_s * 1e3:11.2f} {lag.p99_s * 1e3:11.2f} {lag.split():>16} {lag.over_split():>16}{extra}",
                  flush=True)


class _StepTimer:
    """Times every callback the standard asyncio loop runs (``asyncio.events.Handle._run``, patched between
    ``start`` and ``stop``; uvloop runs its callbacks in C, out of reach) and names the one that used the most CPU:
    a task's step by its coroutine and the line it suspended at after the step (tasks are the pure-Python ones
    meanwhile, whose step callbacks name their task), any other callback by its qualified name."""

    def __init__(self) -> None:
        self._steps: list[tuple[float, float]] = []
        self._original: Any = None
        self._longest = ""

    def start(self) -> None:
        handle = asyncio.events.Handle
        original = self._original = handle._run
        steps = self._steps = []
        self._longest = ""
        begin = time.perf_counter()
        most = [0.0]
        loop = asyncio.get_running_loop()
        loop.set_task_factory(lambda lp, coro: asyncio.tasks._PyTask(coro, loop=lp))  # type: ignore[attr-defined]

        def timed_run(h: asyncio.Handle) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            original(h)
            if t0 >= begin:  # not the step that called ``start`` (the benchmark's own setup)
                cpu_s = time.thread_time() - c0
                steps.append((time.perf_counter() - t0, cpu_s))
                if cpu_s > most[0]:
                    most[0] = cpu_s
                    self._longest = _step_name(h)

        handle._run = timed_run  # type: ignore[method-assign,assignment]

    def stop(self) -> tuple[float, float, float, str]:
        """The longest step's wall time and CPU time, the most CPU time of any step (seconds) and that step's name."""
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign]
        asyncio.get_running_loop().set_task_factory(None)
        wall_s, cpu_s = max(self._steps)
        return wall_s, cpu_s, max(c for _, c in self._steps), self._longest


def _step_name(h: asyncio.Handle) -> str:
    """``coroutine:line>...`` for a pure-Python task's step (the awaited chain where it suspended after it,
    outermost first), else the callback's name."""
    callback = getattr(h, "_callback", None)
    get_coro = getattr(getattr(callback, "__self__", None), "get_coro", None)  # a task's (``_PyTask``, not ``Task``)
    if get_coro is not None:
        coro = get_coro()
        frame = getattr(coro, "cr_frame", None)
        where: list[str] = []
        while frame is not None:  # the awaited chain, outermost first
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None)
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        return ">".join(where) or "task (done)"
    return getattr(callback, "__qualname__", repr(callback))


async def _loop_point(model: Any, index: Any, kind: Any, convs: list[list[bytes]], concurrency: int | None = None
                      ) -> tuple[list[float], list[float], LagProbe]:
    """Decision times of first and following turns, and the lateness probe that ran meanwhile, for the
    conversations ``convs`` (each one's turns in order), ``concurrency`` of them at a time (all by default); long
    bodies are decoded in a parse executor of the gateway's ``PARSE_THREADS``."""
    from router.api import parse_request_async, prompt_view
    from router.request_view import PARSE_THREADS
    from router.sliced_insert import SlicedInsert

    parser = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")

    probe = LagProbe()
    first: list[float] = []
    following: list[float] = []

    async def session(conversations: list[list[bytes]]) -> None:
        for t, body in ((t, body) for bodies in conversations for t, body in enumerate(bodies)):
            t0 = time.perf_counter()
            view = await prompt_view(model, await parse_request_async(kind, body, parser))
            index.match(view.block_hashes)
            SlicedInsert(index, "w0", view.block_hashes, time.monotonic())
            (first if t == 0 else following).append(time.perf_counter() - t0)
            await asyncio.sleep(0)

    task = asyncio.ensure_future(probe.run())
    try:
        c = concurrency or len(convs)
        await asyncio.gather(*(session(convs[i::c]) for i in range(c)))
    finally:
        probe.stop()
        await task
        parser.shutdown()
    return first, following, probe


class Summary:
    """The figures issue 21's targets are about, gathered over a run and printed at its end (``print``).

    Attributes:
        loops: (kind, tokens, concurrency) -> (first-turn decision p50 s, the loop's ``LagSummary``, the longest
            step's (CPU s, name) with ``--loop-steps`` else ``None``).
        proxies: (kind, tokens, turn, stream, concurrency) -> target -> (CPU us per request, added p50 ms).
        skipped: peer -> why it did not run.
        allocator: the kvgate process's (``--allocator``).
        prompt_cache_mib: the model's prompt-cache budget (``--prompt-cache-mib``; ``None``: the gateway's).
    """

    FIRST_TURN_TARGET_S = 0.020
    CPU_TARGET_RATIO = 1.2

    def __init__(self) -> None:
        self.loops: dict[tuple[str, int, int], tuple[float, LagSummary, tuple[float, str] | None]] = {}
        self.proxies: dict[tuple[str, int, str, bool, int], dict[str, tuple[float, float]]] = {}
        self.skipped: dict[str, str] = {}
        self.allocator = "pymalloc"
        self.prompt_cache_mib: int | None = None

    def print(self) -> None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cache = "the gateway's default" if self.prompt_cache_mib is None else f"{self.prompt_cache_mib} MiB"
        print(f"\nsummary ({usable} usable CPUs; the kvgate process's allocator {self.allocator}; prompt caches "
              f"{cache})")
        budget_ms, first_ms = LAG_BUDGET_S * 1e3, self.FIRST_TURN_TARGET_S * 1e3
        lowest: dict[tuple[str, int], int] = {}
        for kind, tokens, c in self.loops:
            lowest[(kind, tokens)] = min(c, lowest.get((kind, tokens), c))
        for (kind, tokens), c in lowest.items():
            first_s = self.loops[(kind, tokens, c)][0]
            print(f"  first turn decided, {kind} {tokens} tokens, c={c}: {first_s * 1e3:.1f} ms p50 "
                  f"(target {first_ms:.0f} ms: {_met(first_s <= self.FIRST_TURN_TARGET_S)})")
        for (kind, tokens, c), (_, lag, longest) in self.loops.items():
            step = "" if longest is None else (f"; longest step {longest[0] * 1e3:.2f} ms CPU ({longest[1]}; "
                                               f"{_met(longest[0] <= LAG_BUDGET_S)})")
            print(f"  loop lag, {kind} {tokens} tokens, c={c}: max {lag.max_s * 1e3:.1f} ms, p99 "
                  f"{lag.p99_s * 1e3:.1f} ms (target {budget_ms:.0f} ms: {_met(lag.max_s <= LAG_BUDGET_S)}); worst "
                  f"{lag.split()} (CPU/run queue/GIL ms, cores busy); over {budget_ms:.0f} ms {lag.over_split()}"
                  f"{step}")
        for (kind, tokens, turn, stream, c), rows in self.proxies.items():
            bare = rows.get("bare", (float("nan"), 0.0))[0]
            added = "" if "direct" not in rows else "; p50 {:+.1f} ms vs direct"
            parts = [f"{name} {cpu:.0f} us ({cpu / bare:.2f}x bare" + added.format(more) + ")"
                     for name, (cpu, more) in rows.items() if name not in ("direct", "bare")]
            met = ""
            if turn == "following" and "kvgate" in rows:
                met = f"; target {self.CPU_TARGET_RATIO}x: {_met(rows['kvgate'][0] <= self.CPU_TARGET_RATIO * bare)}"
            print(f"  CPU per request, {kind} {tokens} tokens, {turn} turns, stream {stream}, c={c}: "
                  f"bare {bare:.0f} us, " + ", ".join(parts) + met)
        for peer, why in self.skipped.items():
            print(f"  {peer}: skipped ({why})")


def _met(is_met: bool) -> str:
    return "met" if is_met else "NOT met"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32_768, 100_000, 200_000])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--stream", type=lambda s: [x == "true" for x in s.split(",")], default=[False, True],
                        help="comma-separated true/false")
    parser.add_argument("--turns", type=int, default=3, help="following turns per session")
    parser.add_argument("--first-requests", type=int, default=8, help="first-turn requests per point (at least c)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--chat", action="store_true", help="chats instead of text prompts (--kinds chat)")
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=None,
                        help="comma-separated text (/v1/completions) and chat (/v1/chat/completions); default text")
    parser.add_argument("--targets", type=lambda s: s.split(","), default=["direct", "bare", "kvgate", "sglang",
                                                                              "vllm"])
    parser.add_argument("--switch-interval-s", type=float, default=None,
                        help="the loop part's sys.setswitchinterval (default: the gateway's, router.serve)")
    parser.add_argument("--prompt-cache-mib", type=int, default=None,
                        help="the model's prompt_cache_max_bytes in MiB (default the gateway's: 1024, idle entries "
                             "64; a 100K-token text session keeps about 1.2 MiB of checkpoints, 3/8 of the budget "
                             "holds them; 64 is the budget before idle entries were told apart)")
    parser.add_argument("--allocator", default="pymalloc", choices=ALLOCATORS,
                        help="the kvgate process's allocator (common.allocator; the documented deployment: jemalloc)")
    parser.add_argument("--vocab-size", type=int, default=LLAMA3_VOCAB_SIZE)
    parser.add_argument("--skip-proxies", action="store_true")
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument("--loop-steps", action="store_true",
                        help="the event-loop part on the standard asyncio loop, every callback timed")
    args = parser.parse_args(argv)
    if args.switch_interval_s is not None and not args.switch_interval_s > 0:
        parser.error(f"--switch-interval-s must be positive, got {args.switch_interval_s}")
    if args.prompt_cache_mib is not None and args.prompt_cache_mib < 1:
        parser.error(f"--prompt-cache-mib must be at least 1, got {args.prompt_cache_mib}")
    if args.allocator == "jemalloc" and find_jemalloc() is None:
        parser.error(f"--allocator jemalloc: no libjemalloc.so.2 at {', '.join(JEMALLOC_PATHS)}")
    kinds = args.kinds or (["chat"] if args.chat else ["text"])
    if not kinds or any(k not in ("text", "chat") for k in kinds):
        parser.error(f"--kinds: text and/or chat, got {','.join(kinds)}")
    tokenizer_path = llama3_shaped_tokenizer(CACHE_DIR / "models", args.vocab_size)
    corpus = Corpus(tokenizer_path)
    print(f"tokenizer {tokenizer_path}: vocab {corpus.tokenizer.vocab_size}, {corpus.chars_per_token:.2f} chars/token")
    import uvloop

    summary = Summary()
    summary.allocator, summary.prompt_cache_mib = args.allocator, args.prompt_cache_mib
    t0 = time.monotonic()
    for kind in kinds:
        if not args.skip_loop:
            (asyncio.run if args.loop_steps else uvloop.run)(bench_loop(args, tokenizer_path, corpus, kind, summary))
    for kind in kinds:
        if not args.skip_proxies:
            uvloop.run(bench_proxies(args, tokenizer_path, corpus, kind, summary))
    summary.print()
    print(f"  ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
