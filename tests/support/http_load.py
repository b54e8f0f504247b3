"""Many small HTTP/1.1 requests to a local server, fast: ``concurrency`` keep-alive connections,
each sending its share of the requests one after the other (asyncio streams, no HTTP library).

Why not httpx or aiohttp: on the 2-core test machine the client's own CPU is the limit; measured
against the real vLLM OpenAI server answering 404s, httpx's AsyncClient managed 80 requests/s,
aiohttp 230/s, this 540/s (tests/test_vllm_refusals.py sends 10,000).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit


def request_bytes(host: str, path: str, body: Any, headers: dict[str, str] | None = None) -> bytes:
    """One ``POST path`` with ``body`` as JSON (``bytes``: sent as they are), keep-alive."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"host: {host}",
        "content-type: application/json",
        f"content-length: {len(payload)}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


async def _one_connection(host: str, port: int, requests: Sequence[tuple[int, bytes]], statuses: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for index, raw in requests:
            writer.write(raw)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            length = 0
            chunked = False
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
            if chunked:
                while True:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            else:
                await reader.readexactly(length)
            statuses[index] = status
    finally:
        writer.close()


def post_all(base: str, requests: Sequence[bytes], concurrency: int = 16) -> list[int]:
    """Send ``requests`` (from :func:`request_bytes`) to ``base`` (``http://host:port``) over
    ``concurrency`` keep-alive connections; the HTTP status of each, in order."""
    url = urlsplit(base)
    statuses = [0] * len(requests)
    indexed = list(enumerate(requests))

    async def main() -> None:
        await asyncio.gather(
            *(
                _one_connection(url.hostname or "127.0.0.1", url.port or 80, indexed[k::concurrency], statuses)
                for k in range(concurrency)
            )
        )

    asyncio.run(main())
    return statuses
