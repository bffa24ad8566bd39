"""Schemathesis against the server's own OpenAPI document (a bounded run on the fake engine):
whatever a client sends, no 5xx, and every 4xx carries an OpenAI-style error body."""

from __future__ import annotations

import pytest
import schemathesis
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from server_harness import ServerThread

from inferlab.server.app import ServerSettings, build_app


@pytest.fixture(scope="module")
def api_schema():
    # A short context and many seats keep any case quick (n up to 128, any max_tokens); the
    # deadline is there so that a hung request fails the run instead of stalling it.
    app = build_app(lambda: FakeEngine(max_model_len=32, max_num_seqs=128), ServerSettings(request_timeout=60))
    with ServerThread(app) as srv:
        srv.wait_ready()
        yield schemathesis.openapi.from_url(srv.url("/openapi.json"))


def no_5xx(ctx, response, case) -> None:
    """No server error, except the 504 of a deadline the request itself set too short to meet
    (`timeout`: 5e-324 s is a valid positive number)."""
    body = case.body if isinstance(case.body, dict) else {}
    own_deadline = isinstance(body.get("timeout"), (int, float)) and body["timeout"] < 1
    if response.status_code == 504 and own_deadline:
        return
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"


def error_body(ctx, response, case) -> None:
    """A 4xx is an OpenAI error object: {"error": {"message": str, "type": str, ...}}."""
    if 400 <= response.status_code < 500:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict), f"{response.status_code} without an error object: {body!r}"
        assert isinstance(err.get("message"), str) and err["message"], body
        assert isinstance(err.get("type"), str), body


def test_no_5xx_and_every_4xx_has_an_error_body(api_schema):
    # Operations driven one by one through hypothesis (schemathesis' pytest plugin does not
    # load under this pytest); 25 cases each, derandomized so CI runs the same cases.
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    statuses: dict[str, set[int]] = {}
    for op in operations:

        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy())
        def run(case):
            response = case.call(timeout=30)
            name = f"{case.operation.method.upper()} {case.operation.path}"
            statuses.setdefault(name, set()).add(response.status_code)
            case.validate_response(response, checks=[no_5xx, error_body])

        run()
    print({k: sorted(v) for k, v in sorted(statuses.items())})
