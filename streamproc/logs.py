"""One log style for every component: ``event=<name> key=value ...`` (logfmt).

Every line the processor, the durable input, the control plane and the edge write goes through
:func:`log_event`, so a line is always machine-parseable and always starts with its event name.
"""

from __future__ import annotations

import logging

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
