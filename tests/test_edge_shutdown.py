"""SIGTERM with streams open: every client gets a clean, resumable end, and the edge's log stays quiet.

Before, Uvicorn's graceful-shutdown timeout (1 s) cancelled every open stream's task: each client
saw its connection cut in the middle of a chunked body (``incomplete chunked read``), a waiting
unary request got nothing, and the edge logged "Exception in ASGI application" once per stream.
Now the edge ends each stream itself when the stop begins (``Edge.stop_streams``): an
``overloaded`` error event saying the edge is stopping and how to resume (``Last-Event-ID``),
``[DONE]``, then the chunked body's proper end; a unary request waiting for its final result
gets ``503`` with the same error.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time

import anyio
import httpx
import pytest

from edge_harness import EdgeProcess, fill_send_queue, publish_result, slow_reader, unread_stream
from helpers import connection
from streamproc.edge.stopping import FINAL_WRITE_TIMEOUT, RECANCEL_INTERVAL, RECANCEL_ROUNDS, Stopping
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = pytest.mark.nats

STOP_WITHIN = 2.0  # as tests/test_signals.py: a stop the operator asked for takes at most 2 s
GRACEFUL_TIMEOUT = 1.0  # streamproc/edge/server.py: timeout_graceful_shutdown=1


class Reader(threading.Thread):
    """One SSE client reading its stream to the end; ``outcome`` is "complete" or the error."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = url, headers or {}
        self.body = b""
        self.status: int | None = None
        self.outcome = "running"
        self.opened = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=10) as client, client.stream("GET", self.url, headers=self.headers) as response:
                self.status = response.status_code
                self.opened.set()
                for part in response.iter_raw():
                    self.body += part
            self.outcome = "complete"
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on
            self.outcome = f"{type(exc).__name__}: {exc}"
        finally:
            self.opened.set()


def events(body: bytes) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event in ``body``; keep-alive comments are skipped."""
    found = []
    for block in body.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        ident = next((line[4:] for line in lines if line.startswith("id: ")), None)
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        found.append((ident, data))
    return found


def stopped_in(edge: EdgeProcess) -> float:
    """SIGTERM to ``edge``; the seconds until it exited, with status 0 (within STOP_WITHIN + 3 s)."""
    started = time.monotonic()
    edge.proc.send_signal(signal.SIGTERM)
    assert edge.proc.wait(STOP_WITHIN + 3) == 0
    return time.monotonic() - started


def plain_stop(url: str, *args: str) -> float:
    """The seconds a SIGTERM takes to stop an edge with nothing open: what a stop costs on this machine
    now (Uvicorn's close, the process's exit), before any wait of its own."""
    edge = EdgeProcess(url, *args).start()
    try:
        return stopped_in(edge)
    finally:
        edge.close()


def loud_lines(log: str) -> list[str]:
    """Warnings and errors, but the start-up one an --insecure-demo edge (EdgeProcess's default) always logs."""
    return [line for line in log.splitlines()
            if re.search(r"level=(warning|error|critical)", line) and "event=insecure_demo " not in line]


@pytest.mark.parametrize("with_slow_reader", [False, True], ids=["readers", "and-a-client-that-never-reads"])
def test_sigterm_ends_every_open_stream_with_a_resumable_error_event_and_stops_quietly(with_slow_reader):
    """A client that stopped reading (its writes blocked by flow control) cannot hold the stop:
    its connection is closed after the last frame's short wait, and everyone else ends cleanly."""
    subjects = Subjects()
    with EmbeddedNats(jetstream=False) as server:
        edge = EdgeProcess(server.url, "--log-format", "logfmt").start()
        try:
            streams = [Reader(f"{edge.url}/v1/results/stop-{i}") for i in range(6)]
            unary = Reader(f"{edge.url}/v1/results/stop-unary", {"Accept": "application/json"})
            for reader in [*streams, unary]:
                reader.start()
            for reader in streams:
                assert reader.opened.wait(10) and reader.status == 200, reader.outcome

            async def two_results() -> None:
                async with connection(server.url) as nc:
                    for seq in range(2):
                        await publish_result(nc, subjects, "stop-0", seq, b'{"n": %d}' % seq)
                    await nc.flush()

            anyio.run(two_results)
            stuck = None
            if with_slow_reader:
                stuck = slow_reader(edge.url, "stop-stuck")

                async def flood_it() -> None:  # far more than the socket buffers and the transport's hold
                    async with connection(server.url) as nc:
                        for seq in range(64):
                            await publish_result(nc, subjects, "stop-stuck", seq, b'{"pad": "%s"}' % (b"x" * 65536))
                        await nc.flush()

                anyio.run(flood_it)
            deadline = time.monotonic() + 10
            while len(events(streams[0].body)) < 2:
                assert time.monotonic() < deadline, streams[0].body
                time.sleep(0.02)
            time.sleep(0.2)  # the unary request is waiting for its final result

            elapsed = stopped_in(edge)
            for reader in [*streams, unary]:
                reader.join(5)
            log = edge.log()
        finally:
            edge.close()
            if stuck is not None:
                stuck.close()

    assert elapsed < STOP_WITHIN, f"the edge took {elapsed:.2f}s to stop"
    for reader in streams:
        assert reader.outcome == "complete", (reader.url, reader.outcome)
        seen = events(reader.body)
        assert seen[-1] == (None, "[DONE]"), reader.body
        error = json.loads(seen[-2][1])
        assert "stopping" in json.dumps(error) and "Last-Event-ID" in json.dumps(error), error
        assert "overloaded" in json.dumps(error), error
    first = events(streams[0].body)
    assert [ident for ident, _ in first] == ["0", "1", None, None]  # its results, then the stop's error and [DONE]
    assert unary.outcome == "complete" and unary.status == 503, (unary.status, unary.outcome, unary.body)
    assert "stopping" in unary.body.decode()
    assert loud_lines(log) == [], "\n".join(loud_lines(log))


def test_sigterm_during_a_burst_of_connections_stops_at_once_and_quietly():
    """Connections accepted in the loop pass before SIGTERM (the edge accepts 8 per pass,
    connections.py) were made after Uvicorn had asked every connection it knew to close: it waited
    its whole graceful timeout (1 s) for them and logged "timeout graceful shutdown exceeded"."""
    with EmbeddedNats(jetstream=False) as server:
        edge = EdgeProcess(server.url, "--log-format", "logfmt").start()
        socks: list[socket.socket] = []
        try:
            for _ in range(1000):  # still being accepted when the signal comes
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", edge.port))
                socks.append(sock)
            elapsed = stopped_in(edge)
            log = edge.log()
        finally:
            for sock in socks:
                sock.close()
            edge.close()
    assert elapsed < 0.9, f"the edge took {elapsed:.2f}s to stop"  # under the graceful timeout it waited
    assert loud_lines(log) == [], "\n".join(loud_lines(log))


# The stop's bookkeeping alone (edge/stopping.py), on asyncio tasks without an edge.


def waiting_stream(stopping: Stopping, outcome: list[str], *, loses_a_cancel: bool) -> asyncio.Task:
    """A task that waits as a stream does and, when cancelled, records whether the stop claims it;
    ``loses_a_cancel``: its first cancel is swallowed first, as 3.11's ``wait_for`` does when the
    reply it waits for is already in (no ``uncancel``: ``cancelling()`` still counts it)."""

    async def stream() -> None:
        task = asyncio.current_task()
        assert task is not None
        stopping.enter(task)
        try:
            if loses_a_cancel:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    pass
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                outcome.append("claimed" if stopping.claims(task) else "not ours")
                if outcome[-1] != "claimed":
                    raise
        finally:
            stopping.leave(task)

    return asyncio.get_running_loop().create_task(stream())


@pytest.mark.anyio
async def test_a_stop_cancel_lost_in_a_wait_is_sent_again_and_the_task_still_ends_its_response():
    """Python 3.11's asyncio.wait_for returns the result and drops a cancel that arrives with the
    reply: the stream went on waiting until Uvicorn's timeout cut it (seen with JetStream replays at
    SIGTERM). The stop cancels again, and claims every cancel it sent."""
    stopping, outcome = Stopping(), []
    task = waiting_stream(stopping, outcome, loses_a_cancel=True)
    await asyncio.sleep(0.01)
    assert stopping.stop() == 1
    with anyio.fail_after(RECANCEL_INTERVAL * (RECANCEL_ROUNDS + 1) + 1):
        await task
    assert outcome == ["claimed"] and task.cancelling() == 0


@pytest.mark.anyio
async def test_a_cancel_that_is_not_the_stops_is_not_claimed():
    """The server's own timeout (or the client leaving) cancels a task the stop cancelled too: the
    task must re-raise, not answer as if only the stop had asked."""
    stopping, outcome = Stopping(), []
    task = waiting_stream(stopping, outcome, loses_a_cancel=False)
    await asyncio.sleep(0.01)
    stopping.stop()
    task.cancel()  # someone else's, before the task ran again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outcome == ["not ours"]


@pytest.mark.anyio
async def test_a_task_that_enters_during_a_stop_is_cancelled_at_once():
    stopping = Stopping()
    stopping.stop()
    task = asyncio.get_running_loop().create_task(asyncio.sleep(30))
    stopping.enter(task)
    with pytest.raises(asyncio.CancelledError):
        await task


def test_sigterm_with_a_closing_connection_whose_client_never_read_stops_at_once_and_quietly():
    """A finished stream whose client read none of it, its last bytes in the edge's transport under
    the high-water mark, on a keep-alive connection: the stop closes it, asyncio's close waits for
    the client to take them, and --write-timeout's check (30 s) comes long after Uvicorn's graceful
    timeout (1 s). The stop waited that whole second and logged "timeout graceful shutdown exceeded".
    The rest is cut after the last frame's short wait, as an open stream's at the stop."""
    subjects = Subjects()
    with EmbeddedNats() as server:  # stored results fill what the stream's subscription missed
        baseline = plain_stop(server.url, "--log-format", "logfmt", "--ensure-results-stream")
        edge = EdgeProcess(server.url, "--log-format", "logfmt", "--ensure-results-stream").start()
        sock: socket.socket | None = None
        try:
            async def finished_unread_stream() -> socket.socket:
                async with connection(server.url) as nc:
                    unread = await unread_stream(edge.port, "stop-closing-unread")
                    seq = await fill_send_queue(nc, subjects, "stop-closing-unread", edge.port, unread)
                    await publish_result(nc, subjects, "stop-closing-unread", seq, b'{"text":"end"}', final=True)
                    await nc.flush()
                    await asyncio.sleep(0.3)  # the stream ended; Uvicorn's keep-alive timeout (5 s) is far
                    return unread

            sock = anyio.run(finished_unread_stream)
            elapsed = stopped_in(edge)
            log = edge.log()
        finally:
            if sock is not None:
                sock.close()
            edge.close()
    # The stop waits the last frame's FINAL_WRITE_TIMEOUT (0.5 s) on top of what any stop costs; the defect
    # waited Uvicorn's whole graceful timeout (1 s). A fixed 0.9 s bound left that cost 0.4 s: measured 0.62 s
    # alone but up to 0.94 s beside two CPU burners (1 of 3 runs failed). Past a plain stop measured in the
    # same run, the bound is the midpoint of the two waits; with the cut removed (connections.py
    # watch_closing) the stop took 1.24 s under that load and logged "timeout graceful shutdown exceeded".
    midpoint = (FINAL_WRITE_TIMEOUT + GRACEFUL_TIMEOUT) / 2
    assert elapsed - baseline < midpoint, f"stopped in {elapsed:.2f}s, {baseline:.2f}s with nothing open"
    assert loud_lines(log) == [], "\n".join(loud_lines(log))
