"""CORS is closed by default: the edge sends no Access-Control-* header, so a page on another
origin cannot read results through a visitor's browser (issue 11, item 3: CORS closed by default)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.nats


@pytest.mark.parametrize("path", ["/v1/results/cors-1?stream=false", "/v1/recent", "/healthz"])
def test_a_cross_origin_request_gets_no_cors_grant(edge, path):
    headers = {"Origin": "https://evil.example"}
    with httpx.Client(timeout=10) as client:
        preflight = client.options(f"{edge.url}{path}", headers={**headers, "Access-Control-Request-Method": "GET"})
        assert not any(k.lower().startswith("access-control-") for k in preflight.headers), preflight.headers
        if path.startswith("/v1/results"):
            return  # a GET would wait for results that never come; the preflight is what a browser sends first
        response = client.get(f"{edge.url}{path}", headers=headers)
        assert response.status_code == 200
        assert not any(k.lower().startswith("access-control-") for k in response.headers), response.headers
