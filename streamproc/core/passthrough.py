"""The fused passthrough path: subject and headers in, result subject and header block out.

The general path of an aggregated chunk builds a 9-field :class:`~streamproc.core.events.Chunk`
(:class:`~streamproc.core.wire.ChunkParser`), a :class:`~streamproc.core.events.Result` and a list
(:meth:`Correlator.receive`), then a header dict (:func:`~streamproc.core.wire.result_headers`) that
the NATS client encodes again: about 4-5 µs per message in a profile (issue 14). For the two cases
that are nearly all aggregated traffic (a unary response; the next chunk of a streamed one, attempt
0, no format header, plain traceparent), :class:`PassthroughPath` validates the same contract
inline, updates the correlator through :meth:`Correlator.receive_agg` (which also opens a streamed
request at its seq 0) and formats the result header
block directly. Anything else returns None and takes the general path, which then decides exactly
as before (nothing was changed). With tracing on, only chunks whose worker did not sample their
trace (``traceparent`` flags ``00``, under a sampler that records nothing for them: the general
path would record no span either) are taken (``unsampled_only``); a chunk without a traceparent
starts a trace the sampler decides, so it takes the general path. tests/test_passthrough_path.py pins that both paths give the same
results, stats and headers; benchmarks/passthrough_steps.py measures each step.
"""

from __future__ import annotations

from typing import Mapping

from .correlator import Correlator
from .wire import (
    ATTEMPT,
    FINAL,
    FORMAT,
    MAX_REQUEST_ID_LEN,
    MAX_TRACEPARENT_LEN,
    SEQ,
    TRACEPARENT,
    Subjects,
    plain_header_value,
    result_header_block,
)


class PassthroughPath:
    """``path(subject, headers, body, now)`` -> ``(result subject, header block)`` or None."""

    __slots__ = ("_head", "_cut", "_results", "_receive", "_untraced")

    def __init__(self, subjects: Subjects, correlator: Correlator, *, unsampled_only: bool = False) -> None:
        self._untraced = not unsampled_only  # a chunk without traceparent, or any plain one, is taken
        self._head = f"{subjects.prefix}.chunks."
        self._cut = len(self._head)
        self._results = subjects.result("")
        self._receive = correlator.receive_agg

    def __call__(self, subject: str, headers: Mapping[str, str] | None, body: bytes,
                 now: float) -> tuple[str, bytes] | None:
        if headers is None or not subject.endswith(".agg") or not subject.startswith(self._head):
            return None
        rid = subject[self._cut:-4]
        get = headers.get
        seq = get(SEQ)
        final = get(FINAL)
        attempt = get(ATTEMPT)
        traceparent = get(TRACEPARENT)
        # ChunkParser's fast-path checks (valid_request_id, seq, final, attempt), plus: no format
        # header (the general path compares it with the request's) and a traceparent that can be
        # copied into a pre-formatted block unchanged. valid_request_id is repeated inline (calling
        # it costs ~27 ns a message); tests/test_passthrough_path.py pins that both rules agree.
        # (Checking the id only when a request is opened, so that a streamed request's later chunks
        # skip it, saved ~0.06 µs of the ~1.8 µs here and cost unary chunks a call: not done.)
        if not (rid and len(rid) <= MAX_REQUEST_ID_LEN and rid.isascii() and rid.isprintable()
                and " " not in rid and "." not in rid and "*" not in rid and ">" not in rid
                and seq is not None and seq.isascii() and seq.isdigit() and len(seq) <= 18
                and (final is None or final == "true" or final == "false")
                and (attempt is None or attempt == "0")
                and not get(FORMAT)
                and ((len(traceparent) <= MAX_TRACEPARENT_LEN and plain_header_value(traceparent)
                      and (self._untraced or traceparent.endswith("-00")))
                     if traceparent else self._untraced)):
            return None
        n = int(seq)
        last = final == "true"
        if not self._receive(rid, n, last, body, traceparent, now):
            return None
        return self._results + rid, result_header_block(rid, n, last, traceparent)
