"""`streamproc edge` over real localhost HTTP: SSE framing, ordering, resume, limits.

The edge runs as ``python -m streamproc.edge`` against a real nats-server; results are published
straight to ``P.results.<id>`` with a processor's headers. Clients are httpx (raw bytes, to pin
the framing byte for byte) and httpx-sse (a maintained SSE parser, to pin what a client sees).
"""

from __future__ import annotations

import json
import random

import anyio
import httpx
import pytest
from edge_harness import (
    expected_sse,
    http_status,
    publish_result,
    publish_results,
    running_edge,
    sse_view,
    subscribed_subjects,
)
from helpers import rid
from httpx_sse import aconnect_sse

from streamproc.catalog import Catalog, worker_for
from streamproc.codec import ErrorKind
from streamproc.metrics import parse as parse_metrics
from streamproc.sim.embedded import EmbeddedNats
from streamproc.simulation import make_truth
from streamproc.wire import Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

CORE = Subjects("core")  # no JetStream stream captures core.results.>: live subscriptions only
DURABLE = Subjects("streamproc")  # the edge below creates the results stream for this prefix

OPAQUE_BODIES = [
    b'{"text":" h\xc3\xa9llo \xe2\x80\xa8 \xf0\x9f\x98\x80","meta_info":{"routed_experts":"%%not-base64%%"}}',
    b'{"text":"data: [DONE]\\n\\nid: 9","meta_info":{"routed_experts":12345678901234567890}}',
    b' {"leading":"space","routed_experts":[1,2,{"x":null}],"esc":"\\u0000\\ud83d\\ude00"}',
    b"not json at all: [DONE] : keep-alive",
    b'{"text":"","meta_info":{"routed_experts":"AAAA","finish_reason":{"type":"length","length":3}}}',
]


@pytest.fixture(scope="module")
def core_edge(server):
    with running_edge(
        server.url, "--prefix", CORE.prefix, "--keepalive", "0.3", "--gap-timeout", "1",
        "--max-streams-per-client", "1000",  # 200 concurrent clients share 127.0.0.1
    ) as edge:
        yield edge


@pytest.fixture(scope="module")
def durable_edge(server):
    with running_edge(server.url, "--prefix", DURABLE.prefix, "--ensure-results-stream") as edge:
        yield edge


def native_error_type(kind: ErrorKind) -> str:
    """The ``type`` the edge's format (sglang, the default) gives an error of this kind."""
    return json.loads(Catalog()("sglang").error_body("x", kind))["error"]["type"]


async def stream_bytes(edge, path: str, publish, headers: dict[str, str] | None = None) -> bytes:
    """Open the SSE stream, run ``publish`` once the edge has subscribed, return every byte received."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
        async with client.stream("GET", path, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            await publish()
            return await response.aread()


async def test_aggregated_bodies_arrive_byte_for_byte_inside_data_frames(core_edge, nc):
    request_id = rid("agg")
    worker = worker_for("sglang")
    truth = make_truth(11, request_id=request_id)
    bodies = (
        worker.opaque_agg(truth, stream=True, rng=random.Random(5))
        + OPAQUE_BODIES
        + [
            b"\xff\x00raw \xfe bytes, not UTF-8",
        ]
    )

    raw = await stream_bytes(
        core_edge, f"/v1/results/{request_id}", lambda: publish_results(nc, CORE, request_id, bodies)
    )

    assert raw == expected_sse(bodies)
    for body in bodies:
        if b"\r" not in body and b"\n" not in body:
            assert b"data: " + body + b"\n\n" in raw  # the very bytes, unescaped, unre-encoded


async def test_a_conforming_sse_parser_sees_every_opaque_body(core_edge, nc):
    request_id = rid("opaque")
    truth = make_truth(13, request_id=request_id)
    bodies = [b"\xffbinary\r\nwith CRLF\rand CR\n"]
    bodies += [
        worker_for("sglang").opaque_agg(truth, stream=True, rng=random.Random(seed))[0] for seed in range(8)
    ]
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            await publish_results(nc, CORE, request_id, bodies)
            events = [event async for event in source.aiter_sse()]

    assert [e.data for e in events] == [sse_view(b) for b in bodies] + ["[DONE]"]


async def test_sse_parser_sees_exactly_the_published_bodies(core_edge, nc):
    request_id = rid("parsed")
    bodies = OPAQUE_BODIES + worker_for("sglang").agg(make_truth(12, request_id=request_id), stream=True)
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            await publish_results(nc, CORE, request_id, bodies)
            events = [event async for event in source.aiter_sse()]

    assert [e.data for e in events] == [b.decode() for b in bodies] + ["[DONE]"]
    assert [e.id for e in events[:-1]] == [str(i) for i in range(len(bodies))]
    assert {e.event for e in events} == {"message"}


async def test_a_body_with_line_breaks_is_split_into_data_lines_and_rejoined_by_the_client(core_edge, nc):
    request_id = rid("lines")
    body = b'{\n  "text": "a",\r\n  "b": 1\r}'
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with client.stream("GET", f"/v1/results/{request_id}") as response:
            await publish_result(nc, CORE, request_id, 0, body, final=True)
            raw = await response.aread()
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}2") as source:
            await publish_result(nc, CORE, request_id + "2", 0, body, final=True)
            events = [event async for event in source.aiter_sse()]

    assert raw == b'id: 0\ndata: {\ndata:   "text": "a",\ndata:   "b": 1\ndata: }\n\ndata: [DONE]\n\n'
    assert events[0].data == '{\n  "text": "a",\n  "b": 1\n}'


async def test_joined_results_keep_their_bytes_and_verdicts_come_as_meta_events(core_edge, nc):
    request_id = rid("pd")
    worker = worker_for("sglang")
    truth = make_truth(21, request_id=request_id)
    bodies = worker.decode(truth, stream=True)
    verdicts = [Verdict.JOINED] * (len(bodies) - 1) + [Verdict.OMITTED]

    async def publish():
        for seq, (body, verdict) in enumerate(zip(bodies, verdicts)):
            await publish_result(
                nc, CORE, request_id, seq, body, final=seq == len(bodies) - 1, verdict=verdict
            )

    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}?verdicts=1") as source:
            await publish()
            events = [event async for event in source.aiter_sse()]
        plain = await stream_bytes(
            core_edge,
            f"/v1/results/{request_id}x",
            lambda: publish_results(nc, CORE, request_id + "x", bodies, verdict=Verdict.JOINED),
        )

    metas = [json.loads(e.data) for e in events if e.event == "meta"]
    messages = [e for e in events if e.event == "message"]
    assert metas == [{"seq": i, "verdict": v.value, "error": None} for i, v in enumerate(verdicts)]
    assert [e.data for e in messages] == [b.decode() for b in bodies] + ["[DONE]"]
    assert [e.event for e in events[:2]] == ["meta", "message"]  # each meta precedes its result
    assert plain == expected_sse(bodies)  # no meta frames unless asked for


async def test_done_is_sent_once_and_the_stream_ends_after_the_final_result(core_edge, nc):
    request_id = rid("done")
    bodies = [b'{"text":"a"}', b'{"text":"b"}']

    async def publish():
        await publish_results(nc, CORE, request_id, bodies)
        await publish_result(nc, CORE, request_id, 1, bodies[1], final=True)  # a repeat of the final one
        await publish_result(nc, CORE, request_id, 2, b'{"text":"late"}', final=True)

    raw = await stream_bytes(core_edge, f"/v1/results/{request_id}", publish)

    assert raw == expected_sse(bodies)
    assert raw.count(b"[DONE]") == 1


async def test_error_result_becomes_its_frame_then_done(core_edge, nc):
    request_id = rid("err")
    error_body = b'{"error":{"message":"no progress for 300s","type":"timeout"}}'

    async def publish():
        await publish_result(nc, CORE, request_id, 0, b'{"text":"a"}')
        await publish_result(nc, CORE, request_id, 1, error_body, final=True, verdict=None, error="timeout")
        await publish_result(nc, CORE, request_id, 2, b'{"text":"after"}', final=True)

    raw = await stream_bytes(core_edge, f"/v1/results/{request_id}", publish)
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}e?verdicts=1") as source:
            await publish_result(
                nc, CORE, request_id + "e", 0, error_body, final=True, verdict=None, error="timeout"
            )
            events = [event async for event in source.aiter_sse()]

    assert raw == expected_sse([b'{"text":"a"}', error_body])
    assert [(e.event, e.data) for e in events] == [
        ("meta", '{"seq":0,"verdict":null,"error":"timeout"}'),
        ("message", error_body.decode()),
        ("message", "[DONE]"),
    ]


@pytest.fixture(scope="module")
def subscribing_edge(server):
    """``--recent 0``: no wildcard subscription, so each core stream has its own subscription."""
    with running_edge(server.url, "--prefix", CORE.prefix, "--recent", "0") as edge:
        yield edge


def dispatched(edge) -> float:
    return edge.metrics()["streamproc_edge_streams_dispatched"]


@pytest.mark.parametrize("fed_by", ["own subscription", "wildcard dispatch"])
async def test_client_disconnect_frees_the_subscription_at_once(server, core_edge, subscribing_edge, nc, fed_by):
    """With its own subscription (``--recent 0``) the stream's SUB is gone from the server at once;
    fed from the recent ring's wildcard subscription (fanout.py), its registration is."""
    edge = subscribing_edge if fed_by == "own subscription" else core_edge
    request_id = rid("gone")
    subject = CORE.result(request_id)
    before = edge.metrics()
    registered = before["streamproc_edge_streams_dispatched"]

    def listening() -> bool:
        if fed_by == "own subscription":
            return subject in subscribed_subjects(server.monitor_url)
        return dispatched(edge) > registered

    async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            assert listening()
            if fed_by == "wildcard dispatch":  # and no subscription of its own
                assert subject not in subscribed_subjects(server.monitor_url)
            await publish_result(nc, CORE, request_id, 0, b'{"text":"first"}')
            events = source.aiter_sse()
            first = await events.__anext__()
            assert first.data == '{"text":"first"}'
        # leaving the block closes the connection without reading on: a client kill

    with anyio.fail_after(2):
        while listening():
            await anyio.sleep(0.02)
    await publish_result(nc, CORE, request_id, 1, b'{"text":"second"}', final=True)
    await nc.flush()
    after = edge.metrics()
    assert after["streamproc_edge_streams_active"] == 0
    assert (
        after["streamproc_edge_client_disconnects_total"]
        == before["streamproc_edge_client_disconnects_total"] + 1
    )
    assert after["streamproc_edge_results_sent_total"] == before["streamproc_edge_results_sent_total"] + 1


async def test_results_are_reordered_by_seq_and_repeats_dropped(core_edge, nc):
    request_id = rid("order")
    bodies = [b'{"n":%d}' % i for i in range(4)]

    async def publish():
        for seq in (1, 0, 1, 0, 3, 2, 2):
            await publish_result(nc, CORE, request_id, seq, bodies[seq], final=seq == 3)

    before = core_edge.metrics()["streamproc_edge_duplicates_dropped_total"]
    raw = await stream_bytes(core_edge, f"/v1/results/{request_id}", publish)

    assert raw == expected_sse(bodies)
    assert core_edge.metrics()["streamproc_edge_duplicates_dropped_total"] >= before + 2


async def test_requests_never_mix_even_with_similar_ids(core_edge, nc):
    ids = [rid("mix"), None, None]
    ids[1], ids[2] = ids[0] + "0", ids[0][:-1]
    received: dict[str, list[str]] = {}
    connected = anyio.Event()
    ready: list[str] = []

    async def follow(client: httpx.AsyncClient, request_id: str) -> None:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            ready.append(request_id)
            if len(ready) == len(ids):
                connected.set()
            received[request_id] = [e.data async for e in source.aiter_sse()]

    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with anyio.create_task_group() as tg:
            for request_id in ids:
                tg.start_soon(follow, client, request_id)
            await connected.wait()
            for seq in range(3):
                for request_id in ids:
                    body = json.dumps({"id": request_id, "seq": seq}).encode()
                    await publish_result(nc, CORE, request_id, seq, body, final=seq == 2)

    for request_id in ids:
        assert received[request_id] == [json.dumps({"id": request_id, "seq": s}) for s in range(3)] + [
            "[DONE]"
        ]


async def test_keepalive_comments_flow_while_idle(core_edge, nc):
    request_id = rid("idle")

    async def publish():
        await anyio.sleep(1.0)
        await publish_result(nc, CORE, request_id, 0, b'{"text":"x"}', final=True)

    raw = await stream_bytes(core_edge, f"/v1/results/{request_id}", publish)

    assert raw.startswith(b": keep-alive\n\n")
    assert raw.count(b": keep-alive\n\n") >= 2
    assert raw.replace(b": keep-alive\n\n", b"") == expected_sse([b'{"text":"x"}'])


async def test_results_written_while_the_stream_waits_are_exact_and_count_for_the_result_timeout(server, nc):
    """A result that reaches an idle stream is written by the fan-out itself (direct.py), not by the
    stream's task: the bytes are the same (meta frames included), and those writes count as results
    for ``--result-timeout`` (here 1 s, while results come every 0.25 s for 2.5 s) and the keep-alive."""
    request_id = rid("direct")
    bodies = [b'{"text":"%d"}' % k for k in range(10)]
    verdicts = [Verdict.JOINED] * len(bodies)

    async def publish(request_id: str) -> None:
        for seq, body in enumerate(bodies):
            await anyio.sleep(0.25)
            await publish_result(nc, CORE, request_id, seq, body, final=seq == len(bodies) - 1,
                                 verdict=verdicts[seq])

    with running_edge(server.url, "--prefix", CORE.prefix, "--result-timeout", "1", "--keepalive", "0.4") as edge:
        raw = await stream_bytes(edge, f"/v1/results/{request_id}", lambda: publish(request_id))
        async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
            async with aconnect_sse(client, "GET", f"/v1/results/{request_id}m?verdicts=1") as source:
                await publish(request_id + "m")
                events = [event async for event in source.aiter_sse()]
        metrics = edge.metrics()

    assert raw.replace(b": keep-alive\n\n", b"") == expected_sse(bodies)
    metas = [json.loads(e.data) for e in events if e.event == "meta"]
    assert metas == [{"seq": i, "verdict": v.value, "error": None} for i, v in enumerate(verdicts)]
    assert [e.data for e in events if e.event == "message"] == [b.decode() for b in bodies] + ["[DONE]"]
    assert [e.event for e in events[:4]] == ["meta", "message"] * 2
    assert metrics["streamproc_edge_result_timeouts_total"] == 0
    assert metrics["streamproc_edge_results_sent_total"] == 2 * len(bodies)
    # The final result ends the response, so it goes through the task; the others could go direct.
    assert metrics["streamproc_edge_results_written_directly_total"] >= len(bodies)


async def test_a_seq_that_never_arrives_ends_the_stream_with_an_error_not_a_splice(core_edge, nc):
    request_id = rid("gap")
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=15) as client:
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            await publish_result(nc, CORE, request_id, 1, b'{"text":"second"}')
            await publish_result(nc, CORE, request_id, 2, b'{"text":"third"}', final=True)
            with anyio.fail_after(5):
                events = [e async for e in source.aiter_sse()]

    assert [e.data for e in events][-1] == "[DONE]"
    assert len(events) == 2
    error = json.loads(events[0].data)["error"]
    assert error["type"] == native_error_type(ErrorKind.INTERNAL) and "seq 0" in error["message"]
    assert events[0].id == ""  # an edge error is no result: it does not move Last-Event-ID


async def test_late_attach_replays_everything_from_the_results_stream(durable_edge, nc):
    request_id = rid("late")
    bodies = [b'{"text":"%d"}' % i for i in range(5)]
    await publish_results(nc, DURABLE, request_id, bodies)  # all published before any client came

    async def nothing():
        return None

    raw = await stream_bytes(durable_edge, f"/v1/results/{request_id}", nothing)

    assert raw == expected_sse(bodies)


async def test_last_event_id_resumes_after_that_seq(durable_edge, nc):
    request_id = rid("resume")
    bodies = [b'{"text":"%d"}' % i for i in range(6)]
    for seq in range(3):
        await publish_result(nc, DURABLE, request_id, seq, bodies[seq])
    await nc.flush()

    async def rest():
        for seq in range(3, 6):
            await publish_result(nc, DURABLE, request_id, seq, bodies[seq], final=seq == 5)

    raw = await stream_bytes(durable_edge, f"/v1/results/{request_id}", rest, headers={"Last-Event-ID": "1"})
    again = await stream_bytes(
        durable_edge, f"/v1/results/{request_id}", nc.flush, headers={"Last-Event-ID": "4"}
    )
    finished = await stream_bytes(
        durable_edge, f"/v1/results/{request_id}", nc.flush, headers={"Last-Event-ID": "5"}
    )

    assert raw == expected_sse(bodies[2:], start=2)
    assert again == expected_sse(bodies[5:], start=5)
    assert finished == b"data: [DONE]\n\n"


async def test_bad_request_ids_and_last_event_ids_are_rejected_with_400(core_edge):
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=5) as client:
        for path in ("/v1/results/a.b", "/v1/results/a%20b", "/v1/results/%2A", "/v1/results/" + "x" * 300):
            response = await client.get(path)
            assert response.status_code == 400, path
            assert response.json()["error"]["type"] == "invalid_request"
        response = await client.get("/v1/results/ok", headers={"Last-Event-ID": "seven"})
        assert response.status_code == 400


async def test_a_last_event_id_of_digits_that_are_not_ascii_is_a_400_naming_the_rule(core_edge):
    """A header is read as latin-1, where ``"²".isdigit()`` and NBSP is whitespace to ``str.strip``:
    ``Last-Event-ID: ²`` got a 400 whose message was Python's ``invalid literal for int() with base
    10: '²'``, and NBSP + ``1`` resumed after seq 1. Only ASCII digits are a seq, around them only the
    spaces and tabs HTTP allows."""
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=5) as client:
        for value in (b"\xb2", b"1\xb3", b"\xb9\xb2", b"\xa01", b"1\xa0", b"\x851"):
            response = await client.get("/v1/results/ok", headers=[(b"Last-Event-ID", value)])
            assert response.status_code == 400, value
            message = response.json()["error"]["message"]
            assert message.startswith("Last-Event-ID must be a result seq"), (value, message)


async def test_two_hundred_concurrent_sse_clients_each_get_their_own_results(core_edge, nc):
    n = 200
    ids = [rid(f"many{i}") for i in range(n)]
    received: dict[str, list[str]] = {}
    opened = 0
    all_open = anyio.Event()

    async def follow(client: httpx.AsyncClient, request_id: str) -> None:
        nonlocal opened
        async with aconnect_sse(client, "GET", f"/v1/results/{request_id}") as source:
            assert source.response.status_code == 200
            opened += 1
            if opened == n:
                all_open.set()
            received[request_id] = [e.data async for e in source.aiter_sse()]

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    with anyio.fail_after(25):
        async with httpx.AsyncClient(base_url=core_edge.url, timeout=20, limits=limits) as client:
            async with anyio.create_task_group() as tg:
                for request_id in ids:
                    tg.start_soon(follow, client, request_id)
                await all_open.wait()
                for seq in range(3):
                    for request_id in ids:
                        await publish_result(
                            nc,
                            CORE,
                            request_id,
                            seq,
                            b'{"id":"%s","seq":%d}' % (request_id.encode(), seq),
                            final=seq == 2,
                        )
                await nc.flush()

    assert len(received) == n
    for request_id in ids:
        assert received[request_id] == [f'{{"id":"{request_id}","seq":{s}}}' for s in range(3)] + ["[DONE]"]
    assert core_edge.metrics()["streamproc_edge_streams_active"] == 0


async def test_streams_past_max_streams_get_a_clear_503(server, nc):
    with running_edge(server.url, "--prefix", CORE.prefix, "--max-streams", "2") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            async with (
                client.stream("GET", "/v1/results/held-1") as first,
                client.stream("GET", "/v1/results/held-2") as second,
            ):
                assert (first.status_code, second.status_code) == (200, 200)
                refused = await client.get("/v1/results/one-too-many")
                unary_refused = await client.get("/v1/results/one-too-many?stream=false")
            assert refused.status_code == 503 and unary_refused.status_code == 503
            assert refused.headers["content-type"] == "application/json"
            assert refused.json()["error"]["type"] == "overloaded"
            assert "2" in refused.json()["error"]["message"]
            with anyio.fail_after(5):  # the held streams were closed: room again
                while edge.metrics()["streamproc_edge_streams_active"] != 0:
                    await anyio.sleep(0.02)
            async with client.stream("GET", "/v1/results/fits-again") as again:
                assert again.status_code == 200
        assert edge.metrics()["streamproc_edge_streams_rejected_total"] == 2


async def test_no_result_within_result_timeout_ends_the_stream_with_a_timeout_error(server):
    with running_edge(
        server.url, "--prefix", CORE.prefix, "--result-timeout", "1", "--keepalive", "0.4"
    ) as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            with anyio.fail_after(5):
                async with client.stream("GET", "/v1/results/never") as response:
                    raw = await response.aread()
    frames = raw.split(b"\n\n")
    assert frames[-3:] == [frames[-3], b"data: [DONE]", b""]
    assert json.loads(frames[-3].removeprefix(b"data: "))["error"]["type"] == native_error_type(
        ErrorKind.TIMEOUT
    )
    assert b": keep-alive" in raw


async def test_healthz_follows_the_nats_connection():
    with EmbeddedNats() as srv:
        with running_edge(srv.url, "--prefix", CORE.prefix) as edge:
            assert http_status(f"{edge.url}/healthz") == 200
            srv.stop()
            with anyio.fail_after(10):
                while http_status(f"{edge.url}/healthz") != 503:
                    await anyio.sleep(0.05)
            async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
                response = await client.get("/v1/results/any")
            assert response.status_code == 503


async def test_metrics_are_prometheus_text(core_edge):
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=5) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE streamproc_edge_streams_opened_total counter" in response.text
    assert parse_metrics(response.text)["streamproc_edge_nats_connected"] == 1


async def test_recent_lists_request_ids_seen_on_result_subjects(core_edge, nc):
    request_id = rid("recent")
    await publish_results(nc, CORE, request_id, [b'{"text":"a"}', b'{"text":"b"}'], verdict=Verdict.JOINED)
    async with httpx.AsyncClient(base_url=core_edge.url, timeout=5) as client:
        with anyio.fail_after(5):
            while True:
                entries = (await client.get("/v1/recent")).json()
                if entries and entries[0]["request_id"] == request_id:
                    break
                await anyio.sleep(0.05)
        page = await client.get("/")
        script = await client.get("/edge.js")
    assert entries[0] | {"last_seen": 0} == {
        "request_id": request_id,
        "results": 2,
        "final": True,
        "error": None,
        "verdicts": {"joined": 2},
        "last_seen": 0,
    }
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="/edge.js"' in page.text
    assert "new EventSource(" in script.text


async def test_a_hundred_streams_make_next_to_no_garbage_collections(core_edge, nc):
    """The edge freezes its start-up objects and raises the collector's thresholds, as the
    processor does (cli.collect_rarely): with CPython's defaults the opens and their events made a
    collection every ~130 events, each pause holding every stream (docs/benchmarks.md, "Where the
    SSE tail comes from")."""
    def gen0() -> float:
        return core_edge.metrics()['streamproc_edge_gc_collections_total{generation="0"}']

    before = gen0()
    ids = [rid(f"gc{i}") for i in range(100)]
    bodies = [b'{"text":"token %d","meta_info":{"id":"%d"}}' % (k, k) for k in range(20)]

    async def one(request_id: str) -> None:
        raw = await stream_bytes(core_edge, f"/v1/results/{request_id}",
                                 lambda: publish_results(nc, CORE, request_id, bodies))
        assert raw.replace(b": keep-alive\n\n", b"") == expected_sse(bodies)

    async with anyio.create_task_group() as tasks:
        for request_id in ids:
            tasks.start_soon(one, request_id)
    # 100 opens and 2,000 events: 15 gen-0 collections with the default threshold (700), none with 50,000
    assert gen0() - before <= 1


def http10_exchange(port: int, path: str, wait_for: bytes, then) -> bytes:
    """``GET path HTTP/1.0`` on a raw socket: read until ``wait_for`` has arrived, call ``then()``, then
    read until the edge closes; everything received."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n".encode())
        received = b""
        while wait_for not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        then()
        while chunk := sock.recv(65536):
            received += chunk
    return received


async def test_an_http_1_0_client_gets_the_stream_close_delimited_not_chunked(durable_edge, nc):
    """RFC 9112 section 6.1: a server MUST NOT send ``Transfer-Encoding`` to a request that does not
    indicate HTTP/1.1. Uvicorn's httptools protocol framed an SSE stream to an HTTP/1.0 client in chunks
    (``63\\r\\ndata: ...``), which such a client reads as part of the events. It now gets the stream
    unframed, ended by the close (RFC 9112 section 6.3), results stored before the open and published
    after it alike; a unary answer keeps its Content-Length, and an HTTP/1.1 client beside it is served."""
    request_id = rid("http10")
    bodies = [b'{"text":"%d"}' % i for i in range(5)]
    for seq in range(2):
        await publish_result(nc, DURABLE, request_id, seq, bodies[seq])
    await nc.flush()

    def rest() -> None:
        async def publish() -> None:
            for seq in range(2, 5):
                await publish_result(nc, DURABLE, request_id, seq, bodies[seq], final=seq == 4)
            await nc.flush()

        anyio.from_thread.run(publish)

    raw = await anyio.to_thread.run_sync(http10_exchange, durable_edge.port, f"/v1/results/{request_id}",
                                         b"id: 1\n", rest)
    head, _, body = raw.partition(b"\r\n\r\n")
    fields = head.lower().split(b"\r\n")
    assert fields[0].startswith(b"http/1.1 200"), head
    assert b"content-type: text/event-stream; charset=utf-8" in fields and b"connection: close" in fields, head
    assert not any(field.startswith(b"transfer-encoding") for field in fields), head
    assert body == expected_sse(bodies), body
    unary = await anyio.to_thread.run_sync(http10_exchange, durable_edge.port,
                                           f"/v1/results/{request_id}?stream=false", b"\r\n\r\n", lambda: None)
    unary_head, _, unary_body = unary.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(unary_body) in unary_head.lower().split(b"\r\n"), unary
    async with httpx.AsyncClient(base_url=durable_edge.url, timeout=15) as client:
        bystander = await client.get(f"/v1/results/{request_id}")
    assert bystander.status_code == 200 and bystander.content == expected_sse(bodies)
    assert "Traceback" not in durable_edge.log()


async def test_two_last_event_id_headers_are_a_400_not_a_resume_from_the_first(durable_edge, nc):
    """Last-Event-ID is one value (no list, RFC 9110 section 5.3: no sender repeats it); a recipient
    that joins repeated lines reads ``1, 3``, which is no seq. The edge took the first line and
    resumed after it, where a proxy in front that reads the last would have logged or routed another
    resume point. Both lines are now read as one value, a 400 naming it; one line resumes as before."""
    request_id = rid("two-lei")
    bodies = [b'{"text":"%d"}' % i for i in range(5)]
    await publish_results(nc, DURABLE, request_id, bodies)
    async with httpx.AsyncClient(base_url=durable_edge.url, timeout=15) as client:
        twice = await client.get(f"/v1/results/{request_id}", headers=[("Last-Event-ID", "1"), ("Last-Event-ID", "3")])
        same = await client.get(f"/v1/results/{request_id}", headers=[("Last-Event-ID", "2"), ("Last-Event-ID", "2")])
        once = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": "3"})
    assert (twice.status_code, same.status_code) == (400, 400), (twice.content, same.content)
    assert twice.json()["error"]["type"] == "invalid_request"
    assert twice.json()["error"]["message"] == ("Last-Event-ID must be a result seq (a non-negative integer), "
                                               "got '1, 3'")
    assert once.status_code == 200 and once.content == expected_sse(bodies[4:], start=4)
