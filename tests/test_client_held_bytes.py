"""A forger on a results subject against a client reader's byte bound: what a held result costs is
more than its body. Bodies were all the bound counted, so results with empty bodies and long header
values (a traceparent, an error text: any publisher picks their length) grew a reader without end and
never ended its stream. Real nats-server; the reader runs in a subprocess whose peak RSS (VmHWM,
/proc) is read against a baseline run of the same script on a single result."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
from helpers import connection

from streamproc import Subjects
from streamproc.core.wire import ERROR, SEQ, TRACEPARENT

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
BOUND = 4 << 20  # the reader's max_buffered_bytes (max_payload, 1 MiB, is its floor)

READER = """
import json, sys, anyio, streamproc
from streamproc import Subjects, follow
async def main():
    url, rid, bound, published = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    nc = await streamproc.connect(url)
    outcome = "no error within 5 s"
    async with follow(nc, Subjects(), rid, timeout=60, max_buffered_bytes=bound) as results:
        print("subscribed", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # the forger has published everything
        # and the callback has taken all of it: a fixed 0.5 s was not enough for 100,000 results on a
        # loaded machine (61,203 read when the overrun ended the loop and closed the connection)
        with anyio.move_on_after(30):
            while nc.stats["in_msgs"] < published:
                await anyio.sleep(0.05)
        with anyio.move_on_after(5):
            try:
                async for _ in results:
                    pass
                outcome = "ended normally"
            except Exception as exc:
                outcome = type(exc).__name__
    received = nc.stats["in_msgs"]
    await nc.close()
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"outcome": outcome, "received": received, "vmhwm_kib": hwm}), flush=True)
anyio.run(main)
"""


async def read_forged(nats_url: str, rid: str, headers: list[dict[str, str]]) -> dict:
    """Run the reader on ``rid``, publish one empty-bodied result per header set, let it read."""
    proc = subprocess.Popen([sys.executable, "-c", READER, nats_url, rid, str(BOUND), str(len(headers))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert await anyio.to_thread.run_sync(proc.stdout.readline) == "subscribed\n"
        async with connection(nats_url) as forger:
            for h in headers:
                await forger.publish(SUBJECTS.result(rid), b"", headers=h)
            await forger.flush()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert await anyio.to_thread.run_sync(proc.wait) == 0
        return json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


LONG = "t" * 50_000
CASES = {
    # in seq order, never final, to a loop that has not read yet: 2,000 x 50 kB of traceparent
    "in-order-long-traceparent": [{SEQ: str(seq), TRACEPARENT: LONG} for seq in range(2000)],
    # behind a seq 0 that never comes (under SeqOrder's 4,096): 2,000 x 50 kB of error text
    "behind-a-gap-long-error": [{SEQ: str(seq), ERROR: LONG} for seq in range(1, 2001)],
    # in order, nothing but a seq: 100,000 results of no bytes at all
    "in-order-empty": [{SEQ: str(seq)} for seq in range(100_000)],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_results_with_empty_bodies_are_charged_to_the_readers_byte_bound(nats_url, case):
    baseline = await read_forged(nats_url, "one", [{SEQ: "0"}])
    got = await read_forged(nats_url, case, CASES[case])
    grown = (got["vmhwm_kib"] - baseline["vmhwm_kib"]) << 10
    print(f"{case}: {got}; baseline VmHWM {baseline['vmhwm_kib']} KiB")
    assert got["received"] == len(CASES[case]), got
    assert got["outcome"] == "ResultsOverrun", f"{case}: {got['outcome']}, the reader grew by {grown >> 20} MiB"
    assert grown < 6 * BOUND, f"{case}: the reader grew by {grown >> 20} MiB for a {BOUND >> 20} MiB bound"


@pytest.mark.parametrize("rid", ["a", "x" * 256], ids=["shortest-id", "longest-id"])
async def test_a_held_result_costs_no_more_than_nats_server_counts_it_against_a_pulls_max_bytes(client, nats_url,
                                                                                              rid):
    """A replay's pull asks for ``max_bytes`` = the room the reader's bound has left: if a result cost
    the reader more than nats-server counts for it, a full pull would pass the bound and end a
    legitimate replay with ``ResultsOverrun``. The smallest result (no body, only its seq; a
    one-letter consumer name) against ``RESULT_HELD_OVERHEAD``."""
    from helpers import pull_counted_size

    from streamproc.core.wire import result_from_message
    from streamproc.nats.streams import ensure_results_stream, find_stream

    js = client.jetstream()
    await ensure_results_stream(js, SUBJECTS)
    for seq in range(2):
        await js.publish(SUBJECTS.result(rid), b"", headers={SEQ: str(seq)})
    stream = await find_stream(js, SUBJECTS.result(rid))
    held = result_from_message(SUBJECTS, SUBJECTS.result(rid), {SEQ: "0"}, b"").held_bytes
    counted = await pull_counted_size(js, client, stream, SUBJECTS.result(rid), "c", 2 * held - 1)
    assert held <= counted, f"a result held costs {held} bytes, nats-server counts {counted}"


def text_bytes(text: str | None) -> int:
    """Bytes CPython keeps the characters of ``text`` in (PEP 393: 1, 2 or 4 a character by its widest)."""
    if not text:
        return 0
    widest = max(text)
    return len(text) * (1 if widest < "\u0100" else 2 if widest < "\U00010000" else 4)


NOT_ASCII = {  # header value bytes on the wire
    "astral": "\U0001F600".encode() + b"a" * 3000,  # 4 bytes a character once a str
    "bmp": "\u2713".encode() + b"a" * 3000,  # 2 bytes a character
    "latin-1": "caf\u00e9".encode() * 700,
    "invalid-utf8": b"\xff" + b"a" * 3000,  # U+FFFD once decoded with "replace": 2 bytes a character
    "only-astral": "\U0001F600".encode() * 700,
}


@pytest.mark.parametrize("name", [ERROR, TRACEPARENT])
@pytest.mark.parametrize("value", list(NOT_ASCII))
async def test_a_header_value_past_ascii_costs_what_it_holds_within_what_nats_server_counts(
        client, nats_url, name, value):
    """Both invariants of the byte bound for a header value that is not ASCII: the charge covers the
    bytes the kept value's characters take in memory (one character past Latin-1 made every character
    2 or 4 bytes while ``len`` was charged: 4 x the bound held), and stays at most what nats-server
    counts for the stored result against a pull's ``max_bytes`` (so charging 4 x ``len`` is no fix).
    The result is read both ways a reader reads one: nats-py's header dict and the raw block."""
    from helpers import pull_counted_size

    from streamproc.core.defaults import RESULT_HELD_OVERHEAD
    from streamproc.core.wire import result_from_message
    from streamproc.nats.fast_client import parse_header_block, result_from_block
    from streamproc.nats.streams import ensure_results_stream, find_stream

    rid = f"text{len(value)}{name[-3:]}"
    subject = SUBJECTS.result(rid)
    js = client.jetstream()
    await ensure_results_stream(js, SUBJECTS)
    block = b"NATS/1.0\r\n%s: 0\r\n%s: %s\r\n\r\n" % (SEQ.encode(), name.encode(), NOT_ASCII[value])
    for _ in range(2):  # nats-py encodes str header values as UTF-8: the raw block goes as HPUB by hand
        command = b"HPUB %s %d %d\r\n%s\r\n" % (subject.encode(), len(block), len(block), block)
        await client._send_command(command)
    await client.flush()
    stream = await find_stream(js, subject)
    # one message fits, two do not (the stored message is its block, subject and a reply of ~60 bytes)
    counted = await pull_counted_size(js, client, stream, subject, "c", len(block) + len(subject) + 200)
    assert counted >= len(block) + len(subject)
    for result in (result_from_message(SUBJECTS, subject, parse_header_block(block), b""),
                   result_from_block(SUBJECTS, subject, block, b"")):
        held = result.held_bytes
        kept = text_bytes(result.error) + text_bytes(result.traceparent)
        assert held - len(rid) - RESULT_HELD_OVERHEAD >= kept, f"charged {held}, its values hold {kept} bytes"
        assert held <= counted, f"a result held costs {held} bytes, nats-server counts {counted}"
