"""Attacks on the processor's fast paths (FastParser, FastClient, the fused passthrough path, dispatch in
the read loop) by a hostile worker writing raw protocol bytes to a real nats-server, beside legitimate
traffic: the processor stays connected, every legitimate request is answered in full, the victim's
fate is logged, and peak RSS (``VmHWM``) stays under a stated bound.

(tests/test_hostile.py attacks the budgets and the codecs; tests/test_fast_parser.py and
tests/test_fast_client.py pin the fast paths against stock nats-py.)
"""

from __future__ import annotations

import anyio
import nats
import pytest
from conftest import processor_subprocess
from helpers import cpu_seconds, peak_rss, raw_hpub, raw_protocol, wait_until

from streamproc.core.wire import ERROR, FINAL, MAX_HEADER_LINES, SEQ, Subjects, chunk_headers
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
MiB = 1 << 20


async def answered(url: str, rids: list[str], publish) -> dict[str, list[tuple[bytes, dict[str, str]]]]:
    """Subscribe to every result, run ``publish(nc)``, then wait until each of ``rids`` has its final result."""
    nc = await nats.connect(url)
    got: dict[str, list[tuple[bytes, dict[str, str]]]] = {}

    async def on_result(msg) -> None:
        got.setdefault(SUBJECTS.request_id_of_result(msg.subject), []).append((msg.data, msg.headers or {}))

    try:
        await nc.subscribe(SUBJECTS.all_results, cb=on_result, pending_msgs_limit=1_000_000)
        await nc.flush()
        await publish(nc)
        await nc.flush()
        with anyio.move_on_after(30):
            while not all(any(h.get(FINAL) == "true" for _, h in got.get(r, [])) for r in rids):
                await anyio.sleep(0.05)
    finally:
        await nc.close()
    return got


def assert_victims_refused_beside_ok(got, text: str, proc, victims: dict[str, str], needles: tuple[bytes, ...]) -> None:
    """Request ``ok`` (seqs 0-2) was answered whole beside the victims; each victim's last result is
    its error kind with a short body holding every needle; no log line past 2 KiB; the processor
    stayed connected and alive, under 150 MiB."""
    assert [b for b, _ in got.get("ok", [])] == [b"0", b"1", b"2"], text[-3000:]
    for rid, kind in victims.items():
        [(body, headers)] = got.get(rid, [(b"", {})])[-1:]
        assert headers.get(ERROR) == kind, (rid, headers, text[-3000:])
        assert len(body) < 1024 and all(n in body for n in needles), (rid, body[:300])
    assert max(len(line) for line in text.splitlines()) < 2048
    assert "event=disconnected" not in text
    assert proc.poll() is None
    assert peak_rss(proc.pid) < 150 * MiB


async def test_a_chunk_at_max_payload_whose_result_block_is_larger_never_costs_the_connection(
        nats_url, streamproc_run):
    """nats-server counts a message's header block and body against ``max_payload`` and closes a
    connection that publishes more ("Maximum Payload Violation"); nats-py checks only the body. A
    worker may send a chunk of exactly ``max_payload`` with a short header block (``Streamproc-Seq:0``,
    no Nats-Msg-Id): its passthrough result carries the same body under a longer block, and the
    processor's connection was closed, its pending results lost, the next chunks missed while it
    reconnected. Now the client refuses that publish (``MaxPayloadError``), the victim's result is
    logged as ``publish_failed``, and every other request is answered on the same connection: on the
    fused path in the read loop (unary and streamed) and on the general path (a format header).
    The victim gets an ``internal`` error result in its place (it got nothing before: its client
    waited for its timeout)."""
    victims = {
        "big-unary": b"NATS/1.0\r\nStreamproc-Seq:0\r\nStreamproc-Final:true\r\n\r\n",
        "big-stream": b"NATS/1.0\r\nStreamproc-Seq:0\r\n\r\n",
        "big-general": b"NATS/1.0\r\nStreamproc-Seq:0\r\nStreamproc-Format:sglang\r\nStreamproc-Final:true\r\n\r\n",
    }
    legit = [f"ok-{i}" for i in range(60)]

    async def publish(nc) -> None:
        limit = nc.max_payload
        for i, rid in enumerate(legit):
            if i % 20 == 0:  # a victim, then 20 legitimate requests
                victim, block = list(victims.items())[i // 20]
                await raw_protocol(nats_url, [raw_hpub(SUBJECTS.chunk(victim, "agg").encode(), block,
                                                       b"x" * (limit - len(block)))])
            for seq in range(3):
                await nc.publish(SUBJECTS.chunk(rid, "agg"), f"{rid}:{seq}".encode(),
                                 headers=chunk_headers(rid, "agg", seq, final=seq == 2))

    with streamproc_run("--mode", "core") as (proc, log_path):
        got = await answered(nats_url, legit + list(victims), publish)
        text = log_path.read_text(errors="replace")
        missing = [r for r in legit if [b for b, _ in got.get(r, [])] != [f"{r}:{s}".encode() for s in range(3)]]
        assert not missing, (missing[:5], text[-3000:])
        assert all(ERROR not in h for r in legit for _, h in got[r])
        assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
        await wait_until(lambda: log_path.read_text().count("event=publish_failed") == 2, 10,
                         "the 1st and 2nd refused results logged (then at powers of two)")
        text = log_path.read_text()
        assert "request_id=big-unary" in text and "MaxPayloadError" in text, text[-3000:]
        for victim in victims:  # nothing oversized was sent: an error result in its place
            [(body, headers)] = got.get(victim, [(b"", {})])
            assert (headers.get(ERROR), headers.get(SEQ), headers.get(FINAL)) == ("internal", "0", "true"), headers
            assert b"larger than the NATS server's max_payload" in body and len(body) < 2048, body[:300]
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_an_error_result_that_is_itself_too_large_is_given_up_not_replaced_again():
    """On a server whose ``max_payload`` is smaller than the error result that replaces a too-large
    result, that error cannot be published either. Replacing it in turn made another error result of
    the same size, and so on: the processor spun at full CPU on one hostile chunk, forever. Now the
    replacement is tried once (two ``publish_failed``: the result, its error), and requests whose
    results fit are still answered. ``streamproc run`` refuses such a server at start-up (57787ed:
    below the largest error result), so here the server is restarted under the running processor
    with a 256-byte ``max_payload`` (an operator's config change): the client takes it from the new
    INFO on reconnect, and the start-up check never sees it. (Core mode: durable mode cannot run on
    such a server, its JetStream API requests do not fit.)"""
    legit = [f"ok-{i}" for i in range(10)]
    with EmbeddedNats(jetstream=False) as server:
        with processor_subprocess(server.url, "--mode", "core") as (proc, log_path):
            server.terminate()
            server.config = "max_payload: 256"
            server.start()
            await wait_until(lambda: "event=reconnected" in log_path.read_text(), 20, "the processor's reconnect")

            async def publish(nc) -> None:
                assert nc.max_payload == 256
                block = b"NATS/1.0\r\nStreamproc-Seq:0\r\nStreamproc-Final:true\r\n\r\n"
                await raw_protocol(server.url, [raw_hpub(SUBJECTS.chunk("big", "agg").encode(), block,
                                                         b"x" * (nc.max_payload - len(block)))])
                for rid in legit:
                    await nc.publish(SUBJECTS.chunk(rid, "agg"), rid.encode(),
                                     headers=chunk_headers(rid, "agg", 0, final=True))

            got = await answered(server.url, legit, publish)
            assert [r for r in legit if [b for b, _ in got.get(r, [])] != [r.encode()]] == []
            await wait_until(lambda: log_path.read_text().count("event=publish_failed") >= 2, 10,
                             "the result and its error result refused")
            await anyio.sleep(1.0)  # a loop of replacements would log at 4, 8, 16... failures by now
            text = log_path.read_text()
            assert text.count("event=publish_failed") == 2 and "failures_total=2" in text, text[-2000:]
            assert "big" not in got  # nothing of it fits: it is logged, not sent
            assert "event=max_payload_below_error_results max_payload=256" in text, text[-2000:]
            assert proc.poll() is None


def hpub_with_reply(subject: bytes, reply: bytes, block: bytes, body: bytes) -> bytes:
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject, reply, len(block), len(block) + len(body), block, body)


FINAL_0 = b"Streamproc-Seq: 0\r\nStreamproc-Final: true\r\n"
JUNK_LINES = [b"X-Junk-%d: %s\r\n" % (i, b"v" * 12) for i in range(2600)]
JUNK = b"".join(JUNK_LINES)  # ~60 KiB of headers

# Header blocks a raw-socket worker can send, the request id each goes to, and what it gets:
# (result body, its Streamproc-Seq, Streamproc-Error or None, its traceparent or None).
ODD_BLOCKS = {
    # Status lines go to nats-py's own header parser (FastClient declines them); their headers still count.
    "st503": (b"NATS/1.0 503\r\n" + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    "st999": (b"NATS/1.0 999 Whatever It Says\r\n" + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    "stabc": (b"NATS/1.0 abc\r\n" + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    "st100": (b"NATS/1.0 100 Idle Heartbeat\r\n" + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    # Names that differ from Streamproc-Seq only in case are other headers, in a block of exactly
    # MAX_HEADER_LINES lines (LF bytes): read as nats-py reads it.
    "at-bound": (b"NATS/1.0\r\nstreamproc-seq: 7\r\n" + b"".join(JUNK_LINES[:MAX_HEADER_LINES - 6]) + b"STREAMPROC-SEQ: 9\r\n"
                 + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    # One line more, or a 60 KiB block of 2,600 headers, with or without a status line: not parsed,
    # an unreadable header block (not what stock nats-py does: it parses every line).
    "over-bound": (b"NATS/1.0\r\nstreamproc-seq: 7\r\n" + b"".join(JUNK_LINES[:MAX_HEADER_LINES - 5]) + b"STREAMPROC-SEQ: 9\r\n"
                   + FINAL_0 + b"\r\n", (None, "0", "invalid_chunk", None)),
    "big-hdr": (b"NATS/1.0\r\n" + JUNK + FINAL_0 + b"\r\n", (None, "0", "invalid_chunk", None)),
    "st100-big": (b"NATS/1.0 100 Idle Heartbeat\r\n" + JUNK + FINAL_0 + b"\r\n", (None, "0", "invalid_chunk", None)),
    # Duplicate exact names: the last one counts (nats-py's dict), on both paths.
    "dup": (b"NATS/1.0\r\nStreamproc-Seq: 5\r\n" + FINAL_0 + b"\r\n", (b"{}", "0", None, None)),
    # NUL and a lone LF in a traceparent: not plain, so the general path encodes it (LF -> space).
    "tp-nul": (b"NATS/1.0\r\n" + FINAL_0 + b"traceparent: 00-\x00ab\r\n\r\n", (b"{}", "0", None, "00-\x00ab")),
    # 0x80-0xff: not ASCII, so ignored (wire._traceparent: a W3C one is ASCII; a non-ASCII one took up to
    # 4 bytes a character in every result's header block, past what the start-up max_payload check counts).
    "tp-bytes": (b"NATS/1.0\r\n" + FINAL_0 + b"traceparent: 00-\x00a\xff\x80b\r\n\r\n", (b"{}", "0", None, None)),
    "tp-lf": (b"NATS/1.0\r\n" + FINAL_0 + b"traceparent: 00-a\nb\r\n\r\n", (b"{}", "0", None, "00-a b")),
    # A lone CR inside Streamproc-Seq is part of the value: not digits.
    "seq-cr": (b"NATS/1.0\r\nStreamproc-Seq: 0\r1\r\nStreamproc-Final: true\r\n\r\n", (None, "0", "invalid_chunk", None)),
    # A NUL in a header name is part of the name: Streamproc-Seq is missing.
    "name-nul": (b"NATS/1.0\r\nStreamproc-Seq\x00: 0\r\nStreamproc-Final: true\r\n\r\n",
                 (None, "0", "invalid_chunk", None)),
}


async def test_odd_header_blocks_and_worker_chosen_reply_subjects_through_the_fast_read_path(nats_url, streamproc_run):
    """Chunks a raw-socket worker can send (status lines with odd codes, a block of as many lines
    as a message may carry, names that differ in case, duplicates, NUL and 0x80-0xff bytes, lone CR
    or LF in values, an empty body) are each read as nats-py reads them (blocks of more lines: as
    an unreadable header block, unparsed) and answered once as their headers say, on
    their own result subject: a reply subject the worker sets (another request's result subject, an
    inbox) is never published to. Legitimate traffic beside them is answered in full, the connection
    never drops."""
    assert [ODD_BLOCKS[rid][0].count(b"\n") for rid in ("at-bound", "over-bound")] == \
        [MAX_HEADER_LINES, MAX_HEADER_LINES + 1]
    legit = [f"ok-{i}" for i in range(100)]
    frames = [hpub_with_reply(SUBJECTS.chunk(rid, "agg").encode(), b"hijack.%s" % rid.encode(), block, b"{}")
              for rid, (block, _) in ODD_BLOCKS.items()]
    frames += [hpub_with_reply(b"streamproc.chunks.empty.agg", b"streamproc.results.ok-0",
                               b"NATS/1.0\r\n" + FINAL_0 + b"\r\n", b""),
               b"PUB streamproc.chunks.plain.agg hijack.plain 2\r\n{}\r\n"]  # no headers: no Streamproc-Seq
    hijacked: list[str] = []

    async def publish(nc) -> None:
        async def on_hijack(msg) -> None:
            hijacked.append(msg.subject)

        await nc.subscribe("hijack.>", cb=on_hijack)
        await nc.flush()
        for i, rid in enumerate(legit):
            if i == 50:
                await raw_protocol(nats_url, frames)
            for seq in range(3):
                await nc.publish(SUBJECTS.chunk(rid, "agg"), f"{rid}:{seq}".encode(),
                                 headers=chunk_headers(rid, "agg", seq, final=seq == 2))

    with streamproc_run("--mode", "core") as (proc, log_path):
        got = await answered(nats_url, legit + list(ODD_BLOCKS) + ["empty", "plain"], publish)
        text = log_path.read_text(errors="replace")
        assert [b for b, _ in got["ok-0"]] == [b"ok-0:0", b"ok-0:1", b"ok-0:2"]  # nothing forged on its subject
        missing = [r for r in legit if [b for b, _ in got.get(r, [])] != [f"{r}:{s}".encode() for s in range(3)]]
        assert not missing, (missing[:5], text[-3000:])
        for rid, (_, (body, seq, error, traceparent)) in ODD_BLOCKS.items():
            [(data, headers)] = got[rid]
            assert (headers.get("Streamproc-Seq"), headers.get(ERROR), headers.get("traceparent")) == \
                (seq, error, traceparent), (rid, headers, data)
            assert body is None or data == body, (rid, data)
        [(data, headers)] = got["empty"]
        assert data == b"" and headers.get(ERROR) is None
        [(data, headers)] = got["plain"]
        assert headers.get(ERROR) == "invalid_chunk" and b"Streamproc-Seq" in data
        await anyio.sleep(0.5)
        assert hijacked == []
        assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_a_header_value_as_long_as_max_payload_is_not_echoed_into_the_error_result_or_the_log(
        nats_url, streamproc_run):
    """A contract error names the offending header value. A worker chooses its length (up to
    ``max_payload``, over a raw socket): echoed whole, ``Streamproc-Final: xxx…`` (1 MiB) made an error
    result body over ``max_payload`` that could not be published (the victim got nothing) and a
    1 MiB log line per chunk (the per-event limit of 20 lines per 10 s then let one worker write
    2 MB/s of log). The value is shown cut to its start, with its length: each victim gets its
    ``invalid_chunk`` result and every log line stays short. The same for ``Streamproc-Format``
    (``unknown_format``, or ``invalid_chunk`` when it differs from its request's)."""
    values = {"Seq": b"0", "Final": b"true", "Attempt": b"0"}

    async def publish(nc) -> None:
        frames = []
        for name in values:  # one header's value replaced by a run of x filling max_payload
            lines = [b"Streamproc-%s: %s\r\n" % (k.encode(), b"{x}" if k == name else v) for k, v in values.items()]
            block = b"NATS/1.0\r\n" + b"".join(lines) + b"\r\n"
            block = block.replace(b"{x}", b"x" * (nc.max_payload - 2 - len(block) + 3))
            assert len(block) + 2 == nc.max_payload
            frames.append(raw_hpub(SUBJECTS.chunk(f"long-{name}", "agg").encode(), block, b"{}"))
        # The format a chunk names, unknown (seq 0 of a streamed request) or other than its request's
        # (seq 1): before, both repeated it whole in the error result.
        head = b"NATS/1.0\r\nStreamproc-Seq: %d\r\nStreamproc-Final: false\r\nStreamproc-Format: "
        long_format = b"x" * (nc.max_payload // 2)
        frames.append(raw_hpub(SUBJECTS.chunk("long-Format", "agg").encode(),
                               head % 0 + long_format + b"\r\n\r\n", b"{}"))
        frames.append(raw_hpub(SUBJECTS.chunk("other-Format", "agg").encode(),
                               head % 0 + b"sglang\r\n\r\n", b"{}"))
        frames.append(raw_hpub(SUBJECTS.chunk("other-Format", "agg").encode(),
                               head % 1 + long_format + b"\r\n\r\n", b"{}"))
        await raw_protocol(nats_url, frames)
        for seq in range(3):
            await nc.publish(SUBJECTS.chunk("ok", "agg"), b"%d" % seq, headers=chunk_headers("ok", "agg", seq, final=seq == 2))

    victims = {"long-Final": "invalid_chunk", "long-Seq": "invalid_chunk", "long-Attempt": "invalid_chunk",
               "long-Format": "unknown_format", "other-Format": "invalid_chunk"}
    with streamproc_run("--mode", "core") as (proc, log_path):
        got = await answered(nats_url, [*victims, "ok"], publish)
        text = log_path.read_text(errors="replace")
        assert_victims_refused_beside_ok(got, text, proc, victims, (b"characters",))


async def test_a_result_over_max_payload_is_refused_and_given_up_in_durable_mode_without_a_disconnect(
        nats_url, streamproc_run):
    """Durable mode, the same attack as the core test above: the stored chunk of exactly
    ``max_payload`` has a result the client refuses (``MaxPayloadError``) instead of a publish that
    made nats-server close the connection at every send and redelivery. The result is given up at
    once (not after ``--max-result-attempts``, 100 by default, sends that cannot succeed) and, as in
    core mode, an ``internal`` error result takes its place at its first delivery (it was NAKed and
    ended the request as poison on its ``--max-deliver``-th, each delivery making the same result;
    tests/test_durable_worker_attack.py); legitimate requests are answered on the same connection."""
    block = b"NATS/1.0\r\nStreamproc-Seq:0\r\nStreamproc-Final:true\r\n\r\n"

    async def publish(nc) -> None:
        await raw_protocol(nats_url, [raw_hpub(SUBJECTS.chunk("big", "agg").encode(), block,
                                               b"x" * (nc.max_payload - len(block)))])
        for i in range(20):
            await nc.publish(SUBJECTS.chunk(f"ok-{i}", "agg"), b"{}", headers=chunk_headers(f"ok-{i}", "agg", 0, final=True))

    with streamproc_run("--mode", "durable", "--max-deliver", "2", "--ack-wait", "1") as (proc, log_path):
        got = await answered(nats_url, ["big"] + [f"ok-{i}" for i in range(20)], publish)
        text = log_path.read_text(errors="replace")
        assert all(got.get(f"ok-{i}") for i in range(20)), text[-3000:]
        [(body, headers)] = got.get("big", [(b"", {})])
        assert headers.get(ERROR) == "internal", (headers, body[:300], text[-3000:])
        assert b"result 0 could not be delivered: with its headers it is larger than the NATS server's max_payload" \
            in body and b"delivered 2 times" not in body, body[:300]
        assert "chunk_poisoned" not in text, text[-3000:]
        assert "MaxPayloadError" in text
        assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 200 * MiB


async def test_a_finished_request_s_result_over_max_payload_is_replaced_in_its_chunk_s_format_in_durable_mode(
        nats_url, streamproc_run):
    """The oversized result was its request's final one, so the request is finished and keeps no
    codec: the error result in its place takes the shape of the chunk's ``Streamproc-Format``, as in
    core mode (``Correlator.unpublishable``), not the default codec's (a vLLM client got SGLang's
    error object, without the ``code`` the edge answers with)."""
    block = b"NATS/1.0\r\nStreamproc-Seq:0\r\nStreamproc-Final:true\r\nStreamproc-Format:vllm\r\n\r\n"

    async def publish(nc) -> None:
        await raw_protocol(nats_url, [raw_hpub(SUBJECTS.chunk("big", "agg").encode(), block,
                                               b"x" * (nc.max_payload - len(block)))])

    with streamproc_run("--mode", "durable", "--format", "sglang") as (proc, log_path):
        got = await answered(nats_url, ["big"], publish)
        text = log_path.read_text(errors="replace")
        [(body, headers)] = got.get("big", [(b"", {})])
        assert headers.get(ERROR) == "internal", (headers, body[:300], text[-3000:])
        assert b"max_payload" in body and b'"type":"InternalServerError"' in body and b'"code":500' in body, body[:300]
        assert proc.poll() is None


async def test_a_worker_forged_unreadable_headers_mark_is_not_echoed_whole_into_the_error_result_or_the_log(
        nats_url, streamproc_run):
    """``Streamproc-Unreadable-Headers`` is the mark the processor's client puts in place of a header
    block it could not decode (its text cut to 200 characters), but a worker can send a header of
    that name itself, with a value as long as ``max_payload``. The contract error repeated it whole:
    the error result (~1 MiB) could not be published, so the victim got an ``internal`` error in
    place of its ``invalid_chunk`` one, and the log took a 1 MiB line per chunk (the values of
    ``Streamproc-Seq``/``-Final``/``-Attempt``/``-Format`` were already cut, the test above). Now the
    value is shown cut, as theirs are (with or without other headers beside it)."""
    name = b"Streamproc-Unreadable-Headers"
    heads = {"forged-mark": b"", "forged-mark-beside": b"Streamproc-Seq: 0\r\nStreamproc-Final: yes\r\n"}

    async def publish(nc) -> None:
        frames = []
        for rid, head in heads.items():
            block = b"NATS/1.0\r\n" + head + name + b": {x}\r\n\r\n"
            block = block.replace(b"{x}", b"x" * (nc.max_payload - 2 - len(block) + 3))
            assert len(block) + 2 == nc.max_payload
            frames.append(raw_hpub(SUBJECTS.chunk(rid, "agg").encode(), block, b"{}"))
        await raw_protocol(nats_url, frames)
        for seq in range(3):
            await nc.publish(SUBJECTS.chunk("ok", "agg"), b"%d" % seq, headers=chunk_headers("ok", "agg", seq, final=seq == 2))

    with streamproc_run("--mode", "core") as (proc, log_path):
        got = await answered(nats_url, [*heads, "ok"], publish)
        text = log_path.read_text(errors="replace")
        assert_victims_refused_beside_ok(got, text, proc, dict.fromkeys(heads, "invalid_chunk"),
                                         (b"unreadable header block", b"characters"))


async def test_a_workers_header_lines_cost_the_processor_no_more_than_the_same_bytes_as_a_body(
        nats_url, streamproc_run):
    """A worker chooses how its ``max_payload`` is split between header block and body. The body of an
    aggregated chunk is never parsed; every header line is, one Python step per line. Measured
    (2026-12-06, core mode, an honest request of 250 chunks at 50/s beside it): 10 such chunks a
    second (10 MB/s, far from a bandwidth flood) took the honest request's median result latency
    from 0.8 ms to 165 ms, 20 a second to 383 ms (max 944 ms); the same bytes sent as bodies left it
    at 0.8 ms. Here 40 chunks of ~1 MiB of header lines must cost the processor under a second of
    CPU (they cost 2.1 s; 40 chunks of the same size with the bytes in the body pass), and every
    request, the honest one and theirs, is answered. A block of more than ``MAX_HEADER_LINES`` lines
    is counted, not parsed: its chunk gets ``invalid_chunk`` naming the count and the bound."""
    block = (b"NATS/1.0\r\nStreamproc-Seq: 0\r\nStreamproc-Final: true\r\n"
             + b"".join(b"k%d:v\r\n" % i for i in range(95000)) + b"\r\n")
    hostile = [f"lines-{i}" for i in range(40)]

    async def publish(nc) -> None:
        assert len(block) + 2 <= nc.max_payload
        await raw_protocol(nats_url, [raw_hpub(SUBJECTS.chunk(rid, "agg").encode(), block, b"{}") for rid in hostile])
        for seq in range(3):
            await nc.publish(SUBJECTS.chunk("ok", "agg"), b"%d" % seq, headers=chunk_headers("ok", "agg", seq, final=seq == 2))

    with streamproc_run("--mode", "core") as (proc, log_path):
        before = cpu_seconds(proc.pid)
        got = await answered(nats_url, [*hostile, "ok"], publish)
        spent = cpu_seconds(proc.pid) - before
        text = log_path.read_text(errors="replace")
        assert [b for b, _ in got.get("ok", [])] == [b"0", b"1", b"2"], text[-3000:]
        assert all(len(got.get(rid, [])) == 1 for rid in hostile), [rid for rid in hostile if rid not in got]
        for rid in hostile:  # not parsed: the unreadable mark, naming the count and the bound
            [(data, headers)] = got[rid]
            assert headers.get(ERROR) == "invalid_chunk", (rid, headers, data[:300])
            assert b"unreadable header block (%d lines, more than the %d" % (block.count(b"\n"), MAX_HEADER_LINES) \
                in data, data[:300]
        assert "event=disconnected" not in text
        assert spent < 1.0, f"{spent:.2f} s of CPU for {len(hostile)} chunks of header lines"
