"""Found by reviews (2026-12-07) of 57787ed and aad5ec6.

``streamproc run`` starts against any ``max_payload`` that takes its largest error result (~1.5 KiB),
but a migrate's reply had to fit ``max_payload`` less a fixed 8 KiB (``SEAL_HEADROOM``) meant for the
rest of the durable seal record: below ~8 KiB every migrate was refused, however small its seal. And
the record was never measured: it holds one result seq per seal besides the reply and the migrate id,
8,565 bytes past the reply at 1,000 migrations, so past ~950 migrations of one request (``--max-migrations``
allows 1,000,000) the reply fitted while the record did not. Now ``Correlator.migrate`` measures the
record exactly as it is written (``wire.encode_seal_record``) against ``max_payload`` less the write's
header block, and the reply alone against ``max_payload``.
"""

from __future__ import annotations

import json

import pytest
from conftest import processor_subprocess
from durable_helpers import connect, durable_flags

from streamproc.core.codec import ErrorKind
from streamproc.core.wire import (ERROR, FINAL, MigrateErrorCode, Sealed, SealRecord, Subjects, chunk_headers,
                                  decode_migrate_reply, encode_seal_record, max_error_result_size)
from streamproc.nats.processor import RECORD_HEADER_ROOM
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(180)]

SUBJECTS = Subjects()
SMALL = 4096  # takes every error result (wire.max_error_result_size), below the old 8 KiB headroom
MIGRATE_ID = "m" * 250  # a long id (each migrate its own: the same one is a retry) is in the record


def body(rid: str) -> bytes:
    return json.dumps({"text": "x", "output_ids": [1, 2, 3], "meta_info": {"id": rid}}).encode()


async def test_below_8_kib_a_core_migrate_seals():
    rid = "small-payload-migrate"
    with EmbeddedNats(config=f"max_payload: {SMALL}", jetstream=False) as server:
        with processor_subprocess(server.url, "--mode", "core", "--format", "sglang") as (_proc, log_path):
            nc = await connect(server.url)
            try:
                results = await nc.subscribe(SUBJECTS.result(rid))
                await nc.flush()
                await nc.publish(SUBJECTS.chunk(rid, "agg"), body(rid), headers=chunk_headers(rid, "agg", 0))
                first = await results.next_msg(timeout=10)
                assert (first.headers or {}).get(FINAL) != "true", first.headers
                reply = await nc.request(SUBJECTS.migrate(rid), b'{"id":"m1"}', timeout=8)
                answer = decode_migrate_reply(reply.data)
                assert isinstance(answer, Sealed) and answer.attempt == 1, answer
            finally:
                await nc.close()
            log = log_path.read_text(errors="replace")
    assert "event=migrate_unavailable" not in log, log[-2000:]


def test_every_server_start_up_accepts_takes_a_first_seal_record():
    """Why start-up checks nothing for migrates: the smallest seal record a first migrate writes (a
    1-character id, no token, no codec state, no migrate id), with its write's header block, is smaller
    than an error result's header block alone, which every accepted ``max_payload`` takes."""
    least = len(encode_seal_record(SealRecord([0], Sealed("x", 1, 0, [], 0, "sglang", {}), None)))
    header_block_alone = max_error_result_size([lambda text, kind: b""], list(ErrorKind))
    assert least + RECORD_HEADER_ROOM < header_block_alone, (least, RECORD_HEADER_ROOM, header_block_alone)


@pytest.mark.parametrize("max_payload", [SMALL, 9000])
async def test_a_seal_record_past_max_payload_is_refused_not_answered_unavailable_for_ever(max_payload: int):
    """Migrated until its record outgrows one message: every migrate seals while its record fits, the
    next one is refused (both byte figures named) and ends the request; none is answered ``unavailable``.
    At 9000 bytes (above the old 8 KiB headroom, so the reply fitted) the old code sealed 4,159 times,
    then the 4,160th seal's record could not be written (``unavailable``: "the seal cannot be recorded:
    MaxPayloadError") and the request never ended; at 4096 the first migrate was refused."""
    rid = "r" * 200
    with EmbeddedNats(config=f"max_payload: {max_payload}") as server:
        with processor_subprocess(server.url, *durable_flags(partitions=1, format="sglang"),
                                  "--max-migrations", "1000000") as (_proc, log_path):
            nc = await connect(server.url)
            try:
                js = nc.jetstream()
                results = await nc.subscribe(SUBJECTS.result(rid))
                await nc.flush()
                await js.publish(SUBJECTS.chunk(rid, "agg"), body(rid), headers=chunk_headers(rid, "agg", 0))
                first = await results.next_msg(timeout=10)
                assert (first.headers or {}).get(FINAL) != "true", first.headers
                answers: list[object] = []
                for i in range(6000):
                    ask = json.dumps({"id": f"{i:06d}{MIGRATE_ID}"}).encode()
                    reply = await nc.request(SUBJECTS.migrate(rid), ask, timeout=10)
                    answer = decode_migrate_reply(reply.data)
                    answers.append(answer)
                    if not isinstance(answer, Sealed):
                        break
                final = await results.next_msg(timeout=10)  # the request still ends: its client is told
            finally:
                await nc.close()
    sealed = [a for a in answers if isinstance(a, Sealed)]
    last = answers[-1]
    assert not isinstance(last, Sealed), f"{len(sealed)} seals and no refusal"
    assert last.code == MigrateErrorCode.REFUSED, (len(sealed), last)
    assert "seal record" in last.message and f"{max_payload - RECORD_HEADER_ROOM} bytes" in last.message, last
    assert len(sealed) > 50 and [a.attempt for a in sealed] == list(range(1, len(sealed) + 1))
    assert final.headers[FINAL] == "true" and final.headers[ERROR] == "migration_refused", final.headers
