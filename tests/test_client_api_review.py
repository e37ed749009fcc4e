"""A user's review of the public client API (streamproc.client): results, subscriptions, payload
limits, exports. Real nats-server processes only."""

from __future__ import annotations

import json
import urllib.request

import anyio
import nats
import pytest

import streamproc
from streamproc import ChunkPublisher, MalformedResult, Subjects, follow
from streamproc.client.results import collect
from streamproc.core.events import Result, Verdict
from streamproc.core.wire import result_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


def server_subscriptions(nats_server, nc) -> int:
    """Subscriptions the server holds for ``nc``'s connection (what leaks if a helper forgets one)."""
    with urllib.request.urlopen(f"{nats_server.monitor_url}/connz?subs=1&cid={nc._client_id}", timeout=5) as r:
        conns = json.load(r)["connections"]
    return len(conns[0].get("subscriptions_list") or []) if conns else 0


async def publish_result(nc, subjects: Subjects, request_id: str, seq: int, final: bool = False) -> None:
    r = Result(request_id, seq, f"body-{seq}".encode(), final, Verdict.PASSTHROUGH)
    await nc.publish(subjects.result(request_id), r.body, headers=result_headers(r))


async def test_results_that_arrived_before_a_malformed_one_are_still_yielded(client):
    """Results 0 and 1 arrived in order, then a stray message broke the contract: the stream raised
    MalformedResult on its first ``__anext__`` and results 0 and 1 were never handed out."""
    subjects = Subjects()
    got = []
    async with follow(client, subjects, "mal", timeout=5) as results:
        await publish_result(client, subjects, "mal", 0)
        await publish_result(client, subjects, "mal", 1)
        await client.publish(subjects.result("mal"), b"junk", headers={"Streamproc-Seq": "x"})
        await publish_result(client, subjects, "mal", 2, final=True)  # after the error: not yielded
        await client.flush()
        await anyio.sleep(0.2)  # all four delivered before the reader looks
        with pytest.raises(MalformedResult, match="Streamproc-Seq must be a non-negative integer"):
            async for r in results:
                got.append(r.seq)
    assert got == [0, 1]


async def test_a_cancelled_collect_leaves_no_subscription_on_the_connection(client, nats_server):
    """``collect(nc, ...)`` cancelled while it waited (the caller's deadline, a client gone) left its
    subscription on the connection, client and server side: one more per abandoned request."""
    subjects = Subjects()
    before = server_subscriptions(nats_server, client), len(client._subs)
    with anyio.move_on_after(0.3):
        await collect(client, subjects, "cancelled")
    with anyio.move_on_after(0.3):
        await follow(client, subjects, "cancelled-2").collect()
    await client.flush()
    assert (server_subscriptions(nats_server, client), len(client._subs)) == before


async def test_a_bare_async_for_can_be_closed_with_aclosing(client, nats_server):
    """``follow``'s docstring advertised a bare ``async for r in follow(...)``: a ``break`` there left
    the subscription on the connection, and ``contextlib.aclosing`` could not help (no ``aclose``)."""
    import contextlib

    subjects = Subjects()
    before = server_subscriptions(nats_server, client), len(client._subs)
    async with contextlib.aclosing(follow(client, subjects, "brk", timeout=5)) as stream:
        await stream.subscribe()
        await publish_result(client, subjects, "brk", 0)
        async for result in stream:
            assert result.seq == 0
            break
    await client.flush()
    assert (server_subscriptions(nats_server, client), len(client._subs)) == before
    assert "async with follow(" in follow.__doc__ and "break" in follow.__doc__


async def test_a_stream_that_ended_is_exhausted_and_subscribes_to_nothing_again(client, nats_server):
    """Iterating an ended stream again (final result, error or timeout) subscribed once more: a SUB
    and UNSUB per loop, and after an error or a timeout a fresh wait of ``timeout`` seconds."""
    subjects = Subjects()
    before = server_subscriptions(nats_server, client), len(client._subs)
    stream = follow(client, subjects, "again", timeout=5)
    await stream.subscribe()
    await publish_result(client, subjects, "again", 0, final=True)
    assert [r.seq async for r in stream] == [0]
    timed_out = follow(client, subjects, "never", timeout=0.2)
    with pytest.raises(TimeoutError):
        [r async for r in timed_out]
    subs = []
    real_subscribe = client.subscribe

    async def counting(*args, **kwargs):
        subs.append(args)
        return await real_subscribe(*args, **kwargs)

    client.subscribe = counting
    try:
        with anyio.fail_after(1):  # an exhausted stream answers at once, not after another timeout
            assert [r async for r in stream] == [] and [r async for r in timed_out] == []
        await stream.subscribe()
    finally:
        del client.subscribe
    assert subs == []
    await client.flush()
    assert (server_subscriptions(nats_server, client), len(client._subs)) == before


@pytest.mark.parametrize("replay", [False, True])
async def test_async_with_releases_the_subscription_on_cancel_and_on_error(client, nats_server, replay):
    """Holds: ``async with follow(...)`` leaves nothing behind, in core and in replay mode."""
    subjects = Subjects()
    if replay:
        await client.jetstream().add_stream(name="RESULTS_REVIEW", subjects=[subjects.all_results])
    before = server_subscriptions(nats_server, client), len(client._subs)
    with anyio.move_on_after(0.5):
        async with follow(client, subjects, "cx", replay=replay) as results:
            await results.collect()
    with pytest.raises(RuntimeError):
        async with follow(client, subjects, "cx2", replay=replay):
            raise RuntimeError
    await client.flush()
    assert (server_subscriptions(nats_server, client), len(client._subs)) == before


@pytest.mark.parametrize("durable", [False, True])
async def test_a_chunk_over_max_payload_with_its_headers_is_refused_and_the_connection_survives(nats_url, durable):
    """With a stock nats-py connection (README: "nc is a connected nats-py client"), a chunk whose
    body fits max_payload but whose headers push it over was sent: the server closed the connection
    ("Maximum Payload Violation"), and other messages written with it were lost."""
    from streamproc.core.errors import PublishRefused

    problems: list[str] = []

    async def error_cb(exc: Exception) -> None:
        problems.append(repr(exc))

    async def disconnected_cb() -> None:
        problems.append("disconnected")

    nc = await nats.connect(nats_url, error_cb=error_cb, disconnected_cb=disconnected_cb)
    try:
        if durable:
            await nc.jetstream().add_stream(name="CHUNKS_REVIEW", subjects=["streamproc.chunks.>"])
        publisher = ChunkPublisher(nc, durable=durable, timeout=0.5, retries=1, backoff=0.05)
        with pytest.raises(PublishRefused, match=r"exceed the server's max_payload \(1048576 bytes\)") as info:
            await publisher.publish("big", "agg", 0, bytes(nc.max_payload - 10), final=True)
        assert not info.value.retryable
        with pytest.raises(PublishRefused, match="max_payload"):  # the body alone too large: the same error
            await publisher.publish("big", "agg", 0, bytes(nc.max_payload + 1), final=True)
        await publisher.publish("small", "agg", 0, b"x", final=True)
        await nc.flush(2)
        await anyio.sleep(0.3)
        assert problems == [] and nc.is_connected
    finally:
        await nc.close()


def test_what_the_client_helpers_raise_and_offer_is_importable_from_streamproc():
    """README: ``from streamproc import ChunkPublisher`` ... "raises PublishRefused when the stream
    refuses a chunk", but ``from streamproc import PublishRefused`` was an ImportError (and so were
    ChunkIdTaken, the Migrator's ``publish_request`` and ``mint_capability``)."""
    import subprocess
    import sys

    code = ("import sys; from streamproc import PublishRefused, ChunkIdTaken, StreamprocError;"
            "assert issubclass(ChunkIdTaken, PublishRefused) and issubclass(PublishRefused, StreamprocError);"
            "print('nats' in sys.modules, 'jwt' in sys.modules);"
            "from streamproc import publish_request, mint_capability;"
            "from streamproc.client.migration import publish_request as p;"
            "from streamproc.client.capability import mint_capability as m;"
            "assert (p, m) == (publish_request, mint_capability)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]  # the errors are pure; the helpers stay lazy
    assert {"PublishRefused", "ChunkIdTaken", "publish_request", "mint_capability"} <= set(streamproc.__all__)


class CuttableProxy:
    """A TCP relay in front of the nats-server: ``cut()`` drops the reader's connection (a network
    fault, not a mock; nats-py reconnects through it)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.writers: list = []
        self.server = None

    async def start(self) -> int:
        import asyncio

        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers += [writer, up_writer]

        async def pipe(src, dst) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, RuntimeError):
                pass
            finally:
                dst.close()

        asyncio.ensure_future(pipe(reader, up_writer))
        asyncio.ensure_future(pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers = []

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@pytest.mark.parametrize("replay", [True, False])
async def test_a_reconnect_mid_follow(nats_server, client, replay):
    """Results 1 and 2 (final) are stored while the reader's connection is down. Replay: all three,
    once (holds). Live: 1 and 2 are lost and the stream times out; the TimeoutError only said "no
    final result (1 results received)", nothing about the reconnect that lost them."""
    subjects = Subjects()
    js = client.jetstream()
    await js.add_stream(name="RESULTS_REVIEW", subjects=[subjects.all_results])

    async def store(seq: int, final: bool = False) -> None:
        r = Result("rc", seq, f"body-{seq}".encode(), final, Verdict.PASSTHROUGH)
        await js.publish(subjects.result("rc"), r.body, headers=result_headers(r))

    proxy = CuttableProxy(nats_server.port)
    reader = await nats.connect(f"nats://127.0.0.1:{await proxy.start()}", reconnect_time_wait=0.2)
    got: list[int] = []
    try:
        async with follow(reader, subjects, "rc", timeout=3 if not replay else 20, replay=replay) as results:
            await store(0)

            async def read() -> None:
                async for r in results:
                    got.append(r.seq)
                    if r.seq == 0:
                        proxy.cut()
                        await anyio.sleep(0.05)
                        await store(1)
                        await store(2, final=True)

            if replay:
                await read()
            else:
                with pytest.raises(TimeoutError, match=r"reconnected 1 time\(s\) meanwhile: results published "
                                                       r"while it was disconnected are lost"):
                    await read()
    finally:
        await reader.close()
        proxy.close()
    assert got == ([0, 1, 2] if replay else [0])


def test_mint_capability_refuses_a_bare_string_and_invalid_ids():
    """``mint_capability(key, rids=request_id)`` (one id, not a list) minted a token whose ``rids``
    were the id's characters: it granted requests "r", "e", "q", ... and refused the one meant.
    Ids the edge can never serve ("a.b", "") were signed without a word."""
    import jwt

    from streamproc import mint_capability

    key = b"k" * 32
    with pytest.raises(TypeError, match=r"not one id: use rids=\['req-42'\]"):
        mint_capability(key, rids="req-42")
    for bad in (["a.b"], [""], ["ok", "a b"]):
        with pytest.raises(ValueError, match="invalid request id"):
            mint_capability(key, rids=bad)
    with pytest.raises(ValueError, match="invalid rid_prefix 'tenant.a'"):
        mint_capability(key, rid_prefix="tenant.a")
    claims = jwt.decode(mint_capability(key, rids=("req-42",), rid_prefix="tenant-"), key, algorithms=["HS256"],
                        audience="streamproc-edge")
    assert claims["rids"] == ["req-42"] and claims["rid_prefix"] == "tenant-"


async def test_a_forged_puback_names_its_stream_and_seq_in_the_error_shown_not_raw(nats_url):
    """A peer subscribed to the chunk subjects may answer a durable publish first, with a PubAck whose
    stream name and seq it chose (here a line break and a protocol line in the name). The publisher
    takes it for a duplicate it did not send and raises ``ChunkIdTaken``: its text showed those values
    raw, so a caller logging it wrote the peer's line breaks into its log. Now they are shown quoted."""
    from streamproc.core.errors import ChunkIdTaken

    nc = await nats.connect(nats_url)
    try:
        forged = json.dumps({"stream": "S\r\nPUB evil 1\r\nx", "seq": 1, "duplicate": True})

        async def answer(msg) -> None:
            await nc.publish(msg.reply, forged.encode())

        await nc.subscribe("streamproc.chunks.>", cb=answer)  # no stream: the peer is the only answer
        publisher = ChunkPublisher(nc, durable=True, timeout=0.5, retries=0)
        with pytest.raises(ChunkIdTaken) as info:
            await publisher.publish("forged", "agg", 0, b"x", final=True)
        text = str(info.value)
        assert "\r" not in text and "\n" not in text, text
        assert "'S\\r\\nPUB evil 1\\r\\nx'" in text, text
    finally:
        await nc.close()
