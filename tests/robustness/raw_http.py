"""HTTP written byte for byte to a gateway on loopback (what no client library would send), for the bad-input
tests."""

from __future__ import annotations

import asyncio


async def exchange(port: int, request: bytes, *, max_bytes: int = -1) -> bytes:
    """Write ``request`` as is on a new connection to 127.0.0.1:``port`` and read the answer: to the end (the peer
    closes the connection), or the first chunk of at most ``max_bytes`` bytes; 10 s at most, then ``TimeoutError``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(max_bytes)
    finally:
        writer.close()
