"""Found by a review (2026-12-07) of 57787ed: ``streamproc run`` now starts against any ``max_payload``
that takes its largest error result (~1.5 KiB), but a migrate's seal must fit ``max_payload`` less
``processor.SEAL_HEADROOM`` (8 KiB). Below that every migrate was refused with a message naming a
negative byte count ("does not fit one NATS message (-4096 bytes with max_payload)") and nothing at
start-up said so. Now start-up warns (``event=migrate_unavailable``) and the refusal says why.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import processor_subprocess
from durable_helpers import connect

from streamproc.core.wire import ERROR, FINAL, MigrateErrorCode, Subjects, chunk_headers, decode_migrate_reply
from streamproc.nats.processor import SEAL_HEADROOM
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
SMALL = 4096  # takes every error result (wire.max_error_result_size), below SEAL_HEADROOM


async def test_below_the_seal_headroom_migrates_are_refused_with_a_reason_and_start_up_warns():
    assert SMALL < SEAL_HEADROOM
    rid = "small-payload-migrate"
    with EmbeddedNats(config=f"max_payload: {SMALL}", jetstream=False) as server:
        with processor_subprocess(server.url, "--mode", "core", "--format", "sglang") as (_proc, log_path):
            nc = await connect(server.url)
            try:
                results = await nc.subscribe(SUBJECTS.result(rid))
                await nc.flush()
                body = json.dumps({"text": "x", "output_ids": [1, 2, 3], "meta_info": {"id": rid}}).encode()
                await nc.publish(SUBJECTS.chunk(rid, "agg"), body, headers=chunk_headers(rid, "agg", 0))
                first = await results.next_msg(timeout=10)
                assert (first.headers or {}).get(FINAL) != "true", first.headers
                reply = await nc.request(SUBJECTS.migrate(rid), b'{"id":"m1"}', timeout=8)
                answer = decode_migrate_reply(reply.data)
                assert answer.code == MigrateErrorCode.REFUSED, answer
                assert not re.search(r"-\d+ bytes", answer.message), answer.message
                assert "leaves no room" in answer.message, answer.message
                final = await results.next_msg(timeout=10)  # the request still ends: its client is told
                assert final.headers[FINAL] == "true" and final.headers[ERROR] == "migration_refused"
            finally:
                await nc.close()
            log = log_path.read_text(errors="replace")
    warned = [line for line in log.splitlines() if "event=migrate_unavailable" in line]
    assert warned and f"max_payload={SMALL}" in warned[0] and str(SEAL_HEADROOM) in warned[0], log[-2000:]
