"""A public server's limits on 127.0.0.1: body size (413), slow headers and bodies, idle
connections, and a streaming client that stops reading. Raw sockets, every wait bounded."""

from __future__ import annotations

import json
import socket

import httpx
from fake_engine import FakeEngine
from server_harness import ServerThread, metric, scrape, wait_until

from inferlab.server.app import ServerSettings, build_app
from inferlab.server.limits import HttpLimits

MSG = [{"role": "user", "content": "Why might a parcel arrive late?"}]


def serve(limits: HttpLimits, **engine_kw) -> ServerThread:
    return ServerThread(build_app(lambda: FakeEngine(**engine_kw), ServerSettings(limits=limits)))


def connect(srv: ServerThread, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(20)
    s.connect(("127.0.0.1", srv.port))
    return s


def read_until_closed(s: socket.socket, limit: int = 10_000_000) -> bytes:
    """Everything the server sends until it closes the connection (20 s at most per recv)."""
    data = b""
    while len(data) < limit:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_body_over_the_limit_is_413():
    with serve(HttpLimits(max_request_body_bytes=1024)) as srv:
        srv.wait_ready()
        url = srv.url("/v1/chat/completions")
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 1}).encode()
        r = httpx.post(url, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 413 and "1024 bytes" in err["message"]
        # without a Content-Length (chunked): refused once the bytes read pass the limit
        r = httpx.post(url, content=iter([big[:600], big[600:]]), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        # a declared length beyond the limit is refused before any of the body is read
        s = connect(srv)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")  # fmt: skip
        reply = read_until_closed(s)
        s.close()
        assert reply.startswith(b"HTTP/1.1 413") and b'"code": 413' in reply.replace(b'"code":413', b'"code": 413')
        small = json.dumps({"messages": MSG, "max_tokens": 1}).encode()
        assert httpx.post(url, content=small, headers={"content-type": "application/json"}).status_code == 200


def test_slow_header_client_is_cut_off():
    """A slow-loris client (a header byte every 50 ms, forever) is closed after --header-timeout,
    while a normal client is served; the loop is bounded (400 bytes, 20 s)."""
    with serve(HttpLimits(header_timeout=0.5)) as srv:
        srv.wait_ready()
        s = connect(srv)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.05)
        closed = False
        for _ in range(400):
            try:
                s.sendall(b"X")
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue  # nothing from the server yet: send the next byte
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        s.close()
        assert closed, "the server kept a half-sent request open"
        assert httpx.get(srv.url("/health")).status_code == 200

        idle = connect(srv)  # connected, sends nothing
        assert read_until_closed(idle) == b""
        idle.close()


def test_keep_alive_connection_survives_between_quick_requests():
    with serve(HttpLimits(header_timeout=0.5, keep_alive_timeout=5)) as srv:
        srv.wait_ready()
        with httpx.Client() as client:  # one connection, several requests
            for _ in range(3):
                assert client.get(srv.url("/health")).status_code == 200


def test_slow_body_is_408():
    with serve(HttpLimits(body_timeout=0.5)) as srv:
        srv.wait_ready()
        s = connect(srv)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"messages\"")  # fmt: skip
        reply = read_until_closed(s)
        s.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(body)["error"]["type"] == "timeout_error"


def test_client_that_stops_reading_is_closed_and_its_request_aborted():
    """A streaming client that reads nothing: once its TCP window and uvicorn's write buffer are
    full, a send blocks; after --send-timeout the connection is closed and the engine request
    aborted (finished_reason abort, KV blocks freed), long before it could have finished."""
    limits = HttpLimits(send_timeout=0.5)
    with serve(limits, step_delay=0.002, max_model_len=4096, num_blocks=20000, max_num_seqs=4) as srv:
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
        srv.wait_ready()
        body = json.dumps({"messages": MSG, "max_tokens": 4000, "n": 8, "stream": True}).encode()
        s = connect(srv, rcvbuf=4096)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        try:
            wait_until(lambda: metric(scrape(srv.base_url), "vllm:request_success_total", finished_reason="abort") == 1,
                       timeout=30, what="the stalled stream to be aborted")  # fmt: skip
            samples = scrape(srv.base_url)
            assert metric(samples, "vllm:request_success_total", finished_reason="length") == 0
            wait_until(lambda: metric(scrape(srv.base_url), "vllm:kv_cache_usage_perc") == 0, what="blocks freed")
            assert read_until_closed(s).startswith(b"HTTP/1.1 200")  # what fitted in the buffers, then EOF
        finally:
            s.close()
        assert httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 2}).status_code == 200


def test_limits_must_be_positive():
    for field in ("max_request_body_bytes", "header_timeout", "body_timeout", "send_timeout", "keep_alive_timeout"):
        try:
            HttpLimits(**{field: 0})
        except ValueError as e:
            assert field in str(e) and "--" + field.replace("_", "-") in str(e)
        else:
            raise AssertionError(f"{field}=0 was accepted")
