"""`inferlab serve --replicas 2` on a real local Ray cluster: one cluster for the whole module
(Ray's start costs ~15-25 s here), a tiny model, two replicas at 0.5 CPU each, on 127.0.0.1.

Both replicas serve; the router keeps a repeated prefix on one replica; a replica whose actor is
killed is replaced by Serve, and requests sent meanwhile are all answered (the ingress retries
one whose replica died before answering on the other)."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray")  # in the test extra; the import guard only spares a partial install
from ray import serve  # noqa: E402

from inferlab.engine.engine_args import EngineArgs  # noqa: E402
from inferlab.ray_serve.launch import ScaleConfig, deploy  # noqa: E402
from inferlab.server.app import ServerSettings  # noqa: E402

pytestmark = pytest.mark.timeout(400)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from inferlab.models.testing import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m")
    # Ray's memory monitor kills workers when the machine is near full, whoever fills it (other
    # test runs on a shared box); the replicas here are a few hundred MB.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        deploy(ScaleConfig(replicas=2, replica_cpus=0.5),
               EngineArgs(model=str(model), max_num_seqs=4, num_threads=1, num_kv_blocks=64, max_model_len=256),
               ServerSettings(served_model_names=("m",), shutdown_timeout=5.0), "127.0.0.1", port, app_name="inferlab")  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client: httpx.Client, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0})  # fmt: skip


def many(client: httpx.Client, prompts: list[str]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p), prompts))


def test_both_replicas_serve(cluster):
    replies = many(cluster, [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(8)])
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
    assert all(r.json()["choices"][0]["text"] is not None for r in replies)
    used = {r.headers["x-inferlab-replica"] for r in replies}
    assert len(used) == 2
    served = cluster.get("/ray/replicas").json()["served"]
    assert set(served) == used and all(n > 0 for n in served.values())


def test_a_stream_passes_through(cluster):
    with cluster.stream("POST", "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]") and '"delta"' in body
    bad = cluster.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the server's own errors


def test_a_repeated_prefix_stays_on_one_replica(cluster):
    """Cache-aware routing through Ray's router: the same long prompt prefix, one replica."""
    shared = "You are a careful assistant. Answer briefly and cite the sentence you used. " * 4
    replicas = [complete(cluster, shared + f"Question {i}?").headers["x-inferlab-replica"] for i in range(5)]
    assert len(set(replicas)) == 1, replicas


def _replica_actor(replica_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id) and "#engine#" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")


def _running_engine_replicas() -> int:
    app = serve.status().applications["inferlab"]
    return app.deployments["engine"].replica_states.get("RUNNING", 0)


def test_a_killed_replica_is_replaced_and_no_request_is_lost(cluster):
    victim = complete(cluster, "who answers this?").headers["x-inferlab-replica"]
    ray.kill(_replica_actor(victim), no_restart=True)
    replies = many(cluster, [f"after the kill {i}: the lazy dog sleeps" for i in range(6)])
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    survivors = {r.headers["x-inferlab-replica"] for r in replies}
    assert victim not in survivors
    deadline = time.monotonic() + 180
    replacement: set[str] = set()
    while time.monotonic() < deadline and not replacement:  # Serve finds it dead and starts another
        probes = many(cluster, [f"probe {i} {time.monotonic()}" for i in range(4)])
        assert all(r.status_code == 200 for r in probes)
        replacement = {r.headers["x-inferlab-replica"] for r in probes} - survivors - {victim}
    assert replacement, "Serve did not replace the killed replica in 180 s"
    assert _running_engine_replicas() == 2
