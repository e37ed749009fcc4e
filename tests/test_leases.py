"""LeaseTable against a real nats-server, on a clock the test moves: a lease ends only in expired().

The step awaits KV requests; a lease it dropped itself would be served on, unseen by the fence
before results are sent (``Partitions.fence``), until it returned. So the step gives up nothing
and renews no lapsed lease, and what it finds taken over is reported by the next expired().
"""

from __future__ import annotations

import nats
import pytest

from streamproc.nats.durable.leases import MARGIN, LeaseTable

from helpers import connection

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

TTL = 6.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def a_table(nc, clock: Clock, instance: str = "me") -> LeaseTable:
    table = LeaseTable(nc, "TEST_LEASES", 1, instance, TTL, clock=clock)
    await table.open()
    return table


async def test_a_step_neither_gives_up_nor_renews_a_lease_that_lapsed_expired_reports_it(nats_url):
    clock = Clock()
    async with connection(nats_url) as nc:
        table = await a_table(nc, clock)
        assert (await table.step()).acquired == (0,)
        clock.now += TTL * (1 - MARGIN)  # the lease may have run out on the server (it has not: no time passed)
        change = await table.step()
        assert change.acquired == () and change.surplus == ()
        assert 0 in table.owned and table.owned[0].valid_until <= clock.now  # still there, not renewed
        assert table.expired(clock.now) == [0] and table.owned == {}


async def test_a_lease_a_step_finds_taken_over_stays_until_expired_reports_it_at_once(nats_url):
    clock = Clock()
    async with connection(nats_url) as nc:
        table = await a_table(nc, clock)
        assert (await table.step()).acquired == (0,)
        kv = await nc.jetstream().key_value("TEST_LEASES")
        await kv.delete(table.key(0))  # an operator deleted it, and another instance took it
        await kv.create(table.key(0), b"another-instance")
        clock.now += 1.0  # well inside the lease's validity
        change = await table.step()
        assert change.acquired == () and change.surplus == ()
        assert 0 in table.owned and table.taken_over  # not dropped inside the step...
        assert table.expired(clock.now) == [0] and table.owned == {}  # ...but reported by the next expired()
        assert not table.taken_over


async def owner_and_peer(nc: nats.aio.client.Client, bucket: str, ttl: float) -> tuple[LeaseTable, LeaseTable]:
    """An owner that took the bucket's one partition, and an opened peer."""
    owner = LeaseTable(nc, bucket, 1, "owner", ttl)
    await owner.open()
    assert (await owner.step()).acquired == (0,)
    peer = LeaseTable(nc, bucket, 1, "peer", ttl)
    await peer.open()
    return owner, peer


async def shorten_max_age(nc: nats.aio.client.Client, stream: str, seconds: float) -> None:
    """A co-tenant's edit of a running bucket: its max age (and duplicate window) set to ``seconds``."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    info.config.max_age = info.config.duplicate_window = seconds
    await js.update_stream(info.config)


async def test_a_lease_bucket_whose_max_age_was_shortened_under_a_running_owner_has_no_two_owners(nats_url):
    """A co-tenant (or an operator) shortened the lease bucket's max age after start-up, where
    ``open`` checks it: the server expired the owner's entry well before the owner's own validity
    (``0.9 × lease_ttl`` after its renewal), a peer took the partition, and both served it until
    the owner's next renewal failed, again at every renewal. The step reads the bucket's max age
    anyway (the member count): the lease is now valid for the shorter of the two."""
    import asyncio
    import time

    ttl = 3.0
    async with connection(nats_url) as nc:
        owner, peer = await owner_and_peer(nc, "SHORTENED_LEASES", ttl)
        assert (await peer.step()).acquired == ()
        await shorten_max_age(nc, "KV_SHORTENED_LEASES", 0.6)
        await owner.step()  # renews: the entry now expires 0.6 s after this write
        deadline = time.monotonic() + 5
        while not (await peer.step()).acquired:
            assert time.monotonic() < deadline, "the peer never took the expired lease"
            await asyncio.sleep(0.2)
        assert owner.expired(time.monotonic()) == [0], "two owners: the peer took the lease the owner still serves"
        assert owner.bucket_ttl_changes == 1


async def test_a_peer_that_sees_the_shortened_max_age_first_takes_no_lease_its_owner_still_serves(nats_url):
    """The same edit, seen first by a peer (the owner's next step not come yet): the server may expire
    the owner's entry, written under the old max age, long before the owner's own validity, and the
    peer took it in the step that read the new age while the owner served it for 1.7 s more (a
    review's case). A step that finds the max age shortened takes nothing for as long as a lease
    written under the old one may be served; the peer takes the partition once the owner's lapsed."""
    import asyncio
    import time

    ttl = 3.0
    async with connection(nats_url) as nc:
        owner, peer = await owner_and_peer(nc, "SHORTENED_FIRST_SEEN", ttl)
        assert (await peer.step()).acquired == ()
        await shorten_max_age(nc, "KV_SHORTENED_FIRST_SEEN", 0.6)
        deadline = time.monotonic() + 8
        while not (await peer.step()).acquired:  # the owner never steps again: its lease lapses
            assert time.monotonic() < deadline, "the peer never took the lapsed lease"
            await asyncio.sleep(0.05)
        assert owner.expired(time.monotonic()) == [0], "two owners: the peer took the lease the owner still serves"
        assert peer.bucket_ttl_changes == 1


async def test_a_lease_bucket_deleted_under_running_instances_is_made_again_and_never_gives_two_owners(nats_url):
    """A co-tenant (or an operator) deleted the lease bucket: every renewal and every create failed
    as "unreachable" (logged at debug), the owner's lease lapsed and nobody could take the partition
    again, so nothing was served until a restart. Now a step that finds the bucket gone says so, makes
    it again and takes nothing for a ttl, by when every lease of the old bucket has lapsed."""
    import asyncio
    import time

    ttl = 2.0
    async with connection(nats_url) as nc:
        owner, peer = await owner_and_peer(nc, "GONE_LEASES", ttl)
        await nc.jetstream().delete_key_value("GONE_LEASES")

        def serving(table: LeaseTable) -> bool:
            table.expired(time.monotonic())
            return 0 in table.owned

        taken_again = False
        deadline = time.monotonic() + 4 * ttl
        while time.monotonic() < deadline and not taken_again:
            for table in (peer, owner):
                taken_again |= (await table.step()).acquired == (0,)
                assert not (serving(owner) and serving(peer)), "two owners of partition 0"
            await asyncio.sleep(ttl / 6)
        assert taken_again, f"partition 0 not taken again within {4 * ttl:g} s of the bucket's deletion"
        assert owner.bucket_recreations + peer.bucket_recreations >= 1
