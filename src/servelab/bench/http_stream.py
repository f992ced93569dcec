"""A minimal HTTP/1.1 client for the load generator: one POST per connection, its body read as it
arrives (chunked, Content-Length or until close), split into server-sent-event lines.

Why not httpx: the client shares the machine with the server it measures, and on a 2-core machine every
millisecond of client CPU is taken from the server's step. httpx (httpcore, h11, its line decoder) costs
about 1 ms of CPU per streamed event; this costs a few microseconds, the same for every server measured.
vLLM's client (aiohttp) is not a dependency here. TLS goes through asyncio's ssl support."""
from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024


class HTTPStreamError(Exception):
    """The connection failed or the server broke HTTP/1.1 framing; the name says which (ConnectError,
    ReadError, RemoteProtocolError), as httpx's errors did."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    target: str  # path and query
    tls: bool

    @classmethod
    def from_url(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), target, tls)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"


class StreamedResponse:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked transfer decoded)."""
        reader = self._reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await reader.readline()
                    try:
                        size = int(size_line.split(b";", 1)[0], 16)
                    except ValueError:
                        raise HTTPStreamError("RemoteProtocolError", f"bad chunk size line {size_line[:40]!r}") from None
                    if size == 0:
                        return
                    data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                    yield data[:-2]
            elif "content-length" in self.headers:
                yield await reader.readexactly(int(self.headers["content-length"]))
            else:
                while data := await reader.read(65536):
                    yield data
        except asyncio.IncompleteReadError as exc:
            raise HTTPStreamError("ReadError", f"the connection closed mid-body ({len(exc.partial)} bytes of "
                                  f"{exc.expected})") from None
        except ConnectionError as exc:
            raise HTTPStreamError("ReadError", str(exc) or type(exc).__name__) from None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[tuple[bytes, float]]:
        """Each complete line of the body (without its line ending), with the perf_counter its bytes arrived."""
        pending = b""
        async for chunk in self.chunks():
            now = time.perf_counter()
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r"), now
        if pending:
            yield pending.rstrip(b"\r"), time.perf_counter()

    def close(self) -> None:
        self._writer.close()


async def request(method: str, url: str, headers: dict[str, str], body: bytes = b"") -> StreamedResponse:
    """Send one request (Connection: close) and read the status line and headers. Close the response when done."""
    endpoint = Endpoint.from_url(url)
    try:
        reader, writer = await asyncio.open_connection(
            endpoint.host, endpoint.port, ssl=ssl.create_default_context() if endpoint.tls else None,
            limit=MAX_HEADER_BYTES)
    except (OSError, ssl.SSLError) as exc:
        raise HTTPStreamError("ConnectError", str(exc) or type(exc).__name__) from None
    try:
        head = [f"{method} {endpoint.target} HTTP/1.1", f"Host: {endpoint.host_header}", "Connection: close",
                *(("Content-Type: application/json", f"Content-Length: {len(body)}") if body else ()),
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        status, response_headers = await _read_head(reader)
    except BaseException as exc:
        writer.close()
        if isinstance(exc, (ConnectionError, asyncio.IncompleteReadError)):
            raise HTTPStreamError("ReadError", str(exc) or type(exc).__name__) from None
        raise
    return StreamedResponse(reader, writer, status, response_headers)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HTTPStreamError("RemoteProtocolError", f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise HTTPStreamError("RemoteProtocolError", f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers
