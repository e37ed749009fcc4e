"""Connect a neighbour (a worker, a reader, the serving layer) the way the processor and the edge
connect: with a nats-py client that no message another publisher sends can silence.

Stock nats-py parses each message's headers inside its one read loop; a header block it cannot
read (a status text that is not UTF-8, a forged JetStream reply) raises there, and the loop stops
for good: every subscription of the connection goes deaf while it still says it is connected
(docs/operations.md, "Subjects nats-py cannot parse"). The helpers work with any nats-py client,
and say once per process when they are given such a stock one.
"""

from __future__ import annotations

import logging
import os
from collections import UserString
from typing import Any

from nats.aio.client import Client as NatsClient

from ..core.defaults import NATS_URL
from ..logs import log_event
from ..nats.connection import creds_callbacks
from ..nats.fast_client import new_client
from ..nats.robust import RobustClient

__all__ = ["connect", "check_client"]

log = logging.getLogger("streamproc.client")
_warned = False


async def connect(servers: str | list[str] = NATS_URL, **options: Any) -> NatsClient:
    """``nats.connect(servers, **options)``, returning streamproc's client (:class:`RobustClient`,
    its fast path when the installed nats-py is supported): the same API, minus the messages that
    end stock nats-py's read loop. A ``user_credentials`` file (or ``RawCredentials``) without a user
    JWT or nkey seed raises :class:`~streamproc.core.errors.ConfigError` here, instead of nats-py's
    endless read at the connect."""
    credentials = options.get("user_credentials")
    if isinstance(credentials, (str, os.PathLike, UserString)):
        # read as the processor reads --nats-creds-file: nats-py's own reader never returns from a
        # file without a user JWT line (nats/connection.py, read_creds)
        del options["user_credentials"]
        named = "user_credentials" + ("" if isinstance(credentials, UserString) else f" {os.fspath(credentials)!r}")
        # keep=False: a pipe's content lives with this client's callbacks, not for the process (config._PIPED)
        options["user_jwt_cb"], options["signature_cb"] = creds_callbacks(credentials, named, keep=False)
    nc = new_client()
    await nc.connect(servers=[servers] if isinstance(servers, str) else servers, **options)
    return nc


def check_client(nc: object) -> None:
    """Warn once per process when a helper is given a stock nats-py client (module doc)."""
    global _warned
    if _warned or isinstance(nc, RobustClient):
        return
    _warned = True
    log_event(log, logging.WARNING, "stock_nats_client", client=type(nc).__name__,
              problem="one message with headers nats-py cannot read, on any subject this connection "
                      "subscribes to, stops its read loop for every subscription; connect with "
                      "streamproc.connect()")
