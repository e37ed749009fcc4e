"""The nats-py (and asyncio.Queue) internals streamproc reads or replaces, listed once, checked once.

The edge (edge/pending.py, fanout.py, barrier.py, source.py, replay.py) and the processor's
FastClient (fast_client.py, fast_parser.py, eager_reads.py) read private attributes of nats-py 2.16
objects. A release that renames one would not fail at import: it would silently break the held-bytes
bound or delivery. The stock-path client (robust.py's ``RobustClient``, which FastClient extends),
subscription.py's ``handled_all`` and the durable migrations' server-time read have no fallback below
them: :func:`require_stock_support` refuses to make a client in one line. :func:`missing` builds
each object as nats-py does and names the listed attributes it lacks; ``pending_support`` (edge:
refuses to start) and ``fast_path_support`` (processor: stock nats-py) report them.
tests/test_nats_internals.py fails when a module of any set names a nats-py internal that is not listed here.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any, Callable

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from ..core.errors import NatsPyUnsupported

# "Owner.attribute": the edge's (instance attributes as nats-py 2.16's constructors set them, or
# methods/class attributes).
EDGE_INTERNALS: tuple[str, ...] = (
    "Client._reading_task", "Client._flusher_task", "Client._transport", "Client._pending",  # barrier.py
    "Client._pending_data_size", "Client._pongs", "Client._close", "Client._process_msg",  # pending.py checks
    "Subscription._conn", "Subscription._id", "Subscription._jsi", "Subscription._pending_queue",
    "Subscription._pending_size", "Subscription._pending_bytes_limit", "Subscription._pending_next_msgs_calls",
    "PushSubscription._sub", "PushSubscription._pending_queue", "PushSubscription._consumer",
    "_JSI._fcr", "_JSI._fciseq", "_JSI._active", "_JSI._sseq", "_JSI.reset_ordered_consumer",
    "JetStreamContext._nc", "JetStreamContext._prefix", "JetStreamContext._jsm", "JetStreamContext._JSI",
    "asyncio.Queue._getters", "asyncio.Queue._queue", "asyncio.Queue._put", "asyncio.Queue._get",
    "asyncio.Queue._wakeup_next",
)

# The processor's FastClient (a nats-py Client subclass) and its parser and eager reads.
FAST_CLIENT_INTERNALS: tuple[str, ...] = (
    "Client._build_message", "Client._error_cb", "Client._flush_pending", "Client._flush_queue",
    "Client._flusher", "Client._flusher_task", "Client._max_payload", "Client._max_pending_size", "Client._pending",
    "Client._pending_data_size", "Client._process_headers", "Client._process_msg", "Client._process_op_err",
    "Client._process_ping", "Client._process_pong", "Client._ps", "Client._read_loop",
    "Client._skip_subject_validation", "Client._status", "Client._subs", "Client._transport",
    "Subscription._future", "Subscription._id", "Subscription._jsi", "Subscription._max_msgs",
    "Subscription._pending_bytes_limit", "Subscription._pending_queue", "Subscription._pending_size",
    "Subscription._received",
    "_JSI._active", "_JSI._cmeta", "_JSI._dseq", "_JSI._fciseq", "_JSI._ordered", "_JSI._sseq",
    "JetStreamContext._JSI", "asyncio.Queue._unfinished_tasks", "Client._parse_header_lines",
)

# The stock path: every client streamproc makes (FastClient is a RobustClient), on any nats-py release.
# What a release renaming each would do, unchecked (robust.py's module doc numbers the fixes):
STOCK_CLIENT_INTERNALS: tuple[str, ...] = (
    # methods RobustClient replaces: renamed, its version is never called and the fix goes silently
    "Client._process_msg",  # a forged flow-control reply is published with the client's permissions
    "Client._build_message",  # a subject that is not UTF-8 ends the read loop again
    "Client._process_headers",  # the header-line bound goes: ~110 ms of the loop per hostile message
    "Client._send_publish",  # a result over max_payload with its headers: the server closes the connection
    "Client._send_ping",  # flush() returns before the queued commands are written (a SUB not yet seen)
    "Client._process_pong",  # a cancelled flush's PONG raises InvalidStateError out of the read loop
    # read or written by those methods: AttributeError in the read loop or every publish/flush, or
    # (the PONG counters) nats-py's own never reset: a stale-connection reconnect every few ping intervals
    "Client._subs", "Subscription._jsi", "Client._is_control_message", "Client._max_payload",
    "Client._pending", "Client._pending_data_size", "Client._transport",
    "Client._pongs", "Client._pongs_received", "Client._pings_outstanding",
    "Client._flush_pending",  # robust.flush_queued on a plain nats-py client: AttributeError at each call
    # subscription.handled_all: it returns at once, and a migrate overtakes chunks delivered before it
    "Subscription._pending_queue", "asyncio.Queue._unfinished_tasks",
    "JetStreamContext._prefix",  # durable/migrations.py's server-time read: AttributeError at each call
)


def _made(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception:  # noqa: BLE001  (another constructor: each attribute then reads as missing)
        return None


def owners() -> dict[str, Any]:
    """Each owner as nats-py makes it (None where its constructor changed)."""
    sub = _made(lambda: Subscription(types.SimpleNamespace()))
    psub = _made(lambda: JetStreamContext.PushSubscription(None, sub, "", "")) if sub is not None else None
    jsi = _made(lambda: JetStreamContext._JSI(None, None, "", False, psub, sub, None))  # type: ignore[arg-type]
    client = _made(Client)
    return {"Client": client, "Subscription": sub, "PushSubscription": psub, "_JSI": jsi,
            "JetStreamContext": _made(lambda: JetStreamContext(client)) if client is not None else None,
            "asyncio.Queue": _made(asyncio.Queue)}


def missing(names: tuple[str, ...]) -> list[str]:
    """The ``Owner.attribute`` names of ``names`` that nats-py's objects, made now, lack."""
    made = owners()
    gone = []
    for name in names:
        owner, _, attribute = name.rpartition(".")  # "asyncio.Queue._get": owner "asyncio.Queue"
        obj = made[owner]
        if obj is None or not hasattr(obj, attribute):
            gone.append(name)
    return gone


_stock_missing: list[str] | None = None


def require_stock_support() -> None:
    """Raise :class:`NatsPyUnsupported` when nats-py lacks one of :data:`STOCK_CLIENT_INTERNALS`
    (checked once per process): below the stock path there is no client to fall back to, and running
    without one of its fixes would fail silently (see the list)."""
    global _stock_missing
    if _stock_missing is None:
        _stock_missing = missing(STOCK_CLIENT_INTERNALS)
    if _stock_missing:
        from nats.aio.client import __version__ as version

        raise NatsPyUnsupported(
            f"installed nats-py {version} lacks internals streamproc's NATS client reads "
            f"({', '.join(_stock_missing)}); use a nats-py release that has them "
            "(docs/operations.md, Supported dependency versions)")
