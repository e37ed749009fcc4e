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
import traceback
from types import TracebackType
from typing import Any, Callable, Literal, TextIO
from urllib.parse import unquote_plus

import msgspec

from .core.errors import (MAX_LOG_CHAIN, MAX_LOG_FRAMES, MAX_LOG_MESSAGE, MAX_LOG_TRACEBACK, cut_error_text,
                          error_text_size, escaped_size, shown, without_lone_surrogates)

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
    # A library may log a peer's or client's value whole: cut with every long field (StructuredFormatter)
    return {"event": "log", "msg": record.getMessage()}


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"
MAX_LOG_NOTES = 3  # __notes__ of an exception kept (each cut as its message), and sub-exceptions of a group


def exception_line(exc: BaseException) -> str:
    """``module.Type: message`` as a traceback ends, the message cut (``cut_error_text``: it may echo a
    worker's input), then its first notes, each cut, and a group's first sub-exceptions (their lines)."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not lose the line
        text = "<exception str() failed>"
    lines = [cut_error_text(f"{name}: {text}" if text else name)]
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, (list, tuple)):
        lines += [cut_error_text(str(note)) for note in notes[:MAX_LOG_NOTES]]
        if len(notes) > MAX_LOG_NOTES:
            lines.append(f"[{len(notes) - MAX_LOG_NOTES} more notes not shown]")
    if isinstance(exc, BaseExceptionGroup):
        subs = exc.exceptions
        shown_subs = enumerate(subs[:MAX_LOG_NOTES], 1)
        lines += [f"  +-- {i}: {cut_error_text(_one_line(sub))}" for i, sub in shown_subs]
        if len(subs) > MAX_LOG_NOTES:
            lines.append(f"  +-- [{len(subs) - MAX_LOG_NOTES} more sub-exceptions not shown]")
    return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__}: <exception str() failed>"


# traceback's own walk and extraction (private in 3.11 and 3.12); the public ones where they are gone
_WALK = getattr(traceback, "_walk_tb_with_full_positions", None)
_EXTRACT = getattr(traceback.StackSummary, "_extract_from_extended_frame_gen", None)
if _WALK is None or _EXTRACT is None:  # pragma: no cover - a later CPython
    _WALK, _EXTRACT = traceback.walk_tb, traceback.StackSummary.extract


def _frames(tb: TracebackType | None) -> str:
    """The last :data:`MAX_LOG_FRAMES` frames of a traceback as ``traceback`` prints them, and how many
    earlier ones were left out (walking the traceback is cheap; formatting 100,000 frames is not)."""
    if tb is None:
        return ""
    count = 0

    def counted():
        nonlocal count
        for item in _WALK(tb):
            count += 1
            yield item
    # As TracebackException.__init__ (CPython 3.11) extracts them: "_extract_from_extended_frame_gen(
    # _walk_tb_with_full_positions(exc_traceback), limit=limit, ...)", the positions (lines, carets)
    # taken from each frame's last instruction; and StackSummary._extract_from_extended_frame_gen: "if
    # limit >= 0: frame_gen = itertools.islice(frame_gen, limit) else: frame_gen =
    # collections.deque(frame_gen, maxlen=-limit)": a negative limit keeps the last frames.
    stack = _EXTRACT(counted(), limit=-MAX_LOG_FRAMES)
    left_out = count - len(stack)
    head = "Traceback (most recent call last):\n"
    if left_out:
        head += f"  [{left_out} earlier frames not shown]\n"
    return head + "".join(stack.format())


def bounded_traceback(exc_info: tuple) -> str:
    """A record's traceback as ``traceback.format_exception`` writes it, bounded whatever the exception:
    the last :data:`MAX_LOG_CHAIN` exceptions of its ``__cause__`` / ``__context__`` chain, the last
    :data:`MAX_LOG_FRAMES` frames of each, each message cut (:func:`exception_line`), and the whole at most
    :data:`MAX_LOG_TRACEBACK` bytes as JSON (:func:`_cut_middle`). ``formatException`` wrote it whole: a
    codec's 10 MB exception message was a 10 MB log line."""
    value = exc_info[1]
    if value is None:
        return "NoneType: None"
    chain: list[tuple[BaseException, str]] = []  # newest first, each with how it follows the next one
    seen: set[int] = set()
    exc: BaseException | None = value
    earlier = 0
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__cause__ is not None:
            older, how = exc.__cause__, _CAUSE
        elif exc.__context__ is not None and not exc.__suppress_context__:
            older, how = exc.__context__, _CONTEXT
        else:
            older, how = None, ""
        if len(chain) < MAX_LOG_CHAIN:
            chain.append((exc, how))
        else:
            earlier += 1
        exc = older
    parts = [f"[{earlier} earlier exceptions of the chain not shown]\n"] if earlier else []
    for i in range(len(chain) - 1, -1, -1):
        exc, how = chain[i]
        if i < len(chain) - 1 or earlier:
            parts.append(how)  # how it follows the older one printed above it
        tb = exc_info[2] if exc is value else exc.__traceback__
        parts.append(_frames(tb) + exception_line(exc) + "\n")
    return _cut_middle("".join(parts).rstrip("\n"), MAX_LOG_TRACEBACK)


def _cut_middle(text: str, limit: int) -> str:
    """``text`` if it takes at most ``limit`` bytes as JSON, else its start and end in that many with
    how many characters between were left out (the start names the first exception, the end the one
    logged). Lone surrogates (a file name's) become U+FFFD, as ``cut_error_text`` does."""
    text = without_lone_surrogates(text)
    if error_text_size(text) <= limit:
        return text
    marker = "\n[... {} characters not shown ...]\n"
    budget = (limit - len(marker) - 20) // 2
    start = 0
    left = budget
    while left - escaped_size(text[start]) >= 0:
        left -= escaped_size(text[start])
        start += 1
    end = len(text)
    left = budget
    while left - escaped_size(text[end - 1]) >= 0:
        left -= escaped_size(text[end - 1])
        end -= 1
    return text[:start] + marker.format(end - start) + text[end:]


# A field value shorter than this takes at most MAX_LOG_MESSAGE bytes as JSON (6 at most a character):
# only a longer one is measured (cut_error_text), so an ordinary line costs one len() per field.
_FIELD_CHARS = MAX_LOG_MESSAGE // 6


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
        for key, value in fields.items():  # error=<exc> and the like: 49 fields carry an exception's text
            if isinstance(value, str) and len(value) > _FIELD_CHARS:
                fields[key] = cut_error_text(value, MAX_LOG_MESSAGE)
        if record.exc_info:
            fields["traceback"] = bounded_traceback(record.exc_info)  # bounded: messages may echo input
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
