"""One log style for every component: ``event=<name> key=value ...`` (logfmt).

Every line the processor, the durable input, the control plane and the edge write goes through
:func:`log_event`, so a line is always machine-parseable and always starts with its event name.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import msgspec


def kv(**fields: object) -> str:
    """``key=value`` text; values with spaces, quotes or ``=`` are JSON-quoted so lines stay parseable."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = msgspec.json.encode(text).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


def log_event(logger: logging.Logger, level: int, event: str, *, exc_info: bool = False, **fields: object) -> None:
    """Log ``event=<event>`` and the fields at ``level``; costs one level check when disabled.
    ``exc_info`` appends the traceback of the exception being handled (for bugs, not for input)."""
    if logger.isEnabledFor(level):
        logger.log(level, kv(event=event, **fields), exc_info=exc_info)


def error_text(exc: BaseException) -> str:
    """``Type: message``, the form every ``error=`` field uses."""
    return f"{type(exc).__name__}: {exc}"


class LogLimiter:
    """Per-event rate limit for lines one client can cause (per-request warnings, contract errors).

    Within each ``interval`` the first ``burst`` lines of an event name are written; the rest are
    counted and reported as one ``event=log_suppressed suppressed_event=<name> count=<n>`` line when
    the interval is over (at the next line of any limited event, or :meth:`flush`). 40,000
    ``overloaded`` results thus cost a handful of lines per interval, not 40,000.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._windows: dict[str, list] = {}  # event -> [window start, lines, suppressed, level]
        self._next_flush = math.inf

    def log(self, level: int, event: str, **fields: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = self._clock()
        if now >= self._next_flush:
            self.flush(now)
        window = self._windows.get(event)
        if window is None:
            window = self._windows[event] = [now, 0, 0, level]
        window[1] += 1
        if window[1] <= self.burst:
            log_event(self.logger, level, event, **fields)
            return
        if not window[2]:
            self._next_flush = min(self._next_flush, window[0] + self.interval)
        window[2] += 1
        window[3] = max(window[3], level)

    def flush(self, now: float | None = None) -> None:
        """Report suppressed counts of every interval that is over, and start new intervals."""
        now = self._clock() if now is None else now
        self._next_flush = math.inf
        for event, window in list(self._windows.items()):
            start, _, suppressed, level = window
            if now - start < self.interval:
                if suppressed:
                    self._next_flush = min(self._next_flush, start + self.interval)
                continue
            del self._windows[event]
            if suppressed:
                log_event(self.logger, level, "log_suppressed", suppressed_event=event, count=suppressed,
                          interval=self.interval)
