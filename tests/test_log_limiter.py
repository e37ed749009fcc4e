"""Rate-limited logging: a flood of per-request warnings costs a few lines per interval and a count."""

from __future__ import annotations

import logging

import pytest

from streamproc.logs import LogLimiter


def test_a_flood_of_one_event_logs_the_burst_then_one_suppressed_count_per_interval(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("test.limiter"), interval=10.0, burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.limiter"):
        for i in range(40_000):
            limiter.log(logging.WARNING, "overloaded", request_id=f"r{i}")
        limiter.log(logging.WARNING, "other", request_id="x")  # another event has its own budget
        now[0] = 10.5
        limiter.log(logging.WARNING, "overloaded", request_id="again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"event=overloaded request_id=r{i}" for i in range(3)]
    assert lines[3] == "event=other request_id=x"
    assert lines[4] == "event=log_suppressed suppressed_event=overloaded count=39997 interval=10.0"
    assert lines[5] == "event=overloaded request_id=again"
    assert len(lines) == 6


def test_flush_reports_suppressed_lines_once_the_interval_is_over_even_without_new_events(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("test.limiter2"), interval=5.0, burst=1, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.limiter2"):
        limiter.log(logging.WARNING, "e")
        limiter.log(logging.ERROR, "e")
        limiter.flush(4.0)
        assert len(caplog.records) == 1
        limiter.flush(5.0)
        limiter.flush(20.0)
    assert [r.getMessage() for r in caplog.records][1] == "event=log_suppressed suppressed_event=e count=1 interval=5.0"
    assert caplog.records[1].levelno == logging.ERROR
    assert len(caplog.records) == 2


@pytest.mark.anyio
@pytest.mark.nats
async def test_a_flood_of_bad_control_subjects_logs_the_burst_not_every_message(caplog, nats_url):
    """Anyone allowed on P.control.*.migrate can send ids the contract refuses, at will."""
    import anyio
    import nats

    from streamproc import config
    from streamproc.nats.processor import Processor

    settings = config.load({}, {"nats_url": nats_url, "format": "sglang", "mode": "core"})
    with caplog.at_level(logging.WARNING, "streamproc"):
        async with Processor(settings) as p:
            async with await nats.connect(nats_url) as nc:
                for i in range(300):
                    await nc.publish(f"{p.subjects.prefix}.control.\u00e9{i}.migrate", b"{}")
                await nc.flush()
                await anyio.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if "bad_control_subject" in r.getMessage()]
    assert 1 <= len(lines) <= 20, len(lines)
