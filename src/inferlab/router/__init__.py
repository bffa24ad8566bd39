"""`inferlab router`: one OpenAI endpoint in front of several replicas, routing each request to
the replica that predicts the lowest time to first token (its cached prefix against its queue).

The scoring core is plain Python (no HTTP, no asyncio), so the HTTP router, a Ray Serve request
router and `inferlab simulate` can drive the same code:

    hashing.py        the engine's own chained block hashes of a prompt
    prefix_index.py   which block hashes each replica holds (confirmed by its KV events; speculative)
    kv_sync.py        one replica's KV events into the index, in order; snapshot resyncs
    replica.py        per-replica load kept by the router (tickets) and its last scraped metrics
    health.py         readiness from active probes, and a circuit breaker from passive failures
    policies.py       round-robin, least-load, cache-aware, session: views in, a decision out
    fleet.py          the replicas, the index and a policy together: route, dispatch, finish
    canary.py         a canary pool: the weighted sticky split and the rollback rules

The HTTP side: app.py (routes), proxy.py (upstream calls, retries, SSE passthrough),
probes.py (health, metrics and KV event polling), tokens.py (prompt → token ids), metrics.py,
cli.py. `plan/fleet_sim.py` drives `Fleet` over simulated replicas on a virtual clock.
"""
