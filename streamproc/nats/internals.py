"""The nats-py (and asyncio.Queue) internals streamproc reads or replaces, listed once, checked once.

The edge (edge/pending.py, fanout.py, barrier.py, source.py, replay.py) and the processor's
FastClient (fast_client.py, fast_parser.py, eager_reads.py) read private attributes of nats-py 2.16
objects. A release that renames one would not fail at import: it would silently break the held-bytes
bound or delivery. :func:`missing` builds each object as nats-py does and names the listed
attributes it lacks; ``pending_support`` (edge: refuses to start) and ``fast_path_support``
(processor: stock nats-py) report them. tests/test_nats_internals.py fails when a module of either
set names a nats-py internal that is not listed here.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any, Callable

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

# "Owner.attribute": the edge's (instance attributes as nats-py 2.16's constructors set them, or
# methods/class attributes).
EDGE_INTERNALS: tuple[str, ...] = (
    "Client._reading_task", "Client._flusher_task", "Client._transport", "Client._pending",  # barrier.py
    "Client._pending_data_size", "Client._pongs",
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
    "JetStreamContext._JSI", "asyncio.Queue._unfinished_tasks",
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
        owner, attribute = name.split(".", 1) if not name.startswith("asyncio.") else ("asyncio.Queue", name[14:])
        obj = made[owner]
        if obj is None or not hasattr(obj, attribute):
            gone.append(name)
    return gone
