"""Recovery lookups of a durable partition and the deliveries parked behind them
(:mod:`streamproc.core.lookups`), pure: a model of the shell's use of them, driven by hypothesis."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.lookups import Lookups, LookupSlots


@dataclass(eq=False)
class Delivery:
    rid: str
    n: int  # delivery order, across requests
    size: int
    needs: bool  # needs a lookup when it is decided and its request has none in flight


@dataclass
class Shell:
    """The partition's shell as nats/durable/deliveries.py drives :class:`Lookups`: one callback, deciding its
    inbox in order; a delivery that needs a lookup while every slot is taken waits in the queue, and
    the callback waits (blocked) only when the queue or the parked bytes are full; lookups end in any
    order, and each end gives the free slot to the oldest queued request."""

    lookups: Lookups[Delivery]
    inbox: list[Delivery] = field(default_factory=list)
    decided: list[Delivery] = field(default_factory=list)
    naked: list[Delivery] = field(default_factory=list)
    largest: int = 0
    waits: list[str] = field(default_factory=list)  # request ids in the order they were queued

    def decide(self, d: Delivery) -> None:
        parked = [t for t in self.lookups.tokens() if t.rid == d.rid]
        assert not parked or all(t.n > d.n for t in parked), "decided while an earlier one of its request is parked"
        self.decided.append(d)

    def settle(self, d: Delivery, admit: bool) -> bool:
        lookups = self.lookups
        if d.rid in lookups:
            if admit and not lookups.fits(d.size):
                return False
            lookups.park(d.rid, d, d.size)
            return True
        if not d.needs:
            self.decide(d)
            return True
        if admit and not (lookups.fits(d.size) and (lookups.room() or lookups.queue_room())):
            return False
        if lookups.room():
            lookups.begin(d.rid, d, d.size)
        else:
            assert admit, "a delivery handed back found no free slot"
            lookups.wait(d.rid, d, d.size)
            self.waits.append(d.rid)
        return True

    def step(self) -> bool:
        """The callback takes the inbox's first delivery; False when it must wait for room."""
        if not self.inbox:
            return False
        d = self.inbox[0]
        if not self.settle(d, admit=True):
            # Only a delivery that would park or queue waits: one of a request in memory never does.
            assert d.rid in self.lookups or d.needs, "a delivery needing no lookup waited"
            return False
        self.inbox.pop(0)
        return True

    def start_queued(self) -> None:
        while (taken := self.lookups.next()) is not None:
            waiting, retry = taken
            assert not retry, "one attempt per delivery: nothing is retried"
            assert waiting[0].rid == self.waits.pop(0), "queued requests started out of order"
            for b in waiting:
                self.settle(b, admit=False)

    def end(self, rid: str, ok: bool) -> None:
        """The lookup of ``rid`` ends (found, or failed and retried later); the queue takes the slot."""
        d = self.lookups.by_request[rid][0][0]
        later = self.lookups.finish(rid, d)
        assert later is not None
        if not ok:
            self.naked.extend([d, *later])
        else:
            self.decide(d)
            for b in later:
                self.settle(b, admit=False)
        self.start_queued()

    def check(self) -> None:
        lookups = self.lookups
        assert len(lookups) <= lookups.limit
        assert len(lookups.queued) <= lookups.max_queued
        assert not lookups.queued or not lookups.room(), "a request waits while a slot is free"
        assert set(lookups.queued) <= set(lookups.by_request)
        assert sorted(lookups.in_flight() + list(lookups.queued)) == sorted(lookups.requests())
        assert list(lookups.queued) == [r for r in self.waits if r in lookups.queued]
        parked = list(lookups.tokens())
        assert lookups.parked_bytes == sum(t.size for t in parked)
        assert lookups.parked_bytes <= max(lookups.max_bytes, self.largest)
        for rid, entry in lookups.by_request.items():
            assert [t.n for t, _ in entry] == sorted(t.n for t, _ in entry) and {t.rid for t, _ in entry} == {rid}


deliveries = st.tuples(st.sampled_from("abcdef"), st.integers(1, 40), st.booleans())
ops = st.lists(st.one_of(
    st.tuples(st.just("deliver"), deliveries),
    st.tuples(st.just("step"), st.just(None)),
    st.tuples(st.just("end"), st.tuples(st.integers(0, 7), st.booleans()))), max_size=80)


@outbox_settings
@given(limit=st.integers(1, 4), max_queued=st.integers(0, 4), max_bytes=st.integers(0, 100), script=ops,
       hand_over=st.booleans())
def test_each_request_is_decided_in_order_within_the_bounds_and_a_hand_over_returns_every_token_once(
        limit, max_queued, max_bytes, script, hand_over):
    shell = Shell(Lookups(LookupSlots(limit), max_bytes, max_queued))
    delivered: list[Delivery] = []
    for op, arg in script:
        if op == "deliver":
            rid, size, needs = arg
            d = Delivery(rid, len(delivered), size, needs)
            delivered.append(d)
            shell.largest = max(shell.largest, size)
            shell.inbox.append(d)
        elif op == "step":
            shell.step()
        else:
            i, ok = arg
            rids = shell.lookups.in_flight()
            if rids:
                shell.end(rids[i % len(rids)], ok)
        shell.check()
    if hand_over:
        returned = shell.lookups.abandon()
        assert shell.lookups.parked_bytes == 0 and list(shell.lookups.tokens()) == []
        assert not shell.lookups.queued and shell.lookups.next() is None and not shell.lookups.in_flight()
        for d in returned:  # a lookup that ends later finds nothing to decide, and frees its slot
            assert shell.lookups.finish(d.rid, d) is None
        assert len(shell.lookups) == 0 and shell.lookups.slots.running == 0
        shell.naked.extend(returned)
        shell.naked.extend(shell.inbox)  # the callback NAKs what the handed-over partition still gets
        shell.inbox.clear()
    else:  # run to the end: every lookup found the request, every delivery is decided
        while shell.inbox or len(shell.lookups):
            if not shell.step() and len(shell.lookups):
                shell.end(shell.lookups.in_flight()[0], True)
            shell.check()
        assert not shell.lookups.requests(), "a request left in the queue"
    settled = [id(d) for d in shell.decided + shell.naked]
    assert sorted(settled) == sorted(id(d) for d in delivered), "every delivery decided or NAKed exactly once"
    for rid in "abcdef":
        got = [d.n for d in shell.decided if d.rid == rid]
        assert got == sorted(got), f"{rid}'s deliveries decided out of order"


@outbox_settings
@given(limit=st.integers(1, 4), max_queued=st.integers(1, 8), needing=st.integers(0, 12),
       sizes=st.lists(st.integers(1, 40), min_size=12, max_size=12), max_bytes=st.integers(0, 400))
def test_a_request_in_memory_is_decided_at_once_while_the_queue_has_room(limit, max_queued, needing, sizes,
                                                                         max_bytes):
    """No lookup ends: ``needing`` new requests' deliveries that each need one, then one of a request in
    memory. It is decided as soon as the callback reaches it, unless the deliveries before it filled
    the slots, the queue (``max_queued``) or the parked bytes: then the callback waits, before it."""
    shell = Shell(Lookups(LookupSlots(limit), max_bytes, max_queued))
    flood = [Delivery(f"new-{i}", i, sizes[i], True) for i in range(needing)]
    shell.largest = max(sizes)
    victim = Delivery("held", needing, 1, False)
    shell.inbox = [*flood, victim]
    while shell.step():
        shell.check()
    fit = 0  # how many of the flood the bounds admit, in order
    total = 0
    for size in sizes[:needing]:
        if fit >= limit + max_queued or (total and total + size > max_bytes):
            break
        fit += 1
        total += size
    assert shell.inbox == (flood[fit:] + [victim] if fit < needing else [])
    assert (victim in shell.decided) == (fit == needing)
    assert len(shell.lookups) == min(fit, limit) and len(shell.lookups.queued) == max(0, fit - limit)


def test_one_delivery_always_parks_and_a_full_partition_has_no_room():
    lookups: Lookups[str] = Lookups(LookupSlots(2), max_bytes=10)
    assert lookups.room() and lookups.fits(1000)  # nothing parked: even one above the bound
    lookups.begin("a", "a0", 1000)
    assert not lookups.fits(1)
    lookups.begin("b", "b0", 5)  # the shell asks first; here the bound is the caller's
    assert not lookups.room()
    lookups.park("a", "a1", 3)
    assert list(lookups.tokens()) == ["a0", "a1", "b0"] and lookups.parked_bytes == 1008
    assert lookups.finish("a", "a1") is None  # only the token that started the lookup ends it
    assert lookups.finish("a", "a0") == ["a1"] and lookups.parked_bytes == 5 and lookups.room()
    with pytest.raises(ValueError):
        lookups.begin("b", "b1", 1)
    assert lookups.abandon() == ["b0"] and lookups.closed
    assert lookups.finish("b", "b0") is None
    with pytest.raises(RuntimeError):
        lookups.begin("c", "c0", 1)


def test_queued_requests_take_freed_slots_oldest_first_with_what_parked_behind_them():
    lookups: Lookups[str] = Lookups(LookupSlots(1), max_bytes=100, max_queued=2)
    lookups.begin("a", "a0", 1)
    assert not lookups.room() and lookups.queue_room() and lookups.next() is None
    lookups.wait("b", "b0", 2)
    lookups.park("b", "b1", 3)
    lookups.wait("c", "c0", 4)
    assert not lookups.queue_room() and len(lookups) == 1 and "b" in lookups and "c" in lookups
    assert lookups.in_flight() == ["a"] and lookups.requests() == ["a", "b", "c"] and lookups.parked_bytes == 10
    assert lookups.next() is None  # no free slot
    assert lookups.finish("b", "b0") is None  # a queued request has no lookup to end
    assert lookups.finish("a", "a0") == [] and lookups.room()
    assert lookups.next() == (["b0", "b1"], False) and "b" not in lookups and lookups.parked_bytes == 4
    lookups.begin("b", "b0", 2)  # the shell settles them again: the first starts the lookup ...
    lookups.park("b", "b1", 3)  # ... the rest park behind it
    assert lookups.next() is None and lookups.queue_room()
    assert sorted(lookups.abandon()) == ["b0", "b1", "c0"] and not lookups.queued and lookups.next() is None
    with pytest.raises(RuntimeError):
        lookups.wait("d", "d0", 1)


@dataclass
class Instance:
    """Several partitions' shells drawing on one :class:`LookupSlots`, as nats/durable/deliveries.py
    drives them: a free slot goes to ``slots.next()`` (the partitions in turn); a failed lookup is
    queued again while attempts are left (its deliveries held), then NAKed with what parked behind it."""

    slots: LookupSlots[Delivery]
    shells: list[Shell]
    attempts: int
    tries: dict[int, int] = field(default_factory=dict)  # id(delivery) -> lookups made for it
    behind: dict[int, int] = field(default_factory=dict)  # partition -> grants to others while it waited

    def grant(self) -> None:
        """Every free slot to the queue, the partitions in turn; checks that no partition waits while
        another is served twice."""
        while True:
            waiting = [i for i, sh in enumerate(self.shells) if sh.lookups.queued]
            taken = self.slots.next()
            if taken is None:
                return
            lookups, tokens, retry = taken
            k = lookups.key
            for j in waiting:
                self.behind[j] = 0 if j == k else self.behind.get(j, 0) + 1
                assert self.behind[j] < len(self.shells), f"partition {j} waited behind {self.behind[j]} grants"
            shell = self.shells[k]
            if retry:
                [d] = tokens
                assert lookups.flying[d.rid][0] is d
                self.tries[id(d)] += 1
            else:
                for b in tokens:
                    self.settle(shell, b)

    def settle(self, shell: Shell, d: Delivery) -> None:
        before = d.rid in shell.lookups.flying
        shell.settle(d, admit=False)
        if not before and shell.lookups.flying.get(d.rid, (None,))[0] is d:
            self.tries[id(d)] = 1

    def step(self, k: int) -> None:
        shell = self.shells[k]
        if shell.inbox:
            d = shell.inbox[0]
            if shell.step() and shell.lookups.flying.get(d.rid, (None,))[0] is d:
                self.tries[id(d)] = 1

    def end(self, k: int, i: int, ok: bool) -> None:
        shell = self.shells[k]
        lookups = shell.lookups
        rids = lookups.in_flight()
        if not rids:
            return
        rid = rids[i % len(rids)]
        d = lookups.flying[rid][0]
        if not ok and lookups.retry(rid, d):
            assert self.tries[id(d)] < self.attempts
            shell.waits.append(rid)
        else:
            assert ok or self.tries[id(d)] == self.attempts, "NAKed with attempts left"
            later = lookups.finish(rid, d)
            assert later is not None
            if not ok:
                shell.naked.extend([d, *later])
            else:
                shell.decide(d)
                for b in later:
                    self.settle(shell, b)
        self.grant()

    def check(self) -> None:
        running = sum(len(sh.lookups) for sh in self.shells)
        assert running == self.slots.running <= self.slots.limit
        queued = any(sh.lookups.queued for sh in self.shells)
        assert not (queued and self.slots.free()), "a request waits while a slot is free"
        assert set(self.slots.turns) == {sh.lookups for sh in self.shells if sh.lookups.queued}
        for sh in self.shells:
            # A retry queues without asking, but only a request that was in flight: the partition's
            # requests stay within what the slots and the queue admitted.
            assert len(sh.lookups.by_request) <= sh.lookups.max_queued + self.slots.limit
            parked = list(sh.lookups.tokens())
            assert sh.lookups.parked_bytes == sum(t.size for t in parked)
            assert sh.lookups.parked_bytes <= max(sh.lookups.max_bytes, sh.largest)


instance_ops = st.lists(st.one_of(
    st.tuples(st.just("deliver"), st.tuples(st.integers(0, 2), deliveries)),
    st.tuples(st.just("step"), st.integers(0, 2)),
    st.tuples(st.just("end"), st.tuples(st.integers(0, 2), st.integers(0, 7), st.booleans()))), max_size=120)


@outbox_settings
@given(limit=st.integers(1, 4), max_queued=st.integers(0, 4), attempts=st.integers(1, 3), script=instance_ops,
       hand_over=st.sets(st.integers(0, 2)))
def test_partitions_share_the_lookup_slots_in_turn_and_a_failed_lookup_is_retried_before_its_nak(
        limit, max_queued, attempts, script, hand_over):
    """Three partitions (request ids apart) on one :class:`LookupSlots`: at most ``limit`` lookups in
    flight across them, none queued while a slot is free, a free slot goes to the partitions in turn
    (none waits while another is served twice), a failed lookup is made again (up to ``attempts`` per
    delivery, its deliveries held) before they are NAKed, every delivery is decided or NAKed once, each
    request's in order; handed-over partitions return everything parked, and their lookups in flight
    keep their slots until they end."""
    slots: LookupSlots[Delivery] = LookupSlots(limit)
    shells = [Shell(Lookups(slots, 60, max_queued, attempts=attempts, key=k)) for k in range(3)]
    model = Instance(slots, shells, attempts)
    delivered: list[Delivery] = []
    for op, arg in script:
        if op == "deliver":
            k, (rid, size, needs) = arg
            d = Delivery(f"{k}{rid}", len(delivered), size, needs)
            delivered.append(d)
            shells[k].largest = max(shells[k].largest, size)
            shells[k].inbox.append(d)
        elif op == "step":
            model.step(arg)
        else:
            model.end(*arg)
        model.check()
    for k in sorted(hand_over):
        shell = shells[k]
        flying = [shell.lookups.flying[r][0] for r in shell.lookups.in_flight()]
        shell.naked.extend(shell.lookups.abandon())
        shell.naked.extend(shell.inbox)
        shell.inbox.clear()
        assert slots.running == sum(len(sh.lookups) for sh in shells)  # still in flight
        for d in flying:  # they end: nothing to decide, the slot is free
            assert shell.lookups.retry(d.rid, d) is False and shell.lookups.finish(d.rid, d) is None
        model.grant()
        model.check()
    live = [k for k in range(3) if k not in hand_over]
    for _ in range(10_000):  # run to the end: every lookup found its request
        if not any(shells[k].inbox or len(shells[k].lookups) for k in live):
            break
        for k in live:
            while shells[k].inbox and shells[k].step():
                pass
            if len(shells[k].lookups):
                model.end(k, 0, True)
            model.check()
    assert slots.running == 0 and not slots.turns
    for sh in shells:
        assert not sh.lookups.requests()
    settled = [id(d) for sh in shells for d in sh.decided + sh.naked]
    assert sorted(settled) == sorted(id(d) for d in delivered), "every delivery decided or NAKed exactly once"
    assert all(n <= attempts for n in model.tries.values())
    for sh in shells:
        for rid in {d.rid for d in sh.decided}:
            got = [d.n for d in sh.decided if d.rid == rid]
            assert got == sorted(got), f"{rid}'s deliveries decided out of order"


def test_a_flooded_partition_gets_one_turn_in_each_round_of_free_slots():
    """Partition 0 has 5 requests queued, then partition 1 queues one: the next free slots go 0, 1,
    0, 0 ... (partition 1's request does not wait behind partition 0's queue)."""
    slots: LookupSlots[str] = LookupSlots(1)
    a = Lookups(slots, 100, 10, key=0)
    b = Lookups(slots, 100, 10, key=1)
    a.begin("a-running", "x", 1)
    for i in range(5):
        a.wait(f"a{i}", f"a{i}", 1)
    b.wait("b0", "b0", 1)
    order = []
    running = ("a-running", "x", a)
    while True:
        rid, token, lookups = running
        assert lookups.finish(rid, token) == []
        taken = slots.next()
        if taken is None:
            break
        lookups, [token], retry = taken
        assert not retry
        order.append(token)
        lookups.begin(token, token, 1)
        running = (token, token, lookups)
    assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]


def test_a_failed_lookup_waits_behind_the_queue_and_keeps_what_parked_behind_it():
    slots: LookupSlots[str] = LookupSlots(1)
    lookups = Lookups(slots, 100, 4, attempts=2)
    lookups.begin("a", "a0", 1)
    lookups.park("a", "a1", 1)
    lookups.wait("b", "b0", 1)
    assert lookups.retries_left("a") and lookups.retry("a", "a0")
    assert "a" in lookups and list(lookups.queued) == ["b", "a"] and slots.free()
    assert slots.next() == (lookups, ["b0"], False)  # the queue first
    lookups.begin("b", "b0", 1)
    assert lookups.finish("b", "b0") == []
    assert slots.next() == (lookups, ["a0"], True) and lookups.in_flight() == ["a"]  # a retry: in flight at once
    assert list(lookups.tokens()) == ["a0", "a1"] and not slots.free()
    assert not lookups.retries_left("a") and not lookups.retry("a", "a0")  # the last attempt
    assert lookups.finish("a", "a0") == ["a1"] and slots.free() and not lookups.requests()


def test_a_delivery_larger_than_max_bytes_parks_when_nothing_else_is_parked():
    lookups: Lookups[str] = Lookups(LookupSlots(2), max_bytes=100)
    assert lookups.fits(1000)  # nothing parked: one delivery always fits, however large
    lookups.begin("r", "first", 1000)
    assert not lookups.fits(1)


def test_a_finished_lookup_hands_back_only_what_parked_behind_its_own_delivery():
    lookups: Lookups[str] = Lookups(LookupSlots(1), max_bytes=100)
    lookups.begin("r", "first", 10)
    lookups.park("r", "second", 10)
    lookups.park("r", "third", 10)
    assert lookups.finish("r", "first") == ["second", "third"]  # "first" is the caller's own
    assert "r" not in lookups and lookups.parked_bytes == 0 and lookups.room()


def test_lookups_need_one_slot_at_least_no_negative_queue_and_one_attempt():
    with pytest.raises(ValueError, match="limit must be at least 1"):
        LookupSlots(0)
    with pytest.raises(ValueError, match="max_queued must not be negative"):
        Lookups(LookupSlots(1), max_bytes=100, max_queued=-1)
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        Lookups(LookupSlots(1), max_bytes=100, attempts=0)
    assert Lookups(LookupSlots(1), max_bytes=100, max_queued=0).queue_room() is False
