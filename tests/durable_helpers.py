"""Shared helpers of the durable-mode tests: settings, processes, and reading what the streams hold."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import nats
import nats.errors
from helpers import clean_env
from hypothesis import HealthCheck, settings
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from streamproc import config
from streamproc.sim.embedded import stop_process
from streamproc.nats.streams import CHUNKS_STREAM, RESULTS_STREAM, partition_consumer_name
from streamproc.testing.laws import LAW_EXAMPLES
from streamproc.wire import ResultInfo, Subjects, chunk_headers, result_from_message

FORMAT = "sglang"

# Hypothesis settings of the durable-mode state machines' properties (outbox, pull credit), pure.
outbox_settings = settings(
    max_examples=max(500, LAW_EXAMPLES),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CI") == "true",
)


def durable_settings(nats_url: str, **overrides: object) -> config.Settings:
    """Durable mode tuned for tests: few partitions, short ack wait and lease, so failover is quick."""
    values: dict[str, object] = {"nats_url": nats_url, "format": FORMAT, "mode": "durable", "partitions": 4,
                                 "ack_wait": 2.0, "lease_ttl": 1.5}
    values.update(overrides)
    return config.load({}, values)


def durable_flags(**overrides: object) -> list[str]:
    """The same as command-line flags of `streamproc run`."""
    values: dict[str, object] = {"format": FORMAT, "mode": "durable", "partitions": 4, "ack_wait": 2.0,
                                 "lease_ttl": 1.5}
    values.update(overrides)
    return [arg for name, value in values.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


async def stored_results(js: JetStreamContext, subjects: Subjects, stream: str = RESULTS_STREAM,
                         timeout: float = 20.0) -> dict[str, list[ResultInfo]]:
    """Every message of the results stream, grouped by request id, in stream order (duplicates kept)."""
    info = await js.stream_info(stream)
    total = info.state.messages
    out: dict[str, list[ResultInfo]] = {}
    if total == 0:
        return out
    sub = await js.subscribe(subjects.all_results, stream=stream, ordered_consumer=True,
                             pending_msgs_limit=-1, pending_bytes_limit=-1)
    try:
        seen = 0
        with anyio.fail_after(timeout):
            while seen < total:
                msg = await sub.next_msg(timeout=timeout)
                seen += 1
                result = result_from_message(subjects, msg.subject, msg.headers, msg.data)
                out.setdefault(result.request_id, []).append(result)
    finally:
        await sub.unsubscribe()
    return out


async def wait_for_finals(js: JetStreamContext, subjects: Subjects, request_ids: list[str],
                          timeout: float) -> dict[str, list[ResultInfo]]:
    """Poll the results stream until every request's final result is stored; returns what it holds."""
    deadline = time.monotonic() + timeout
    missing: list[str] = list(request_ids)
    while True:
        try:
            stored = await stored_results(js, subjects)
        except (nats.errors.Error, TimeoutError) as exc:  # a cluster electing leaders answers nothing for a while
            stored, missing = None, [f"stream unreadable: {exc!r}"]
        if stored is not None:
            missing = [r for r in request_ids if not any(x.final for x in stored.get(r, []))]
            if not missing:
                return stored
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} of {len(request_ids)} requests have no final result after "
                                 f"{timeout}s (first: {missing[:5]})")
        await anyio.sleep(0.5)


async def refuse_new_results(nc: nats.aio.client.Client, js: JetStreamContext, subjects: Subjects) -> None:
    """Make the results stream refuse every new result (10077, retried by the processor): one request
    ("before") is stored first, then the stream is edited to discard ``new`` at its ``max_msgs``."""
    await nc.request(subjects.chunk("before", "agg"), b"{}", headers=chunk_headers("before", "agg", 0, final=True),
                     timeout=5)
    await wait_for_finals(js, subjects, ["before"], 20)
    info = await js.stream_info(RESULTS_STREAM)
    info.config.discard, info.config.max_msgs = DiscardPolicy.NEW, info.state.messages
    await js.update_stream(info.config)


async def accept_results_again(js: JetStreamContext) -> None:
    """Undo :func:`refuse_new_results`: discard ``old``, no message limit."""
    info = await js.stream_info(RESULTS_STREAM)
    info.config.discard, info.config.max_msgs = DiscardPolicy.OLD, -1
    await js.update_stream(info.config)


async def chunk_stream_messages(js: JetStreamContext, stream: str = CHUNKS_STREAM) -> int:
    return (await js.stream_info(stream)).state.messages


async def ack_pending(js: JetStreamContext, partitions: int, stream: str = CHUNKS_STREAM) -> list[int]:
    """Unacknowledged deliveries per partition consumer."""
    out = []
    for n in range(partitions):
        info = await js.consumer_info(stream, partition_consumer_name(n))
        out.append(info.num_ack_pending)
    return out


async def publish_paced(nc: nats.aio.client.Client, messages: list[tuple[str, bytes, dict[str, str]]],
                        window: int = 32, timeout: float = 60.0) -> None:
    """Publish ``messages`` (subject, body, headers) into a stream as fast as it stores them: each
    asks for its PubAck, and at most ``window`` wait for theirs. A plain publish has no
    back-pressure: nats-server queues a stream's inbound messages up to 128 MiB
    (``streamDefaultMaxQueueBytes``) and drops the rest with one warning, "Dropping messages due to
    excessive stream ingest rate". 800 chunks of 1 MB so published lost 2 on a loaded machine, and
    the request behind the gap never completed. Raises if the stream refused any."""
    inbox = nc.new_inbox()
    acked = 0
    refused: list[bytes] = []
    progress = anyio.Event()

    async def on_ack(msg: nats.aio.msg.Msg) -> None:
        nonlocal acked, progress
        acked += 1
        if not msg.data or b'"error"' in msg.data:
            refused.append(msg.data or (msg.headers or {}).get("Status", "").encode())
        progress.set()
        progress = anyio.Event()

    sub = await nc.subscribe(inbox, cb=on_ack, pending_msgs_limit=-1, pending_bytes_limit=-1)
    try:
        with anyio.fail_after(timeout):
            for sent, (subject, body, headers) in enumerate(messages):
                while sent - acked >= window:
                    await progress.wait()
                await nc.publish(subject, body, reply=inbox, headers=headers)
            await nc.flush()
            while acked < len(messages):
                await progress.wait()
    finally:
        await sub.unsubscribe()
    assert not refused, f"{len(refused)} of {len(messages)} messages refused by the stream: {refused[:3]}"


async def connect(url: str) -> nats.aio.client.Client:
    """A driver/verifier connection that outlives server restarts and does not log their errors."""

    async def quiet(exc: Exception) -> None:
        pass

    return await nats.connect(url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)


class Instance:
    """One `streamproc run` subprocess that a test can SIGKILL and start again (a new process each time)."""

    def __init__(self, nats_url: str, flags: list[str], log_path: Path) -> None:
        self.nats_url = nats_url
        self.flags = flags
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0

    def start(self) -> None:
        env = clean_env()
        with open(self.log_path, "ab") as log:
            log.write(f"----- start {self.starts}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamproc.cli", "run", "--nats-url", self.nats_url, *self.flags],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def started(self, timeout: float = 30.0) -> None:
        """Wait for this process's `event=started` line."""
        marker = f"----- start {self.starts - 1}\n"
        deadline = time.monotonic() + timeout
        while "event=started" not in self.log().rsplit(marker, 1)[-1]:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"streamproc run exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"streamproc run not started after {timeout}s:\n{self.log()[-4000:]}")
            await anyio.sleep(0.05)

    def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.kills += 1

    def stop(self, timeout: float = 15.0) -> int | None:
        if not self.running:
            return None if self.proc is None else self.proc.returncode
        assert self.proc is not None
        return stop_process(self.proc, timeout)


async def dead_owner_takes(client, count: int) -> list:
    """A dead owner: takes ``count`` chunks from partition 0's consumer (within 5 s) and acknowledges none.

    Fetched until ``count`` came: nats-py's ``fetch(n)`` asks ``no_wait`` first and returns what the
    consumer had at once, and a chunk published without a PubAck wait (core publish) may be stored just
    after that ask (1 of 2 came under load: test_durable_lookups_review)."""
    sub = await client.jetstream().pull_subscribe_bind(partition_consumer_name(0), stream=CHUNKS_STREAM)
    taken: list = []
    deadline = time.monotonic() + 5
    try:
        while len(taken) < count and (left := deadline - time.monotonic()) > 0:
            try:
                taken += await sub.fetch(count - len(taken), timeout=left)
            except nats.errors.TimeoutError:
                break
        return taken
    finally:
        await sub.unsubscribe()


SLOW_LOOKUPS = '''\
# Written by tests/durable_helpers.py: a results stream slow to answer a recovery lookup, in the
# processor subprocess (its chunk lookups, Recovery.adopt called with current=, sleep first).
import anyio
from streamproc.nats.durable import recovery as durable_recovery

_adopt = durable_recovery.Recovery.adopt
_slowed = [0, 0]  # in the sleep now, the most at once (written to {peak!r})


async def _slow(self, rid, *args, **kwargs):
    if kwargs.get("current") is not None and rid.startswith({only!r}):
        _slowed[0] += 1
        if _slowed[0] > _slowed[1]:
            _slowed[1] = _slowed[0]
            with open({peak!r}, "w") as out:
                out.write(str(_slowed[1]))
        try:
            await anyio.sleep({seconds!r})
        finally:
            _slowed[0] -= 1
    return await _adopt(self, rid, *args, **kwargs)


durable_recovery.Recovery.adopt = _slow
'''


def lookups_peak(directory: Path) -> int:
    """The most lookups a ``slow_lookups_env`` subprocess had in its sleep at once (a count, not a time)."""
    path = directory / "lookups_peak"
    return int(path.read_text()) if path.exists() else 0


def slow_lookups_env(directory: Path, seconds: float, only: str = "") -> dict[str, str]:
    """The environment of a ``streamproc run`` subprocess whose recovery lookups of chunks take
    ``seconds`` longer (a ``sitecustomize`` in ``directory``, first on its PYTHONPATH): what an
    in-process test does with monkeypatch, for a test that reads the subprocess's memory. ``only``:
    just those of request ids starting with it (the others are a same-run baseline). The most slowed
    lookups in flight at once is written to ``directory / "lookups_peak"`` (``lookups_peak``)."""
    (directory / "sitecustomize.py").write_text(
        SLOW_LOOKUPS.format(seconds=seconds, only=only, peak=str(directory / "lookups_peak")))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


class Heir:
    """What :func:`vllm_heir` gives its test: the processor, a client connection and its JetStream
    context, and (once the block is left) the processor's log."""

    def __init__(self, proc: subprocess.Popen, nc: nats.aio.client.Client) -> None:
        self.proc = proc
        self.nc = nc
        self.js = nc.jetstream()
        self.log = ""


@contextlib.asynccontextmanager
async def vllm_heir(*flags: str):
    """An embedded nats-server and a one-partition vLLM ``streamproc run --mode durable`` (``flags``
    added) to take requests over, with a client connection for the test (the take-over read tests'
    setup). On a clean exit the processor must still run; its log is then in ``heir.log``."""
    from conftest import processor_subprocess
    from streamproc.sim.embedded import EmbeddedNats

    with EmbeddedNats() as server:
        with processor_subprocess(server.url, *durable_flags(partitions=1, format="vllm"), *flags) as (proc, log):
            nc = await connect(server.url)
            heir = Heir(proc, nc)
            try:
                yield heir
            finally:
                await nc.close()
            assert proc.poll() is None, "the processor exited during the test"
            heir.log = log.read_text(errors="replace")
