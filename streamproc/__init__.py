"""streamproc: a NATS stream processor that joins prefill/decode LLM responses.

The public API, in the style of h11: the pure core (records, the correlator, the codec
interface, errors) is imported eagerly and imports no I/O library; the NATS shell and the client
helpers are loaded on first use, so ``import streamproc`` costs a codec author nothing.

    from streamproc import Correlator, Chunk, Role            # pure
    from streamproc import Processor, ChunkPublisher, follow  # NATS (imports nats-py)
"""

from __future__ import annotations

import importlib
from typing import Any

from . import compiled

compiled.check()  # before any module that may run compiled is imported (compiled.py says why)

from .core.codec import (
    Codec,
    CodecOptions,
    Emitted,
    ErrorKind,
    JoinSession,
    MigrationSession,
    OmissionReason,
    SequenceCodec,
)
from .core.correlator import Correlator, CorrelatorConfig
from .core.errors import (
    ChunkIdTaken,
    ConfigError,
    ContractError,
    CorruptPayload,
    MalformedResult,
    MigrationError,
    MigrationRefused,
    PublishRefused,
    ReplayRefused,
    ResultsOverrun,
    StartupError,
    StreamMismatch,
    StreamprocError,
    UnknownFormat,
)
from .core.events import (
    Chunk,
    Decision,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    MigrateRequest,
    Notice,
    Result,
    ResultInfo,
    Role,
    Sealed,
    Settle,
    Verdict,
)
from .core.reorder import SeqOrder
from .core.wire import ChunkParser, Subjects

__version__ = "0.1.0"

# Names whose modules import nats-py (or the web stack), loaded by ``__getattr__`` on first use.
_LAZY = {
    "Settings": "streamproc.config",
    "CommonSettings": "streamproc.config",
    "Catalog": "streamproc.catalog",
    "Processor": "streamproc.nats.processor",
    "ChunkPublisher": "streamproc.client.publisher",
    "ResultStream": "streamproc.client.results",
    "ResultCollector": "streamproc.client.results",
    "follow": "streamproc.client.results",
    "collect": "streamproc.client.results",
    "Migrator": "streamproc.client.migration",
    "Resumed": "streamproc.client.migration",
    "publish_request": "streamproc.client.migration",
    "mint_capability": "streamproc.client.capability",
    "connect": "streamproc.client.connection",
}

__all__ = [
    "__version__",
    # records
    "Chunk", "Result", "ResultInfo", "Role", "Verdict", "Settle", "Notice", "Decision",
    "MigrateRequest", "MigrateReply", "MigrateError", "MigrateErrorCode", "Sealed",
    # the pure core
    "Correlator", "CorrelatorConfig", "ChunkParser", "Subjects", "SeqOrder",
    # the codec interface
    "Codec", "CodecOptions", "JoinSession", "MigrationSession", "SequenceCodec", "Emitted",
    "ErrorKind", "OmissionReason",
    # errors
    "StreamprocError", "ContractError", "CorruptPayload", "UnknownFormat", "MigrationRefused",
    "MigrationError", "MalformedResult", "ConfigError", "StartupError", "StreamMismatch", "PublishRefused",
    "ChunkIdTaken", "ReplayRefused", "ResultsOverrun",
    # the shell and the client helpers (lazy)
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamproc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
