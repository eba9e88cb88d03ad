"""A lean HTTP/1.1 client for the benchmarks' streamed requests: one connection a request, the
body read in large blocks, chunked transfer decoded in place.

Why not httpx: its async client spent ~630 us of CPU per SSE event on a 2-core host (1,000
streams of 32 small events from a bare asyncio server: 20.2 s of CPU in 20.2 s of wall, where
the events took 1.6 s to send; benchmarks/NOTES.md, "The served gap was the client"). A burst
of 1,000 streamed requests on an H100 brings ~7,000 events a second, so the client, not the
server, set the pace and the TTFTs it measured. This client does what the benchmarks need and
nothing else: ``http://`` only (``https`` goes to httpx), no redirects, no cookies, no
keep-alive (``connection: close``: a streamed request holds its connection to the end anyway).

The interface is the part of httpx's the benchmarks call: ``stream(method, url, json=,
headers=)`` as an async context manager giving a response with ``status_code``, ``headers``
(names lowercased), ``aiter_bytes()``, ``aiter_lines()`` and ``aread()``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json as jsonlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

_BLOCK = 1 << 16


class HTTPError(Exception):
    """A response this client cannot read (a malformed status line, headers or chunk)."""


class Response:
    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.status_code, self.headers, self._reader = status, headers, reader

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked, sized by ``content-length``, or up to EOF)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            async for data in self._chunked():
                yield data
            return
        length = self.headers.get("content-length")
        left = int(length) if length is not None else -1
        while left:
            data = await self._reader.read(_BLOCK if left < 0 else min(_BLOCK, left))
            if not data:
                if left > 0:
                    raise HTTPError(f"the body ended {left} bytes short")
                return
            left -= len(data) if left > 0 else 0
            yield data

    async def _chunked(self) -> AsyncIterator[bytes]:
        reader, buf = self._reader, b""
        while True:
            while b"\r\n" not in buf:  # the chunk's size line
                more = await reader.read(_BLOCK)
                if not more:
                    raise HTTPError("the chunked body ended inside a size line")
                buf += more
            line, _, buf = buf.partition(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise HTTPError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                return  # (trailers, if any, are not read: the connection closes)
            while len(buf) < size + 2:
                more = await reader.read(max(_BLOCK, size + 2 - len(buf)))
                if not more:
                    raise HTTPError("the chunked body ended inside a chunk")
                buf += more
            data, buf = buf[:size], buf[size + 2 :]
            yield data

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines as text (UTF-8; a character or a line split between reads is put
        back together), without their ``\n`` or ``\r\n``, as httpx's ``aiter_lines``."""
        decoder, rest = codecs.getincrementaldecoder("utf-8")(), ""
        async for data in self.aiter_bytes():
            *lines, rest = (rest + decoder.decode(data)).split("\n")
            for line in lines:
                yield line.removesuffix("\r")
        rest += decoder.decode(b"", final=True)
        if rest:
            yield rest.removesuffix("\r")


class RawStreamClient:
    """``stream`` requests over plain asyncio streams; ``timeout_s`` bounds a whole request."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, url: str, json: Any = None, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"RawStreamClient takes http:// URLs only, got {url!r}")
        host, port = parts.hostname, parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        body = b"" if json is None else jsonlib.dumps(json).encode()
        lines = [
            f"{method} {path} HTTP/1.1",
            f"host: {host}:{port}",
            "accept: */*",
            "connection: close",
            f"content-length: {len(body)}",
        ]
        if json is not None:
            lines.append("content-type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        async with asyncio.timeout(self.timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=_BLOCK)
            try:
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
                head = await reader.readuntil(b"\r\n\r\n")
                yield Response(reader, *_parse_head(head))
            finally:
                writer.close()

    async def aclose(self) -> None:  # (no pool: nothing to close)
        return None


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
        raise HTTPError(f"bad status line {status_line[:60]!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HTTPError(f"bad header line {line[:60]!r}")
            headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers
