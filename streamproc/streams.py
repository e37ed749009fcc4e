"""The JetStream stream that keeps results, so an edge can attach late and a client can resume.

Results are published on core subjects (``P.results.<request_id>``); a stream capturing
``P.results.>`` stores them with their ``Nats-Msg-Id`` (``<request_id>.<seq>``), so a processor
that republishes after a restart is de-duplicated inside ``duplicate_window``. The edge replays a
request's subject from this stream, then follows it live.

:func:`ensure_results_stream` creates the stream or checks an existing one; it never changes a
stream that exists, because a silently shortened ``max_age`` would lose other people's results.
"""

from __future__ import annotations

import msgspec
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import NotFoundError, ServiceUnavailableError

from .wire import Subjects

RESULTS_STREAM = "STREAMPROC_RESULTS"
DEFAULT_MAX_AGE = 3600.0  # seconds a result can still be replayed
DEFAULT_DUPLICATE_WINDOW = 120.0  # seconds within which a republished Nats-Msg-Id is dropped


class ResultsStreamMismatch(RuntimeError):
    """A stream exists but differs from what was asked for; nothing was changed."""

    def __init__(self, name: str, differences: list[str]) -> None:
        super().__init__(
            f"JetStream stream {name!r} does not match the requested results stream: "
            + "; ".join(differences)
            + " (change or delete it deliberately; streamproc never edits it)"
        )
        self.name = name
        self.differences = differences


class ResultsStreamSpec(msgspec.Struct, frozen=True):
    """What a results stream must look like."""

    name: str
    subject: str
    max_age: float
    duplicate_window: float
    storage: StorageType

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description="streamproc results, for late-attaching edges and client resume",
            subjects=[self.subject],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            storage=self.storage,
            allow_direct=True,
        )

    def differences(self, actual: StreamConfig) -> list[str]:
        found = []
        if not any(covers(pattern, self.subject) for pattern in actual.subjects or []):
            found.append(f"subjects {actual.subjects} do not capture {self.subject!r}")
        if actual.retention not in (RetentionPolicy.LIMITS, RetentionPolicy.LIMITS.value):
            found.append(
                f"retention is {_value(actual.retention)!r}, not 'limits' (results must stay readable)"
            )
        if not _close(actual.max_age, self.max_age):
            found.append(f"max_age is {actual.max_age}s, not {self.max_age}s")
        if not _close(actual.duplicate_window, self.duplicate_window):
            found.append(f"duplicate_window is {actual.duplicate_window}s, not {self.duplicate_window}s")
        if _value(actual.storage) != _value(self.storage):
            found.append(f"storage is {_value(actual.storage)!r}, not {_value(self.storage)!r}")
        return found


def _value(x: object) -> object:
    return getattr(x, "value", x)


def _close(a: float | None, b: float) -> bool:
    return abs((a or 0.0) - b) < 1e-3


def covers(pattern: str, subject: str) -> bool:
    """Whether every subject matched by ``subject`` (which may hold wildcards) is matched by ``pattern``."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s):
            return False
        if token == "*":
            if s[i] == ">":
                return False
            continue
        if token != s[i]:
            return False
    return len(p) == len(s)


async def ensure_results_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    name: str = RESULTS_STREAM,
    max_age: float = DEFAULT_MAX_AGE,
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
    storage: StorageType = StorageType.FILE,
) -> StreamInfo:
    """Create the stream capturing ``subjects.all_results``, or check that the existing one fits.

    Raises :class:`ResultsStreamMismatch` when a stream of that name differs, or when another
    stream already captures the results subjects (JetStream forbids overlapping streams).
    """
    spec = ResultsStreamSpec(name, subjects.all_results, max_age, duplicate_window, storage)
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        other = await find_results_stream(js, subjects.all_results)
        if other is not None and other != name:
            raise ResultsStreamMismatch(
                name, [f"stream {other!r} already captures {spec.subject!r}"]
            ) from None
        return await js.add_stream(spec.config())
    differences = spec.differences(info.config)
    if differences:
        raise ResultsStreamMismatch(name, differences)
    return info


async def find_results_stream(js: JetStreamContext, subject: str) -> str | None:
    """The stream that stores ``subject``, or None (also when the server has no JetStream)."""
    try:
        return await js.find_stream_name_by_subject(subject)
    except (NotFoundError, ServiceUnavailableError, NoRespondersError):
        return None
