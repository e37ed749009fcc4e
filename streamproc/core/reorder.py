"""Reading one request's results back in order: the reorder buffer of every reader.

Results can reach a reader out of order or twice (a JetStream replay overlapping a live
subscription, a processor that republished after a crash). :class:`SeqOrder` hands them out in
seq order, each once, up to and including the final (or error) result, after an optional resume
point (an SSE client's ``Last-Event-ID``). Used by the client helpers
(:mod:`streamproc.client.results`) and the edge (:mod:`streamproc.edge.source`). Pure.
"""

from __future__ import annotations

from . import defaults
from .events import ResultInfo

MAX_PENDING_RESULTS = defaults.MAX_PENDING_RESULTS


def stale_final_text(request_id: str, seq: int, last: int) -> str:
    """What a reader says of a :attr:`SeqOrder.contradicted` final (the edge's error event, the client
    helpers' MalformedResult): one text for both."""
    return (f"a final result at seq {seq} of request {request_id} arrived after results up to seq {last}: "
            "no processor publishes one")


class SeqOrder:
    """One request's results in seq order, each once, after an optional resume point (sans-I/O)."""

    __slots__ = ("next_seq", "pending", "done", "ended_before_resume", "contradicted", "error_below",
                 "duplicates", "max_pending", "_start", "_highest")

    def __init__(self, after: int | None = None, *, max_pending: int = MAX_PENDING_RESULTS) -> None:
        self.next_seq = 0 if after is None else after + 1
        self.pending: dict[int, ResultInfo] = {}
        self.done = False
        self.ended_before_resume = False
        # The seq of a final result that the results already seen contradict (below): the reading
        # ended without all of them, which a reader must report, never take for a clean end.
        self.contradicted: int | None = None
        # The error result that ended the reading came below a seq already handed out or seen (push):
        # the edge frames it without an SSE id, so a client's Last-Event-ID keeps naming its last result.
        # Set here, when it is handed out: results handed out before it may still wait to be framed.
        self.error_below = False
        self.duplicates = 0
        self.max_pending = max_pending
        self._start = self.next_seq
        self._highest = -1  # the highest seq push saw (next_in_line's are all handed out)

    def push(self, result: ResultInfo) -> list[ResultInfo]:
        """Results that can be handed out now, in order. Raises OverflowError when ``max_pending``
        results wait for a missing seq and another that would wait arrives."""
        if self.done:
            self.duplicates += 1
            return []
        seq = result.seq
        if seq < self.next_seq:
            if not result.final:
                self.duplicates += 1
                if seq > self._highest:
                    self._highest = seq
            elif (self.next_seq == self._start and seq > self._highest
                  and (result.error is None or seq == self._start - 1)):
                # The final at or before the resume point, nothing handed out or seen at or past it: the
                # client has it all (a Last-Event-ID at or past the final seq). A non-final copy of the
                # same seq seen first (the resume point's result, read again) rules it out as well: one
                # seq has one result, so a final there is the contradicted case below, not a clean end.
                # The final handed out ended the reading (done, above), so a copy of it never gets here.
                # An error result only at the resume point itself and past every result seen: one below
                # it, or one at the seq of a result seen (the error at 0 beside result 0: Last-Event-ID 0
                # names that result, the error went out without an id), is the case below, which a
                # client resuming after the results it had never saw.
                self.done = self.ended_before_resume = True
                self.pending.clear()
            elif result.error is not None:
                # A processor's error result below what the reader has: its own word that the request
                # failed, from one that never saw the earlier results published (core mode, restarted
                # mid-request: Correlator._fail puts request_timeout's error, or a refused migrate's,
                # at its own next seq, 0). Handed out as the end, so the reader reports that error
                # (the edge sends it without an SSE id: the client's Last-Event-ID stays where it was).
                self.done = self.error_below = True
                self.pending.clear()
                return [result]
            else:
                # A final (not an error) below a seq handed out or seen as not final: no processor makes
                # one (a request's seqs end at its final, a migrated one's continue past the sealed
                # attempt's).
                # A writer with publish rights on the results subject, or a broken processor, would
                # otherwise end every reader with a clean end and results missing.
                self.done = True
                self.contradicted = seq
                self.pending.clear()
            return []
        if seq > self._highest:
            self._highest = seq
        if result.seq in self.pending:
            self.duplicates += 1
            return []
        # The bound is on results that wait: the one they wait for (next_seq) never does, and it
        # must get in when max_pending of them wait, else the gap that just closed fails the stream.
        if len(self.pending) >= self.max_pending and result.seq != self.next_seq:
            raise OverflowError(f"{self.max_pending} results wait for seq {self.next_seq}")
        self.pending[result.seq] = result
        ready = []
        while self.next_seq in self.pending:
            item = self.pending.pop(self.next_seq)
            ready.append(item)
            self.next_seq += 1
            if item.final or item.error is not None:
                self.done = True
                self.pending.clear()
                break
        return ready

    def next_in_line(self, result: ResultInfo) -> bool:
        """:meth:`push`'s answer ``[result]`` without storing it: True (and handed out) when ``result``
        is the next seq, nothing waits and it ends nothing; else False and nothing changes. The edge's
        ``DirectFrames.offer`` reads this test inline (tests/test_edge_direct_offer.py holds the two
        together)."""
        if (self.done or self.pending or result.seq != self.next_seq or result.final
                or result.error is not None):
            return False
        self.next_seq += 1
        return True

    @property
    def dropped(self) -> int:
        """Results that repeated a seq or came after the final one (the client reader's name)."""
        return self.duplicates
