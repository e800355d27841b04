"""Slow and oversized clients against a real uvicorn server (the worker's protocol class and app):
late request heads are cut off, slow bodies get 408, large bodies 413, honest slow answers are untouched."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from tests.server.fake_engine import FakeEngine, make_app

from pdserve.api.config import LimitsConfig
from pdserve.api.http_bounds import declared_length, http_protocol_with_header_deadline

LIMITS = LimitsConfig(max_body_bytes=2048, header_timeout_s=0.5, body_timeout_s=0.5)


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(reply="Hello there", token_delay_s=0.3)  # an answer slower than the header deadline
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(engine, limits=LIMITS), log_level="warning", lifespan="off",
                            http=http_protocol_with_header_deadline(LIMITS.header_timeout_s))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def connect(address) -> socket.socket:
    conn = socket.create_connection(address, timeout=5)
    return conn


def closed_within(conn: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """(closed by the server within timeout_s, whatever it sent first)."""
    conn.settimeout(timeout_s)
    received = b""
    try:
        while True:
            data = conn.recv(4096)
            if not data:
                return True, received
            received += data
    except socket.timeout:
        return False, received


def test_a_connection_that_never_completes_its_head_is_closed(served):
    with connect(served) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        started = time.monotonic()
        closed, _ = closed_within(conn, 3)
    assert closed and time.monotonic() - started < 2


def test_an_idle_connection_is_closed_too(served):
    with connect(served) as conn:
        closed, received = closed_within(conn, 3)
    assert closed and received == b""


def test_a_trickled_head_does_not_keep_the_connection_alive(served):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    with connect(served) as conn:
        started = time.monotonic()
        try:
            for byte in head:
                conn.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            pass  # closed under us: what we want
        closed, _ = closed_within(conn, 3)
    assert closed and time.monotonic() - started < 2.5


def test_a_slow_body_gets_408(served):
    with connect(served) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        closed, received = closed_within(conn, 3)
    assert received.startswith(b"HTTP/1.1 408"), received[:200]


def test_a_large_body_gets_413_declared_or_chunked(served):
    url = f"http://{served[0]}:{served[1]}/v1/completions"
    declared = httpx.post(url, content=b'{"prompt": "' + b"x" * 4000 + b'"}', timeout=5)
    assert declared.status_code == 413

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    chunked = httpx.post(url, content=chunks(), timeout=5)
    assert chunked.status_code == 413


def test_an_answer_slower_than_the_head_deadline_is_not_cut_off(served):
    url = f"http://{served[0]}:{served[1]}"
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(2):  # twice on one keep-alive connection
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "Hell"


@pytest.mark.parametrize("header, length", [
    ("12", 12), ("0012", 12), ("", None), ("²", None), ("٣", None), (" 5", None), ("1e3", None), ("-1", None),
    ("9" * 5000, 10**18),  # int() would refuse it; it is over any limit all the same
])
def test_a_declared_length_is_read_only_from_plain_ascii_digits(header, length):
    assert declared_length(header) == length
