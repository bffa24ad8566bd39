"""Run an app under uvicorn on 127.0.0.1 (a free port) in a thread, for the server tests."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from inferlab.server.limits import uvicorn_options


class ServerThread:
    """`with ServerThread(app) as srv:` serves `app` at `srv.base_url` until the block ends."""

    def __init__(self, app, shutdown_timeout: float = 5.0, port: int = 0):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # port 0: a free one, ours from here on (no race with other tests); a given port: a restart
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        settings = getattr(app.state, "settings", None)
        options = uvicorn_options(settings.limits) if settings is not None else {}  # the server's own protocol
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=shutdown_timeout,
            **options,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def url(self, path: str) -> str:
        return self.base_url + path

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self.app.state.llm.wait_ready(timeout):
            raise RuntimeError(f"the engine did not load: {self.app.state.llm.load_error}")


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll until `predicate()` holds; fail after `timeout` seconds (never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (labels in the order the server wrote them)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of the one sample of `name` whose labels include `labels`."""
    found = []
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            found.append(value)
    if len(found) != 1:
        raise KeyError(f"{name}{labels}: {len(found)} samples")
    return found[0]


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """Parsed `data:` payloads of an SSE response; '[DONE]' as the string."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)
