"""Fuzz the server from its own OpenAPI document (schemathesis, in-process over ASGI): whatever the body, no
5xx, responses fit the documented schemas, and every graph stays consistent."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from tvcache.server import CacheService, create_app  # noqa: E402

service = CacheService()
service.cache.graph("t")  # a task to hit, besides the random ones
app = create_app(service)
# The long-poll blocks for as long as it is asked to while a claim is held: tested directly, not fuzzed.
schema = schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path="/v1/claim/wait")


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_graphs_stay_consistent(case: object) -> None:
    response = case.call()  # type: ignore[attr-defined]
    assert response.status_code < 500, response.text
    for task in service.cache.tasks():
        service.cache.graph(task).check_invariants()
