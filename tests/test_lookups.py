"""Recovery lookups of a durable partition and the deliveries parked behind them
(:mod:`streamproc.core.lookups`), pure: a model of the shell's use of them, driven by hypothesis."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.lookups import Lookups


@dataclass(eq=False)
class Delivery:
    rid: str
    n: int  # delivery order, across requests
    size: int
    needs: bool  # needs a lookup when it is decided and its request has none in flight


@dataclass
class Shell:
    """The partition's shell as durable_input.py drives :class:`Lookups`: one callback, deciding its
    inbox in order and waiting (blocked) when there is no room; lookups that end in any order."""

    lookups: Lookups[Delivery]
    inbox: list[Delivery] = field(default_factory=list)
    decided: list[Delivery] = field(default_factory=list)
    naked: list[Delivery] = field(default_factory=list)
    largest: int = 0

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
        if admit and not (lookups.room() and lookups.fits(d.size)):
            return False
        lookups.begin(d.rid, d, d.size)
        return True

    def step(self) -> bool:
        """The callback takes the inbox's first delivery; False when it must wait for room."""
        if not self.inbox or not self.settle(self.inbox[0], admit=True):
            return False
        self.inbox.pop(0)
        return True

    def end(self, rid: str, ok: bool) -> None:
        """The lookup of ``rid`` ends (found, or failed and retried later)."""
        d = self.lookups.by_request[rid][0][0]
        later = self.lookups.finish(rid, d)
        assert later is not None
        if not ok:
            self.naked.extend([d, *later])
            return
        self.decide(d)
        for b in later:
            self.settle(b, admit=False)

    def check(self) -> None:
        lookups = self.lookups
        assert len(lookups) <= lookups.limit
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
@given(limit=st.integers(1, 4), max_bytes=st.integers(0, 100), script=ops, hand_over=st.booleans())
def test_each_request_is_decided_in_order_within_the_bounds_and_a_hand_over_returns_every_token_once(
        limit, max_bytes, script, hand_over):
    shell = Shell(Lookups(limit, max_bytes))
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
            rids = shell.lookups.requests()
            if rids:
                shell.end(rids[i % len(rids)], ok)
        shell.check()
    if hand_over:
        returned = shell.lookups.abandon()
        assert len(shell.lookups) == 0 and shell.lookups.parked_bytes == 0 and list(shell.lookups.tokens()) == []
        for d in returned:  # a lookup that ends later finds nothing to decide
            assert shell.lookups.finish(d.rid, d) is None
        shell.naked.extend(returned)
        shell.naked.extend(shell.inbox)  # the callback NAKs what the handed-over partition still gets
        shell.inbox.clear()
    else:  # run to the end: every lookup found the request, every delivery is decided
        while shell.inbox or len(shell.lookups):
            if not shell.step() and len(shell.lookups):
                shell.end(shell.lookups.requests()[0], True)
            shell.check()
    settled = [id(d) for d in shell.decided + shell.naked]
    assert sorted(settled) == sorted(id(d) for d in delivered), "every delivery decided or NAKed exactly once"
    for rid in "abcdef":
        got = [d.n for d in shell.decided if d.rid == rid]
        assert got == sorted(got), f"{rid}'s deliveries decided out of order"


def test_one_delivery_always_parks_and_a_full_partition_has_no_room():
    lookups: Lookups[str] = Lookups(2, max_bytes=10)
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
