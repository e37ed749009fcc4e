"""The codec catalog: codecs and simulated workers discovered through entry points.

Built-in formats register in this project's own ``pyproject.toml`` exactly as an external
distribution would (``streamproc.codecs`` and ``streamproc.workers`` groups), so discovery is
exercised by every run rather than special-cased.
"""

from __future__ import annotations

import time
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Callable, NamedTuple

from .core.codec import Codec, CodecOptions
from .core.errors import CodecUnavailable, UnknownFormat
from .logs import error_text

if TYPE_CHECKING:  # the runtime path never imports the simulation
    from .sim.simulation import SimulatedWorker

CODECS_GROUP = "streamproc.codecs"
WORKERS_GROUP = "streamproc.workers"

# A codec that failed to load for a reason other than its configuration is built again after this
# many seconds at the earliest (Catalog).
CODEC_RETRY_SECONDS = 30.0
# Failures that come back the same on every attempt: a --format-option value the constructor refuses
# (ValueError, TypeError), a module or dependency that is not installed (ImportError).
PERMANENT_FAILURES = (ValueError, TypeError, ImportError)


@lru_cache(maxsize=None)
def _entries(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def refresh() -> None:
    """Forget cached discovery (after installing a codec distribution at run time)."""
    _entries.cache_clear()


def codec_names() -> list[str]:
    return sorted(_entries(CODECS_GROUP))


def codec_class(name: str) -> type[Codec]:
    entries = _entries(CODECS_GROUP)
    ep = entries.get(name)
    if ep is None:
        raise UnknownFormat(name, sorted(entries))
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"entry point {name!r} ({ep.value}) is not a streamproc Codec subclass")
    return cls


def describe() -> list[tuple[str, str, str]]:
    """(name, distribution, description) for every installed codec."""
    rows = []
    for name, ep in sorted(_entries(CODECS_GROUP).items()):
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            description = codec_class(name).description
        except Exception as exc:  # a broken plugin is reported, not fatal to the listing
            description = f"(failed to load: {exc})"
        rows.append((name, dist, description))
    return rows


class OptionKeys(NamedTuple):
    """What the installed codecs say about the ``--format-option`` keys given (:func:`unread_option_keys`)."""

    unread: list[str]  # keys given that no installed codec declares it reads
    read: list[str]  # every key some installed codec declares
    undeclared: list[str]  # installed codecs that declare nothing (``Codec.option_keys`` None)


def unread_option_keys(options: CodecOptions) -> OptionKeys:
    """Check the given keys against every installed codec's ``option_keys`` (a codec other than
    ``--format`` reads them too, when a chunk names it). A codec that fails to load reads nothing."""
    read: set[str] = set()
    undeclared = []
    for name in codec_names():
        try:
            keys = codec_class(name).option_keys
        except Exception:  # noqa: BLE001 - a broken plugin: its requests fail with why (Catalog)
            continue
        if keys is None:
            undeclared.append(name)
        else:
            read |= keys
    unread = [key for key, _ in options.format_options if key not in read]
    return OptionKeys(unread, sorted(read), undeclared)


class Catalog:
    """Codec instances for one processor, created once per name with the processor's limits.

    A codec that fails to import or build makes each request naming it fail at once with why
    (:class:`CodecUnavailable`), without importing and building it again per chunk, at a worker's
    pace. A configuration error (``PERMANENT_FAILURES``) would fail the same way each time: it is
    kept for the process's life. Anything else (a ``MemoryError`` while importing, an ``OSError``
    reading a file) may pass: the codec is built again at the first request after
    ``retry_after`` seconds of ``clock`` (the processor's), so a flood of chunks naming it costs
    one attempt per interval, not one per chunk. The clock is read only while such a failure is
    kept; a resolver already does I/O (imports), so the correlator calling it stays clock-free in
    its own logic and its signature (``name -> Codec``) is unchanged.
    """

    def __init__(self, options: CodecOptions | None = None, *, clock: Callable[[], float] = time.monotonic,
                 retry_after: float = CODEC_RETRY_SECONDS) -> None:
        self.options = options or CodecOptions()
        self._clock = clock
        self._retry_after = retry_after
        self._codecs: dict[str, Codec] = {}
        # Codecs that failed to import or build: why, and when to try again (None: never). Raised
        # as a fresh exception each time: re-raising a stored one grows its traceback by every raise.
        self._failed: dict[str, tuple[str, float | None]] = {}

    def __call__(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            failed = self._failed.get(name)
            if failed is not None:
                reason, retry_at = failed
                if retry_at is None or self._clock() < retry_at:
                    raise CodecUnavailable(name, reason)
            try:
                codec = codec_class(name)(self.options)
            except UnknownFormat:
                raise  # not installed: may be installed later, and costs only a dict lookup
            except Exception as exc:  # noqa: BLE001 - a plugin's import or constructor error, reported
                reason = error_text(exc)
                permanent = isinstance(exc, PERMANENT_FAILURES)
                self._failed[name] = (reason, None if permanent else self._clock() + self._retry_after)
                raise CodecUnavailable(name, reason) from None
            self._failed.pop(name, None)
            self._codecs[name] = codec
        return codec


def worker_for(name: str) -> SimulatedWorker:
    entries = _entries(WORKERS_GROUP)
    ep = entries.get(name)
    if ep is None:
        raise LookupError(f"no simulated worker for format {name!r}; available: {', '.join(sorted(entries))}")
    return ep.load()()
