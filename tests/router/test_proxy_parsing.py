"""The proxy's pure helpers: the client-header pass and the SSE usage scan."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from router.proxy import MAX_MEMO_BLOCK_CHARS, ClientHeaderReader, client_headers_of, response_headers_of
from router.sse import cached_tokens_of, usage_from_sse_tail


def _usage_event(cached: int) -> bytes:
    return (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":%d}}}\n\n' % cached)


def test_sse_usage_is_the_last_event_that_has_one() -> None:
    tail = (b'data: {"choices":[{"text":"a"}]}\n\n' + _usage_event(16) + b'data: {"choices":[{"text":"b"}]}\n\n'
            + _usage_event(32) + b"data: [DONE]\n\n")
    assert cached_tokens_of(usage_from_sse_tail(tail)) == 32


def test_sse_usage_skips_null_usage_and_text_that_looks_like_events() -> None:
    tail = (_usage_event(8)
            + b'data: {"choices":[{"text":"data: \\"usage\\" data: x"}],"usage":null}\r\n\r\n'
            + b"data: [DONE]\r\n\r\n")
    assert cached_tokens_of(usage_from_sse_tail(tail)) == 8
    crlf = _usage_event(24).replace(b"\n", b"\r\n")
    assert cached_tokens_of(usage_from_sse_tail(crlf + b"data: [DONE]\r\n\r\n")) == 24


def test_sse_usage_of_a_cut_first_line_or_no_usage_is_none() -> None:
    cut = _usage_event(16)[10:]  # the tail starts inside the event
    assert usage_from_sse_tail(cut + b"data: [DONE]\n\n") is None
    assert usage_from_sse_tail(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n') is None
    assert usage_from_sse_tail(b"") is None
    assert cached_tokens_of(usage_from_sse_tail(_usage_event(0).rstrip(b"\n"))) == 0  # no final newline


def test_response_headers_drop_hop_by_hop_in_any_case_and_keep_repeats() -> None:
    upstream = [("Content-Type", "application/json"), ("CONNECTION", "keep-alive"), ("Set-Cookie", "a=1"),
                ("transfer-Encoding", "chunked"), ("Set-Cookie", "b=2"), ("Content-Length", "9"), ("Server", "w")]
    expected = [("Content-Type", "application/json"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
                ("Server", "w"), ("x-kvgate-worker", "w1"), ("x-kvgate-predicted-cached-tokens", "32"),
                ("x-kvgate-decision", "min_ttft"), ("x-request-id", "r-9")]
    for given in (CIMultiDictProxy(CIMultiDict(upstream)), dict(upstream)):  # aiohttp's headers, any mapping
        got = response_headers_of(given, "w1", 32, "min_ttft", "r-9")
        if isinstance(given, dict):  # a plain dict keeps one value per name
            expected = [item for item in expected if item != ("Set-Cookie", "a=1")]
        assert list(got.items()) == expected


def test_client_headers_one_pass() -> None:
    headers = CIMultiDictProxy(CIMultiDict([
        ("Host", "gw:8000"), ("User-Agent", "openai/1.0"), ("Content-Type", "application/json"),
        ("Connection", "keep-alive"), ("X-Session-Id", ""), ("X-Session-Id", "conv-7"),
        ("X-SMG-Target-Worker", "w1"), ("Authorization", "Bearer t"), ("Content-Length", "12"),
    ]))
    got = client_headers_of(headers)
    assert got.forward == (("User-Agent", "openai/1.0"), ("Content-Type", "application/json"),
                           ("X-Session-Id", ""), ("X-Session-Id", "conv-7"), ("X-SMG-Target-Worker", "w1"),
                           ("Authorization", "Bearer t"))
    assert got.skip_auto_headers == ("accept-encoding",)
    assert got.routing == {"x-session-id": "conv-7", "x-smg-target-worker": "w1"}
    every_auto = CIMultiDictProxy(CIMultiDict(
        [("user-agent", "u"), ("accept-encoding", "gzip"), ("content-type", "application/json")]))
    got = client_headers_of(every_auto)
    assert got.skip_auto_headers == () and got.routing == {}


def test_client_header_reader_reads_each_distinct_block_once() -> None:
    reader = ClientHeaderReader(max_entries=2)
    block_a = ((b"User-Agent", b"openai/1.0"), (b"X-Session-Id", b"conv-7"))
    headers_a = CIMultiDictProxy(CIMultiDict([("User-Agent", "openai/1.0"), ("X-Session-Id", "conv-7")]))
    first = reader.read(block_a, headers_a)
    assert first.forward == (("User-Agent", "openai/1.0"), ("X-Session-Id", "conv-7"))
    assert first.routing == {"x-session-id": "conv-7"}
    assert first.skip_auto_headers == ("accept-encoding", "content-type")
    # A byte-identical block (a new tuple, as aiohttp builds one per request) is answered from the memo: the headers
    # mapping is not read again, so a different mapping passed beside it is ignored.
    assert reader.read(tuple(block_a), CIMultiDictProxy(CIMultiDict())) is first
    block_b = ((b"User-Agent", b"openai/1.0"), (b"X-Session-Id", b"conv-8"))
    second = reader.read(block_b, CIMultiDictProxy(CIMultiDict([("User-Agent", "openai/1.0"),
                                                                 ("X-Session-Id", "conv-8")])))
    assert second.routing == {"x-session-id": "conv-8"}
    # A block with the client's own request id is read every time and never memoized.
    with_id = ((b"X-Request-Id", b"trace-1"),)
    got = reader.read(with_id, CIMultiDictProxy(CIMultiDict([("X-Request-Id", "trace-1")])))
    assert (got.request_id, got.forward) == ("trace-1", (("X-Request-Id", "trace-1"),))
    assert reader.read(with_id, CIMultiDictProxy(CIMultiDict([("X-Request-Id", "trace-2")]))).request_id == "trace-2"
    # Full (2 entries): a third block clears the memo, so block A is read afresh.
    reader.read(((b"Host", b"gw"),), CIMultiDictProxy(CIMultiDict([("Host", "gw")])))
    again = reader.read(block_a, headers_a)
    assert again is not first and again == first


def test_client_header_reader_shares_an_entry_across_content_lengths() -> None:
    """A client's POSTs differ only in Content-Length: they share one memo entry, whose forwarded headers hold no
    length (the HTTP client writes the forwarded body's own)."""
    reader = ClientHeaderReader()

    def block(length: bytes, spelling: bytes = b"Content-Length") -> tuple[tuple[bytes, bytes], ...]:
        return ((b"Host", b"gw:8000"), (b"User-Agent", b"openai/1.0"), (spelling, length),
                (b"Content-Type", b"application/json"), (b"X-Session-Id", b"conv-7"))

    def mapping(raw: tuple[tuple[bytes, bytes], ...]) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict([(name.decode(), value.decode()) for name, value in raw]))

    first = reader.read(block(b"12"), mapping(block(b"12")))
    assert first.forward == (("User-Agent", "openai/1.0"), ("Content-Type", "application/json"),
                             ("X-Session-Id", "conv-7"))
    assert first.num_chars == len("Hostgw:8000User-Agentopenai/1.0Content-Typeapplication/jsonX-Session-Idconv-7")
    for length, spelling in ((b"2048", b"Content-Length"), (b"7", b"content-length"), (b"99", b"CONTENT-LENGTH")):
        assert reader.read(block(length, spelling), CIMultiDictProxy(CIMultiDict())) is first
    assert list(reader._memo) == [(block(b"")[:2] + block(b"")[3:])]
    # Another spelling stays in the key: memoized per length, with the same headers to forward.
    odd = reader.read(block(b"5", b"content-Length"), mapping(block(b"5", b"content-Length")))
    assert odd is not first and odd == first and len(reader) == 2
    # A header other than Content-Length that differs is another block.
    other = ((b"User-Agent", b"openai/1.1"), (b"Content-Length", b"12"))
    assert reader.read(other, mapping(other)).forward == (("User-Agent", "openai/1.1"),) and len(reader) == 3


def test_client_headers_drop_the_request_content_encoding() -> None:
    """aiohttp inflates a compressed request body before the gateway reads it, so the body forwarded is no longer
    encoded: the client's Content-Encoding is not forwarded."""
    headers = CIMultiDictProxy(CIMultiDict([("Content-Type", "application/json"), ("Content-Encoding", "gzip"),
                                            ("Content-Length", "31")]))
    got = client_headers_of(headers)
    assert got.forward == (("Content-Type", "application/json"),)
    # Content-Length is left out of the count, as of the memo's key: one memoized block serves every length.
    assert got.num_chars == len("Content-Type") + len("application/json") + len("Content-Encoding") + len("gzip")


def test_client_header_reader_memoizes_only_small_blocks() -> None:
    reader = ClientHeaderReader()
    # MAX_MEMO_BLOCK_CHARS - 1 characters (names plus values): memoized.
    small_value = "v" * (MAX_MEMO_BLOCK_CHARS - 1 - len("X-Pad"))
    small = ((b"X-Pad", small_value.encode()),)
    small_headers = CIMultiDictProxy(CIMultiDict([("X-Pad", small_value)]))
    first = reader.read(small, small_headers)
    assert first.num_chars == MAX_MEMO_BLOCK_CHARS - 1
    assert reader.read(tuple(small), small_headers) is first
    # One character more: read on every request, never retained.
    large_value = small_value + "v"
    large = ((b"X-Pad", large_value.encode()),)
    large_headers = CIMultiDictProxy(CIMultiDict([("X-Pad", large_value)]))
    got = reader.read(large, large_headers)
    assert got.num_chars == MAX_MEMO_BLOCK_CHARS
    again = reader.read(tuple(large), large_headers)
    assert again is not got and again == got
    assert len(reader._memo) == 1


def test_client_header_reader_holds_at_most_1024_blocks_by_default() -> None:
    reader = ClientHeaderReader()
    blocks = [((b"X-N", str(i).encode()),) for i in range(1025)]
    for i, block in enumerate(blocks[:1024]):
        reader.read(block, CIMultiDictProxy(CIMultiDict([("X-N", str(i))])))
    assert len(reader._memo) == 1024
    reader.read(blocks[1024], CIMultiDictProxy(CIMultiDict([("X-N", "1024")])))  # full: cleared, then stored
    assert list(reader._memo) == [blocks[1024]]


def test_response_headers_drop_control_characters_only() -> None:
    upstream = CIMultiDictProxy(CIMultiDict([
        ("X-Tab", "a\tb"), ("X-Latin", "caf\xe9 \x85"), ("X-Nul", "a\x00b"), ("X-Cr", "a\rb"), ("X-Lf", "a\nb"),
        ("X-Del", "a\x7fb"), ("X-Esc", "\x1b[0m"), ("Server", "w"),
    ]))
    got = response_headers_of(upstream, "w1", 0, "min_ttft", "r-1")
    assert list(got.items())[:3] == [("X-Tab", "a\tb"), ("X-Latin", "caf\xe9 \x85"), ("Server", "w")]
    assert len(got) == 7
    printable = response_headers_of(CIMultiDictProxy(CIMultiDict([("Server", "w x")])), "w1", 0, "min_ttft", "r-1")
    assert list(printable.items())[0] == ("Server", "w x")
