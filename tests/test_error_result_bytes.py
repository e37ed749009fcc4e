"""Error results against a real nats-server with a lowered ``max_payload`` and ``streamproc run`` (core
and durable mode), under a hostile worker that chooses the text an error result echoes.

An error result is never replaced: one the server refuses leaves its client waiting out its timeout
(durable mode: its chunk NAKed until ``--max-deliver``). So the processor says, at start-up, the
``max_payload`` it needs for every error result (``wire.max_error_result_size``) and refuses a server
below it; at exactly that ``max_payload`` the worst error results a worker can cause are delivered.
"""

from __future__ import annotations

import subprocess

import anyio
import pytest
from conftest import CLI, processor_subprocess
from durable_helpers import connect, durable_flags, wait_for_finals
from helpers import clean_env, raw_hpub, raw_protocol

from streamproc.catalog import Catalog, codec_names
from streamproc.core.codec import ErrorKind
from streamproc.core.wire import MAX_REQUEST_ID_LEN, MAX_TRACEPARENT_LEN, Subjects, max_error_result_size
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
FORMAT = "sglang"


def needed() -> int:
    catalog = Catalog()
    return max_error_result_size([catalog(n).error_body for n in codec_names()], list(ErrorKind))


def mode_flags(mode: str) -> list[str]:
    if mode == "durable":
        return durable_flags(partitions=1, format=FORMAT)
    return ["--mode", "core", "--format", FORMAT]


@pytest.mark.parametrize("mode", ["core", "durable"])
def test_a_server_whose_max_payload_cannot_take_every_error_result_is_refused_at_start_up(mode):
    """At ``max_payload: 1024`` the processor started and served; an error result of ~1.5 KB (a 256
    character request id, a 512-character traceparent, a cut text) was then refused by the server,
    never replaced. It refuses to start now, naming both figures."""
    small = 1024
    assert small < needed()
    with EmbeddedNats(config=f"max_payload: {small}", jetstream=mode == "durable") as server:
        done = subprocess.run([*CLI, "run", "--nats-url", server.url, *mode_flags(mode)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                              env=clean_env(None))
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "event=started" not in out, out[-2000:]
    assert f"max_payload is {small} bytes" in out and f"at least {needed()}" in out, out[-2000:]


# Hostile texts a worker puts in an error result: each character a non-printable astral one, shown as
# a 10-character escape ('\U000f0000') whose backslash doubles as JSON.
ASTRAL = "\U000f0000" * 300


def hostile_chunks(tag: str) -> tuple[list[bytes], list[str]]:
    rids = [f"{tag}{k}".ljust(MAX_REQUEST_ID_LEN, "e") for k in range(3)]
    head = (b"NATS/1.0\r\nStreamproc-Final: true\r\ntraceparent: " + b"t" * MAX_TRACEPARENT_LEN + b"\r\n")
    astral = ASTRAL.encode()
    frames = [
        raw_hpub(f"{SUBJECTS.chunk(rids[0], 'agg')[:-3]}".encode() + astral[:1200],  # an unknown role
                 head + b"Streamproc-Seq: 0\r\n\r\n", b"{}"),
        raw_hpub(SUBJECTS.chunk(rids[1], "decode").encode(),  # an unknown format (agg passes through)
                 head + b"Streamproc-Seq: 0\r\nStreamproc-Format: " + astral[:600] + b"\r\n\r\n", b"{}"),
        raw_hpub(SUBJECTS.chunk(rids[2], "agg").encode(),  # a seq that is no number
                 head + b"Streamproc-Seq: " + astral[:600] + b"\r\n\r\n", b"{}"),
    ]
    return frames, rids


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_at_the_max_payload_it_needs_every_hostile_error_result_is_delivered(mode):
    limit = needed()
    with EmbeddedNats(config=f"max_payload: {limit}", jetstream=mode == "durable") as server:
        with processor_subprocess(server.url, *mode_flags(mode)) as (_proc, log_path):
            nc = await connect(server.url)
            try:
                assert nc.max_payload == limit
                frames, rids = hostile_chunks(mode)
                got: dict[str, list] = {r: [] for r in rids}

                async def keep(msg) -> None:
                    got[SUBJECTS.request_id_of_result(msg.subject)].append(msg)

                sub = await nc.subscribe(SUBJECTS.result("*"), cb=keep)
                await nc.flush()
                await raw_protocol(server.url, frames)
                with anyio.move_on_after(10):
                    while not all(got.values()):
                        await anyio.sleep(0.1)
                await sub.unsubscribe()
                log = log_path.read_text(errors="replace")
                for r, msgs in got.items():
                    assert msgs, f"no error result for {r[:12]}... ({mode}): {log[-1500:]}"
                    [msg] = msgs
                    kind = msg.headers.get("Streamproc-Error")
                    assert kind in ("invalid_chunk", "unknown_format"), msg.headers
                    size = len(msg.data) + sum(len(k) + len(v) + 4 for k, v in msg.headers.items()) + 12
                    assert size <= limit, (size, limit)
                if mode == "durable":
                    stored = await wait_for_finals(nc.jetstream(), SUBJECTS, rids, 10)
                    assert all(len(stored[r]) == 1 and stored[r][0].error for r in rids), stored
            finally:
                await nc.close()


def test_a_codec_whose_error_body_raises_is_not_counted_and_does_not_stop_the_bound():
    """A broken codec plugin (its ``error_body`` raises) made ``max_error_result_size`` raise, and with
    it ``streamproc run``'s start-up check: one bad plugin stopped every format from being served
    (tests/test_durable_hostile.py's broken-codec case). It builds no error result, so it is skipped."""

    def broken(text: str, kind: object) -> bytes:
        raise RuntimeError("broken codec: every call raises")

    catalog = Catalog()
    good = [catalog(n).error_body for n in codec_names()]
    assert max_error_result_size([broken, *good], list(ErrorKind)) == needed()
    empty = max_error_result_size([lambda text, kind: b""], list(ErrorKind))  # the header block alone
    assert max_error_result_size([broken], list(ErrorKind)) == empty
