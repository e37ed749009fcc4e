"""How nats-server refuses a publish, read the one way the client helpers and the edge both need.

nats-server answers a publish the user may not make with nothing: ``client.pubPermissionViolation``
(server/client.go) drops the message and sends ``-ERR 'Permissions Violation for Publish to
"<subject>"'``. nats-py 2.16 ``Client._process_err`` keeps that text, lower-cased by its parser, as
``last_error`` and hands it to the error callback, without closing the connection; a request made
on the refused subject waits for its whole timeout. So a refusal is read from that text.
"""

from __future__ import annotations

import re

_VIOLATION = re.compile(r'permissions violation for publish to "([^"]*)"')


def refused_publish(error_text: str, subject: str, *, below_only: bool = False) -> bool:
    """Whether ``error_text`` is the server refusing a publish to ``subject`` or to a subject below it
    (``<subject>.<more>``; with ``below_only``, below it only). Case is ignored: the parser lower-cases."""
    match = _VIOLATION.search(error_text.lower())
    if match is None:
        return False
    refused, wanted = match[1], subject.lower()
    return refused.startswith(wanted + ".") or (not below_only and refused == wanted)
