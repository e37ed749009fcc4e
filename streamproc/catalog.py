"""The codec catalog: codecs and simulated workers discovered through entry points.

Built-in formats register in this project's own ``pyproject.toml`` exactly as an external
distribution would (``streamproc.codecs`` and ``streamproc.workers`` groups), so discovery is
exercised by every run rather than special-cased.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from .core.codec import Codec, CodecOptions
from .core.errors import CodecUnavailable, UnknownFormat
from .logs import error_text

if TYPE_CHECKING:  # the runtime path never imports the simulation
    from .sim.simulation import SimulatedWorker

CODECS_GROUP = "streamproc.codecs"
WORKERS_GROUP = "streamproc.workers"


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


class Catalog:
    """Codec instances for one processor, created once per name with the processor's limits."""

    def __init__(self, options: CodecOptions | None = None) -> None:
        self.options = options or CodecOptions()
        self._codecs: dict[str, Codec] = {}
        # Codecs that failed to import or build, with why: each chunk naming one fails at once with
        # that error, instead of importing and building it again (per chunk, at a worker's pace). A
        # fresh exception each time: re-raising a stored one grows its traceback by every raise.
        self._failed: dict[str, str] = {}

    def __call__(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            failed = self._failed.get(name)
            if failed is not None:
                raise CodecUnavailable(name, failed)
            try:
                codec = codec_class(name)(self.options)
            except UnknownFormat:
                raise  # not installed: may be installed later, and costs only a dict lookup
            except Exception as exc:  # noqa: BLE001 - a plugin's import or constructor error, reported
                self._failed[name] = error_text(exc)
                raise CodecUnavailable(name, self._failed[name]) from None
            self._codecs[name] = codec
        return codec


def worker_for(name: str) -> SimulatedWorker:
    entries = _entries(WORKERS_GROUP)
    ep = entries.get(name)
    if ep is None:
        raise LookupError(f"no simulated worker for format {name!r}; available: {', '.join(sorted(entries))}")
    return ep.load()()
