"""The durable migration stores on a real nats-server: seal records (compare-and-set, any request
id) and stored result bodies read back in seq order."""

from __future__ import annotations

import time

import pytest
from nats.js.errors import KeyWrongLastSequenceError

from streamproc.core.errors import HistoryOverBound, MissingResults, UnreadableRecord
from streamproc.nats.durable.migrations import MigrationLedger, record_key, request_id_of
from streamproc.nats.streams import RESULTS_STREAM, ensure_results_stream
from streamproc.wire import MSG_ID, SEQ, Result, Sealed, SealRecord, Subjects, Verdict, result_headers

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


@pytest.mark.parametrize("read", ["consumer", "msg_get"])
async def test_stored_bodies_come_back_in_seq_order_once_each_and_a_gap_is_an_error(client, read):
    """``read``: with an ordered consumer (``history``) or without one (``_history_by_get``, what
    ``history`` does when no consumer can be created: docs/security.md)."""
    ledger = await ledger_for(client)
    if read == "msg_get":
        ledger.history = ledger._history_by_get  # type: ignore[method-assign]
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


@pytest.mark.parametrize("read", ["consumer", "msg_get"])
async def test_the_read_bound_counts_kept_bodies_and_copies_only_against_the_copies_bound(client, read):
    """Both reads (``history``, ``_history_by_get``), the bounds lowered to the distinct bodies' bytes:
    each result stored twice (after the duplicate window: same seq) reads whole, the copies costing
    nothing toward ``max_history_bytes`` (until 2026-12-07 they counted, and this was ``HistoryOverBound``);
    copies of one seq past ``max_history_copies`` times the bytes end the read, whatever was kept."""
    ledger = await ledger_for(client)
    if read == "msg_get":
        ledger.history = ledger._history_by_get  # type: ignore[method-assign]
    js = client.jetstream()
    subjects = Subjects()
    bodies = [b"a" * 100, b"b" * 100, b"c" * 100]
    ledger.max_history_bytes, ledger.max_history_copies = sum(map(len, bodies)), 2
    twice, copies = f"twice-{read}", f"copies-{read}"
    for seq, body in enumerate(bodies):
        for _ in range(2):
            headers = result_headers(Result(twice, seq, body, False, Verdict.PASSTHROUGH))
            del headers[MSG_ID]  # no de-duplication: the second is stored too
            await js.publish(subjects.result(twice), body, headers=headers)
    assert await ledger.history(twice, 3) == bodies
    for _ in range(7):  # 700 bytes of seq 0, past 2 x 300: seq 1 is never reached
        await js.publish(subjects.result(copies), bodies[0], headers={SEQ: "0"})
    await js.publish(subjects.result(copies), bodies[1], headers={SEQ: "1"})
    with pytest.raises(HistoryOverBound, match="copies"):
        await ledger.history(copies, 2)


async def test_a_new_owner_lists_every_sealed_request_once_with_its_age(client):
    """What a new owner reads before its first pull: each request with a seal record, once however
    often it was sealed, named exactly (any printable ASCII id); an empty bucket lists nothing."""
    subjects = Subjects()
    await ensure_results_stream(client.jetstream(), subjects)
    ledger = MigrationLedger(client, "TEST_SEALED_LIST", RESULTS_STREAM, subjects.result(""), ttl=60)
    await ledger.open()
    assert await ledger.sealed() == []
    ids = ["plain", "odd/id=with~chars!and'quotes", "a.b*c>d", "x" * 200]
    revisions = {rid: await ledger.write(rid, record(rid, [1], "first"), None) for rid in ids}
    await ledger.write(ids[0], record(ids[0], [1, 3], "again"), revisions[ids[0]])
    listed = await ledger.sealed()
    assert sorted(rid for rid, _ in listed) == sorted(ids)
    assert all(0 <= age < 30 for _, age in listed), listed
    assert [request_id_of(record_key(rid)) for rid in ids] == ids
    assert request_id_of("p.3") is None and request_id_of("r.!!") is None


async def test_seal_record_ages_are_read_on_the_servers_clock_whatever_the_hosts_says(client, monkeypatch):
    """A record's age was the host's wall clock minus the server's write stamp: with the host a day
    ahead of the server (past the records' ttl, 60 s here), every record read 86,400 s old, so the
    new owner's seal list dropped it at its next seal while it was still in the bucket, and the
    sealed attempt's late first output chunk would start the request afresh. Both ends are the
    server's now (the bucket's stream info ``ts``)."""
    ledger = await ledger_for(client)
    await ledger.write("skewed", record("skewed", [1], "first"), None)
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 86_400)  # the host's clock a day ahead
    ((rid, age),) = await ledger.sealed()
    monkeypatch.undo()
    assert rid == "skewed" and 0 <= age < 30, age


async def test_a_history_read_that_stalls_is_no_gap(nats_url):
    """The server stops sending mid-read (slow, a leader change): the stored results are not gone, so
    the read fails as a store that does not answer (retried), not as ``MissingResults``, which a
    take-over without a seal record takes for bodies that can never come back (recovery.py: the vLLM
    session then omits its rows for good). A TCP proxy relays the server's bytes and holds those after
    the first stored result for longer than ``HISTORY_TIMEOUT``. Until 2026-12-07 it raised
    ``MissingResults``."""
    import anyio
    import nats.errors
    from helpers import connection
    from proxy_helpers import HoldingProxy

    from streamproc.nats.durable.migrations import HISTORY_TIMEOUT

    port = int(nats_url.rsplit(":", 1)[1])
    subject = Subjects().result("slow").encode()
    proxy = HoldingProxy(port, lambda _: False, stall_after=lambda s: s == subject,
                         stall_for=HISTORY_TIMEOUT + 1.5)
    async with proxy.running(), connection(nats_url) as direct, connection(proxy.url) as slow:
        js = direct.jetstream()
        await ensure_results_stream(js, Subjects())
        for seq in range(3):
            body = b"x%d" % seq
            await js.publish(Subjects().result("slow"), body,
                             headers=result_headers(Result("slow", seq, body, False, Verdict.PASSTHROUGH)))
        ledger = MigrationLedger(slow, "TEST_MIGRATIONS", RESULTS_STREAM, Subjects().result(""), ttl=60)
        with pytest.raises(Exception) as caught:
            await ledger.history("slow", 3)
        assert proxy.stalled.is_set()  # the first stored result came, then nothing past the timeout
        assert not isinstance(caught.value, MissingResults), caught.value
        assert isinstance(caught.value, (nats.errors.Error, TimeoutError))
        await anyio.sleep(2)  # the held bytes reach the client before it closes


async def test_a_seal_record_with_more_seals_than_the_budget_holds_is_unreadable_not_held(client):
    """A record's seals are counted in its bytes before they are decoded (wire.max_seals: what a list
    of them costs, 36 bytes a seal, within max_buffered_bytes): one past it (a forger's, or written
    where max_payload is large) reads as unreadable, like a malformed value, and is never held."""
    subjects = Subjects()
    await ensure_results_stream(client.jetstream(), subjects)
    ledger = MigrationLedger(client, "TEST_SEAL_COUNT", RESULTS_STREAM, subjects.result(""), ttl=60,
                             max_buffered_bytes=36 * 1000)
    await ledger.open()
    assert ledger.max_seals == 1000
    await ledger.write("fits", record("fits", [1] * 1000, "a"), None)
    assert (await ledger.read("fits"))[0].attempt == 1000
    await ledger.write("over", record("over", [1] * 1001, "b"), None)
    with pytest.raises(UnreadableRecord, match="1001 seals, more than the 1000"):
        await ledger.read("over")


async def test_copies_within_the_copies_bound_are_never_dropped_from_the_subscriptions_queue(client):
    """The queue of the history read's subscription (nats-py ``pending_msgs_limit``, an
    ``asyncio.Queue(maxsize=...)``) held ``max_history_results`` messages: once copies stopped counting
    toward that bound (only toward ``max_history_copies`` times it), the server could send more than the
    queue holds (its flow control counts bytes, never messages) and nats-py's ``Client._process_msg``
    dropped the rest (``asyncio.QueueFull``: SlowConsumerError), after its ordered-consumer sequence
    tracking had counted them, so no reset re-sent them: the last results never came and the read
    timed out (retried for good). Copies within the bound must read whole."""
    ledger = await ledger_for(client)
    js = client.jetstream()
    subjects = Subjects()
    ledger.max_history_results, ledger.max_history_copies = 100, 4
    rid, early, late, copies = "queued-copies", 8, 2, 35  # 8 x 35 + 2 = 282 messages, under 4 x 100
    bodies = [b"%d" % seq * 10 for seq in range(early + late)]
    for _ in range(copies):  # results 0..7 stored again and again (each owner re-publishing them)
        for seq in range(early):
            await js.publish(subjects.result(rid), bodies[seq], headers={SEQ: str(seq)})
    for seq in range(early, early + late):
        await js.publish(subjects.result(rid), bodies[seq], headers={SEQ: str(seq)})
    assert await ledger.history(rid, early + late) == bodies
