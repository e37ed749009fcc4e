"""Opening a result stream: what an open costs and what it guarantees (issue 14, target 2).

A core-mode open answers its client only once nats-server has its subscription; the opens of one
event-loop pass share one PING for that (``edge/barrier.py``). ``GET /v1/results/{id}`` is
dispatched before Starlette's middleware and router (``EdgeApp``); everything else is Starlette's.
A burst of opens is started a few per loop pass (``edge/pacer.py``), so open streams' events get
through between them.
Real nats-server, the edge's real ``ResultSource`` or a real ``streamproc edge`` process.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import time

import httpx
import nats.errors
import pytest
from edge_harness import publish_result, running_edge, started_source, subscribed_subjects
from helpers import rid, tcp_sockets

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from streamproc.client.capability import mint_capability
from streamproc.core.wire import ResultInfo
from streamproc.edge import settings as edge_settings
from streamproc.edge.app import Edge, EventStreamResponse
from streamproc.edge.pacer import OPENS_PER_PASS, OpenPacer
from streamproc.edge.feed import Lost
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SUBJECTS = Subjects("open")  # no results stream: core subscriptions, the path with a PING per open


async def assert_live(client, feeds, subjects: Subjects = SUBJECTS) -> None:
    """A result published right after the opens returned reaches each feed: each subscription was
    on the server when its open returned."""
    for i, feed in enumerate(feeds):
        await publish_result(client, subjects, feed.request_id, 0, b'{"n":%d}' % i, final=True)
    await client.flush()
    for i, feed in enumerate(feeds):
        item = await feed.next(5.0)
        assert isinstance(item, ResultInfo), (feed.request_id, item)
        assert item.body == b'{"n":%d}' % i


async def test_opens_of_one_loop_pass_share_one_ping_and_each_is_live(nats_url, client):
    async with started_source(nats_url, SUBJECTS, recent=0) as source:
        await source.open(rid("first"))  # the stream lookup's first round trip, out of the way
        rounds = source.barrier.rounds
        feeds = await asyncio.gather(*(source.open(rid(f"together{i}")) for i in range(30)))
        assert source.barrier.rounds - rounds == 1  # one PING for the 30 opens, not 30
        assert source.metrics.core_subscriptions == 31
        await assert_live(client, feeds)
        one = await source.open(rid("alone"))  # a later open gets its own round
        assert source.barrier.rounds - rounds == 2
        await assert_live(client, [one])


async def test_an_open_cancelled_while_waiting_leaves_the_round_to_the_others(nats_url, nats_server, client):
    async with started_source(nats_url, SUBJECTS, recent=0) as source:
        await source.open(rid("first"))
        ids = [rid(f"cancel{i}") for i in range(3)]
        tasks = [asyncio.create_task(source.open(i)) for i in ids]
        while not source.barrier._waiters or len(source.barrier._waiters) < 3:  # all three wait on the round
            await asyncio.sleep(0)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[1], asyncio.CancelledError)
        await assert_live(client, [done[0], done[2]])
        subjects = subscribed_subjects(nats_server.monitor_url)
        assert SUBJECTS.result(ids[1]) not in subjects  # the cancelled open left nothing subscribed
        assert SUBJECTS.result(ids[0]) in subjects


async def test_an_open_without_a_pong_fails_after_the_timeout_and_the_next_one_works(nats_url, nats_server,
                                                                                     client):
    async with started_source(nats_url, SUBJECTS, recent=0) as source:
        await source.open(rid("first"))
        source.barrier.timeout = 0.5
        os.kill(nats_server.pid, signal.SIGSTOP)  # the server stops answering, the connection stays up
        try:
            wait_stopped(nats_server.pid)
            started = time.monotonic()
            with pytest.raises(nats.errors.FlushTimeoutError):
                await source.open(rid("frozen"))
            assert 0.4 < time.monotonic() - started < 3
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        source.barrier.timeout = 10
        await assert_live(client, [await source.open(rid("after"))])


def wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped: a thread still running may answer one more PING."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop: {states}")


async def test_results_paths_the_direct_route_does_not_take_answer_as_starlette_did(edge):
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as http:
        for path in ("/v1/results/a/b", "/v1/results/"):
            assert (await http.get(path)).status_code == 404, path
        response = await http.post("/v1/results/x")
        assert response.status_code == 405
        assert "GET" in response.headers["allow"]
        response = await http.get("/v1/results/a.b")  # the direct route: the same 400 as before
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request"


async def test_a_request_id_holding_a_slash_is_read_when_the_slash_is_sent_encoded(edge, nc):
    """The wire rule allows ``/`` in a request id and the processor answers such a request, but
    Uvicorn decodes ``%2F`` in ``scope["path"]``, so ``/v1/results/tenant%2F42`` (what the page's
    ``encodeURIComponent`` sends) looked like two segments and got a bare 404, from the direct
    route and Starlette alike: nobody could read it. The id is now read from the raw path; a literal
    slash still is another path (404), and a neighbour without a slash is served as before."""
    from urllib.parse import quote

    from streamproc.wire import valid_request_id

    slashed, plain = f"tenant/{rid('slash')}", rid("no-slash")
    assert valid_request_id(slashed)
    for request_id in (slashed, plain):
        await publish_result(nc, Subjects("streamproc"), request_id, 0, b'{"text":"x"}', final=True)
    await nc.flush()
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        for request_id in (slashed, plain):
            unary = await http.get(f"/v1/results/{quote(request_id, safe='')}", params={"stream": "false"})
            assert (unary.status_code, unary.content) == (200, b'{"text":"x"}'), (request_id, unary.text)
            stream = await http.get(f"/v1/results/{quote(request_id, safe='')}")
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n"), stream.text
            assert 'data: {"text":"x"}' in stream.text
        assert (await http.get(f"/v1/results/{slashed}")).status_code == 404  # a literal slash: two segments
        assert (await http.get("/v1/results/a%2F.b")).status_code == 400  # still checked as an id


async def test_head_answers_what_get_answers_without_a_body_for_every_get_route(edge, nc):
    """RFC 9110 section 9.3.2: HEAD gets GET's status and header fields, no content. A request id
    holding ``/`` (sent as ``%2F``) got 404 on HEAD while GET served it (HEAD went through
    Starlette's router, which matched the decoded path), and a HEAD of a stream went on until the
    stream ended, holding a stream slot and its connection (no request can follow it on a kept-alive
    connection) for a head that was complete at once: it is answered with the SSE head, at once. A
    unary HEAD waits for the answer, as GET does, so its status and ``Content-Length`` are GET's."""
    from urllib.parse import quote

    slashed, plain, silent = f"tenant/{rid('head-slash')}", rid("head-plain"), f"tenant/{rid('head-silent')}"
    for request_id in (slashed, plain):
        await publish_result(nc, Subjects("streamproc"), request_id, 0, b'{"text":"x"}', final=True)
    await nc.flush()
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        for request_id in (slashed, plain, silent):
            path = f"/v1/results/{quote(request_id, safe='')}"
            started = time.monotonic()
            head = await http.head(path)
            assert (head.status_code, head.content) == (200, b""), (request_id, head.status_code)
            assert head.headers["content-type"].startswith("text/event-stream"), head.headers
            assert head.headers["cache-control"] == "no-store"
            assert time.monotonic() - started < 2, "a HEAD of a stream waited for the stream"
            # the same connection serves the next request at once: nothing of the HEAD is still running
            assert (await http.get("/healthz")).status_code == 200
        for request_id in (slashed, plain):
            path = f"/v1/results/{quote(request_id, safe='')}?stream=false"
            get, head = await http.get(path), await http.head(path)
            assert (head.status_code, head.content) == (get.status_code, b"") == (200, b"")
            for name in ("content-type", "content-length", "cache-control", "streamproc-results", "streamproc-join"):
                assert head.headers.get(name) == get.headers.get(name), (request_id, name)
        for path, status in (("/v1/results/a%2F.b", 400), (f"/v1/results/{slashed}", 404), ("/v1/recent", 200),
                             ("/v1/info", 200), ("/healthz", 200), ("/metrics", 200), ("/", 200), ("/edge.js", 200)):
            get, head = await http.get(path), await http.head(path)
            assert (get.status_code, head.status_code, head.content) == (status, status, b""), path
            assert head.headers.get("content-type") == get.headers.get("content-type"), path
    metrics = edge.metrics()
    assert metrics["streamproc_edge_streams_active"] == 0


SECRET = b"open-test-secret-0123456789abcdef-0123456789"


def open_scope(request_id: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict:
    """The scope Uvicorn (httptools) gives ``EdgeApp`` for ``GET /v1/results/<request_id>``."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": f"/v1/results/{request_id}", "raw_path": f"/v1/results/{request_id}".encode(),
            "root_path": "", "query_string": query, "headers": headers, "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080), "path_params": {"request_id": request_id}}


async def test_an_sse_open_reads_its_headers_in_one_pass_and_sends_the_head_starlette_would_build(
        nats_url, tmp_path, monkeypatch):
    """``Edge.results`` answers, refuses and resumes exactly as before, without building Starlette's
    ``Headers`` for the request or running ``init_headers`` for the SSE head per open (docs/benchmarks.md,
    "SSE lifecycle: a leaner open")."""
    key = tmp_path / "edge.key"
    key.write_bytes(SECRET + b"\n")
    settings = edge_settings.load({}, {"nats_url": nats_url, "prefix": SUBJECTS.prefix, "auth_key_file": str(key),
                                       "recent": 0})
    edge = Edge(settings, tracing=None)
    await edge.source.start()
    built: collections.Counter[str] = collections.Counter()
    for cls, name in ((Headers, "__init__"), (Response, "init_headers")):
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _name=f"{cls.__name__}.{name}", **kwargs):
            built[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    async def receive():
        await asyncio.sleep(3600)

    async def answer(request_id: str, headers: list[tuple[bytes, bytes]], query: bytes = b""):
        return await edge.results(Request(open_scope(request_id, headers, query), receive))

    request_id = rid("lean")
    token = mint_capability(SECRET, rids=[request_id]).encode()
    try:
        refused = await answer(request_id, [(b"accept", b"text/event-stream")])
        assert refused.status_code == 401 and b"no capability" in refused.body
        assert refused.headers["www-authenticate"] == 'Bearer realm="streamproc-edge"'
        other = mint_capability(SECRET, rids=[rid("other")]).encode()
        assert (await answer(request_id, [(b"authorization", b"Bearer " + other)])).status_code == 403
        bad = await answer(request_id, [(b"authorization", b"Bearer " + token), (b"last-event-id", b"x")])
        assert bad.status_code == 400 and b"invalid_request" in bad.body
        # Two Authorization values: refused as before (presented_token), not the first one taken.
        twice = await answer(request_id, [(b"authorization", b"Bearer " + token), (b"authorization", b"Bearer " + token)])
        assert twice.status_code == 401
        built.clear()  # the refusals' JSON bodies build their own headers: only the open is counted
        response = await answer(request_id, [(b"accept", b"text/event-stream"), (b"authorization", b"Bearer " + token),
                                             (b"last-event-id", b"2")])
        assert isinstance(response, EventStreamResponse)
        assert built == {}, built
        starlette_head = StreamingResponse(response.body_iterator, media_type="text/event-stream",
                                           headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                                    "X-Accel-Buffering": "no"})
        assert response.raw_headers == starlette_head.raw_headers
        assert response.status_code == 200 and response.media_type == "text/event-stream"
        response.headers["x-one"] = "1"  # a response's head is its own: the next open's is unchanged
        await response.body_iterator.aclose()
        rest = response.on_close(False)
        if rest is not None:
            await rest
        unary = await answer(request_id, [(b"accept", b"application/json"), (b"authorization", b"Bearer " + token)],
                             b"stream=true")
        assert isinstance(unary, EventStreamResponse)  # ?stream= decides before Accept, as before
        assert all(name != b"x-one" for name, _ in unary.raw_headers)
        await unary.body_iterator.aclose()
        rest = unary.on_close(False)
        if rest is not None:
            await rest
    finally:
        await edge.source.stop()


STORED = Subjects("openjs")  # the source below creates a results stream for this prefix


async def test_a_jetstream_open_answers_before_its_consumer_exists_and_misses_nothing(nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True, recent=0) as source:
        request_id = rid("early")
        feed = await source.open(request_id)
        assert feed.mode == "jetstream"
        assert feed.attaching is not None and not feed.attaching.done()  # headers would go out now
        for seq in range(5):  # published while the consumer is being created, or before
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq, final=seq == 4)
        await client.flush()
        got = [await feed.next(5.0) for _ in range(5)]
        assert [r.body for r in got] == [b'{"seq":%d}' % seq for seq in range(5)]
        assert source.metrics.jetstream_replays == 1
        await feed.close()


async def test_a_consumer_that_cannot_be_created_ends_the_feed_with_its_reason(nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True, recent=0) as source:
        source.streams.ttl = 3600.0  # however slow this machine, the deleted stream stays cached
        cached = await source.open(rid("cached"))  # the stream's name is cached now
        await cached.attaching
        await cached.close()
        stream = await source.streams.find(source.nc.jetstream(), STORED.result("x"))
        await source.nc.jetstream().delete_stream(stream)
        feed = await source.open(rid("orphan"))
        assert feed.mode == "jetstream"
        item = await feed.next(20.0)  # the server refuses, or nats-py's request times out (5 s)
        assert isinstance(item, Lost), item
        assert "cannot subscribe to results" in item.reason
        await feed.close()
        assert source.streams._expires == 0.0  # the next open asks the server again


async def test_a_feed_closed_while_its_consumer_is_created_leaves_nothing_subscribed(nats_url, nats_server):
    async with started_source(nats_url, STORED, ensure_results_stream=True, recent=0) as source:
        cached = await source.open(rid("cached"))
        await cached.attaching
        await cached.close()
        await source.nc.flush()
        before = client_subjects(nats_server)
        feed = await source.open(rid("gone"))
        await feed.close()  # the client left before the consumer existed
        await feed.attaching
        # its stream's split (ResultSource._split_at_last) found it closed: no consumer made at all
        assert feed._sub is None and source.metrics.jetstream_replays == 1
        await source.nc.flush()
        assert client_subjects(nats_server) == before


def client_subjects(server) -> list[str]:
    """Clients' subscriptions (an ordered consumer's is its deliver inbox), not the server's own."""
    return sorted(s for s in subscribed_subjects(server.monitor_url) if not s.startswith("$"))


async def test_a_closed_feeds_consumer_is_gone_from_the_stream_within_seconds(nats_url, client):
    """Not the server's 5 s default for an ephemeral consumer without interest (source.CONSUMER_LINGER)."""
    async with started_source(nats_url, STORED, ensure_results_stream=True, recent=0) as source:
        feed = await source.open(rid("linger"))
        await feed.attaching
        stream = await source.streams.find(source.nc.jetstream(), STORED.result("x"))
        jsm = client.jetstream()
        assert (await jsm.stream_info(stream)).state.consumer_count == 1
        await feed.close()
        await source.nc.flush()
        closed = time.monotonic()
        while (await jsm.stream_info(stream)).state.consumer_count and time.monotonic() - closed < 10:
            await asyncio.sleep(0.1)
        assert (await jsm.stream_info(stream)).state.consumer_count == 0
        assert time.monotonic() - closed < 4.0


def pass_counter() -> tuple[list[int], collections.abc.Callable[[], None]]:
    """``count[0]``: the event-loop passes since the call (a callback first in every pass); call ``stop``."""
    loop = asyncio.get_running_loop()
    count, running = [0], [True]

    def tick() -> None:
        count[0] += 1
        if running[0]:
            loop.call_soon(tick)

    loop.call_soon(tick)
    return count, lambda: running.__setitem__(0, False)


async def test_opens_of_one_pass_proceed_a_few_per_later_pass_in_arrival_order():
    pacer = OpenPacer(3)
    passes, stop = pass_counter()
    went: list[tuple[int, int]] = []

    async def open_(i: int) -> None:
        await pacer.turn()
        went.append((i, passes[0]))

    await asyncio.gather(*(open_(i) for i in range(10)))  # all ten start in one pass
    stop()
    assert [i for i, _ in went] == list(range(10))
    per_pass = collections.Counter(p for _, p in went)
    assert sorted(per_pass.values()) == [1, 3, 3, 3]  # three per pass, each group in a later pass
    assert pacer.paced == 7


async def test_an_open_alone_does_not_wait_and_a_cancelled_waiter_takes_no_turn():
    pacer = OpenPacer(1)
    with pytest.raises(StopIteration):  # the first open of a pass proceeds without suspending
        pacer.turn().send(None)
    went: list[int] = []

    async def open_(i: int) -> None:
        await pacer.turn()
        went.append(i)

    tasks = [asyncio.create_task(open_(i)) for i in range(3)]
    await asyncio.sleep(0)  # all three wait: the pass's one turn went to the open above
    tasks[1].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert went == [0, 2]
    assert not pacer.waiting


async def test_an_open_alone_after_a_paced_burst_does_not_wait():
    """The budget of the pass the last waiters went in is renewed too: a later open alone proceeds."""
    pacer = OpenPacer(2)

    async def open_() -> None:
        await pacer.turn()

    await asyncio.gather(*(open_() for _ in range(4)))  # two go, two wait for the next pass
    assert pacer.paced == 2
    for _ in range(3):
        await asyncio.sleep(0)
    with pytest.raises(StopIteration):  # proceeds without suspending
        pacer.turn().send(None)
    assert pacer.paced == 2


def test_a_pacer_letting_no_open_through_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        OpenPacer(0)


def accepted(pid: int, port: int, peers: set[int]) -> int:
    """How many connections from the local ports ``peers`` to ``port`` process ``pid`` has accepted:
    a connection still in the listen queue has inode 0 in /proc/net/tcp; an accepted one has the
    inode of one of ``pid``'s file descriptors."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return sum(1 for row in tcp_sockets() if row.local_port == port and row.remote_port in peers and row.inode in inodes)


def wait_accepted(pid: int, port: int, socks: list[socket.socket]) -> None:
    """Until ``pid`` has accepted every one of ``socks``, and a moment for asyncio to start reading
    them: a connection accepted only after SIGCONT is read in a later loop pass than the others."""
    peers = {sock.getsockname()[1] for sock in socks}
    deadline = time.monotonic() + 10
    while (n := accepted(pid, port, peers)) < len(peers):
        assert time.monotonic() < deadline, f"process {pid} accepted {n} of {len(peers)} connections"
        time.sleep(0.01)
    time.sleep(0.3)


def read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


async def test_a_burst_of_opens_read_in_one_pass_is_paced_and_every_stream_is_live(nats_url, client):
    subjects = Subjects("pace")
    with running_edge(nats_url, "--prefix", "pace", "--max-streams-per-client", "1000") as edge:
        ids = [rid(f"burst{i}") for i in range(4 * OPENS_PER_PASS)]
        socks = [socket.create_connection(("127.0.0.1", edge.port), timeout=10) for _ in ids]
        # The kernel completes a connect before the edge accepts it; one accepted after SIGCONT
        # would be read a pass later than the others, and fewer opens would meet in one pass.
        wait_accepted(edge.proc.pid, edge.port, socks)
        os.kill(edge.proc.pid, signal.SIGSTOP)  # every request is waiting when it runs again: one read pass
        try:
            wait_stopped(edge.proc.pid)
            for sock, request_id in zip(socks, ids):
                sock.sendall(f"GET /v1/results/{request_id} HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
        finally:
            os.kill(edge.proc.pid, signal.SIGCONT)
        try:
            for sock in socks:
                assert read_head(sock).startswith(b"HTTP/1.1 200 ")
            for i, request_id in enumerate(ids):  # published once every open answered: each one is live
                await publish_result(client, subjects, request_id, 0, b'{"n":%d}' % i, final=True)
            await client.flush()
            for i, sock in enumerate(socks):
                body = b""
                while b"data: [DONE]" not in body:
                    chunk = sock.recv(4096)
                    assert chunk, body
                    body += chunk
                assert b'data: {"n":%d}' % i in body
        finally:
            for sock in socks:
                sock.close()
        assert edge.metrics()["streamproc_edge_opens_paced_total"] >= len(ids) - 2 * OPENS_PER_PASS


async def test_queued_connections_are_accepted_a_few_per_loop_pass_from_a_full_listen_queue():
    """The edge's Uvicorn server (``server_class``, whatever ``backlog`` its config has): asyncio
    accepts at most ``ACCEPTS_PER_PASS`` connections per loop pass, and the kernel's listen queue
    still holds ``LISTEN_BACKLOG`` (with the small backlog alone, the connects past it would wait for
    SYN retries: they time out here)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from streamproc.edge.server import server_class
    from streamproc.edge.connections import ACCEPTS_PER_PASS, LISTEN_BACKLOG

    made = [0]

    class Counted(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            made[0] += 1
            super().__init__(*args, **kwargs)

    async def app(scope, receive, send) -> None:
        pass

    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=Counted, lifespan="off", log_config=None)
    server = server_class()(config)
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    port = server.servers[0].sockets[0].getsockname()[1]
    count = 12 * ACCEPTS_PER_PASS
    assert count < LISTEN_BACKLOG
    socks = []
    try:
        for _ in range(count):  # the loop does not run meanwhile: every connect waits in the listen queue
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
        seen = [made[0]]
        for _ in range(4 * count):
            await asyncio.sleep(0)  # one loop pass
            seen.append(made[0])
            if made[0] == count:
                break
        steps = [b - a for a, b in zip(seen, seen[1:])]
        assert made[0] == count, seen
        assert max(steps) == ACCEPTS_PER_PASS, steps
    finally:
        for sock in socks:
            sock.close()
        for listening in server.servers:
            listening.close()
        await asyncio.sleep(0.1)  # the accepted connections see their peers' close
