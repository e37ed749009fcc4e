"""Edge capabilities (issue 11, item 3): a client reads a request's results only with a JWT naming it.

A real edge subprocess on a real nats-server; tokens are minted by the serving-layer helper
(``streamproc.client.capability``) or by ``streamproc token``; clients are real HTTP clients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anyio
import httpx
import jwt
import pytest
from conftest import run_cli_process
from edge_harness import (EdgeProcess, exchange_until_closed, expected_sse, publish_result, publish_results,
                          running_edge)
from helpers import clean_env, rid
from nats_auth import Certificates, openssl

from streamproc.client.capability import mint_capability
from streamproc.core.errors import InvalidCapability
from streamproc.edge.auth import AUDIENCE, Verifier
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

DURABLE = Subjects("streamproc")
SECRET = b"edge-test-secret-0123456789abcdef-0123456789"  # 45 bytes: HS256 wants >= 32


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("edge-key") / "edge.key"
    path.write_bytes(SECRET + b"\n")
    return path


@pytest.fixture(scope="module")
def auth_edge(server, key_file):
    with running_edge(server.url, "--ensure-results-stream", "--auth-key-file", str(key_file),
                      "--max-streams-per-client", "3", "--max-streams", "40") as edge:
        yield edge


def token(**claims) -> str:
    return mint_capability(SECRET, **claims)


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


async def get(edge, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
        return await client.get(path, **kwargs)


def assert_refusal(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and error["code"] == status
    if status == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer "), response.headers
    return error["message"]


async def test_a_capability_for_the_request_id_reads_its_results_by_header_or_query(auth_edge, nc):
    request_id = rid("auth-own")
    bodies = [b'{"text":"a"}', b'{"text":"ab"}']
    await publish_results(nc, DURABLE, request_id, bodies)
    tok = token(rids=[request_id])
    by_header = await get(auth_edge, f"/v1/results/{request_id}", headers=bearer(tok))
    assert by_header.status_code == 200 and by_header.content == expected_sse(bodies)
    by_query = await get(auth_edge, f"/v1/results/{request_id}", params={"access_token": tok})  # EventSource
    assert by_query.status_code == 200 and by_query.content == expected_sse(bodies)
    unary = await get(auth_edge, f"/v1/results/{request_id}?stream=false", headers=bearer(tok))
    assert unary.status_code == 200 and unary.headers["Streamproc-Results"] == "2"


async def test_no_or_a_bad_capability_is_401_and_another_requests_is_403(auth_edge, nc):
    request_id, other = rid("auth-mine"), rid("auth-theirs")
    await publish_results(nc, DURABLE, other, [b'{"text":"secret"}'])
    path = f"/v1/results/{other}"
    assert "no capability" in assert_refusal(await get(auth_edge, path), 401, "unauthorized")
    mine = token(rids=[request_id])
    message = assert_refusal(await get(auth_edge, path, headers=bearer(mine)), 403, "forbidden")
    assert other in message
    expired = token(rids=[other], now=time.time() - 3600, ttl=60)  # expired long past the 30 s leeway
    assert "expired" in assert_refusal(await get(auth_edge, path, headers=bearer(expired)), 401, "unauthorized")
    forged = mint_capability(b"another-key-0123456789abcdef-0123456789", rids=[other])
    assert_refusal(await get(auth_edge, path, headers=bearer(forged)), 401, "unauthorized")
    wrong_audience = jwt.encode({"aud": "someone-else", "exp": int(time.time()) + 60, "rids": [other]}, SECRET)
    assert "aud" in assert_refusal(await get(auth_edge, path, headers=bearer(wrong_audience)), 401, "unauthorized")
    no_expiry = jwt.encode({"aud": "streamproc-edge", "rids": [other]}, SECRET)
    assert "exp" in assert_refusal(await get(auth_edge, path, headers=bearer(no_expiry)), 401, "unauthorized")
    unsigned = jwt.encode({"aud": "streamproc-edge", "exp": int(time.time()) + 60, "rids": [other]}, None,
                          algorithm="none")
    assert_refusal(await get(auth_edge, path, headers=bearer(unsigned)), 401, "unauthorized")
    assert_refusal(await get(auth_edge, path, headers={"Authorization": f"Basic {mine}"}), 401, "unauthorized")
    both = await get(auth_edge, path, headers=bearer(mine), params={"access_token": mine})
    assert_refusal(both, 401, "unauthorized")
    metrics = auth_edge.metrics()
    assert metrics["streamproc_edge_unauthorized_total"] >= 8 and metrics["streamproc_edge_forbidden_total"] >= 1


async def test_a_tenant_prefix_covers_its_ids_and_nothing_else(auth_edge, nc):
    tenant = rid("tenant-a") + "-"
    own, foreign = tenant + "req1", rid("tenant-b") + "-req1"
    await publish_results(nc, DURABLE, own, [b'{"text":"t"}'])
    tok = token(rid_prefix=tenant)
    response = await get(auth_edge, f"/v1/results/{own}?stream=false", headers=bearer(tok))
    assert response.status_code == 200 and response.content == b'{"text":"t"}'
    assert_refusal(await get(auth_edge, f"/v1/results/{foreign}", headers=bearer(tok)), 403, "forbidden")


async def test_recent_needs_an_operator_capability_and_info_is_open(auth_edge, nc):
    request_id = rid("auth-recent")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"r"}'])
    assert_refusal(await get(auth_edge, "/v1/recent"), 401, "unauthorized")
    assert_refusal(await get(auth_edge, "/v1/recent", headers=bearer(token(rids=[request_id]))), 403, "forbidden")
    operator = await get(auth_edge, "/v1/recent", params={"access_token": token(operator=True)})  # the page
    assert operator.status_code == 200
    assert request_id in [entry["request_id"] for entry in operator.json()]
    as_operator = await get(auth_edge, f"/v1/results/{request_id}?stream=false", headers=bearer(token(operator=True)))
    assert as_operator.status_code == 200
    info = await get(auth_edge, "/v1/info")
    assert info.status_code == 200
    assert info.json()["auth"] == "jwt" and info.json()["audience"] == "streamproc-edge"
    for path in ("/", "/edge.js", "/access.js", "/experts.js", "/charts.js", "/healthz", "/metrics"):  # static page, health and counters stay open
        assert (await get(auth_edge, path)).status_code == 200, path


async def test_stats_need_an_operator_and_the_experts_view_any_valid_capability(auth_edge):
    """/v1/stats is operator data like /v1/recent; /v1/experts decodes only the body the client
    sends, but decoding costs CPU, so an anonymous client gets 401 before anything is read."""
    assert_refusal(await get(auth_edge, "/v1/stats"), 401, "unauthorized")
    assert_refusal(await get(auth_edge, "/v1/stats", headers=bearer(token(rids=["x"]))), 403, "forbidden")
    stats = await get(auth_edge, "/v1/stats", headers=bearer(token(operator=True)))
    assert stats.status_code == 200 and "results_sent" in stats.json()
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        anonymous = await client.post("/v1/experts", content=b"{}")
        assert_refusal(anonymous, 401, "unauthorized")
        forged = await client.post("/v1/experts", content=b"{}", headers=bearer(token(rids=["x"]) + "x"))
        assert_refusal(forged, 401, "unauthorized")
        owner = await client.post("/v1/experts", content=b"not json", headers=bearer(token(rids=["x"])))
        assert_refusal(owner, 400, "invalid_request")  # past authentication: the body itself is judged


async def test_tokens_never_reach_the_log(auth_edge, nc):
    request_id = rid("auth-log")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"l"}'])
    tok = token(rids=[request_id])
    assert (await get(auth_edge, f"/v1/results/{request_id}", params={"access_token": tok})).status_code == 200
    assert (await get(auth_edge, "/v1/recent", params={"access_token": tok})).status_code == 403
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert "access_token=<redacted>" in log
    assert tok not in log and tok.split(".")[2] not in log


async def test_a_greedy_client_gets_429_past_its_stream_limit_while_others_are_answered(auth_edge, nc):
    prefix = rid("greedy")
    greedy = token(rid_prefix=prefix, subject="greedy")
    ids = [f"{prefix}-{i}" for i in range(10)]
    # The module's edge is shared: other tests' 429s are in its counter too.
    rejected_before = auth_edge.metrics()["streamproc_edge_streams_rejected_client_total"]
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        async with anyio.create_task_group() as tg:
            statuses: list[int] = []
            opened = anyio.Event()

            async def hold(request_id: str) -> None:
                async with client.stream("GET", f"/v1/results/{request_id}", headers=bearer(greedy)) as response:
                    statuses.append(response.status_code)
                    if len(statuses) == len(ids):
                        opened.set()
                    if response.status_code == 200:
                        await anyio.sleep_forever()

            for request_id in ids:
                tg.start_soon(hold, request_id)
            with anyio.fail_after(10):
                await opened.wait()
            assert sorted(statuses) == [200] * 3 + [429] * 7, statuses
            # anonymous clients hold nothing at all: 401 at once
            anonymous = await anyio.to_thread.run_sync(
                lambda: [httpx.get(f"{auth_edge.url}/v1/results/{rid('anon')}", timeout=10).status_code
                         for _ in range(50)])
            assert set(anonymous) == {401}
            legit_id = rid("legit")
            await publish_results(nc, DURABLE, legit_id, [b'{"text":"ok"}'])
            legit = await client.get(f"/v1/results/{legit_id}?stream=false",
                                     headers=bearer(token(rids=[legit_id], subject="legit")))
            assert legit.status_code == 200 and legit.content == b'{"text":"ok"}'
            tg.cancel_scope.cancel()
    assert auth_edge.metrics()["streamproc_edge_streams_rejected_client_total"] - rejected_before == 7


async def test_an_idle_stream_is_ended_with_a_timeout_error_event(server, key_file):
    with running_edge(server.url, "--insecure-demo", "--idle-stream-timeout", "1", "--keepalive", "0.3") as edge:
        started = time.monotonic()
        response = await get(edge, f"/v1/results/{rid('nobody')}")
        elapsed = time.monotonic() - started
    assert response.status_code == 200 and 0.9 <= elapsed < 5, elapsed
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "within 1.0s" in json.loads(data[-2])["error"]["message"]


async def test_insecure_demo_serves_everyone_and_says_so(server):
    with running_edge(server.url, "--insecure-demo") as edge:
        info = (await get(edge, "/v1/info")).json()
        assert info["auth"] == "insecure-demo"
        assert (await get(edge, "/v1/recent")).status_code == 200
        # In the log too, at every start: the page's banner is seen only by those who open the page.
        assert "level=warning logger=streamproc.edge event=insecure_demo" in edge.log()


def test_without_a_key_the_edge_refuses_to_start_unless_insecure_demo(tmp_path):
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--port", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--auth-key-file" in proc.stderr and "--insecure-demo" in proc.stderr
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--auth-key-file", str(short))
    assert proc.returncode == 2 and "at least 32 bytes" in proc.stderr and "tooshort" not in proc.stderr
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "p.pem", cwd=tmp_path)
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--auth-algorithm", "ES256",
                           "--auth-key-file", str(tmp_path / "p.pem"))
    assert proc.returncode == 2 and "private key" in proc.stderr, proc.stderr
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--auth-key-file", str(tmp_path / "none"))
    assert proc.returncode == 2 and "cannot read --auth-key-file" in proc.stderr


async def test_streamproc_token_mints_an_es256_capability_the_edge_verifies_with_the_public_key(server, nc,
                                                                                                tmp_path):
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "frontend.pem",
            cwd=tmp_path)
    openssl("pkey", "-in", "frontend.pem", "-pubout", "-out", "edge.pub", cwd=tmp_path)
    request_id = rid("es256")
    minted = run_cli_process("token", "--key-file", str(tmp_path / "frontend.pem"), "--algorithm", "ES256",
                             "--rid", request_id, "--ttl", "60")
    assert minted.returncode == 0, minted.stderr
    tok = minted.stdout.strip()
    assert jwt.get_unverified_header(tok)["alg"] == "ES256"
    with running_edge(server.url, "--auth-key-file", str(tmp_path / "edge.pub"), "--auth-algorithm", "ES256",
                      "--ensure-results-stream") as edge:
        # Stored once the edge made the results stream: run alone, no earlier test has made it.
        await publish_results(nc, DURABLE, request_id, [b'{"text":"es"}'])
        response = await get(edge, f"/v1/results/{request_id}?stream=false", headers=bearer(tok))
        assert response.status_code == 200 and response.content == b'{"text":"es"}'
        hs = token(rids=[request_id])  # an HMAC token cannot pass an edge that expects ES256
        assert_refusal(await get(edge, f"/v1/results/{request_id}", headers=bearer(hs)), 401, "unauthorized")
    refused = run_cli_process("token", "--key-file", str(tmp_path / "frontend.pem"), "--algorithm", "ES256")
    assert refused.returncode == 2 and "--rid" in refused.stderr


async def test_the_edge_serves_https_with_its_certificate_and_key(server, nc, tmp_path):
    certs = Certificates(tmp_path)
    request_id = rid("tls")
    with running_edge(server.url, "--insecure-demo", "--ensure-results-stream",
                      "--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.server_key),
                      ca_file=str(certs.ca)) as edge:
        assert edge.url.startswith("https://")
        await publish_results(nc, DURABLE, request_id, [b'{"text":"tls"}'])
        async with httpx.AsyncClient(base_url=edge.url, timeout=15, verify=edge.ssl) as client:
            response = await client.get(f"/v1/results/{request_id}")
            assert response.status_code == 200 and response.content == expected_sse([b'{"text":"tls"}'])
            assert response.http_version == "HTTP/1.1"
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port is not served
            httpx.get(edge.url.replace("https://", "http://") + "/healthz", timeout=5)
    bad = EdgeProcess(server.url, "--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.client_key))
    proc = subprocess.run(bad.argv, capture_output=True, text=True, timeout=30, env=bad.env)
    bad.close()
    assert proc.returncode == 2 and "--tls-cert-file" in proc.stderr and "Traceback" not in proc.stderr


async def test_many_idle_anonymous_connections_do_not_lock_out_another_client(server, nc):
    """The issue's attack on an --insecure-demo edge: one address opens 200 streams for ids nobody
    answers. It gets --max-streams-per-client of them (429 for the rest), they end after
    --idle-stream-timeout, and a client from another address is answered meanwhile."""
    from edge_harness import slow_reader
    from helpers import status_kib

    with running_edge(server.url, "--insecure-demo", "--ensure-results-stream", "--max-streams", "100",
                      "--max-streams-per-client", "32", "--idle-stream-timeout", "3") as edge:
        baseline = status_kib(edge.proc.pid, "VmRSS")
        idle = [slow_reader(edge.url, rid("idle")) for _ in range(200)]
        try:
            with anyio.fail_after(20):
                while edge.metrics()["streamproc_edge_streams_rejected_client_total"] < 200 - 32:
                    await anyio.sleep(0.1)
            assert edge.metrics()["streamproc_edge_streams_active"] == 32
            request_id = rid("other-address")
            await publish_results(nc, DURABLE, request_id, [b'{"text":"hi"}'])
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # another client address
            async with httpx.AsyncClient(base_url=edge.url, timeout=15, transport=transport) as client:
                answer = await client.get(f"/v1/results/{request_id}?stream=false")
            assert answer.status_code == 200 and answer.content == b'{"text":"hi"}'
            with anyio.fail_after(15):  # the idle streams are ended by --idle-stream-timeout
                while edge.metrics()["streamproc_edge_streams_active"] > 0:
                    await anyio.sleep(0.2)
            peak = status_kib(edge.proc.pid, "VmHWM")
            assert peak - baseline < 30 * 1024, (baseline, peak)  # stated bound: 30 MiB for 200 connections
        finally:
            for sock in idle:
                sock.close()


def test_a_verified_token_is_remembered_until_its_exp_and_refused_after_it():
    """The verification cache: the same token again is answered without PyJWT, until its exp
    (leeway 0 here); after it the token is refused as expired, as without the cache. A token that
    differs in any byte (here its signature) is verified, not looked up."""
    verifier = Verifier(SECRET, "HS256", leeway=0.0)
    expiring = mint_capability(SECRET, rids=["a"], now=time.time() - 58.5, ttl=60)  # exp in 1.5 s
    capability = verifier.verify(expiring)
    assert capability.allows("a") and verifier.hits == 0
    assert verifier.verify(expiring) == capability and verifier.hits == 1
    forged = expiring[:-4] + ("AAAA" if not expiring.endswith("AAAA") else "BBBB")
    with pytest.raises(InvalidCapability, match="invalid token"):
        verifier.verify(forged)
    time.sleep(1.6)
    with pytest.raises(InvalidCapability, match="expired"):
        verifier.verify(expiring)
    assert verifier.hits == 1


# ---------------------------------------------------------------------------------------------------------
# Attacks from outside (a review on 2026-12-01): each refused the way docs/edge.md "Authentication" says.


def signed(**claims) -> str:
    """A token with exactly these claims besides ``aud`` and ``exp`` (mint_capability adds iat and sub)."""
    return jwt.encode({"aud": "streamproc-edge", "exp": int(time.time()) + 60, **claims}, SECRET)


def forged_hs256(claims: dict, key: bytes, alg: str = "HS256") -> str:
    """An HMAC-SHA256 signature by hand: PyJWT refuses to sign with a public key, an attacker does not."""
    import base64
    import hashlib
    import hmac

    def segment(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = segment(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    signing_input = header + "." + segment(json.dumps(claims).encode())
    return signing_input + "." + segment(hmac.new(key, signing_input.encode(), hashlib.sha256).digest())


async def test_a_capability_for_one_request_reads_no_other_by_any_route_or_spelling(auth_edge, nc):
    mine, theirs = rid("cross-a"), rid("cross-b")
    secret_body = b'{"text":"not yours"}'
    await publish_results(nc, DURABLE, theirs, [secret_body])
    await publish_results(nc, DURABLE, mine, [b'{"text":"yours"}'])
    tok = token(rids=[mine])
    encoded_theirs = "".join(f"%{ord(ch):02X}" for ch in theirs)  # every character percent-encoded
    attempts = [
        await get(auth_edge, f"/v1/results/{theirs}", headers=bearer(tok)),
        await get(auth_edge, f"/v1/results/{theirs}?stream=false", headers=bearer(tok)),
        await get(auth_edge, f"/v1/results/{theirs}", headers={**bearer(tok), "Accept": "application/json"}),
        await get(auth_edge, f"/v1/results/{theirs}", params={"access_token": tok}),
        await get(auth_edge, f"/v1/results/{theirs}", headers={**bearer(tok), "Last-Event-ID": "0"}),
        await get(auth_edge, f"/v1/results/{encoded_theirs}", headers=bearer(tok)),
        await get(auth_edge, f"/v1/results/{mine}-more", headers=bearer(tok)),  # a longer id is another id
        await get(auth_edge, f"/v1/results/{mine.upper()}", headers=bearer(tok)),  # ids are case-sensitive
    ]
    for response in attempts:
        assert_refusal(response, 403, "forbidden")
        assert b"not yours" not in response.content and tok not in response.text
    # The id is percent-decoded once, before the check and the subject: the same id however spelt.
    encoded_mine = "".join(f"%{ord(ch):02X}" for ch in mine)
    same = await get(auth_edge, f"/v1/results/{encoded_mine}?stream=false", headers=bearer(tok))
    assert same.status_code == 200 and same.content == b'{"text":"yours"}'


async def test_wildcard_substring_and_lookalike_claims_grant_nothing(auth_edge):
    target = rid("wild")
    path = f"/v1/results/{target}"
    for claims in ({"rids": ["*"]}, {"rids": [">"]}, {"rids": [target[:-1] + "*"]}, {"rids": [""]},
                   {"rid_prefix": ""}, {"rid_prefix": "*"}, {"rid_prefix": ">"},
                   {"rids": [], "rid_prefix": ""},
                   {"scope": "Operator"}, {"scope": "operator "}, {"scope": "admin"}):
        assert_refusal(await get(auth_edge, path, headers=bearer(signed(**claims))), 403, "forbidden")
    for claims in ({"scope": "Operator"}, {"scope": "operator "}, {"rid_prefix": ""}):
        assert_refusal(await get(auth_edge, "/v1/recent", headers=bearer(signed(**claims))), 403, "forbidden")
    # A string where a list belongs would be a substring test (`id in "..."`): refused as a claim error.
    message = assert_refusal(await get(auth_edge, path, headers=bearer(signed(rids=f"[{target}]"))), 401,
                             "unauthorized")
    assert "rids" in message
    assert_refusal(await get(auth_edge, "/v1/recent", headers=bearer(signed(scope=["operator"]))), 401,
                   "unauthorized")


async def test_request_ids_that_are_not_one_subject_token_are_400_however_encoded(auth_edge):
    operator = bearer(token(operator=True))  # nothing but the id can refuse these
    for raw in ("%2e%2e", "%2E", "a%2Eb", "%2A", "a%3E", "%3E", "a%20b", "a%09b", "a%00b", "a%7Fb",
                "r%C3%A9q", "a" * 257):
        response = await get(auth_edge, f"/v1/results/{raw}", headers=operator)
        assert_refusal(response, 400, "invalid_request")
    # %2F is part of the id (the wire rule allows "/"), decoded and checked like the rest of it;
    # a literal slash makes two path segments
    assert_refusal(await get(auth_edge, "/v1/results/a%2F.b", headers=operator), 400, "invalid_request")
    assert (await get(auth_edge, "/v1/results/a/b", headers=operator)).status_code == 404


async def test_time_and_audience_claims_at_their_edges(auth_edge):
    """The edge's leeway is 30 s; a 403 for another id shows the token itself was accepted."""
    now = int(time.time())
    path = f"/v1/results/{rid('not-named')}"
    accepted = [
        {"exp": now - 10},  # expired 10 s ago, within the leeway
        {"nbf": now + 10}, {"iat": now + 10},  # not yet valid by 10 s, within the leeway
        {"exp": str(now + 60)},  # PyJWT takes int(exp)
        {"aud": ["another-service", "streamproc-edge"]},  # RFC 7519 4.1.3: one of its audiences
    ]
    for claims in accepted:
        response = await get(auth_edge, path, headers=bearer(signed(rids=["x"], **claims)))
        assert_refusal(response, 403, "forbidden")
    refused = [
        {"exp": now - 60}, {"nbf": now + 120}, {"iat": now + 120},
        {"exp": "soon"}, {"nbf": "x"}, {"iat": "x"},
        {"aud": ""}, {"aud": "streamproc-edge-2"}, {"aud": ["another-service"]}, {"aud": "STREAMPROC-EDGE"},
        {"sub": 5},
    ]
    for claims in refused:
        tok = signed(rids=["x"], **claims)
        response = await get(auth_edge, path, headers=bearer(tok))
        assert_refusal(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"].endswith('error="invalid_token"')
        assert tok not in response.text
    no_aud = jwt.encode({"exp": now + 60, "rids": ["x"]}, SECRET)
    assert "'aud'" in assert_refusal(await get(auth_edge, path, headers=bearer(no_aud)), 401, "unauthorized")


async def test_a_signed_exp_past_a_floats_range_is_a_token_that_never_expires_not_a_500(auth_edge):
    """PyJWT accepts exp = 10**400 (int() of it is fine); the edge's float() of it raised OverflowError."""
    forever = signed(rids=["x"], exp=10**400)
    path = f"/v1/results/{rid('forever')}"
    for _ in range(2):  # verified, then from the verifier's cache
        assert_refusal(await get(auth_edge, path, headers=bearer(forever)), 403, "forbidden")


def signed_json(**claims: str) -> str:
    """A capability whose claims are these JSON texts (``Infinity``, ``NaN``, ``1e400``: JSON Python's
    json reads, as PyJWT's ``json.loads`` does), by default for ``x`` and a minute, signed with the
    edge's secret."""
    texts = {"aud": '"streamproc-edge"', "rids": '["x"]', "exp": str(int(time.time()) + 60), **claims}
    payload = "{" + ", ".join(f'"{name}": {text}' for name, text in texts.items()) + "}"
    return jwt.api_jws.encode(payload.encode(), SECRET, algorithm="HS256")


# JSON values of a time claim that are no number of seconds, each refused naming the claim.
UNREADABLE_TIMES = ["Infinity", "-Infinity", "NaN", "1e400", "-1e400", '"soon"', "[1]", "{}", "null", '"1e400"',
                    '"' + "9" * 5000 + '"']  # past int()'s 4,300 digits


def accepted_times(now: int) -> list[dict[str, str]]:
    """Time claims a token may carry: huge, negative, fractional numbers are times like any other."""
    return [{"nbf": "-1", "iat": "-1"}, {"nbf": f"-{10 ** 400}"}, {"exp": f"{10 ** 400}", "iat": f"{now}"},
            {"exp": f"{now + 60}.75", "nbf": f"{now}.5"}]


async def test_time_claims_that_are_no_finite_number_are_401_with_the_claim_named_never_a_500(auth_edge):
    """A signed ``"exp": Infinity`` (or ``1e400``, which json reads as inf) made PyJWT 2.8 to 2.10's
    ``int(payload["exp"])`` raise OverflowError, which they do not catch: a 500 and a traceback (seen
    with 2.8.0 under this edge; ``nbf``/``iat`` alike, and TypeError for a list or ``null``). The
    installed PyJWT says only ``invalid token: DecodeError``. Each is a 401 naming the claim."""
    now = int(time.time())
    path = f"/v1/results/{rid('times')}"
    for name in ("exp", "nbf", "iat"):
        for value in UNREADABLE_TIMES:
            message = assert_refusal(await get(auth_edge, path, headers=bearer(signed_json(**{name: value}))),
                                     401, "unauthorized")
            expected = ("the token has no 'exp' claim" if (name, value) == ("exp", "null") else
                        f"the token's '{name}' claim is not a finite number of seconds (NumericDate)")
            assert message == expected, (name, value)
    for name, value in [("nbf", f"{10 ** 400}"), ("iat", f"{now + 120}"), ("nbf", "1e300")]:
        message = assert_refusal(await get(auth_edge, path, headers=bearer(signed_json(**{name: value}))),
                                 401, "unauthorized")
        assert message == f"the token is not valid yet ('{name}' is in the future)"
    for value in (f"{now - 60}", f"-{10 ** 400}", "-1e300"):
        message = assert_refusal(await get(auth_edge, path, headers=bearer(signed_json(exp=value))), 401, "unauthorized")
        assert message == "the token has expired"
    for claims in accepted_times(now):
        assert_refusal(await get(auth_edge, path, headers=bearer(signed_json(**claims))), 403, "forbidden")
    assert "Traceback" not in auth_edge.log()


def test_time_claims_are_checked_by_the_edge_also_under_pyjwt_2_8s_own_checks(monkeypatch):
    """PyJWT 2.8.0, the floor pyproject allows (2.10.1 alike), reads each time claim as
    ``int(payload[name])`` catching ValueError only: OverflowError (Infinity, 1e400) and TypeError
    (a list, ``null`` for ``nbf``) left ``jwt.decode``, a 500 at the edge. Here its three validators do
    what 2.8.0's did; the edge reads the claims itself and never reaches them."""
    from jwt.api_jwt import PyJWT

    def as_pyjwt_2_8(name):
        def validate(self, payload, now, leeway):
            try:
                int(payload[name])
            except ValueError:
                raise jwt.DecodeError(f"{name} must be an integer") from None
        return validate

    for name in ("exp", "nbf", "iat"):
        monkeypatch.setattr(PyJWT, f"_validate_{name}", as_pyjwt_2_8(name))
    verifier = Verifier(SECRET, "HS256", leeway=30.0)
    for name in ("exp", "nbf", "iat"):
        for value in UNREADABLE_TIMES:
            with pytest.raises(InvalidCapability, match=f"'{name}'"):
                verifier.verify(signed_json(**{name: value}))
    for claims in accepted_times(int(time.time())):
        assert verifier.verify(signed_json(**claims)).rids == ("x",)


async def test_huge_tokens_are_refused_unparsed_and_huge_heads_before_the_app(auth_edge):
    path = f"/v1/results/{rid('huge')}"
    huge = "a" * 8193
    response = await get(auth_edge, path, headers=bearer(huge))
    assert "longer than 8192" in assert_refusal(response, 401, "unauthorized") and huge not in response.text
    assert_refusal(await get(auth_edge, path, params={"access_token": huge}), 401, "unauthorized")
    head = await get(auth_edge, path, headers=bearer("a" * 70_000))  # --max-head-bytes 64 KiB
    assert head.status_code == 431 and head.json()["error"]["type"] == "invalid_request"


async def test_two_authorization_headers_are_refused_even_when_the_first_is_valid(auth_edge, nc):
    """Before, the edge read the first header and ignored the rest (a proxy in front may read the last)."""
    request_id = rid("two-headers")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"t"}'])
    tok = token(rids=[request_id])
    for pair in ([tok, "x"], [tok, tok], ["x", tok]):
        response = await get(auth_edge, f"/v1/results/{request_id}",
                             headers=[("Authorization", f"Bearer {value}") for value in pair])
        assert "once" in assert_refusal(response, 401, "unauthorized")
    one = await get(auth_edge, f"/v1/results/{request_id}?stream=false", headers=bearer(tok))
    assert one.status_code == 200


async def test_a_percent_encoded_access_token_name_is_redacted_in_the_log_too(auth_edge, nc):
    """Starlette percent-decodes query names, so ``access%5Ftoken`` carries a capability; the access log
    redacted only the literal ``access_token=`` and logged these whole."""
    request_id = rid("auth-log-encoded")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"e"}'])
    tok = token(rids=[request_id])
    for name in ("access%5Ftoken", "%61ccess_token", "access_t%6Fken", "ACCESS%5Ftoken"):
        response = await get(auth_edge, f"/v1/results/{request_id}?stream=false&{name}={tok}")
        assert response.status_code == (200 if name != "ACCESS%5Ftoken" else 401), (name, response.text)
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert "access%5Ftoken=<redacted>" in log and "%61ccess_token=<redacted>" in log
    assert tok not in log and tok.split(".")[2] not in log


async def test_tokens_without_sub_are_each_their_own_client_for_the_stream_limit(auth_edge):
    """Before, every token without ``sub`` was the one client "sub:": one holder's three streams
    (--max-streams-per-client 3 here) left every other such holder 429."""
    prefix = rid("nosub")
    first, second = signed(rid_prefix=prefix), signed(rid_prefix=prefix, iat=int(time.time()) - 1)
    assert first != second
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        async with anyio.create_task_group() as tg:
            statuses: dict[str, list[int]] = {"first": [], "second": []}
            done = anyio.Event()

            async def hold(who: str, tok: str, request_id: str, count: int) -> None:
                async with client.stream("GET", f"/v1/results/{request_id}", headers=bearer(tok)) as response:
                    statuses[who].append(response.status_code)
                    if sum(map(len, statuses.values())) == count:
                        done.set()
                    if response.status_code == 200:
                        await anyio.sleep_forever()

            for i in range(4):  # the first holder wants one stream more than its limit
                tg.start_soon(hold, "first", first, f"{prefix}-{i}", 4)
            with anyio.fail_after(10):
                await done.wait()
            done = anyio.Event()
            tg.start_soon(hold, "second", second, f"{prefix}-other", 5)
            with anyio.fail_after(10):
                await done.wait()
            assert sorted(statuses["first"]) == [200, 200, 200, 429], statuses  # its own limit still holds
            assert statuses["second"] == [200], statuses
            tg.cancel_scope.cancel()


async def test_an_asymmetric_edge_refuses_algorithm_confusion(server, tmp_path):
    """The edge verifies with --auth-algorithm only: an HS256 token HMAC-signed with the edge's public
    key (PEM or DER bytes as the secret), an ES256 header over an HMAC signature, and alg none are 401."""
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "frontend.pem",
            cwd=tmp_path)
    openssl("pkey", "-in", "frontend.pem", "-pubout", "-out", "edge.pub", cwd=tmp_path)
    openssl("pkey", "-in", "frontend.pem", "-pubout", "-outform", "DER", "-out", "edge.der", cwd=tmp_path)
    public_pem, public_der = (tmp_path / "edge.pub").read_bytes(), (tmp_path / "edge.der").read_bytes()
    claims = {"aud": "streamproc-edge", "exp": int(time.time()) + 60, "scope": "operator"}
    forgeries = [
        forged_hs256(claims, public_pem), forged_hs256(claims, public_pem.strip()),
        forged_hs256(claims, public_der),
        forged_hs256(claims, public_pem, alg="ES256"),
        jwt.encode(claims, None, algorithm="none"),
        jwt.encode(claims, SECRET, algorithm="HS256"),
    ]
    with running_edge(server.url, "--auth-key-file", str(tmp_path / "edge.pub"),
                      "--auth-algorithm", "ES256") as edge:
        for forged in forgeries:
            assert_refusal(await get(edge, "/v1/recent", headers=bearer(forged)), 401, "unauthorized")
        genuine = mint_capability((tmp_path / "frontend.pem").read_bytes(), operator=True, algorithm="ES256")
        assert (await get(edge, "/v1/recent", headers=bearer(genuine))).status_code == 200
        assert "Traceback" not in edge.log()


def test_the_edge_refuses_to_start_with_a_key_the_algorithm_cannot_use_safely(tmp_path):
    """Found at start-up (exit 2), not per request: a public key given as an HS256 secret made every
    valid capability a 500 with a traceback; secrets shorter than their hash (RFC 7518 3.2) and RSA
    keys under 2048 bits (3.3) were accepted with a PyJWT warning on stderr."""
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "ec.pem",
            cwd=tmp_path)
    openssl("pkey", "-in", "ec.pem", "-pubout", "-out", "ec.pub", cwd=tmp_path)
    openssl("pkey", "-in", "ec.pem", "-pubout", "-outform", "DER", "-out", "ec.der", cwd=tmp_path)
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:1024", "-out", "rsa.pem",
            cwd=tmp_path)
    openssl("pkey", "-in", "rsa.pem", "-pubout", "-out", "rsa.pub", cwd=tmp_path)
    (tmp_path / "k40").write_bytes(SECRET[:40])
    (tmp_path / "k64").write_bytes(SECRET + SECRET[:20])  # exactly 64 bytes
    cases = [
        ("HS256", "ec.pub", "asymmetric key"), ("HS512", "ec.pub", "asymmetric key"),
        ("HS256", "ec.der", "asymmetric key"),
        ("HS384", "k40", "at least 48 bytes"), ("HS512", "k40", "at least 64 bytes"),
        ("RS256", "rsa.pub", "2048"),
    ]
    for algorithm, name, reason in cases:
        proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--connect-timeout", "1",
                               "--auth-algorithm", algorithm, "--auth-key-file", str(tmp_path / name))
        assert proc.returncode == 2 and reason in proc.stderr, (algorithm, name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "BEGIN" not in proc.stderr
    ok = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--auth-algorithm", "HS512",
                         "--auth-key-file", str(tmp_path / "k64"), "--print-config")
    assert ok.returncode == 0, ok.stderr


def test_a_der_public_key_ending_in_a_whitespace_byte_is_refused_as_an_hmac_secret(tmp_path):
    """HS* secrets are stripped of surrounding whitespace (a file's trailing newline). A DER public
    key whose last byte is 0x09-0x0d or 0x20 (random: ~2% of P-256 keys) no longer parsed once
    stripped, so it was taken as a valid secret and anyone holding the public key could sign
    capabilities; seen as a rare failure of the test above. Every such key is refused now."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    for _ in range(20_000):
        der = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if der[-1:].isspace():
            break
    else:
        pytest.fail("no P-256 public key ending in a whitespace byte in 20,000 tries")
    (tmp_path / "ec.der").write_bytes(der)
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--connect-timeout", "1",
                           "--auth-algorithm", "HS256", "--auth-key-file", str(tmp_path / "ec.der"))
    assert proc.returncode == 2 and "asymmetric key" in proc.stderr, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr


def jwk_documents() -> dict[str, bytes]:
    """Public keys as JWK and JWK Set (RFC 7517, PyJWT's ``to_jwk``), and a symmetric JWK: key
    documents, none of whose bytes is a shared secret."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from jwt.algorithms import ECAlgorithm, HMACAlgorithm, RSAAlgorithm

    ec_jwk = ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())
    rsa_jwk = RSAAlgorithm.to_jwk(rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key())
    return {"ec.jwk": ec_jwk.encode(), "rsa.jwk": rsa_jwk.encode(),
            "keys.jwks": json.dumps({"keys": [json.loads(ec_jwk), json.loads(rsa_jwk)]}).encode(),
            "oct.jwk": HMACAlgorithm.to_jwk(SECRET).encode(), "bom.jwk": b"\xef\xbb\xbf" + ec_jwk.encode() + b"\n"}


# ``HMACAlgorithm.prepare_key`` as PyJWT 2.8.0's (``algorithms.py``), which pyproject allows: it refuses
# PEM and OpenSSH keys only (``is_pem_format(key_bytes) or is_ssh_key(key_bytes)``); 2.13 added JWKs,
# 2.14 JWK Sets, 2.15 DER. Source text, so that a CLI subprocess runs with it too (a sitecustomize).
PYJWT_2_8_HMAC_PREPARE_KEY = """
from jwt.algorithms import HMACAlgorithm
from jwt.exceptions import InvalidKeyError
from jwt.utils import force_bytes, is_pem_format, is_ssh_key


def prepare_key(self, key):
    key_bytes = force_bytes(key)
    if is_pem_format(key_bytes) or is_ssh_key(key_bytes):
        raise InvalidKeyError("The specified key is an asymmetric key or x509 certificate and"
                              " should not be used as an HMAC secret.")
    return key_bytes
"""


def hmac_prepare_key_as_pyjwt_2_8(monkeypatch) -> None:
    namespace: dict = {}
    exec(PYJWT_2_8_HMAC_PREPARE_KEY, namespace)
    monkeypatch.setattr(namespace["HMACAlgorithm"], "prepare_key", namespace["prepare_key"])


def pyjwt_2_8_env(directory) -> dict[str, str]:
    """The environment of a CLI subprocess whose PyJWT signs and verifies HMAC as 2.8.0 does."""
    patch = PYJWT_2_8_HMAC_PREPARE_KEY + "\nHMACAlgorithm.prepare_key = prepare_key\n"
    (directory / "sitecustomize.py").write_text(patch)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.parametrize("pyjwt", ["installed", "2.8"])
def test_a_jwk_or_jwk_set_is_refused_as_an_hmac_secret_whatever_pyjwt_pyproject_allows(tmp_path, monkeypatch,
                                                                                        pyjwt):
    """A public key as JWK or JWK Set given as an HS256 secret: anyone who has the public key could
    sign capabilities. PyJWT refuses a JWK as a raw HMAC secret from 2.13 and a JWK Set from 2.14; 2.8
    to 2.12 (pyproject allows 2.8) took the file's bytes as the secret and the edge started (seen
    with PyJWT 2.8.0 and 2.12.1 installed aside). The edge now refuses every key document itself;
    secrets that are JSON but no key document (a quoted string, an object without ``kty``) stay
    secrets, as PyJWT 2.15 has them."""
    from streamproc.core.errors import ConfigError
    from streamproc.edge.auth import load_key

    if pyjwt == "2.8":
        hmac_prepare_key_as_pyjwt_2_8(monkeypatch)
    for name, data in jwk_documents().items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match="holds a JWK or JWK Set"):
            load_key(str(tmp_path / name), "HS256")
    for name, data in [("quoted", json.dumps(SECRET.decode()).encode()),
                       ("object", json.dumps({"secret": SECRET.decode()}).encode()), ("raw", SECRET)]:
        (tmp_path / name).write_bytes(data)
        assert load_key(str(tmp_path / name), "HS256") == data
    # A real edge refuses to start with one (exit 2), naming the file's kind.
    proc = run_cli_process("edge", "--nats-url", "nats://127.0.0.1:1", "--connect-timeout", "1",
                           "--auth-algorithm", "HS256", "--auth-key-file", str(tmp_path / "keys.jwks"))
    assert proc.returncode == 2 and "JWK" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("pyjwt", ["installed", "2.8"])
def test_streamproc_token_refuses_to_sign_with_a_key_document_or_public_key_as_an_hmac_secret(tmp_path, pyjwt):
    """``streamproc token`` refuses the HS* "secrets" the edge refuses to start with (above), whatever
    PyJWT pyproject allows: with 2.8 it signed with a public JWK, a JWK Set or a DER public key's bytes
    and printed the token (exit 0), for a key file no edge starts with."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    env = None
    if pyjwt == "2.8":
        (tmp_path / "site").mkdir()
        env = pyjwt_2_8_env(tmp_path / "site")
        signs = subprocess.run([sys.executable, "-c", "import jwt; jwt.encode({}, '{\"kty\": \"EC\"}', 'HS256')"],
                               env=clean_env(env), capture_output=True, text=True, timeout=30, check=False)
        assert signs.returncode == 0, signs.stderr  # the subprocess's PyJWT is 2.8's: a JWK is a secret
    keys = dict(jwk_documents())
    keys["ec.der"] = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    for name, data in keys.items():
        (tmp_path / name).write_bytes(data)
        proc = run_cli_process("token", "--key-file", str(tmp_path / name), "--algorithm", "HS256", "--rid", "x",
                               env=env)
        kind = "asymmetric key" if name.endswith(".der") else "JWK or JWK Set"
        assert proc.returncode == 2 and kind in proc.stderr and proc.stdout == "", (name, proc.stderr)
    (tmp_path / "raw").write_bytes(SECRET + b"\n")
    ok = run_cli_process("token", "--key-file", str(tmp_path / "raw"), "--algorithm", "HS256", "--rid", "x", env=env)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert jwt.decode(ok.stdout.strip(), SECRET, algorithms=["HS256"], audience=AUDIENCE)["rids"] == ["x"]


@pytest.mark.parametrize("pyjwt", ["installed", "2.8"])
def test_mint_capability_refuses_the_keys_the_edge_refuses_whatever_pyjwt(monkeypatch, pyjwt):
    """The library function signs with no key the edge would refuse to start with: with PyJWT 2.8
    (pyproject allows it) ``mint_capability`` signed with a public JWK, a JWK Set or a DER public
    key's bytes as an HS256 secret (anyone holding the public key could then sign), and with a secret
    shorter than its hash or an RSA key under 2048 bits, none of which an edge verifies with."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    from streamproc import mint_capability

    if pyjwt == "2.8":
        hmac_prepare_key_as_pyjwt_2_8(monkeypatch)
        assert jwt.encode({}, '{"kty": "EC"}', algorithm="HS256")  # this PyJWT takes a JWK as a secret
    public_der = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    while public_der[-1:].strip():  # one ending in a whitespace byte (~2% of them): no longer DER stripped
        public_der = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    for name, data in [*jwk_documents().items(), ("ec.der", public_der), ("short", b"k" * 31)]:
        for key in (data, data.decode()) if name.endswith(("jwk", "jwks")) else (data,):  # bytes and str
            with pytest.raises(ValueError, match="unusable HS256 key"):
                mint_capability(key, rids=["x"], algorithm="HS256")
    small_rsa = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    pem = small_rsa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    for key in (pem, small_rsa):  # the PEM bytes and cryptography's key object alike
        with pytest.raises(ValueError, match="at least 2048 bits"):
            mint_capability(key, rids=["x"], algorithm="RS256")
    ec_public = ec.generate_private_key(ec.SECP256R1()).public_key()  # the half the edge gets
    ec_pem = ec_public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for key in (ec_pem, ec_public):
        with pytest.raises(ValueError, match="a public key, which only verifies"):
            mint_capability(key, rids=["x"], algorithm="ES256")
    # A secret read from a file with its newline signs as the edge verifies (it strips the file).
    token = mint_capability(SECRET + b"\n", rids=["x"], algorithm="HS256")
    assert jwt.decode(token, SECRET, algorithms=["HS256"], audience=AUDIENCE)["rids"] == ["x"]
    assert jwt.decode(mint_capability(SECRET.decode(), rids=["y"]), SECRET, algorithms=["HS256"],
                      audience=AUDIENCE)["rids"] == ["y"]


async def test_a_second_valid_signature_of_the_same_es256_token_is_the_same_client(server, tmp_path):
    """An ECDSA signature (r, s) also verifies as (r, n - s): whoever holds one ES256 token holds two
    token strings. A token without sub is its own client by what was signed, not by its bytes, so the
    second string does not double its --max-streams-per-client."""
    from jwt.utils import base64url_decode, base64url_encode

    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "frontend.pem",
            cwd=tmp_path)
    openssl("pkey", "-in", "frontend.pem", "-pubout", "-out", "edge.pub", cwd=tmp_path)
    prefix = rid("malleable")
    first = jwt.encode({"aud": "streamproc-edge", "exp": int(time.time()) + 60, "rid_prefix": prefix},
                       (tmp_path / "frontend.pem").read_bytes(), algorithm="ES256")
    signing_input, _, signature = first.rpartition(".")
    raw = base64url_decode(signature.encode())
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's n
    flipped = raw[:32] + (order - int.from_bytes(raw[32:], "big")).to_bytes(32, "big")
    second = f"{signing_input}.{base64url_encode(flipped).decode()}"
    assert second != first
    with running_edge(server.url, "--auth-key-file", str(tmp_path / "edge.pub"), "--auth-algorithm", "ES256",
                      "--max-streams-per-client", "2") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
            async with anyio.create_task_group() as tg:
                statuses: list[int] = []
                changed = anyio.Event()

                async def hold(tok: str, request_id: str) -> None:
                    path = f"/v1/results/{request_id}"
                    async with client.stream("GET", path, headers=bearer(tok)) as response:
                        statuses.append(response.status_code)
                        changed.set()
                        if response.status_code == 200:
                            await anyio.sleep_forever()

                for i, tok in enumerate([first, second, second]):  # one at a time: the order is the point
                    changed = anyio.Event()
                    tg.start_soon(hold, tok, f"{prefix}-{i}")
                    with anyio.fail_after(10):
                        await changed.wait()
                assert statuses == [200, 200, 429], statuses  # the second string: valid, the same client
                tg.cancel_scope.cancel()


async def test_the_key_file_from_the_environment_is_used_and_never_shown_and_demo_mode_is_never_implicit(
        server, key_file):
    env = {"STREAMPROC_EDGE_AUTH_KEY_FILE": str(key_file)}
    shown = run_cli_process("edge", "--print-config", env=env)
    assert shown.returncode == 0, shown.stderr
    assert str(key_file) in shown.stdout and SECRET.decode() not in shown.stdout + shown.stderr
    both = run_cli_process("edge", "--print-config", env={**env, "STREAMPROC_EDGE_INSECURE_DEMO": "true"})
    assert both.returncode == 2 and "exclude each other" in both.stderr  # a key never leaves a demo open
    for value in ("false", "maybe", ""):  # only an explicit true turns authentication off
        proc = run_cli_process("edge", "--print-config", env={"STREAMPROC_EDGE_INSECURE_DEMO": value})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (value, proc.stderr)
    with running_edge(server.url, env=env) as edge:
        assert (await get(edge, "/v1/info")).json()["auth"] == "jwt"
        path = f"/v1/results/{rid('env-key')}"
        assert_refusal(await get(edge, path), 401, "unauthorized")
        assert_refusal(await get(edge, path, headers=bearer(token(rids=["x"]))), 403, "forbidden")
        assert "insecure_demo" not in edge.log()


def test_streamproc_token_refuses_a_key_too_short_for_its_algorithm(tmp_path):
    """As the edge does at start (above): before, PyJWT's InsecureKeyLengthWarning went to stderr and
    the token was printed, for a key no edge would start with."""
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:1024", "-out", "rsa.pem",
            cwd=tmp_path)
    (tmp_path / "k40").write_bytes(SECRET[:40])
    for algorithm, name, reason in (("HS512", "k40", "64 bytes"), ("HS384", "k40", "48 bytes"),
                                    ("RS256", "rsa.pem", "2048 bits")):
        proc = run_cli_process("token", "--key-file", str(tmp_path / name), "--algorithm", algorithm,
                               "--rid", "x")
        assert proc.returncode == 2 and reason in proc.stderr and proc.stdout == "", (algorithm, proc.stderr)
        assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    ok = run_cli_process("token", "--key-file", str(tmp_path / "k40"), "--algorithm", "HS256", "--rid", "x")
    assert ok.returncode == 0 and ok.stdout.count(".") == 2 and ok.stderr == "", ok.stderr


async def test_every_answer_to_a_capability_says_no_store_so_no_cache_keeps_results_or_tokens(auth_edge, nc):
    """RFC 6750 section 2.3: a response to a request whose token came as ?access_token= (the page's
    EventSource) should not be cached; results read with a header are no less private. Every /v1
    answer says ``Cache-Control: no-store``: streams, unary results, refusals, operator data."""
    request_id = rid("auth-no-store")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"a"}', b'{"text":"ab"}'])
    own, operator = token(rids=[request_id]), token(operator=True)
    answers = {
        "stream by query": await get(auth_edge, f"/v1/results/{request_id}", params={"access_token": own}),
        "unary by query": await get(auth_edge, f"/v1/results/{request_id}",
                                    params={"access_token": own, "stream": "false"}),
        "unary by header": await get(auth_edge, f"/v1/results/{request_id}?stream=false", headers=bearer(own)),
        "info": await get(auth_edge, "/v1/info"),
        "unauthorized": await get(auth_edge, f"/v1/results/{request_id}"),
        "forbidden": await get(auth_edge, f"/v1/results/{rid('auth-other')}", params={"access_token": own}),
        "recent": await get(auth_edge, "/v1/recent", params={"access_token": operator}),
        "stats": await get(auth_edge, "/v1/stats", params={"access_token": operator}),
    }
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        answers["experts refused"] = await client.post("/v1/experts", content=b"not json", headers=bearer(own))
    statuses = {name: response.status_code for name, response in answers.items()}
    assert statuses == {"stream by query": 200, "unary by query": 200, "unary by header": 200, "unauthorized": 401,
                        "forbidden": 403, "recent": 200, "stats": 200, "experts refused": 400, "info": 200}
    assert {name: response.headers.get("Cache-Control") for name, response in answers.items()} == {
        name: "no-store" for name in answers}


def deep_header_token() -> str:
    from jwt.utils import base64url_encode

    header = b'{"alg":"HS256","typ":"JWT","x":' + b"[" * 3000 + b"]" * 3000 + b"}"
    forged = ".".join(base64url_encode(part).decode() for part in (header, b'{"scope":"operator"}', b"sig"))
    assert len(forged) < 8192  # parsed, not refused for its size
    return forged


async def test_a_token_whose_header_is_nested_too_deeply_is_a_401(auth_edge):
    """PyJWT parses the header before it checks the signature; ``json.loads`` raises RecursionError
    (not ValueError) past ~1,000 levels. The installed PyJWT catches it; the test below covers the
    floor ``pyproject.toml`` allows, which does not."""
    forged = deep_header_token()
    answers = [await get(auth_edge, "/v1/recent", headers=bearer(forged)),
               await get(auth_edge, "/v1/recent", params={"access_token": forged})]
    for answer in answers:
        assert_refusal(answer, 401, "unauthorized")
    assert "RecursionError" not in auth_edge.log()


def test_a_header_pyjwt_cannot_parse_is_refused_also_where_pyjwt_lets_the_recursion_error_out(monkeypatch):
    """PyJWT 2.8.0, the floor pyproject allows, let ``json.loads``' RecursionError out of
    ``jwt.decode`` (seen with 2.8.0 installed aside: an unauthenticated 500 and a traceback per
    request). CI runs the newest PyJWT, which catches it; here ``jwt.decode`` does what 2.8's did."""
    from jwt.utils import base64url_decode

    def decode_as_pyjwt_2_8(token: str, *args, **kwargs):
        json.loads(base64url_decode(token.split(".")[0]))  # the header first, its errors not caught
        raise AssertionError("not reached: the header does not parse")

    forged = deep_header_token()
    monkeypatch.setattr(jwt, "decode", decode_as_pyjwt_2_8)
    with pytest.raises(InvalidCapability, match="invalid token"):
        Verifier(SECRET, "HS256", leeway=0.0).verify(forged)


async def test_a_trailing_slash_on_a_v1_path_does_not_redirect_the_token_to_the_host_header(auth_edge):
    """Starlette's slash redirect answered ``/v1/recent/?access_token=<jwt>`` with a 307 to
    ``http://<Host header>/v1/recent?access_token=<jwt>``, without ``Cache-Control: no-store``
    (docs/edge.md: every /v1 answer says it): the token repeated towards whatever host the request named."""
    tok = token(operator=True)
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        for path in ("/v1/recent/", "/v1/results/some-id/"):
            answer = await client.get(path, params={"access_token": tok}, headers={"Host": "evil.example"})
            assert tok not in answer.headers.get("location", ""), (path, answer.status_code, answer.headers)
            if answer.is_redirect:  # RFC 6750 section 2.3: an answer to ?access_token= is not to be cached
                assert answer.headers.get("cache-control") == "no-store", (path, answer.headers)


async def test_head_is_refused_exactly_as_get_an_id_holding_a_slash_included(auth_edge, nc):
    """HEAD takes GET's route and checks: no capability 401 with the challenge, another tenant's id
    403 (``%2F`` spelling included), operator data 403 for a tenant, no body in any of them."""
    from urllib.parse import quote

    tenant = rid("head-tenant") + "/"
    own, foreign = tenant + "1", rid("head-other") + "/1"
    await publish_results(nc, DURABLE, foreign, [b'{"text":"theirs"}'])
    await publish_results(nc, DURABLE, own, [b'{"text":"mine"}'])
    mine = bearer(token(rid_prefix=tenant))
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        for path, headers, status in ((f"/v1/results/{quote(foreign, safe='')}", {}, 401),
                                      (f"/v1/results/{quote(foreign, safe='')}", mine, 403),
                                      (f"/v1/results/{quote(own, safe='')}?stream=false", mine, 200),
                                      ("/v1/recent", mine, 403), ("/v1/stats", mine, 403)):
            get_, head = await client.get(path, headers=headers), await client.head(path, headers=headers)
            assert (get_.status_code, head.status_code, head.content) == (status, status, b""), path
            assert head.headers.get("www-authenticate") == get_.headers.get("www-authenticate"), path


# ---------------------------------------------------------------------------------------------------------
# The claim checks at their exact bounds, on the Verifier with a fixed clock (mutation testing, 2026-12-05:
# the edge tests above stay ~20 s inside the 30 s leeway, so an off-by-one there went unseen).

LEEWAY = 30.0
NOW = 1_800_000_000  # a whole second: the bounds below are exact


def fixed_verifier(clock: list[float] | None = None) -> Verifier:
    at = clock if clock is not None else [float(NOW)]
    return Verifier(SECRET, "HS256", leeway=LEEWAY, clock=lambda: at[0])


def at_time(**claims) -> str:
    return jwt.encode({"aud": AUDIENCE, "rids": ["x"], "exp": NOW + 600, **claims}, SECRET)


def test_exp_nbf_and_iat_are_refused_exactly_one_second_past_the_leeway():
    """Expired once ``exp <= now - leeway``; not yet valid once ``nbf`` or ``iat > now + leeway``
    (PyJWT 2.15 ``_validate_exp`` / ``_validate_nbf`` / ``_validate_iat``)."""
    leeway = int(LEEWAY)
    for claims in ({"exp": NOW - leeway + 1}, {"nbf": NOW + leeway}, {"iat": NOW + leeway}):
        assert fixed_verifier().verify(at_time(**claims)).allows("x"), claims
    for claims, reason in (({"exp": NOW - leeway}, "expired"), ({"exp": NOW - leeway - 1}, "expired"),
                           ({"nbf": NOW + leeway + 1}, "'nbf' is in the future"),
                           ({"iat": NOW + leeway + 1}, "'iat' is in the future")):
        with pytest.raises(InvalidCapability, match=reason):
            fixed_verifier().verify(at_time(**claims))


def test_a_token_without_exp_is_refused_naming_the_claim():
    no_exp = jwt.encode({"aud": AUDIENCE, "rids": ["x"]}, SECRET)
    with pytest.raises(InvalidCapability, match="no 'exp' claim"):
        fixed_verifier().verify(no_exp)


def test_a_remembered_token_is_refused_from_the_second_its_exp_plus_leeway_is_reached():
    clock = [float(NOW)]
    verifier = fixed_verifier(clock)
    tok = at_time(exp=NOW + 100)
    verifier.verify(tok)
    clock[0] = NOW + 100 + LEEWAY - 0.5
    assert verifier.verify(tok).allows("x") and verifier.hits == 1  # remembered, still valid
    clock[0] = NOW + 100 + LEEWAY
    with pytest.raises(InvalidCapability, match="expired"):
        verifier.verify(tok)
    assert verifier.hits == 1


def test_a_token_that_never_expires_is_remembered_too():
    """``exp`` = 10**400 is past a float's range: remembered for ever, not re-verified each time."""
    verifier = fixed_verifier()
    forever = at_time(exp=10**400)
    verifier.verify(forever)
    verifier.verify(forever)
    assert verifier.hits == 1


def test_the_verification_cache_keeps_the_most_recent_tokens_and_no_long_ones():
    from streamproc.edge.auth import CACHED_TOKENS, MAX_CACHED_TOKEN_CHARS

    verifier = fixed_verifier()
    tokens = [at_time(sub=f"client-{i}") for i in range(CACHED_TOKENS + 1)]
    for tok in tokens:
        verifier.verify(tok)
    verifier.verify(tokens[-1])  # the newest stays
    assert verifier.hits == 1
    verifier.verify(tokens[0])  # the oldest went when the cache was full
    assert verifier.hits == 1
    long = at_time(rids=["x"] + [f"r{i:05d}" for i in range(MAX_CACHED_TOKEN_CHARS // 8)])
    assert len(long) > MAX_CACHED_TOKEN_CHARS
    verifier.verify(long)
    verifier.verify(long)
    assert verifier.hits == 1  # verified each time: no more than MAX_CACHED_TOKEN_CHARS per entry


def test_a_valid_token_one_character_over_the_limit_is_refused_unparsed():
    from streamproc.edge.auth import MAX_TOKEN_CHARS

    sized = {}  # base64url skips some lengths: a "kid" header of 0-2 characters fills them
    for pad in range(MAX_TOKEN_CHARS * 3 // 4 - 150, MAX_TOKEN_CHARS * 3 // 4 - 100):
        for kid in ("", "k", "kk"):
            claims = {"aud": AUDIENCE, "rids": ["x"], "exp": NOW + 600, "pad": "p" * pad}
            tok = jwt.encode(claims, SECRET, headers={"kid": kid} if kid else None)
            sized.setdefault(len(tok), tok)
    at_limit, over = sized.get(MAX_TOKEN_CHARS), sized.get(MAX_TOKEN_CHARS + 1)
    assert at_limit is not None and over is not None, sorted(sized)[-5:]
    assert fixed_verifier().verify(at_limit).allows("x")
    with pytest.raises(InvalidCapability, match=f"longer than {MAX_TOKEN_CHARS}"):
        fixed_verifier().verify(over)


def test_the_bearer_token_is_taken_once_from_one_place_its_scheme_in_any_case():
    from streamproc.edge.auth import presented_token

    assert presented_token(["bearer  tok "], []) == "tok"  # RFC 9110 11.1: the scheme is case-insensitive
    assert presented_token(["BEARER tok"], []) == "tok"
    assert presented_token([], ["tok"]) == "tok"
    assert presented_token([], [""]) is None and presented_token([], []) is None
    for authorization, access_token, reason in (
        (["Bearer a", "Bearer a"], [], "one Authorization header"),
        (["Bearer a"], ["a"], "not both"),
        ([], ["a", "a"], "one access_token parameter"),
        (["Bearer   "], [], "must be 'Bearer <token>'"),
        (["Basic a"], [], "must be 'Bearer <token>'"),
    ):
        with pytest.raises(InvalidCapability, match=reason):
            presented_token(authorization, access_token)


def test_an_hmac_secret_one_byte_short_of_its_hash_is_refused():
    """RFC 7518 section 3.2: at least the hash's output, 32/48/64 bytes."""
    from streamproc.signing_keys import short_secret

    for algorithm, least in (("HS256", 32), ("HS384", 48), ("HS512", 64)):
        assert short_secret(algorithm, b"k" * least) is None
        assert f"at least {least} bytes" in short_secret(algorithm, b"k" * (least - 1))


@pytest.mark.parametrize("bits", [1024, 2047])
def test_an_rsa_key_under_2048_bits_is_refused_also_by_a_pyjwt_without_key_length_checks(tmp_path, monkeypatch,
                                                                                         bits):
    """PyJWT has ``check_key_length`` only from 2.11 (pyproject allows 2.8): the edge's own check is
    then all that refuses a weak RSA key (RFC 7518 section 3.3); 2048 bits pass."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from streamproc.core.errors import ConfigError
    from streamproc.edge.auth import load_key

    for cls in jwt.algorithms.RSAAlgorithm.__mro__:
        if "check_key_length" in vars(cls):
            monkeypatch.delattr(cls, "check_key_length")
    for size in (bits, 2048):
        public = rsa.generate_private_key(public_exponent=65537, key_size=size).public_key()
        (tmp_path / f"rsa{size}.pub").write_bytes(public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(ConfigError, match=f"at least 2048 bits for RSAAlgorithm, it has {bits}"):
        load_key(str(tmp_path / f"rsa{bits}.pub"), "RS256")
    assert load_key(str(tmp_path / "rsa2048.pub"), "RS256").startswith(b"-----BEGIN PUBLIC KEY")


def upgrade_request(path: str) -> bytes:
    """A browser's WebSocket handshake (RFC 6455 section 4.1) for ``path``, the connection to close after
    the answer (a half-close would be the client leaving: no answer)."""
    return (f"GET {path} HTTP/1.1\r\nHost: edge\r\nUpgrade: websocket\r\nConnection: Upgrade, close\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            "Accept: application/json\r\n\r\n").encode()


async def test_a_websocket_handshake_is_answered_as_http_and_its_token_never_reaches_the_log(auth_edge, nc):
    """The edge serves no WebSocket, but with a WebSocket library installed beside it (wsproto comes with
    selenium) Uvicorn upgraded such a handshake, the app refused it (a bare ``403``), and Uvicorn's own
    ``"WebSocket <path>" 403`` line wrote the path whole: ``?access_token=<jwt>`` included, past the
    access log's redaction. Now the handshake is an ordinary GET: its client gets the results (or the
    edge's 401), the access log redacts the token, and other clients are served meanwhile."""
    request_id = rid("auth-ws")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"w"}'])
    tok = token(rids=[request_id])
    answer = await anyio.to_thread.run_sync(
        exchange_until_closed, auth_edge.port, upgrade_request(f"/v1/results/{request_id}?stream=false&access_token={tok}"))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b'\r\n\r\n{"text":"w"}'), answer
    refused = await anyio.to_thread.run_sync(
        exchange_until_closed, auth_edge.port, upgrade_request(f"/v1/results/{request_id}?access_token=not.a.jwt"))
    assert refused.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and b'"type":"unauthorized"' in refused, refused
    other = await get(auth_edge, f"/v1/results/{request_id}", params={"stream": "false"}, headers=bearer(tok))
    assert other.status_code == 200 and other.content == b'{"text":"w"}'
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert tok not in log and tok.split(".")[2] not in log and "not.a.jwt" not in log
    assert f'path="/v1/results/{request_id}?stream=false&access_token=<redacted>" http_version=1.1 status=200' in log
    assert f'path="/v1/results/{request_id}?access_token=<redacted>" http_version=1.1 status=401' in log
    assert "WebSocket" not in log and "upgrade" not in log.lower()


async def test_the_routers_404_and_405_to_a_token_in_the_query_say_no_store_too(auth_edge, nc):
    """RFC 9110 section 15.1 lets a cache keep a 404 or 405 without being told (heuristically
    cacheable), with its URL: ``?access_token=<jwt>`` included. The edge's own answers said
    ``no-store``; those of Starlette's router (a literal ``/`` in an id, a trailing slash, an unknown
    /v1 path, a method a route does not take) said nothing, although docs/edge.md promised it of every
    /v1 answer. The client still gets the clear 404 or 405; a correct read is served as before."""
    request_id = rid("auth-router")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"r"}'])
    tok = token(rids=[request_id, "tenant/7"])
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15, params={"access_token": tok}) as client:
        answers = {
            "literal slash": await client.get("/v1/results/tenant/7"),
            "trailing slash": await client.get(f"/v1/results/{request_id}/"),
            "unknown": await client.get("/v1/result"),
            "head of unknown": await client.head("/v1/result"),
            "post results": await client.post(f"/v1/results/{request_id}"),
            "get experts": await client.get("/v1/experts"),
            "delete recent": await client.delete("/v1/recent"),
        }
        served = await client.get(f"/v1/results/{request_id}", params={"stream": "false", "access_token": tok})
    assert {name: a.status_code for name, a in answers.items()} == {
        "literal slash": 404, "trailing slash": 404, "unknown": 404, "head of unknown": 404, "post results": 405,
        "get experts": 405, "delete recent": 405}
    assert answers["unknown"].text == "Not Found" and answers["head of unknown"].content == b""
    assert set(answers["post results"].headers["Allow"].split(", ")) == {"GET", "HEAD"}
    assert answers["get experts"].headers["Allow"] == "POST"
    assert {name: (a.headers.get("Cache-Control"), a.headers.get("X-Content-Type-Options"))
            for name, a in answers.items()} == {name: ("no-store", "nosniff") for name in answers}
    assert served.status_code == 200 and served.content == b'{"text":"r"}'


async def test_the_page_and_open_routes_opened_with_a_token_in_the_query_say_no_store_and_log_it_redacted(
        auth_edge, nc):
    """docs/edge.md tells operators to put the page's token in the fragment (``/#access_token=``), which
    never reaches a server; a pasted ``/?access_token=<jwt>`` does. The page was answered without
    ``Cache-Control: no-store`` (RFC 6750 section 2.3), so the browser's disk or a proxy could keep that
    URL, token and all; so were ``/healthz``, ``/metrics``, the page's scripts and their 404. Each answers
    as before, says ``no-store`` (the page keeps ``Referrer-Policy: no-referrer``), and the access log
    redacts the token; without a token the page stays cacheable, and a bystander's stream is served."""
    request_id = rid("auth-page-query")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"p"}'])
    operator = token(operator=True)
    paths = {"page": "/", "page with id": f"/?id={request_id}", "script": "/edge.js", "no such script": "/nope.js",
             "healthz": "/healthz", "metrics": "/metrics", "head of page": "/"}
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        answers = {}
        for name, path in paths.items():
            method = "HEAD" if name.startswith("head") else "GET"
            separator = "&" if "?" in path else "?"
            answers[name] = await client.request(method, f"{path}{separator}access_token={operator}")
        spelled = await client.get(f"/?Access%5FToken={operator}")
        plain = await client.get("/")
        bystander = await client.get(f"/v1/results/{request_id}", params={"stream": "false"},
                                     headers=bearer(token(rids=[request_id])))
    assert {name: a.status_code for name, a in answers.items()} == {
        "page": 200, "page with id": 200, "script": 200, "no such script": 404, "healthz": 200, "metrics": 200,
        "head of page": 200}
    assert {name: a.headers.get("cache-control") for name, a in answers.items()} == {
        name: "no-store" for name in answers}
    assert spelled.status_code == 200 and spelled.headers.get("cache-control") == "no-store"
    assert answers["page"].headers["referrer-policy"] == "no-referrer" and "<html" in answers["page"].text.lower()
    assert plain.status_code == 200 and "cache-control" not in plain.headers
    assert bystander.status_code == 200 and bystander.content == b'{"text":"p"}'
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert operator not in log and operator.split(".")[2] not in log
    assert 'method=GET path="/?access_token=<redacted>" http_version=1.1 status=200' in log
    assert f'path="/?id={request_id}&access_token=<redacted>"' in log
    assert 'path="/?Access%5FToken=<redacted>"' in log


async def test_a_token_sent_inside_the_path_by_mistake_is_refused_and_never_reaches_the_access_log(auth_edge):
    """A client that percent-encodes the whole ``<id>?access_token=<jwt>`` (``encodeURIComponent`` over
    the query too), or writes ``;access_token=``, sends its token in the path: the edge rightly refuses
    it (400 for the id, 404 elsewhere), but the access log's redaction read only the query, and Uvicorn
    logs the path quoted (``%3Faccess_token%3D<jwt>``): a live capability was written whole. Now its
    value is ``<redacted>`` there too, in each spelling the log shows."""
    tok = token(rids=["r1"])
    paths = {f"/v1/results/r1%3Faccess_token%3D{tok}": 400, f"/v1/results/r1%3FAccess%5FToken={tok}&x=1": 400,
             f"/%3Faccess_token={tok}": 404, f"/v1/recent;access_token={tok}/x": 404}
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        answers = {path: await client.get(path) for path in paths}
        served = await client.head("/v1/results/r1", params={"access_token": tok})
    assert {path: a.status_code for path, a in answers.items()} == paths
    assert all(a.headers["cache-control"] == "no-store" for a in answers.values())
    assert served.status_code == 200  # the token itself works, sent as a query parameter
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert tok not in log and tok.split(".")[2] not in log and tok.split(".")[1] not in log
    assert "path=/v1/results/r1%3Faccess_token%3D<redacted> " in log
    assert "path=/v1/recent%3Baccess_token%3D<redacted>/x " in log


async def test_a_token_in_the_query_behind_a_semicolon_or_an_encoded_separator_is_redacted_and_its_answer_not_stored(
        auth_edge):
    """A live capability sent in a query spelling the edge does not read as ``access_token`` (behind
    ``;``, the old HTML form separator; with its ``=`` or the ``&`` before it percent-encoded) is refused,
    but the access log wrote it whole (only ``&``-separated names were redacted in the query, the
    pattern for these spellings ran over the path alone), and the page opened so was cacheable, URL and
    token. Each is redacted now and its answer says ``no-store``; a plain page stays cacheable."""
    operator = token(operator=True)
    paths = {"semicolon": f"/?x=1;access_token={operator}", "encoded equals": f"/?access_token%3D{operator}",
             "encoded ampersand": f"/?x=1%26access_token={operator}",
             "stream, semicolon": f"/v1/results/{rid('semi')}?stream=false;access_token={operator}"}
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        answers = {name: await client.get(path) for name, path in paths.items()}
        plain = await client.get("/?x=1;y=2")
    assert {name: a.status_code for name, a in answers.items()} == {
        "semicolon": 200, "encoded equals": 200, "encoded ampersand": 200, "stream, semicolon": 401}
    assert {name: a.headers.get("cache-control") for name, a in answers.items()} == {
        name: "no-store" for name in answers}
    assert plain.status_code == 200 and "cache-control" not in plain.headers
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert operator.split(".")[2] not in log
    assert 'path="/?x=1;access_token=<redacted>"' in log and "path=/?access_token%3D<redacted> " in log
    assert 'path="/?x=1%26access_token=<redacted>"' in log


async def test_a_token_name_with_percent_escaped_letters_behind_a_semicolon_or_encoded_separator_is_redacted(
        auth_edge):
    """The spellings the edge does not read as a parameter (behind ``;``, with an encoded ``&`` or ``=``)
    were redacted only when ``access_token`` itself was literal (``_`` or ``=`` encoded at most): a name
    with an escaped letter, ``x=1;%61ccess_token=<jwt>``, was logged whole and its answer cacheable.
    Starlette decodes names, so ``%61ccess_token`` is ``access_token`` as a name (redacted before, the
    ``&`` field rule); here it is redacted wherever it stands, and the answer says ``no-store``."""
    operator = token(operator=True)
    paths = {"semicolon": f"/?x=1;%61ccess_token={operator}",
             "encoded equals": f"/?%61ccess%5Ftoken%3D{operator}",
             "encoded ampersand": f"/?x=1%26access_%74oken={operator}",
             "upper case, semicolon": f"/?x=1;ACCESS%5F%54OKEN={operator}&y=2",
             "stream, semicolon": f"/v1/results/{rid('semi-escaped')}?stream=false;%61ccess_token={operator}"}
    async with httpx.AsyncClient(base_url=auth_edge.url, timeout=15) as client:
        answers = {name: await client.get(path) for name, path in paths.items()}
        named = await client.get(f"/?%61ccess_token={operator}")  # a parameter the edge reads: as before
    assert {name: a.status_code for name, a in answers.items()} == {
        "semicolon": 200, "encoded equals": 200, "encoded ampersand": 200, "upper case, semicolon": 200,
        "stream, semicolon": 401}
    assert {name: a.headers.get("cache-control") for name, a in answers.items()} == {
        name: "no-store" for name in answers}
    assert named.status_code == 200 and named.headers.get("cache-control") == "no-store"
    await anyio.sleep(0.3)
    log = auth_edge.log()
    assert operator.split(".")[2] not in log and operator.split(".")[1] not in log
    assert 'path="/?x=1;%61ccess_token=<redacted>"' in log
    assert "path=/?%61ccess%5Ftoken%3D<redacted> " in log
    assert 'path="/?x=1%26access_%74oken=<redacted>"' in log
    assert 'path="/?x=1;ACCESS%5F%54OKEN=<redacted>&y=2"' in log
    assert 'path="/?%61ccess_token=<redacted>"' in log


async def test_a_stream_opened_before_exp_runs_to_its_end_and_a_reopen_after_exp_is_401(server, key_file, nc):
    """The capability is checked when a stream opens, not while it runs: a stream opened with a token
    that expires meanwhile gets every result and ``[DONE]`` (an ``EventSource`` whose request outlives
    its token is not cut), and the same token cannot open, resume or reconnect after ``exp``
    (docs/security.md, "A leaked capability"). Coverage, found by an attack: docs/security.md said
    a leaked capability reads its ids "until exp", which an open stream outlives."""
    request_id = rid("outlives-exp")
    path = f"/v1/results/{request_id}"
    exp = int(time.time()) + 3
    expiring = token(rids=[request_id], now=exp - 60, ttl=60)
    assert jwt.decode(expiring, options={"verify_signature": False})["exp"] == exp
    with running_edge(server.url, "--ensure-results-stream", "--auth-key-file", str(key_file),
                      "--auth-leeway", "0", "--keepalive", "0.5") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, \
                client.stream("GET", path, headers=bearer(expiring)) as response:
            assert response.status_code == 200
            await publish_result(nc, DURABLE, request_id, 0, b'{"n":0}')
            await anyio.sleep(exp + 1 - time.time())  # the token has expired (leeway 0)
            reopened = await get(edge, path, headers=bearer(expiring))
            assert "expired" in assert_refusal(reopened, 401, "unauthorized")
            resumed = await get(edge, path, headers={**bearer(expiring), "Last-Event-ID": "0"})
            assert "expired" in assert_refusal(resumed, 401, "unauthorized")
            await publish_result(nc, DURABLE, request_id, 1, b'{"n":1}', final=True)
            body = b"".join([chunk async for chunk in response.aiter_bytes()])
    assert body.replace(b": keep-alive\n\n", b"") == expected_sse([b'{"n":0}', b'{"n":1}']), body
