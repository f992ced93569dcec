"""The load generator's HTTP/1.1 client against raw servers that frame bodies every way HTTP/1.1 allows
(chunked, split anywhere; Content-Length; until close) and that break the framing."""
import asyncio
import json

import pytest

from servelab.bench import http_stream
from servelab.bench.datasets import BenchRequest
from servelab.bench.loadgen import ClientConfig, send_request

SSE = (b'data: {"choices":[{"index":0,"text":""}]}\r\n\r\n'
       b'data: {"choices":[{"index":0,"text":"caf\xc3\xa9"}]}\n\n'
       b'data: {"choices":[{"index":0,"text":" au lait"}]}\n\n'
       b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
       b"data: [DONE]\n\n")


def chunked(body: bytes, sizes: list[int]) -> bytes:
    """body in chunks of these sizes (the rest in one), with a chunk extension on the first, then the end."""
    out, at = [], 0
    for i, size in enumerate([*sizes, len(body)]):
        piece = body[at:at + size]
        at += len(piece)
        if piece:
            out.append(b"%x%s\r\n%s\r\n" % (len(piece), b";ext=1" if i == 0 else b"", piece))
    return b"".join(out) + b"0\r\n\r\n"


async def serve_once(answer: list[bytes], seen: list[bytes]):
    """A server that reads one request (head and body) and writes the answer pieces one at a time."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        seen.append(head + await reader.readexactly(length))
        for piece in answer:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def run_against(answer: list[bytes]):
    async def main():
        seen: list[bytes] = []
        server, url = await serve_once(answer, seen)
        async with server:
            config = ClientConfig(base_url=url, model="m", api_key="k")
            result = await send_request(config, BenchRequest([5, 6, 7], 3, 2, 0.0))
        return result, seen[0]
    return asyncio.run(main())


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


@pytest.mark.parametrize("framing", ["chunked", "chunked split mid-line and mid-size", "content-length", "close"])
def test_every_framing_gives_the_same_events(framing):
    if framing == "chunked":
        answer = [OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked(SSE, [47, 56, 52])]
    elif framing.startswith("chunked split"):
        data = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(SSE, [10, 60, 3])
        answer = [data[i:i + 7] for i in range(0, len(data), 7)]  # the reader sees every boundary split
    elif framing == "content-length":
        answer = [OK_HEAD + b"Content-Length: %d\r\n\r\n" % len(SSE) + SSE]
    else:
        answer = [OK_HEAD + b"\r\n", SSE[:30], SSE[30:]]
    result, request = run_against(answer)
    assert result.success, result.error
    assert result.text == "café au lait" and len(result.chunk_times) == 2
    assert result.output_len == 2 and result.prompt_len == 3
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"\r\nAuthorization: Bearer k\r\n" in request
    body = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert body == {"model": "m", "max_tokens": 2, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt": [5, 6, 7]}


def test_a_body_cut_mid_chunk_is_a_read_error():
    result, _ = run_against([OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"40\r\ndata: {"])
    assert not result.success and result.error.startswith("ReadError: the connection closed mid-body")


def test_not_http_and_bad_chunk_sizes_are_protocol_errors():
    result, _ = run_against([b"SSH-2.0-OpenSSH\r\n"])
    assert result.error.startswith("RemoteProtocolError: not an HTTP/1.1 status line")
    result, _ = run_against([OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n"])
    assert result.error.startswith("RemoteProtocolError: bad chunk size line")


def test_an_error_status_keeps_the_servers_message():
    body = b'{"error":{"message":"slow down","type":"x"}}'
    result, _ = run_against([b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n" % len(body) + body])
    assert result.error == "HTTP 429: slow down"


def test_urls():
    assert http_stream.Endpoint.from_url("https://example.org/v1/x?a=1") == http_stream.Endpoint(
        "example.org", 443, "/v1/x?a=1", True)
    endpoint = http_stream.Endpoint.from_url("http://[::1]:8000/v1/completions")
    assert (endpoint.host, endpoint.port, endpoint.host_header) == ("::1", 8000, "[::1]:8000")
    with pytest.raises(ValueError):
        http_stream.Endpoint.from_url("ftp://example.org/")
