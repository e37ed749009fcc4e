"""Every exception streamproc raises on purpose, under one base class.

``except StreamprocError`` catches all of them; the subclasses keep the builtin bases they had
(``ValueError``, ``LookupError``, ``RuntimeError``) so existing ``except`` clauses keep working.
Pure: nothing here imports an I/O library, so the core, the shell and the codecs share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wire import MigrateError


class StreamprocError(Exception):
    """Base of every error streamproc raises on purpose."""


# Characters of a worker's value that an error text shows (shown()).
MAX_SHOWN = 64
MAX_REPLY_MESSAGE = 1000  # characters of a migrate error's message kept in MigrationError


def shown(value: str) -> str:
    """``repr(value)`` for an error text, cut to its first :data:`MAX_SHOWN` characters and its
    length. A worker chooses a header value's length (up to ``max_payload``); echoed whole, one
    chunk made an error result too large to publish and a log line of that size."""
    if len(value) <= MAX_SHOWN:
        return repr(value)
    return f"{value[:MAX_SHOWN]!r}... ({len(value)} characters)"


# Bytes an error result's text may take as JSON (cut_error_text): a text built from a worker's input (a
# role, a codec's exception echoing a field) could exceed a lowered max_payload, and an error result is
# never replaced, so its chunk was NAKed and redelivered until --max-deliver. Counted in bytes, not
# characters: 512 characters of control characters were ~3 KiB as JSON escapes (\u0001 is 6 bytes).
MAX_ERROR_TEXT = 512


# A log line's traceback (logs.StructuredFormatter): the last MAX_LOG_FRAMES frames of each exception
# (frames are the code's; 16 show the path from a handler into a codec plugin), at most MAX_LOG_CHAIN
# exceptions of a __cause__ / __context__ chain (the last ones: the one logged and what led to it), each
# exception's message cut as an error result's is (cut_error_text, MAX_ERROR_TEXT bytes as JSON: it may
# echo a worker's input), and the whole at most MAX_LOG_TRACEBACK bytes as JSON (its start and end kept).
# 16 KiB holds 4 x (16 frames of ~200 bytes + 512) with room; before, a codec's 10 MB exception message
# was a 10 MB log line, and 100,000 chained exceptions one of ~20 MB.
MAX_LOG_FRAMES = 16
MAX_LOG_CHAIN = 4
MAX_LOG_TRACEBACK = 16384
# Bytes as JSON of a library's log message (``event=log msg=...``: nats-py, Uvicorn), which may carry
# a hostile value (a peer's error text): cut as an error text is.
MAX_LOG_MESSAGE = 4096


def escaped_size(char: str) -> int:
    """The most bytes ``char`` takes in a JSON string, whichever encoder a codec uses: ``\\uXXXX``
    for a control character or (``ensure_ascii``) any non-ASCII one, a surrogate pair (12) for an
    astral one; UTF-8 is never longer (at most 3 and 4 bytes)."""
    code = ord(char)
    if code < 0x20 or 0x7F <= code < 0x10000:
        return 6
    if code >= 0x10000:
        return 12
    return 2 if char == '"' or char == "\\" else 1


def error_text_size(message: str) -> int:
    """The most bytes ``message`` takes as a JSON string's content (:func:`escaped_size` each)."""
    if message.isascii() and message.isprintable() and '"' not in message and "\\" not in message:
        return len(message)
    return sum(escaped_size(c) for c in message)


def without_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (a file name's, a hostile ``\\ud800`` escape's) as U+FFFD: no
    UTF-8 encoder takes one."""
    if text.isascii():
        return text
    return "".join("\ufffd" if 0xD800 <= ord(c) < 0xE000 else c for c in text)


def cut_error_text(message: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``message`` as an error result's text and its log line carry it: at most ``limit`` (by default
    :data:`MAX_ERROR_TEXT`) bytes as JSON under any encoder (:func:`error_text_size`), else cut on a
    character boundary and followed by its length. A lone surrogate (no UTF-8 encoder takes it) becomes
    U+FFFD. Reads at most ``limit`` + 1 characters (each is at least a byte), whatever the text's length."""
    length = len(message)
    head = without_lone_surrogates(message[:limit + 1])
    if length <= limit and error_text_size(head) <= limit:
        return head
    suffix = f"... ({length} characters)"
    budget = limit - len(suffix)
    end = 0
    for char in head:
        budget -= escaped_size(char)
        if budget < 0:
            break
        end += 1
    return head[:end] + suffix


def over_max_payload(seq: int, max_payload: int) -> str:
    """Why result ``seq`` was replaced by an error result (``Correlator.unpublishable``): the client
    refuses it every time, so the request ends there, in core and durable mode alike."""
    return (f"result {seq} could not be delivered: with its headers it is larger than the NATS server's "
            f"max_payload ({max_payload} bytes)")


# ------------------------------------------------------------------ input and formats

class ContractError(StreamprocError, ValueError):
    """A message that breaks the wire contract. ``request_id`` is None when even that is unreadable."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


class CorruptPayload(StreamprocError, ValueError):
    """A sequence payload that cannot be decoded safely. ``reason`` becomes the omission marker."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class UnknownFormat(StreamprocError, LookupError):
    """A format name no installed codec registers."""

    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f"unknown format {shown(name)}; installed codecs: {', '.join(available) or 'none'}")
        self.name = name
        self.available = available


class CodecUnavailable(UnknownFormat):
    """An installed codec that cannot be used: it failed to import or to build with the processor's
    options (a ``--format-option`` value it refuses). A request naming it fails as an unknown format
    would; the processor, started with another default format, answers everyone else. A failure
    that is not a configuration error is tried again after a while (``streamproc.catalog.Catalog``)."""

    def __init__(self, name: str, reason: str) -> None:
        StreamprocError.__init__(self, f"codec {shown(name)} failed to load: {reason}")
        self.name = name
        self.available = []
        self.reason = reason


class MigrationRefused(StreamprocError):
    """This request cannot continue on another worker (n > 1, guided decoding, unreadable output...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PublishRefused(StreamprocError, RuntimeError):
    """A durable publish was not stored: the stream refused it (limits, storage full) or no PubAck came
    after the bounded retries. The worker must know: the chunk is not in the stream. Also raised, in
    either mode, for a chunk larger than the server's ``max_payload`` (headers included): not sent."""

    def __init__(self, subject: str, reason: str, *, retryable: bool) -> None:
        super().__init__(f"chunk on {subject!r} not stored: {reason}")
        self.subject = subject
        self.reason = reason
        self.retryable = retryable  # True: no answer in time (may work later); False: the stream said no


class ChunkIdTaken(PublishRefused):
    """A durable publish came back ``duplicate`` for a chunk this publisher had not stored: another
    publisher stored a chunk under the same ``Nats-Msg-Id`` first (a forged or misrouted chunk, or
    an earlier worker's), so this one was dropped by the stream and the processor never saw it."""

    def __init__(self, subject: str, reason: str) -> None:
        super().__init__(subject, reason, retryable=False)


class StoredResultsRefused(StreamprocError, RuntimeError):
    """The edge may not read stored results by subject (``STREAM.MSG.GET``): the server refused the
    publish (``denied``), nobody answers the subject, or no reply came within the timeout. The
    replay reads with consumers alone then, or its feed with an ordered consumer of its own
    (edge/msg_get.py, edge/replay.py)."""

    def __init__(self, reason: str, *, denied: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.denied = denied

    def __str__(self) -> str:
        return self.reason


class StoredHistoryUnreadable(StreamprocError, RuntimeError):
    """The edge's replay read with consumers alone (``STREAM.MSG.GET`` refused) and its consumer's
    pulls kept ending with nothing brought for a reason that says nothing of what is stored (a
    ``408``/``409`` status: edge/replay.py, ``_busy``): the stream ends with an error event (``Lost``)
    instead of reading its history outside the read budget."""


class ReplayRefused(StreamprocError, RuntimeError):
    """A replay (``follow(replay=True)``) the NATS server refused: this connection's user may not
    publish ``subject``, a JetStream API request the replay needs (``permission`` names the grant).
    nats-server drops a refused publish and says so only on the connection (``-ERR 'Permissions
    Violation for Publish to "<subject>"'``), never to the request, which would wait out its
    timeout: the reader raises this one round trip after the request instead. A RuntimeError, not a
    PermissionError (an OSError, which network-retry code retries): no retry grants the right."""

    def __init__(self, subject: str, permission: str, detail: str, *, imported: bool = False) -> None:
        # imported: the publish went out but nothing in this account answers it ("no responders"):
        # the account lacks the service import of ``permission`` (or the stream's account its export)
        what = ("an import (and the results stream's account an export, response_type: stream) of"
                if imported else "publish permission on")
        super().__init__(f"the NATS server refused this connection's {'request on' if imported else 'publish to'} "
                         f"{subject!r} ({detail}): a replay needs {what} {permission!r} (docs/security.md)")
        self.subject = subject
        self.permission = permission


class MalformedResult(StreamprocError, ValueError):
    """A message on a results subject that does not follow the contract."""


class ResultsOverrun(StreamprocError, RuntimeError):
    """A reader held more of one request's results than it may (received, not yet read: behind a
    missing seq or ahead of a slow reader); the stream is ended rather than grown without bound."""


class MigrationError(StreamprocError):
    """The processor answered a migrate with an error; ``code`` says which (``MigrateErrorCode``)."""

    def __init__(self, reply: MigrateError) -> None:
        message = reply.message  # the replier's text: bounded, as any text another party chose
        if len(message) > MAX_REPLY_MESSAGE:
            message = f"{message[:MAX_REPLY_MESSAGE]}... ({len(message)} characters)"
        super().__init__(f"{reply.code.value}: {message}")
        self.reply = reply
        self.code = reply.code


class InvalidCapability(StreamprocError, ValueError):
    """A client's edge capability (JWT) that is missing, malformed, badly signed, expired or not for
    the edge. The message is safe to show to the client: it never holds the token."""


# ------------------------------------------------------------------- configuration and start-up

class ConfigError(StreamprocError, ValueError):
    """A setting that cannot be used; the message names the flag or variable it came from."""


class StartupError(StreamprocError, RuntimeError):
    """A component cannot start (unknown format, broken codec, NATS unreachable). A user error."""


class NatsPyUnsupported(StartupError):
    """The installed nats-py lacks what streamproc reads of it (its supported range, or an internal
    listed in nats/internals.py): the edge refuses to start, the stock-path client to connect. Its text
    is one line."""


class StaleBuild(StartupError):
    """A compiled module (scripts/build-compiled) whose source changed since it was built: the
    compiled one would run in the edited source's place, so streamproc refuses to import."""


class EmbeddedNatsError(StartupError):
    """The embedded server's binary is missing, or the server did not come up."""


class StreamMismatch(StartupError):
    """A JetStream stream exists but differs from what was asked for; nothing was changed."""

    what = "stream"

    def __init__(self, name: str, differences: list[str]) -> None:
        super().__init__(
            f"JetStream stream {name!r} does not match the requested {self.what}: "
            + "; ".join(differences)
            + " (change or delete it deliberately; streamproc never edits it)"
        )
        self.name = name
        self.differences = differences


class ResultsStreamMismatch(StreamMismatch):
    what = "results stream"


class ResultsStreamCannotStore(ConfigError):
    """The results stream's limits would refuse results (discard new at a limit, a message size
    below what a result may be): refused at start-up, a configuration error, rather than results
    retried and given up one by one in production."""

    def __init__(self, name: str, problems: list[str]) -> None:
        super().__init__(
            f"JetStream stream {name!r} cannot store every result: " + "; ".join(problems)
            + " (use discard 'old' or no such limit, no_ack false, max_msgs_per_subject -1, a max_bytes that holds one maximal result, and a max_msg_size "
            "of at least the server's max_payload; "
            "streamproc never edits the stream)")
        self.name = name
        self.problems = problems


class ChunkStreamMismatch(StreamMismatch):
    what = "chunk stream"


class LeaseBucketMismatch(StreamMismatch):
    what = "lease bucket"


class MigrationBucketMismatch(StreamMismatch):
    what = "migrations bucket"


class UnreadableRecord(StreamprocError, ValueError):
    """A value in the migrations bucket is not a seal record (something else wrote it)."""

    def __init__(self, request_id: str, detail: str) -> None:
        super().__init__(f"seal record of {request_id!r} is unreadable: {detail}")


class MissingResults(StreamprocError, LookupError):
    """Stored results a seal record relies on are gone (expired, or the results stream was purged)."""

    def __init__(self, request_id: str, count: int, missing: list[int]) -> None:
        super().__init__(f"results of {request_id!r} below seq {count} are not stored (first missing: {missing})")


class HistoryOverBound(MissingResults):
    """A take-over's read of one request's stored bodies stopped at its bound (``MAX_HISTORY_BYTES``,
    ``MAX_HISTORY_RESULTS``): not usable, as if gone (the heir never holds a whole huge output)."""

    def __init__(self, request_id: str, why: str) -> None:
        StreamprocError.__init__(self, f"stored results of {request_id!r} not read back: {why}")
        self.why = why  # the bound and what passed it, without the request id (an error result's text)
