"""The durable migration stores on a real nats-server: seal records (compare-and-set, any request
id) and stored result bodies read back in seq order."""

from __future__ import annotations

import pytest
from nats.js.errors import KeyWrongLastSequenceError

from streamproc.core.errors import MissingResults
from streamproc.nats.migrations import MigrationLedger, record_key
from streamproc.nats.streams import RESULTS_STREAM, ensure_results_stream
from streamproc.wire import MSG_ID, Result, Sealed, SealRecord, Subjects, Verdict, result_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def ledger_for(client) -> MigrationLedger:
    subjects = Subjects()
    await ensure_results_stream(client.jetstream(), subjects)
    ledger = MigrationLedger(client, "TEST_MIGRATIONS", RESULTS_STREAM, subjects.result(""), ttl=60)
    await ledger.open()
    return ledger


def record(rid: str, seals: list[int], id: str) -> SealRecord:
    sealed = Sealed(rid, len(seals), seals[-1], list(range(seals[-1])), seals[-1], "sglang")
    return SealRecord(seals, sealed, id)


async def test_exactly_one_of_two_seals_of_the_same_attempt_is_recorded(client):
    ledger = await ledger_for(client)
    rid = "odd/id=with~chars!and'quotes"  # any printable ASCII request id maps to a valid key
    assert record_key(rid).startswith("r.") and await ledger.read(rid) == (None, None)
    first = await ledger.write(rid, record(rid, [2], "a"), None)
    with pytest.raises(KeyWrongLastSequenceError):  # a second "first seal" loses
        await ledger.write(rid, record(rid, [3], "b"), None)
    second = await ledger.write(rid, record(rid, [2, 5], "c"), first)
    with pytest.raises(KeyWrongLastSequenceError):  # a seal on the stale revision loses
        await ledger.write(rid, record(rid, [2, 4], "d"), first)
    stored, revision = await ledger.read(rid)
    assert (stored.seals, stored.id, stored.attempt, revision) == ([2, 5], "c", 2, second)


async def test_stored_bodies_come_back_in_seq_order_once_each_and_a_gap_is_an_error(client):
    ledger = await ledger_for(client)
    js = client.jetstream()
    subjects = Subjects()

    async def store(rid: str, seq: int, body: bytes, again: bool = False) -> None:
        headers = result_headers(Result(rid, seq, body, False, Verdict.PASSTHROUGH))
        if again:  # stored again after the duplicate window: same seq, no de-duplication
            del headers[MSG_ID]
        await js.publish(subjects.result(rid), body, headers=headers)

    for seq, body in [(0, b"a"), (1, b"b"), (2, b"c")]:
        await store("h", seq, body)
    await store("h", 1, b"b", again=True)
    await store("h", 3, b"d")
    await store("other", 0, b"x")
    assert await ledger.history("h", 3) == [b"a", b"b", b"c"]
    assert await ledger.history("h", 0) == []
    await store("gap", 0, b"a")
    await store("gap", 2, b"c")
    with pytest.raises(MissingResults, match=r"first missing: \[1\]"):
        await ledger.history("gap", 3)
