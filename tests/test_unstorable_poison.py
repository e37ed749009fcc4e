"""A chunk of a request ended because its results can never be stored (its subject full,
``Correlator.unstorable``) that arrives on its ``max_deliver``-th delivery is dropped as
``unstorable``, like the request's every later chunk, not reported as poison: before, it was logged
``chunk_poisoned`` at error ("its request ends with an error result now"), counted in
``streamproc_durable_poisoned_total`` and as an internal error, for a request that had already
ended. Pure: the durable shell's ``Deliveries.poisoned`` with a real correlator and outbox."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from streamproc.config import Settings
from streamproc.core.correlator import UNSTORABLE_CHUNK, Correlator, CorrelatorConfig
from streamproc.core.events import Notice, Role, Settle
from streamproc.core.outbox import ACK, TERM, Outbox
from streamproc.logs import LogLimiter
from streamproc.nats.durable.deliveries import Deliveries
from streamproc.nats.durable.input import DurableStats
from streamproc.testing.harness import leg
from toy_codec import resolve


def deliveries_of(correlator: Correlator, outbox: Outbox, stats: DurableStats) -> Deliveries:
    settings = Settings(max_deliver=3)
    pipeline = SimpleNamespace(correlator=correlator, parse=None,
                               limited=LogLimiter(logging.getLogger("test_unstorable_poison")))
    return Deliveries(None, settings, pipeline, outbox, None, None, None, stats, lambda: 0.0,  # type: ignore[arg-type]
                      unstored={}, offload=lambda d, now: d, tasks=lambda: None)


def test_a_chunk_of_an_unstorable_request_on_its_last_delivery_is_dropped_as_unstorable_not_poison():
    correlator = Correlator(resolve, "toy", CorrelatorConfig(finished_grace=60.0))
    outbox, stats = Outbox(), DurableStats()
    shell = deliveries_of(correlator, outbox, stats)
    chunks = leg("f", Role.AGG, [b"0", b"1", b"2", b"3"])
    correlator.receive(chunks[0], 0.0)
    correlator.unstorable("f", 1.0)
    late = chunks[3]
    out = shell.poisoned(late, late.token, 3, 2.0)
    assert out[0] == Settle((late.token,))
    assert isinstance(out[1], Notice) and out[1].event == UNSTORABLE_CHUNK
    outbox.take(out, "f")
    assert outbox.control() == [(late.token, ACK)]
    assert (stats.poisoned, correlator.stats.unstorable, correlator.stats.internal_errors) == (0, 1, 0)


def test_a_chunk_of_a_request_still_running_on_its_last_delivery_is_still_poison():
    """The exception is only for an unstorable request: any other poison chunk ends its request."""
    correlator = Correlator(resolve, "toy", CorrelatorConfig(finished_grace=60.0))
    outbox, stats = Outbox(), DurableStats()
    shell = deliveries_of(correlator, outbox, stats)
    chunks = leg("r", Role.AGG, [b"0", b"1"])
    correlator.receive(chunks[0], 0.0)
    out = shell.poisoned(chunks[1], chunks[1].token, 3, 2.0)
    assert stats.poisoned == 1 and correlator.stats.internal_errors == 1 and not correlator.is_unstorable("r")
    outbox.take(out, "r")
    (error,) = outbox.sending(2.0)
    assert error.result.final and outbox.on_puback(error.ticket, b'{"stream":"R","seq":1}', 2.1) == "stored"
    assert (chunks[1].token, TERM) in outbox.control()
