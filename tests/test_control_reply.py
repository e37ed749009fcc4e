"""Found by an attack (2026-12-03): a migrate request's reply subject is chosen by whoever sends it,
and the processor published its answer there with its own NATS rights (a confused deputy).

Under the shipped trust model (deploy/nats-server.conf) the frontend may publish only
``streamproc.control.*.migrate``: docs/security.md says it "cannot publish a result or a chunk". The
processor may publish ``streamproc.results.>``, ``$KV.<lease bucket>.>``, ``$KV.<migrations bucket>.>``
and ``$JS.API.CONSUMER.>``. Each test names such a subject as a migrate's reply; the processor now
refuses every reply outside ``--control-reply-prefix`` (``_INBOX.``) before touching the request.
"""

from __future__ import annotations

import json

import anyio
import nats
import pytest
from conftest import processor_subprocess
from helpers import free_port, scrape, wait_until
from shipped_config import CONF, requests_unanswered_under_fake_lease_members, shipped_server, url

from streamproc.core.partitions import partition_of
from streamproc.core.wire import ERROR, FINAL, MigrateErrorCode, chunk_headers, decode_migrate_reply
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]
SUBJECTS = Subjects("streamproc")


@pytest.fixture(scope="module")
def server():
    """A nats-server running the shipped configuration, for this module's tests."""
    with shipped_server(CONF.read_text()) as srv:
        yield srv


async def _connect(srv, role: str):
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(url(srv, role), error_cb=on_error, allow_reconnect=False), errors


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_frontend_cannot_get_the_processor_to_publish_on_a_victims_result_subject(server, mode):
    victim = f"victim-{mode}"
    frontend, errors = await _connect(server, "frontend")
    forged: list = []
    try:
        async def on_result(msg) -> None:
            forged.append((msg.subject, msg.headers, msg.data))

        await frontend.subscribe(SUBJECTS.result(victim), cb=on_result)  # the frontend may read results
        await frontend.flush()
        # Directly: refused by nats-server (the trust model holds).
        await frontend.publish(SUBJECTS.result(victim), b"forged directly")
        await frontend.flush()
        http_port = free_port()
        with processor_subprocess(url(server, "processor"), "--mode", mode, "--partitions", "2",
                                  "--prefill-timeout", "2", "--http-port", str(http_port),
                                  "--http-host", "127.0.0.1") as (proc, log_path):
            # subscribed (core) or owning partitions (durable): by condition, not a 1 s sleep
            await wait_until(lambda: scrape(http_port)["streamproc_ready"] == 1, 30, "the processor ready")
            # Through the processor: a migrate whose reply subject is the victim's result subject.
            for i in range(5):
                await frontend.publish(SUBJECTS.migrate(f"anything-{i}"), b"", reply=SUBJECTS.result(victim))
            await frontend.flush()
            refused = "streamproc_control_replies_refused_total"
            await wait_until(lambda: scrape(http_port)[refused] >= 5, 30, "the five migrates refused", every=0.1)
            await anyio.sleep(1.0)  # a window for anything else the processor would do with them (a forged reply)
            log = log_path.read_text()
            assert scrape(http_port)[refused] == 5
        assert any("permissions violation" in e.lower() for e in errors), errors
        assert "event=control_reply_refused" in log and "event=attempt_sealed" not in log, log[-2000:]
        assert forged == [], (f"the processor published {len(forged)} message(s) on {SUBJECTS.result(victim)} "
                              f"for the frontend, first: {forged[:1]}")
    finally:
        await frontend.close()


async def test_a_frontend_cannot_get_the_processor_to_write_the_lease_bucket_and_stall_partitions():
    """Fake members in the lease bucket shrink the processor's fair share: with 8 partitions and 7 fake
    members it serves one partition; requests of the other seven wait in the chunk stream. Each fake
    member is kept alive by one migrate per lease_ttl."""
    with shipped_server(CONF.read_text()) as own:
        await _stall_partitions(own)


async def _stall_partitions(server) -> None:
    frontend, _ = await _connect(server, "frontend")
    in_partition_0 = [r for r in (f"m{i}" for i in range(1000)) if partition_of(r, 8) == 0][:7]

    async def fake_member(i: int) -> None:  # ids of partition 0, which the processor keeps: every migrate is answered
        await frontend.publish(SUBJECTS.migrate(in_partition_0[i]), b"", reply=f"$KV.STREAMPROC_CHUNKS_LEASES.m.fake-{i}")
        await frontend.flush()

    try:
        missing, lease_log = await requests_unanswered_under_fake_lease_members(server, fake_member)
    finally:
        await frontend.close()
    assert not missing, f"{len(missing)} of 40 requests unanswered after 10 s; the processor's lease log:\n{lease_log}"


async def test_a_migrates_reason_is_logged_cut_not_whole(nats_url, streamproc_run):
    """Found by the same attack: ``MigrateRequest.reason`` is free text up to max_payload and was
    logged whole (``event=migrate_requested``): 20 lines per 10 s of 900 KB each from one sender."""
    rid = "reason-long"
    with streamproc_run("--mode", "core") as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            await nc.publish(SUBJECTS.chunk(rid, "agg"), b'{"text":"a","output_ids":[1]}', headers=chunk_headers(rid, "agg", 0))
            await nc.flush()
            await anyio.sleep(0.3)
            await nc.request(SUBJECTS.migrate(rid), json.dumps({"reason": "x" * 900_000}).encode(), timeout=8)
            await anyio.sleep(0.3)
        finally:
            await nc.close()
        lines = log_path.read_text().splitlines()
    requested = [line for line in lines if "event=migrate_requested" in line]
    assert requested and max(len(line) for line in lines) < 4096, max(len(line) for line in lines)


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_request_too_long_to_seal_in_one_message_is_refused_with_a_clear_answer(nats_url, streamproc_run, mode):
    """Found by an attack (2026-12-03): a request of 200,000 emitted tokens was sealed, then its
    reply (core) or seal record (durable) exceeded max_payload: core sent no reply and the request
    waited for its timeout; durable answered "unavailable ... retry", which no retry could change.
    Now the seal is refused before anything is sealed, and the request ends migration_refused."""
    rid = f"long-{mode}"
    chunks, per_chunk = 25, 8000  # 200,000 tokens of 6 digits: ~1.4 MB of ids, well inside the byte budgets
    with streamproc_run("--mode", mode, "--partitions", "1") as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            results = await nc.subscribe(SUBJECTS.result(rid))
            await nc.flush()
            for seq in range(chunks):
                ids = [100000 + (seq * per_chunk + i) % 50000 for i in range(per_chunk)]
                body = json.dumps({"text": "x", "output_ids": ids, "meta_info": {"id": rid}}).encode()
                await nc.publish(SUBJECTS.chunk(rid, "agg"), body, headers=chunk_headers(rid, "agg", seq))
            for _ in range(chunks):
                msg = await results.next_msg(timeout=10)
                assert FINAL not in (msg.headers or {}) or msg.headers[FINAL] != "true"
            try:
                reply = await nc.request(SUBJECTS.migrate(rid), b'{"id":"m1"}', timeout=8)
            except nats.errors.TimeoutError:
                reply = None
            log = log_path.read_text()
            assert reply is not None, ("a migrate of a 200,000-token request got no reply within 8 s:\n"
                                       + "\n".join(line for line in log.splitlines()
                                                   if "migrate" in line or "control" in line or "seal" in line
                                                   or "error" in line)[-2000:])
            answer = decode_migrate_reply(reply.data)
            # A permanent condition answered "unavailable ... retry" makes the Migrator retry until its timeout.
            assert getattr(answer, "code", None) != MigrateErrorCode.UNAVAILABLE, answer
            assert answer.code == MigrateErrorCode.REFUSED and "does not fit one NATS message" in answer.message, answer
            final = await results.next_msg(timeout=10)  # the request ends: its client is not left waiting
            assert final.headers[FINAL] == "true" and final.headers[ERROR] == "migration_refused", final.headers
            # A second migrate (the Migrator's retry, same id) gets an answer too.
            again = await nc.request(SUBJECTS.migrate(rid), b'{"id":"m1"}', timeout=8)
            assert getattr(decode_migrate_reply(again.data), "code", None) != MigrateErrorCode.UNAVAILABLE
        finally:
            await nc.close()


async def test_a_frontend_cannot_get_the_processor_to_publish_on_the_processors_own_pull_inbox(server):
    """Found by a review (2026-12-03) of the reply check above: the shipped frontend may subscribe _INBOX.> (every inbox of the account), so it sees the idle
    heartbeats JetStream sends to the processor's pull inbox and learns it. A migrate naming that
    inbox passes the `_INBOX.` prefix check: the processor publishes its answer there with its own
    rights, into its own pull subscription, where a message without a reply is taken for a status:
    PullCredit.status('') zeroes the outstanding credit (more pulls than the budget) and one INFO
    `pull_status` line is logged per forged migrate (not rate limited). The processor's and the edge's own
    inboxes are now under defaults.OWN_INBOX_PREFIX, which is no migrate's reply.

    Since the shipped file denies the frontend `_INBOX.streamproc.>` (tests/test_durable_attack_review.py:
    the processor's inbox carries chunks and stored results), the frontend no longer sees those
    heartbeats, nor does the edge (an inbox prefix of its own since): here the processor's own user
    observes the inbox, as a leak would give it to the frontend, and the frontend forges the migrates."""
    frontend = await nats.connect(url(server, "frontend"), allow_reconnect=False)
    observer = await nats.connect(url(server, "processor"), allow_reconnect=False)
    inboxes: set[str] = set()
    forged: list[tuple[str, bytes]] = []

    async def on_inbox(msg) -> None:
        status = (msg.headers or {}).get("Status")
        if status == "100":
            inboxes.add(msg.subject)
        elif not status and msg.subject in inboxes:
            forged.append((msg.subject, msg.data))

    try:
        await observer.subscribe("_INBOX.>", cb=on_inbox)
        await observer.flush()
        # The module's server: its chunk stream has the 2 partitions of the tests above.
        with processor_subprocess(url(server, "processor"), "--mode", "durable", "--partitions", "2") as (
                proc, log_path):
            with anyio.fail_after(15):
                while not inboxes:
                    await anyio.sleep(0.1)
            inbox = next(iter(inboxes))
            for i in range(20):
                await frontend.publish(SUBJECTS.migrate(f"anything-{i}"), b"", reply=inbox)
            await frontend.flush()
            await anyio.sleep(2.0)
            log = log_path.read_text()
    finally:
        await frontend.close()
        await observer.close()
    flood = [line for line in log.splitlines() if "event=pull_status" in line]
    answers = [decode_migrate_reply(data) for _, data in forged]
    assert not forged, (f"the processor published {len(forged)} migrate answer(s) on its own pull inbox {inbox} "
                        f"for the frontend (first: {answers[:1]}); pull_status lines: {len(flood)} {flood[:1]}")


def test_a_migrates_id_and_refusal_text_are_bounded():
    """Found by a review (2026-12-03): the id is stored in the seal record beside the sealed state (a
    long one could push the record past max_payload again), and ``refuse`` becomes the text of the
    request's error result; both are free text from the requester. Past their bounds the request is
    malformed (the processor answers bad_request and touches nothing)."""
    import msgspec

    from streamproc.core.events import MAX_MIGRATE_ID_LENGTH, MAX_REFUSE_LENGTH
    from streamproc.core.wire import decode_migrate_request

    assert decode_migrate_request(json.dumps({"id": "x" * MAX_MIGRATE_ID_LENGTH}).encode()).id
    for body in ({"id": "x" * (MAX_MIGRATE_ID_LENGTH + 1)}, {"refuse": "x" * (MAX_REFUSE_LENGTH + 1)}):
        with pytest.raises(msgspec.ValidationError):
            decode_migrate_request(json.dumps(body).encode())
