"""`inferlab serve --simulate`: a replica without a model answers like a replica (usage, cached
tokens on a shared prefix, KV events that are the engine's own block hashes, /server_info,
/metrics, 4xx), on the step clock of its cost model, without torch; and the router drives 8."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from server_harness import ServerThread, metric, scrape, sse_events, wait_until
from sim_replicas import FAST, ROOT, SimProcess, sim_engine_config, sim_servers, write_cost

from inferlab.engine.request import SamplingParams
from inferlab.plan.cost_model import LinearCost, StepShape
from inferlab.router.app import RouterSettings, build_router_app
from inferlab.router.hashing import block_hashes
from inferlab.router.proxy import REPLICA_HEADER
from inferlab.server.sim_engine import PLACEHOLDER, SimulatedEngine, load_step_clock

SYSTEM = "You are a careful assistant. " + "Answer briefly and cite the story where you can. " * 12


def chat(system: str, question: str, **kw) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4, **kw}  # fmt: skip


def test_steps_last_what_the_cost_model_says_and_a_shared_prefix_is_cached():
    slept: list[float] = []
    cost = LinearCost(intercept_s=0.05, per_prefill_token_s=0.001, per_decode_token_s=0.01, per_context_token_s=0.0)
    engine = SimulatedEngine(sim_engine_config(), cost, sleep=slept.append)
    prompt = list(range(100, 300))  # 200 tokens
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    want = [cost.step_time(StepShape.from_chunks([(0, 200, False)])),
            cost.step_time(StepShape.from_chunks([(200, 1, True)])),
            cost.step_time(StepShape.from_chunks([(201, 1, True)]))]  # fmt: skip
    assert engine.simulated_s == pytest.approx(sum(want))
    assert sum(slept) == pytest.approx(sum(want), abs=0.05)  # each step sleeps its own time, less the bookkeeping
    final = outs[-1]
    assert final.finished and final.outputs[0].text == PLACEHOLDER[: len(final.outputs[0].text)]
    assert len(final.outputs[0].token_ids) == 3
    # The same prompt again: the prefix cache holds all but the last block's worth, the prefill is shorter
    before = engine.simulated_s
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step() or outs
    assert outs[-1].num_cached_tokens == 192
    assert engine.simulated_s - before == pytest.approx(cost.step_time(StepShape.from_chunks([(192, 8, False)])))


def test_a_reply_without_max_tokens_ends_with_eos():
    engine = SimulatedEngine(sim_engine_config(), FAST, sleep=lambda s: None)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=None))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].outputs[0].finish_reason == "stop" and len(outs[-1].outputs[0].token_ids) < 200


def test_answers_like_a_replica():
    with sim_servers(1) as (srv,):
        base = srv.base_url
        r = httpx.post(base + "/v1/chat/completions", json=chat(SYSTEM, "first?"), timeout=30)
        assert r.status_code == 200
        body = r.json()
        assert body["choices"][0]["message"]["content"] == " the quick brown fox"
        assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = []
        for q in ("second?", "third question, longer?"):
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                              json=chat(SYSTEM, q, stream=True, stream_options={"include_usage": True})) as s:
                events = list(sse_events(s))
            assert events[-1] == "[DONE]"
            cached.append(events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] > 100 and cached[1] >= cached[0]  # the shared system prompt, from the prefix cache
        # The KV events name exactly the engine's blocks of the prompts: what the router hashes
        ids = httpx.post(base + "/tokenize", json=chat(SYSTEM, "first?"), timeout=10).json()["tokens"]
        info = httpx.get(base + "/server_info", timeout=10).json()
        assert info["device"] == "simulated" and info["kv_cache"]["num_blocks"] == 256
        snap = httpx.get(base + "/kv_events/snapshot", timeout=10).json()
        held = {int(h, 16) for h in snap["block_hashes"]}
        assert set(block_hashes(ids, info["kv_cache"]["block_size"])) <= held
        page = httpx.get(base + "/kv_events", params={"after": 0}, timeout=10).json()
        assert {int(h, 16) for e in page["events"] if e["type"] == "stored" for h in e["block_hashes"]} == held
        m = scrape(base)
        assert metric(m, "vllm:prefix_cache_hits_total") == sum(cached) and metric(m, "vllm:num_requests_running") == 0
        assert httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        # What it cannot honour is a 400 naming the field; bad input is the server's own 400
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": "many"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_serve_simulate_runs_without_torch(tmp_path):
    port = _free_port()
    p = SimProcess(write_cost(tmp_path / "cost.json"), port, tmp_path / "sim.log").start()
    try:
        p.wait_ready()
        assert p.proc is not None
        maps = open(f"/proc/{p.proc.pid}/maps").read()
        assert "libtorch" not in maps
        r = httpx.post(p.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " the quick brown"
    finally:
        p.stop()


@pytest.mark.parametrize("content,message", [(None, "no such file"), ("{not json", "not a readable JSON"),
                                             ('{"samples": [{"x": 1}]}', "neither a saved cost model")])
def test_a_bad_profile_is_one_line(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_step_clock(path)
    r = subprocess.run([sys.executable, "-m", "inferlab.cli", "serve", "--simulate", str(path)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_router_drives_eight_simulated_replicas():
    systems = [f"You are assistant {k}. " + f"Story {k} is about a fox and a dog number {k}. " * 10 for k in range(4)]
    with sim_servers(8) as servers:
        app = build_router_app(RouterSettings(backends=tuple(s.base_url for s in servers), probe_interval_s=0.1))
        with ServerThread(app) as router:
            wait_until(lambda: len(app.state.fleet.routable()) == 8 and all(
                r.kv.synced for r in app.state.fleet.replicas.values()), 20, "8 replicas ready")  # fmt: skip

            async def run() -> list[tuple[int, str, int, int]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    async def one(k: int, q: int) -> tuple[int, str, int, int]:
                        r = await client.post(router.url("/v1/chat/completions"), json=chat(systems[k], f"q{q}?"))
                        u = r.json()["usage"]
                        return k, r.headers[REPLICA_HEADER], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]

                    first = await asyncio.gather(*(one(k, 0) for k in range(4)))  # each system prompt once
                    # its blocks confirmed by the replicas' KV events before the rest are routed (a
                    # fixed 0.3 s was too short now and then under a full suite's load)
                    fleet, names = app.state.fleet, [s.base_url for s in servers]
                    need: dict[str, int] = {}
                    for _k, rep, prompt, _c in first:
                        name = names[int(rep)]
                        need[name] = need.get(name, 0) + prompt // fleet.block_size
                    deadline = asyncio.get_running_loop().time() + 20
                    while any(fleet.index.num_confirmed(n) < b for n, b in need.items()):
                        assert asyncio.get_running_loop().time() < deadline, "KV events never confirmed the prompts"
                        await asyncio.sleep(0.02)
                    rest = await asyncio.gather(*(one(k, q) for q in range(1, 7) for k in range(4)))
                    return first + rest

            results = asyncio.run(run())
            assert len(results) == 28
            rest = results[4:]
            share = sum(c for *_, c in rest) / sum(p for *_, p, _ in rest)
            assert share > 0.6  # each system prompt cached where it is sent
            homes = {k: [rep for kk, rep, *_ in rest if kk == k] for k in range(4)}
            owners = {k: max(set(h), key=h.count) for k, h in homes.items()}
            # most of a prefix's requests stay with its owner (the bounded load spills the rest)
            assert all(homes[k].count(owners[k]) >= 3 for k in range(4)), homes
            assert len(set(owners.values())) >= 3  # and the prefixes are spread over the fleet
            m = scrape(router.base_url)
            assert metric(m, "inferlab:router_actual_cached_tokens_total") == sum(c for *_, c in results)
            for body in ({"messages": "not a list"}, {"messages": [{"role": "user", "content": "x"}], "n": 0},
                         b"{not json"):  # a malformed request: the replica's own 4xx, as it gives it
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                direct = httpx.post(servers[0].url("/v1/chat/completions"), timeout=30, **kw)
                routed = httpx.post(router.url("/v1/chat/completions"), timeout=30, **kw)
                assert direct.status_code == 400
                assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
