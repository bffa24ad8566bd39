"""`inferlab router`: one OpenAI endpoint in front of several replicas, routing each request to
the replica that predicts the lowest time to first token (its cached prefix against its queue).

The scoring core is plain Python (no HTTP, no asyncio), so the HTTP router, a Ray Serve request
router and `inferlab simulate` drive the same code; docs/architecture.md gives each module's job.
"""
