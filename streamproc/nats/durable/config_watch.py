"""What start-up checked once, checked again while running: the chunk and results streams and the
migrations bucket.

Start-up refuses a stream that would lose chunks (discard ``old``), refuse results (discard
``new`` at a limit, a ``max_msg_size`` below ``max_payload``) or lose seal records; the same edit
made under a running processor (a co-tenant on the JetStream domain, an operator) went unseen,
its losses without a word in the log. Streams are never changed here (they may be someone
else's): each new set of problems is logged once as an error and counted, its repair once as info.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import anyio
from nats.aio.client import Client as NatsClient
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from ...logs import error_text, log_event

if TYPE_CHECKING:
    from .input import DurableStats

log = logging.getLogger("streamproc.durable")

Problems = Callable[[StreamConfig], list[str]]


class ConfigWatch:
    """Reads each stream's config every ``every`` seconds and reports what its check finds."""

    def __init__(self, nc: NatsClient, checks: dict[str, Problems], stats: DurableStats, every: float) -> None:
        """``checks``: stream name -> the start-up check's problems of a config (none: as it should be)."""
        self._js = nc.jetstream(timeout=max(0.5, min(every, 5.0)))
        self._checks = checks
        self._stats = stats
        self._every = every
        self._found: dict[str, list[str]] = {name: [] for name in checks}  # as start-up found them: fine

    async def run(self) -> None:
        while True:
            await anyio.sleep(self._every)
            await self.check()

    async def check(self) -> None:
        for name, problems in self._checks.items():
            try:
                found = problems((await self._js.stream_info(name)).config)
            except NotFoundError:
                found = ["the stream is gone (deleted under the running processor)"]
            except Exception as exc:  # noqa: BLE001  (not now: the next round checks again)
                log_event(log, logging.DEBUG, "config_check_failed", stream=name, error=error_text(exc))
                continue
            if found == self._found[name]:
                continue
            self._found[name] = found
            if found:
                self._stats.stream_config_changes += 1
                log_event(log, logging.ERROR, "stream_config_changed", stream=name, found="; ".join(found),
                          detail="edited under the running processor (start-up refuses it); set it back")
            else:
                log_event(log, logging.INFO, "stream_config_restored", stream=name)
