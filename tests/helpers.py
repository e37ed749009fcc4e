"""Small helpers every kind of test uses: unique request ids, free ports, a clean environment, waiting.

They live here once; the fixtures in ``conftest.py`` and the harnesses (``edge_harness.py``,
``durable_helpers.py``) build on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple

import anyio
import nats

from streamproc import config
from streamproc.nats.robust import connect as robust_connect


def rid(name: str) -> str:
    """A request id no other test uses, even on a server shared by a module's tests."""
    return f"{name}-{random.randrange(1 << 30):x}"


def free_port() -> int:
    """A local TCP port nothing listens on right now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without STREAMPROC_* variables (they would leak into a subprocess)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(config.ENV_PREFIX)}
    env.update(extra or {})
    return env


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[nats.aio.client.Client]:
    """A nats-py connection, closed on exit: :class:`~streamproc.nats.robust.RobustClient`, nats-py's
    own client whose ``flush()`` after ``subscribe()`` means the server has the SUB (stock nats-py 2.16
    writes its PING ahead of the queued SUB: under load a test's first messages were lost)."""
    nc = await robust_connect(servers=[url])
    try:
        yield nc
    finally:
        await nc.close()


def wait_ready(ready: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float,
               log: Callable[[], str] = str, every: float = 0.05) -> None:
    """Poll ``ready`` while ``proc`` runs; AssertionError with ``log()`` if it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready after {timeout}s:\n{log()}")
        time.sleep(every)


async def answered_with_the_cancel(started: asyncio.Event | None = None, value: Any = None) -> Any:
    """A nats-py round trip whose answer comes in the loop pass of the task's cancel: Python 3.11's
    ``asyncio.wait_for`` (nats-py's requests) then returns the answer and swallows the cancel, and the
    task runs on. Stands in for such a call (``started`` set once it waits); returns ``value``."""
    if started is not None:
        started.set()
    with contextlib.suppress(asyncio.CancelledError):  # as wait_for does on Python 3.11
        await asyncio.sleep(30)
    return value


async def wait_until(check: Callable[[], Awaitable[bool] | bool], timeout: float, what: str,
                     every: float = 0.05) -> None:
    """Poll ``check`` (sync or async) until it is true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await anyio.sleep(every)


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), for memory bounds under attack."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


class TcpSocket(NamedTuple):
    """One row of ``/proc/net/tcp`` (IPv4), the fields the edge tests read."""

    local_port: int
    remote_port: int
    state: str  # hex, e.g. "0A" LISTEN, "01" ESTABLISHED
    rx_queue: int  # for a LISTEN row: connections waiting to be accepted
    inode: str  # "0" while a connection is still in the listen queue


def tcp_sockets() -> list[TcpSocket]:
    rows = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            rows.append(TcpSocket(int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[3],
                                  int(fields[4].split(":")[1], 16), fields[9]))
    return rows



def least_seconds(call: Callable[[], object], tries: int = 3) -> float:
    """The least of ``tries`` timings of ``call()`` in this thread's CPU seconds: a bounded look
    checked for its bound. CPU, not wall-clock time: what the bounds catch (a regex or search run to
    a body's end, 10-17 ms a MiB) is CPU spent, while wall time also counts the preemptions of a
    loaded machine (least of 3 wall timings beside two CPU burners: up to 1.5 ms a MiB for a look
    that takes 0.13-0.5 ms a MiB alone, against a 2 ms bound)."""
    spent = []
    for _ in range(tries):
        started = time.thread_time()
        call()
        spent.append(time.thread_time() - started)
    return min(spent)


def peak_rss(pid: int) -> int:
    """Peak resident set size of a live process, in bytes (``VmHWM``)."""
    kib = status_kib(pid, "VmHWM")
    print(f"peak RSS of {pid}: {kib} kB")  # the figure, for `pytest -s`
    return kib * 1024


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a live process has used so far (``/proc/<pid>/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[str, float]:
    """Every sample of a status server's ``/metrics`` (``streamproc run --http-port``), by name and labels."""
    import urllib.request

    from streamproc.metrics import parse as parse_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return parse_metrics(response.read().decode())


def inflating_pd_legs(prompt: int = 4096, format: str = "sglang-zstd", layers: int = 512) -> tuple[bytes, bytes]:
    """A real sglang-zstd P/D request whose 4,096-token prompt carries 64 MiB of expert rows (512 layers x
    top-8), compressible to a few KB: prefill's one body, and decode's body that carries rows. ``format``
    and ``layers``: the same request in another format (``sglang``: Base64 of the raw rows) or size
    (prefill's rows are ``prompt x layers x 32`` bytes)."""
    import msgspec
    import numpy as np

    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    small = make_truth(0, prompt_len=prompt, output_len=2, num_layers=1, top_k=1)
    rows = np.tile(np.arange(8, dtype="<i4"), small.rows * layers).tobytes()  # 8 distinct experts per layer
    truth = msgspec.structs.replace(small, num_layers=layers, top_k=8, experts=rows, stale="zeros")
    worker = worker_for(format)
    return worker.prefill(truth, stream=False)[0], worker.decode(truth, stream=False)[-1]


async def publish_repeated_joins(publish: Callable[..., Awaitable], request_id: str, prefill: bytes, decode: bytes,
                                 joins: int) -> None:
    """Publish a sglang-zstd P/D request whose prefill leg is ``prefill`` and whose ``joins`` decode
    chunks each carry ``decode`` (every one a join): ``publish`` is a core ``nc.publish`` or a
    JetStream ``js.publish``. The decode CPU budget tests' attacker."""
    from streamproc.core.wire import Subjects, chunk_headers

    subjects = Subjects()
    await publish(subjects.chunk(request_id, "prefill"), prefill,
                  headers=chunk_headers(request_id, "prefill", 0, final=True, format="sglang-zstd"))
    for seq in range(joins):
        await publish(subjects.chunk(request_id, "decode"), decode,
                      headers=chunk_headers(request_id, "decode", seq, final=seq == joins - 1, format="sglang-zstd"))


def expert_pd_legs(prompt: int = 900, output: int = 256) -> tuple[bytes, bytes]:
    """A real sglang-zstd P/D request with DeepSeek-V3-shaped expert rows (61 layers x top-8 of 256,
    random ids) on the final decode body: prefill's one body and decode's; both under 1 MiB at the
    defaults. Its join recompresses the rows (zstd's worker threads, at a level other than 3)."""
    import msgspec

    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    truth = make_truth(7, prompt_len=prompt, output_len=output, num_layers=61, top_k=8, num_experts=256)
    truth = msgspec.structs.replace(truth, return_logprob=False, chunk_sizes=[output])
    worker = worker_for("sglang-zstd")
    return worker.prefill(truth, stream=False)[0], worker.decode(truth, stream=False)[0]


def logprob_pd_legs(prompt: int = 4096, chunks: int = 40) -> tuple[list[bytes], list[bytes]]:
    """A real sglang P/D request that asked for the prompt's logprobs and no expert rows, streamed
    one token per chunk: prefill's bodies and decode's ``chunks`` bodies. Every decode chunk's join
    copies prefill's prompt logprobs in; none decodes sequence data."""
    import msgspec

    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    truth = make_truth(3, prompt_len=prompt, output_len=chunks, num_layers=1, top_k=1)
    truth = msgspec.structs.replace(truth, chunk_sizes=[1] * chunks, return_experts=False)
    worker = worker_for("sglang")
    return worker.prefill(truth, stream=True), worker.decode(truth, stream=True)


# A codec distribution whose constructor raises: provokes "a message whose handling raises" in the
# hostile tests (core and durable), with PYTHONPATH=broken_codec_site(tmp_path) in the processor's env.
BROKEN_CODEC = '''
from streamproc.codec import Codec


class BrokenCodec(Codec):
    """A codec distribution with a bug, to push an exception out of the correlator into the shell's
    catch-all (no well-formed input can; a codec that fails to load is an unknown_format instead:
    tests/test_processor_nats.py). It loads, its join sessions raise, and its error_body raises for
    every text but the shell's (``internal error: ...``, input.py ``failed``): the correlator's
    attempt to end the request with an internal error raises out of it, and the shell's then
    succeeds. Decided by the text, not by counting calls: the start-up check sizes every installed
    codec's error bodies (``wire.max_error_result_size``), which shifted a call count's parity."""

    name = "broken"

    def error_body(self, message, kind):
        if not message.startswith("internal error:"):
            raise RuntimeError("broken codec: every call raises")
        return b'{"error": "%s"}' % message.encode().replace(b'"', b"'")

    def fold(self, bodies):
        raise RuntimeError("broken codec: every call raises")

    def open_session(self):
        raise RuntimeError("broken codec: every call raises")
'''


def codec_site(root: Path, name: str, source: str, cls: str) -> str:
    """A directory holding an installed-looking distribution (module ``<name>_codec``, ``source``) that
    registers its class ``cls`` as the codec ``name`` (the ``streamproc.codecs`` entry point)."""
    (root / f"{name}_codec.py").write_text(textwrap.dedent(source))
    info = root / f"{name}_codec-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-codec\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[streamproc.codecs]\n{name} = {name}_codec:{cls}\n")
    return str(root)


def broken_codec_site(root: Path) -> str:
    """A directory holding an installed-looking distribution that registers the codec ``broken``."""
    return codec_site(root, "broken", BROKEN_CODEC, "BrokenCodec")


async def raw_protocol(url: str, frames: list[bytes]) -> None:
    """Send protocol lines to nats-server over a bare socket, as a publisher that is not nats-py can
    (nats-py encodes subjects and headers as UTF-8 and could not send these bytes); PING/PONG
    confirms the server took them all."""
    from urllib.parse import urlsplit

    where = urlsplit(url)
    stream = await anyio.connect_tcp(where.hostname, where.port)
    async with stream:
        buffered = b""
        while b"\r\n" not in buffered:
            buffered += await stream.receive()
        assert buffered.startswith(b"INFO "), buffered
        await stream.send(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
                          + b"".join(frames) + b"PING\r\n")
        buffered = b""
        with anyio.fail_after(10):
            while b"PONG\r\n" not in buffered:
                buffered += await stream.receive()
        assert b"-ERR" not in buffered, buffered


def raw_hpub(subject: bytes, header_block: bytes, body: bytes) -> bytes:
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (subject, len(header_block), len(header_block) + len(body), header_block, body)


# Header blocks with bytes that are not UTF-8, and what the chunk's request gets. nats-py's own rules
# (``Client._parse_header_lines``, which the processor's fast path copies): a value is decoded with
# "replace" and a non-ASCII key is skipped, so a foreign header with such bytes is ignored; in a
# Streamproc header the replaced value breaks the contract; a forged inline status line that does not
# decode raised in ``Client._process_headers`` and now ends the request as unreadable.
NON_UTF8_HEADERS = [
    (b"NATS/1.0\r\nStreamproc-Seq: 0\r\nStreamproc-Final: true\r\nX-Worker: \xff\xfe\r\n\r\n", None),
    (b"NATS/1.0\r\nStreamproc-Seq: 0\r\nStreamproc-Final: true\r\n\xff\xfe: 1\r\n\r\n", None),
    (b"NATS/1.0 503 \xff\xfe\r\nStreamproc-Seq: 0\r\nStreamproc-Final: true\r\n\r\n", b"unreadable header block"),
    (b"NATS/1.0\r\nStreamproc-Seq: \xff\xfe\r\nStreamproc-Final: true\r\n\r\n", b"Streamproc-Seq"),
]


def drive_join(codec, decode: list[bytes], prefill: list[bytes] | None) -> list:
    """One P/D join session driven as the correlator drives it: the prefill leg settled first (None:
    it timed out), then each decode body asked ``needs_prefill`` and joined, in order. Returns the
    ``(body, verdict)`` of each decode body."""
    session = codec.open_session()
    if prefill is None:
        session.prefill_unavailable("prefill_timeout")
    else:
        session.absorb_prefill(prefill)
    last = len(decode) - 1
    out = []
    for i, body in enumerate(decode):
        session.needs_prefill(body, i == last)
        out.append(session.join(body, i == last))
    return out


def chunks_published_by(nats_url: str, command, *, expect: str) -> tuple[Any, list[str]]:
    """Run ``command()`` (a CLI subprocess; off the loop) while a subscriber counts the chunk subjects
    it publishes; once it ends, wait until as many arrived as its output announces (the first group of
    the regular expression ``expect``). Returns the finished process and the subjects received."""
    import re

    received: list[str] = []

    async def main():
        nc = await nats.connect(nats_url)

        async def count(msg) -> None:
            received.append(msg.subject)

        try:
            await nc.subscribe("streamproc.chunks.>", cb=count)
            await nc.flush()
            proc = await anyio.to_thread.run_sync(command)
            found = re.search(expect, proc.stdout)
            assert found, proc.stdout + proc.stderr
            with anyio.fail_after(10):
                while len(received) < int(found.group(1)):
                    await anyio.sleep(0.01)
            await nc.flush()
            return proc
        finally:
            await nc.close()

    proc = anyio.run(main)
    return proc, received


def drive_stitch(codec, first: list, second: list) -> list[bytes]:
    """What a client is sent of a migrated request: the first attempt's bodies (``upstream_json``
    docs) as they were, then the resumed attempt's through the codec's migration session (sealed
    after the first), as the correlator stitches them; a body the stitch leaves alone as sent."""
    session = codec.open_migration()
    published = [upstream_json(doc) for doc in first]
    session.absorb(published)
    session.seal()
    for i, doc in enumerate(second):
        stitched = session.stitch(upstream_json(doc), i == len(second) - 1)
        published.append(stitched[0] if stitched is not None else upstream_json(doc))
    return published


def upstream_json(doc: object) -> bytes:
    """A body as the engines write it: orjson (SGLang's ORJSONResponse) and pydantic's
    ``model_dump_json`` / ``JSONResponse`` (vLLM) give compact JSON with raw UTF-8."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _key_order(doc: object) -> object:
    if isinstance(doc, dict):
        return [(k, _key_order(v)) for k, v in doc.items()]
    if isinstance(doc, list):
        return [_key_order(v) for v in doc]
    return None


def assert_same_body(got: bytes, want: bytes) -> None:
    """Equal as JSON and in every object's key order (what a client comparing bodies would see)."""
    g, w = json.loads(got), json.loads(want)
    assert g == w
    assert _key_order(g) == _key_order(w)


async def pull_counted_size(js, client, stream: str, subject: str, name: str, over: int) -> int:
    """What nats-server counts against a pull's ``max_bytes`` for the first message on ``subject``,
    delivered by a consumer named ``name``: a pull that asks for two with ``over`` bytes gets the
    first, and the ``409`` for the second says how many bytes the first left (``Nats-Pending-Bytes``)."""
    from nats.js.api import AckPolicy, ConsumerConfig

    await js.add_consumer(stream, ConsumerConfig(name=name, filter_subject=subject, ack_policy=AckPolicy.NONE))
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    try:
        await client.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
                             json.dumps({"batch": 2, "max_bytes": over, "expires": 2_000_000_000}).encode(),
                             reply=inbox)
        first = await sub.next_msg(timeout=5)
        status = await sub.next_msg(timeout=5)
        assert first.reply and (status.headers or {}).get("Status") == "409", status.headers
        return over - int(status.headers["Nats-Pending-Bytes"])
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(stream, name)


@contextlib.asynccontextmanager
async def sampling(sample: Callable[[], Awaitable[None]], every: float) -> AsyncIterator[None]:
    """``sample()`` every ``every`` seconds in a task while the block runs, ended by a flag it looks
    at and awaited on the way out. Not by a cancel: nats-py awaits a request's answer with
    ``asyncio.wait_for``, which on Python 3.11 returns an answer that came in the cancel's loop pass
    and swallows the cancel, and a sampler asking STREAM.INFO ran on into the connection the test
    closed next (ConnectionClosedError in a task: a failed test, 1 of 5 loaded runs)."""
    stop = asyncio.Event()

    async def run() -> None:
        while not stop.is_set():
            await sample()
            await asyncio.sleep(every)

    task = asyncio.ensure_future(run())
    try:
        yield
    finally:
        stop.set()
        await task


# A codec distribution whose exceptions carry huge texts (a plugin echoing a whole body, or a hostile
# one): its fold raises with 10 MB of text (100,000 control characters when the first body holds
# ``ctl``), its migration session's absorb and seal with 10 MB. Everything else is SGLang's, so
# chunks and error bodies are real ones. PYTHONPATH=loud_codec_site(tmp_path) in the child's env.
LOUD_CODEC = '''
from streamproc_sglang.codec import SGLangCodec

HUGE = "x" * 10_000_000
CONTROL = "\\x01" * 100_000


class LoudSession:
    def absorb(self, bodies):
        raise RuntimeError(HUGE)

    def seal(self):
        raise RuntimeError(HUGE)

    def stitch(self, body, final):
        return None

    def progress_bytes(self):
        return 1


class LoudCodec(SGLangCodec):
    name = "loud"

    def fold(self, bodies):
        raise RuntimeError(CONTROL if b"ctl" in bodies[0] else HUGE)

    def open_migration(self):
        return LoudSession()
'''


def loud_codec_site(root: Path) -> str:
    """A directory holding an installed-looking distribution that registers the codec ``loud``."""
    return codec_site(root, "loud", LOUD_CODEC, "LoudCodec")
