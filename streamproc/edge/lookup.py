"""Which JetStream stream stores a request's results, without asking the server on every open.

Asking per open (``$JS.API.STREAM.NAMES`` filtered by ``P.results.<id>``) was a round trip to a
busy nats-server on the path of every SSE open. The answer for the whole results namespace
changes only when an operator creates, deletes or edits a stream, so it is asked for
``P.results.>`` once per ``ttl`` seconds: no stream there means none stores any request's results;
a stream there (its subjects fetched once with its info) stores exactly the ids its subjects match,
checked here. An id the cached stream does not match (a results namespace split over several
streams) is asked about on its own, as before. The feed drops the cache when a subscription to the
cached stream fails (it was deleted) and asks again.
"""

from __future__ import annotations

import time

import anyio
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from ..core.wire import Subjects
from ..nats.streams import find_results_stream

STREAM_LOOKUP_TTL = 2.0  # seconds a stream created later may go unseen (its clients get core subscriptions)


class StreamLookup:
    def __init__(self, subjects: Subjects, ttl: float = STREAM_LOOKUP_TTL) -> None:
        self.subjects = subjects
        self.ttl = ttl
        self._expires = 0.0
        self._stream: str | None = None
        self._patterns: list[list[str]] = []
        self._refresh = anyio.Lock()  # a burst of opens asks once

    async def find(self, js: JetStreamContext, subject: str) -> str | None:
        """The stream that stores ``subject`` (one request's results subject), or None."""
        if time.monotonic() >= self._expires:
            async with self._refresh:
                if time.monotonic() >= self._expires:
                    await self._ask(js)
        if self._stream is None:
            return None
        tokens = subject.split(".")
        if any(subject_matches(p, tokens) for p in self._patterns):
            return self._stream
        return await find_results_stream(js, subject)  # another stream may store this part of the namespace

    async def _ask(self, js: JetStreamContext) -> None:
        asked = time.monotonic()
        stream = await find_results_stream(js, self.subjects.all_results)
        patterns: list[list[str]] = []
        if stream is not None:
            try:
                info = await js.stream_info(stream)
            except NotFoundError:  # deleted in between
                stream = None
            else:
                patterns = [p.split(".") for p in info.config.subjects or []]
        self._stream, self._patterns, self._expires = stream, patterns, asked + self.ttl

    def forget(self) -> None:
        """The cached stream refused a subscription: ask the server on the next open."""
        self._expires = 0.0


def subject_matches(pattern: list[str], subject: list[str]) -> bool:
    """NATS subject matching on tokens: ``*`` is one token, a final ``>`` one or more."""
    for i, token in enumerate(pattern):
        if token == ">":
            return len(subject) > i
        if i >= len(subject) or (token != "*" and token != subject[i]):
            return False
    return len(subject) == len(pattern)
