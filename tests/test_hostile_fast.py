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
from helpers import peak_rss, raw_hpub, raw_protocol, wait_until

from streamproc.core.wire import ERROR, FINAL, Subjects, chunk_headers

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


async def test_a_chunk_at_max_payload_whose_result_block_is_larger_never_costs_the_connection(
        nats_url, streamproc_run):
    """nats-server counts a message's header block and body against ``max_payload`` and closes a
    connection that publishes more ("Maximum Payload Violation"); nats-py checks only the body. A
    worker may send a chunk of exactly ``max_payload`` with a short header block (``Streamproc-Seq:0``,
    no Nats-Msg-Id): its passthrough result carries the same body under a longer block, and the
    processor's connection was closed, its pending results lost, the next chunks missed while it
    reconnected. Now the client refuses that publish (``MaxPayloadError``), the victim's result is
    logged as ``publish_failed``, and every other request is answered on the same connection: on the
    fused path in the read loop (unary and streamed) and on the general path (a format header)."""
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
        got = await answered(nats_url, legit, publish)
        text = log_path.read_text(errors="replace")
        missing = [r for r in legit if [b for b, _ in got.get(r, [])] != [f"{r}:{s}".encode() for s in range(3)]]
        assert not missing, (missing[:5], text[-3000:])
        assert all(ERROR not in h for r in legit for _, h in got[r])
        assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
        await wait_until(lambda: log_path.read_text().count("event=publish_failed") == 2, 10,
                         "the 1st and 2nd refused results logged (then at powers of two)")
        text = log_path.read_text()
        assert "request_id=big-unary" in text and "MaxPayloadError" in text, text[-3000:]
        assert not any(r.startswith("big") for r in got)  # nothing oversized was sent
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB
