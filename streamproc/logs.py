"""One log style for every component: ``event=<name> key=value ...`` (logfmt), or JSON.

Every line the processor, the durable input, the control plane and the edge write goes through
:func:`log_event`, so a line is always machine-parseable and always names its event.
:func:`configure` installs the one formatter on the root logger, so lines from libraries
(Uvicorn's error and access logs, nats-py) come out in the same format: ``event=log msg=...``,
and ``event=http_request`` for Uvicorn's access log.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import re
import sys
import time
from typing import Any, Callable, Literal, TextIO
from urllib.parse import unquote_plus

import msgspec

from .core.errors import shown

LogFormat = Literal["logfmt", "json"]
_FIELDS = "streamproc_fields"  # the LogRecord attribute that carries log_event's fields


def kv(**fields: object) -> str:
    """``key=value`` text; values with spaces, quotes, ``=`` or anything unprintable (a subject or id
    an attacker chose: VT, ESC, DEL, U+2028) are quoted with every such character escaped, so lines
    stay parseable and a terminal shows them inert."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or not text.isprintable() or any(c in text for c in ' "=\\'):
            text = json.dumps(text, ensure_ascii=False)  # readable text stays as it is
            if not text.isprintable():
                text = "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def log_event(logger: logging.Logger, level: int, event: str, *, exc_info: bool = False, **fields: object) -> None:
    """Log ``event=<event>`` and the fields at ``level``; costs one level check when disabled.
    ``exc_info`` appends the traceback of the exception being handled (for bugs, not for input)."""
    if logger.isEnabledFor(level):
        record_fields = {"event": event, **fields}
        logger.log(level, kv(**record_fields), exc_info=exc_info, extra={_FIELDS: record_fields})


def error_text(exc: BaseException) -> str:
    """``Type: message``, the form every ``error=`` field uses. An exception group (an anyio task
    group wraps even one failure) is named by what it holds: the one exception inside, or how many
    and the first. Before, a durable recovery lookup that timed out was logged as
    ``ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)``, hiding the timeout."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        return f"{len(exc.exceptions)} errors, the first {error_text(exc.exceptions[0])}"
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
ACCESS_TOKEN = "access_token"  # the edge's query parameter for a capability (RFC 6750 section 2.3)
# Characters of a path the access log writes whole: more than any path the edge serves (``/v1/results/``,
# an id of 256 characters that Uvicorn's ``quote`` may triple, its query). A longer one is a client's
# choice up to --max-head-bytes (64 KiB): it is cut as every hostile value is (errors.shown).
ACCESS_LOG_PATH_CHARS = 1024
# Characters of a client address the access log writes whole: ``host:port``, IPv6 with a zone
# included. Behind a proxy --forwarded-allow-ips names it is a hop of X-Forwarded-For, which Uvicorn
# keeps as written (a client's choice up to --max-head-bytes): a longer one is cut as a path is.
ACCESS_LOG_CLIENT_CHARS = 100


def names_access_token(name: str) -> bool:
    """Whether a query parameter's name, as spelled, is ``access_token`` as Starlette reads it
    (``parse_qsl``: names percent-decoded, ``+`` a space), case ignored: ``?access%5Ftoken=<jwt>`` is a
    capability too, and the edge reads only ``access_token``, but a client that sent ``Access_Token=``
    sent a capability all the same."""
    return name == ACCESS_TOKEN or (len(name) >= len(ACCESS_TOKEN) and unquote_plus(name).lower() == ACCESS_TOKEN)


def carries_access_token(query: str) -> bool:
    """Whether a URL's query (without ``?``) holds a parameter :func:`names_access_token`, or an
    ``access_token=`` the edge does not read but the access log redacts (:func:`redact_access_token`:
    behind ``;``, or with its ``=`` or the ``&`` before it percent-encoded; until 2026-12-06 such a
    page was cacheable, its URL and token with it)."""
    return bool(query) and (any(names_access_token(field.partition("=")[0]) for field in query.split("&"))
                            or (_may_spell_token(query) and _TOKEN_IN_PATH.search(query) is not None))


def _spelled(text: str) -> str:
    """A pattern for ``text`` with any of its characters percent-encoded, once or (as Uvicorn's ``quote``
    shows a ``%`` of the path) as ``%25XX``: Starlette decodes query names, so ``%61ccess_token`` is
    ``access_token`` (until 2026-12-06 only ``_`` and ``=`` were matched encoded)."""
    def one(c: str) -> str:
        codes = sorted({f"{ord(c.lower()):02X}", f"{ord(c.upper()):02X}"})
        return f"(?:{re.escape(c)}|%(?:25)?(?:{'|'.join(codes)}))"
    return "".join(one(c) for c in text)


# ``access_token=<value>`` inside a path as Uvicorn's access log shows it (``quote``d: ``?`` is ``%3F``,
# ``=`` ``%3D``, ``;`` ``%3B``), or in a query where the edge does not read it as a name (behind ``;``,
# an encoded ``&`` or ``=``), any of its characters percent-encoded: the value runs to the next
# delimiter, raw or percent-encoded.
_TOKEN_IN_PATH = re.compile(f"({_spelled(ACCESS_TOKEN)}{_spelled('=')})"
                            r"((?:[^&;/?%]|%(?!26|2F|3B|3F)[0-9A-F]{2})*)", re.IGNORECASE)


def _may_spell_token(text: str) -> bool:
    """Cheap test before :data:`_TOKEN_IN_PATH`: ``token`` appears, or some character is encoded."""
    return "%" in text or "token" in text.lower()


def redact_access_token(path: str) -> str:
    """``path`` with the value of every query parameter that the edge reads as ``access_token`` replaced
    by ``<redacted>`` (:func:`names_access_token`; only the literal spelling was redacted before
    2026-12-01), and of every ``access_token=`` inside the path itself: a client that percent-encoded
    its whole ``<id>?access_token=<jwt>``, or wrote ``;access_token=``, is refused (the token is part of
    the id, or of no route), but its token was logged whole until 2026-12-06; so was one in the query
    behind ``;`` or with an encoded ``=`` or ``&``."""
    base, sep, query = path.partition("?")
    if _may_spell_token(base):
        base = _TOKEN_IN_PATH.sub(r"\1<redacted>", base)
    if not sep:
        return base
    if _may_spell_token(query):  # the query's spellings no field name matches (a=1;access_token=<jwt>,
        # access_token%3D<jwt>, a=1%26access_token=<jwt>): logged whole until 2026-12-06
        query = _TOKEN_IN_PATH.sub(r"\1<redacted>", query)
    fields = query.split("&")
    for i, field in enumerate(fields):
        name = field.partition("=")[0]
        if names_access_token(name):
            fields[i] = f"{name}=<redacted>"
    return f"{base}?{'&'.join(fields)}"


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of any record: log_event's own, or ones made from a library's message."""
    fields = getattr(record, _FIELDS, None)
    if fields is not None:
        return dict(fields)
    if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
        client, method, path, version, status = record.args
        if isinstance(path, str) and ("?" in path or _may_spell_token(path)):  # a capability (RFC 6750 2.3)
            path = redact_access_token(path)
        if isinstance(path, str) and len(path) > ACCESS_LOG_PATH_CHARS:  # after the redaction: no token part kept
            path = shown(path)
        if isinstance(client, str) and len(client) > ACCESS_LOG_CLIENT_CHARS:
            client = shown(client)
        return {"event": "http_request", "client": client, "method": method, "path": path,
                "http_version": version, "status": status}
    return {"event": "log", "msg": record.getMessage()}


class StructuredFormatter(logging.Formatter):
    """``ts=... level=... logger=... event=... k=v`` (logfmt) or one JSON object per line."""

    def __init__(self, fmt: LogFormat = "logfmt") -> None:
        super().__init__()
        self.format_name = fmt

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        head = {"ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "level": record.levelname.lower(), "logger": record.name}
        fields = record_fields(record)
        if record.exc_info:
            fields["traceback"] = self.formatException(record.exc_info)
        if self.format_name == "json":
            return _inert(msgspec.json.encode({**head, **fields}, enc_hook=str).decode())
        return kv(**head, **fields)


def _inert(line: str) -> str:
    """A JSON line with every unprintable character escaped, as :func:`kv` does for logfmt. msgspec
    escapes only what JSON requires (below U+0020, quote, backslash): U+2028, U+2029 and NEL, which
    split a line for ``str.splitlines`` and many log viewers, and the C1 CSI and DEL, which drive a
    terminal, stayed raw. Outside strings a JSON line is ASCII, so only string contents change, and
    each escape reads back as the same character."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in line)


def configure(level: str = "INFO", fmt: LogFormat = "logfmt", stream: TextIO | None = None) -> None:
    """Route every logger through one handler with the one format (replaces earlier handlers)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(StructuredFormatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # no handlers of their own: propagate
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
