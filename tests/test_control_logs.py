"""The control plane's per-request log lines are rate limited (real nats-server, real ControlPlane).

Anyone allowed to publish on ``P.control.*.migrate`` can send migrates at will, and each one was
logged at INFO (``migrate_error``, ``attempt_sealed``): a flood of them flooded the log.
"""

from __future__ import annotations

import logging

import pytest

from streamproc.core.wire import MigrateError, MigrateErrorCode, MigrateRequest, Subjects, encode_control
from streamproc.logs import LogLimiter, record_fields
from streamproc.nats.control import ControlPlane

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


class UnknownEverywhere:
    """A migrate target that knows no request (as a processor answers ids it never saw)."""

    def owns(self, request_id: str) -> bool:
        return True

    def holds(self, request_id: str) -> bool:
        return False

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateError:
        return MigrateError(request_id, MigrateErrorCode.UNKNOWN_REQUEST, "no chunk of this request has arrived")


async def test_a_flood_of_migrates_logs_a_burst_of_migrate_error_lines_then_one_suppressed_count(client, caplog):
    now = [0.0]
    logger = logging.getLogger("test.control_logs")
    limited = LogLimiter(logger, interval=10.0, burst=3, clock=lambda: now[0])
    subjects = Subjects()
    plane = ControlPlane(client, subjects, UnknownEverywhere(), limited)
    await plane.start()
    try:
        with caplog.at_level(logging.INFO, logger="test.control_logs"):
            for i in range(50):
                reply = await client.request(subjects.migrate(f"r{i}"), encode_control(MigrateRequest()), timeout=5)
                assert b"unknown_request" in reply.data  # every requester is still answered
            now[0] = 10.0
            limited.flush()
    finally:
        await plane.stop(5)
    events = [record_fields(r) for r in caplog.records if r.name == "test.control_logs"]
    assert [e["event"] for e in events] == ["migrate_error"] * 3 + ["log_suppressed"]
    assert events[-1]["suppressed_event"] == "migrate_error" and events[-1]["count"] == 47
