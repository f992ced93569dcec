"""A client that stops reading its stream (it reads one byte a second) must not stall the engine or other
clients: once more than --max-unsent-tokens generated tokens wait to be sent, its request is aborted, its
KV blocks are freed and the event is logged; the request still gets exactly one line in the request log."""
from __future__ import annotations

import json
import socket
import time

import httpx

from servelab.testing.server import wait_for_metrics

MAX_UNSENT_TOKENS = 64
FLAGS = ("--max-unsent-tokens", str(MAX_UNSENT_TOKENS), "--stub-max-model-len", "8192", "--stub-num-blocks", "8192",
         "--stub-max-num-seqs", "32")


def idle(values: dict) -> bool:
    return (values["servelab:num_requests_running"] == values["servelab:num_requests_waiting"] == 0
            and values["servelab:kv_cache_usage_perc"] == 0)


def slow_reader_events(server) -> list[dict]:
    events = []
    for line in server.log().splitlines():
        _, sep, payload = line.partition("servelab.gateway.job: ")
        if sep and "slow_reader_abort" in payload:
            events.append(json.loads(payload))
    return events


def test_a_client_reading_one_byte_a_second_is_cut_off_without_stalling_others(start_stub_server):
    server = start_stub_server(*FLAGS)
    body = json.dumps({"prompt": "hi", "max_tokens": 7000, "n": 16, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server soon has to wait
    sock.settimeout(10)
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: slow-reader\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        served_meanwhile = 0
        for _ in range(90):  # one byte a second; the server cuts it off long before 90 s
            assert sock.recv(1)
            other = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
            assert other.status_code == 200 and other.json()["choices"][0]["text"] == " w1 w2 w3"
            served_meanwhile += 1
            if slow_reader_events(server):
                break
            time.sleep(1.0)
        events = slow_reader_events(server)
        assert len(events) == 1 and events[0]["x_request_id"] == "slow-reader", events
        assert events[0]["num_unsent_tokens"] > MAX_UNSENT_TOKENS
        values = wait_for_metrics(server.url, idle)  # aborted while the client still holds the connection
        assert values["servelab:kv_cache_num_free_blocks"] == values["servelab:kv_cache_num_blocks"]
        assert served_meanwhile >= 1
    finally:
        sock.close()
    deadline = time.monotonic() + 30
    lines = []
    while not lines and time.monotonic() < deadline:
        lines = [r for r in server.request_log_lines() if r["x_request_id"] == "slow-reader"]
        time.sleep(0.2)
    assert len(lines) == 1 and lines[0]["status"] in (499, 503), lines
