"""CORS is configurable and closed by default (issue 11, item 3).

By default the edge sends no Access-Control-* header, so a page on another origin cannot read
results through a visitor's browser. ``--cors-origin`` (``STREAMPROC_EDGE_CORS_ORIGIN``) names the
exact origins whose pages may: they get the grant, every other origin still gets none."""

from __future__ import annotations

import httpx
import pytest
from edge_harness import publish_result, running_edge
from helpers import rid

from streamproc.wire import Subjects

pytestmark = pytest.mark.nats

PAGE = "https://page.example:8443"
EVIL = "https://evil.example"


def grants(headers: httpx.Headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("access-control-allow-")}


@pytest.mark.parametrize("path", ["/v1/results/cors-1?stream=false", "/v1/recent", "/healthz"])
def test_a_cross_origin_request_gets_no_cors_grant(edge, path):
    headers = {"Origin": EVIL}
    with httpx.Client(timeout=10) as client:
        preflight = client.options(f"{edge.url}{path}", headers={**headers, "Access-Control-Request-Method": "GET"})
        assert not any(k.lower().startswith("access-control-") for k in preflight.headers), preflight.headers
        if path.startswith("/v1/results"):
            return  # a GET would wait for results that never come; the preflight is what a browser sends first
        response = client.get(f"{edge.url}{path}", headers=headers)
        assert response.status_code == 200
        assert not any(k.lower().startswith("access-control-") for k in response.headers), response.headers


@pytest.fixture(scope="module")
def cors_edge(server):
    """An edge whose CORS origin comes from the environment (the variable, not only the flag)."""
    with running_edge(server.url, env={"STREAMPROC_EDGE_CORS_ORIGIN": f"{PAGE}, http://localhost:3000"}) as edge:
        yield edge


def test_a_configured_origin_may_send_a_capability_to_the_results(cors_edge):
    preflight_headers = {"Origin": PAGE, "Access-Control-Request-Method": "GET",
                         "Access-Control-Request-Headers": "authorization, last-event-id"}
    with httpx.Client(timeout=10) as client:
        preflight = client.options(f"{cors_edge.url}/v1/results/cors-2", headers=preflight_headers)
        assert preflight.status_code == 200, preflight.text
        granted = grants(preflight.headers)
        assert granted["access-control-allow-origin"] == PAGE
        allowed_headers = granted["access-control-allow-headers"].lower()
        assert "authorization" in allowed_headers and "last-event-id" in allowed_headers
        assert "access-control-allow-credentials" not in granted  # capabilities are headers, not cookies
        info = client.get(f"{cors_edge.url}/v1/info", headers={"Origin": PAGE})
        assert info.status_code == 200
        assert info.headers["access-control-allow-origin"] == PAGE
        assert "streamproc-results" in info.headers["access-control-expose-headers"].lower()


def test_an_origin_not_configured_still_gets_no_grant(cors_edge):
    with httpx.Client(timeout=10) as client:
        preflight = client.options(f"{cors_edge.url}/v1/results/cors-3",
                                   headers={"Origin": EVIL, "Access-Control-Request-Method": "GET"})
        assert preflight.status_code == 400
        assert "access-control-allow-origin" not in grants(preflight.headers), preflight.headers
        for origin in (EVIL, "https://page.example", "http://page.example:8443"):  # port and scheme matter
            response = client.get(f"{cors_edge.url}/healthz", headers={"Origin": origin})
            assert response.status_code == 200
            assert "access-control-allow-origin" not in grants(response.headers), (origin, response.headers)


@pytest.mark.anyio
async def test_the_event_stream_itself_carries_the_grant_for_a_configured_origin_only(cors_edge, nc):
    """The SSE route is dispatched before Starlette's router (edge/app.py EdgeApp), still behind
    the CORS middleware."""
    for origin, granted in ((PAGE, True), (EVIL, False)):
        request_id = rid("cors-sse")
        async with httpx.AsyncClient(base_url=cors_edge.url, timeout=10) as client:
            async with client.stream("GET", f"/v1/results/{request_id}", headers={"Origin": origin}) as response:
                assert response.status_code == 200
                await publish_result(nc, Subjects("streamproc"), request_id, 0, b'{"x":1}', final=True)
                await nc.flush()
                body = await response.aread()
        assert body == b'id: 0\ndata: {"x":1}\n\ndata: [DONE]\n\n'
        assert grants(response.headers).get("access-control-allow-origin") == (PAGE if granted else None)
        if granted:
            assert "streamproc-results" in response.headers["access-control-expose-headers"].lower()


@pytest.mark.parametrize("value", ["*", "https://page.example/app", "page.example"])
def test_a_cors_origin_that_is_not_an_exact_origin_is_refused_at_start(run_cli, value):
    result = run_cli("edge", "--insecure-demo", "--cors-origin", value, "--print-config")
    assert result.returncode == 2, result
    assert "--cors-origin" in result.stderr and "is not an origin" in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["_INBOX", "_INBOX.streamproc", "_INBOX.streamproc.edgex", "_INBOX.streamproc.edge.*",
                                   "_INBOX.streamproc.edge.>", "_INBOX.streamproc.edge.a b", "_INBOX.frontend.x"])
def test_an_inbox_prefix_outside_the_edges_own_is_refused_at_start(run_cli, value):
    """Only the edge's inboxes and names below them: wildcards or another role's prefix would break the
    permissions that keep each edge's deliveries its own (docs/security.md)."""
    result = run_cli("edge", "--insecure-demo", "--inbox-prefix", value, "--print-config")
    assert result.returncode == 2, result
    assert "--inbox-prefix" in result.stderr and "is not _INBOX.streamproc.edge" in result.stderr, result.stderr


def test_an_inbox_prefix_below_the_edges_own_is_accepted(run_cli):
    result = run_cli("edge", "--insecure-demo", "--inbox-prefix", "_INBOX.streamproc.edge.eu-1", "--print-config")
    assert result.returncode == 0, result
    assert "_INBOX.streamproc.edge.eu-1" in result.stdout, result.stdout
