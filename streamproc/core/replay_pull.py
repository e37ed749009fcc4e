"""The pulls of one replay consumer: how much to ask for, what a delivery or a status changes.

A replay (the client's ``follow(replay=True)``, the edge's history read) reads a request's stored
results through a pull consumer, one pull out at a time, each asking for what the reader's bound
has room for (:mod:`streamproc.nats.replay_pull` says why, and builds the requests and reads the
statuses). Both readers keep the same books, so they live here, pure: the shell tells
:class:`PullState` what it sent, what arrived and what a status said (already read by
``pull_status``), with the time, and asks it whether and how much to pull next, whether the pull
out has gone silent, and whether the consumer may be made again.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["Pull", "PullState"]


class Pull(msgspec.Struct, frozen=True):
    """A pull to send: at most ``batch`` results of at most ``room`` bytes together; ``room`` None
    asks for the next result alone, whatever its size (``batch`` 1)."""

    room: int | None
    batch: int


class PullState:
    """One replay's pulls, across the consumers it makes again (:meth:`consumer_made`).

    - One pull out at a time (``out``), which may still bring ``left`` results; ``got`` it brought.
    - A result larger than the room a pull offered (``too_big`` before that pull brought anything)
      is asked for alone, once the reader holds nothing it could take first (``one_big``).
    - A pull without a word (a result, a heartbeat, a status) until ``until`` is over: lost in a
      reconnect, or used up exactly, which nats-server ends without a status (:meth:`silent`). The
      client reads this clock; the edge, whose ``no_wait`` pulls never wait on the server, times the
      silence from when its queue runs dry instead (its reader may be slow to take what came).
    - A pull refused as asked (``refused``: past the consumer's or the account's request limits)
      brought nothing: the consumer's next pulls ask for one result alone (no ``max_bytes``, a batch of
      one, which no such limit refuses), once the reader holds nothing (``alone``); one refused even
      so (``stuck``) is no answer: the shell makes the consumer again, bounded as below.
    - A pull ended ``busy`` with nothing brought (the server's waiting queue full, a leader change):
      sent again after a doubling backoff, a bounded number of times in a row (:meth:`busy_retry`).
    - Consumers made again in a row without an answer are bounded (:meth:`renew`): past
      ``renewals_max`` the replay ends with an error instead of renewing without end.
    """

    def __init__(self, batch: int, lost_after: float, renewals_max: int, busy_max: int = 0,
                 busy_backoff: float = 0.0) -> None:
        self.batch = batch  # results a pull asks for at most: its bytes bound it, this caps tiny ones
        self.lost_after = lost_after
        self.renewals_max = renewals_max
        self.out = False
        self.left = 0
        self.got = 0
        self.one_big = False
        self.alone = False  # a pull was refused as asked: this consumer's pulls ask for one result alone
        self.stuck = False  # one was refused even so
        self.until = math.inf
        self.delivered = 0  # results the current consumer delivered (its delivery sequence so far)
        self.renewals = 0  # consumers made again since the last answer
        self.sent_total = 0  # pulls sent, all consumers (tests)
        # Pulls in a row ended "busy" with nothing brought (a full waiting queue, a leader change):
        # each sent again after a backoff doubling from busy_backoff, at most busy_max times (busy_retry)
        self.busy_max = busy_max
        self.busy_backoff = busy_backoff
        self.busy = 0

    def consumer_made(self) -> None:
        """A new consumer: nothing asked of it yet, its delivery sequence from 1."""
        self.out = self.one_big = self.alone = self.stuck = False
        self.until = math.inf
        self.delivered = 0

    def ask(self, room: int, bound: int, held: bool, batch: int | None = None) -> Pull | None:
        """The pull to send now, if any. ``room``: bytes the bound has left; ``held``: the reader
        holds results it can take (wait for it to take them: then the room is at least half the
        ``bound``, and the one that did not fit can come alone); ``batch``: results the reader's
        queue has room for, if that is bounded too. None while a pull is out."""
        if self.out:
            return None
        if self.one_big or self.alone:
            return None if held else Pull(None, 1)
        if held and room < bound // 2:
            return None
        batch = self.batch if batch is None else min(self.batch, batch)
        return Pull(room, batch) if batch > 0 else None

    def sent(self, pull: Pull, now: float) -> None:
        """``pull`` is on its way (told before the publish: what it brings may arrive meanwhile)."""
        self.out, self.left, self.got = True, pull.batch, 0
        self.until = now + self.lost_after
        self.sent_total += 1

    def over(self) -> None:
        """Nothing is out any more: the consumer was dropped, or the pull's publish failed (it may
        have left all the same: the client then makes its consumer again, so that a second pull
        cannot bring twice the room)."""
        self.out = False

    def answered(self) -> None:
        """The consumer answered: renewals start again from none."""
        self.renewals = 0

    def took(self, now: float) -> None:
        """A result of the current consumer arrived: the pull out is over once its batch is in."""
        self.delivered += 1
        self.got += 1
        self.left -= 1
        self.until = now + self.lost_after
        if self.left <= 0:
            self.out = False
        self.one_big = False
        self.busy = 0
        self.answered()

    def status(self, kind: str, now: float) -> None:
        """A status on the consumer's inbox, as ``pull_status`` reads it: a ``heartbeat`` says the
        pull out still waits on the server; any other ends it, and ``too_big`` before the pull
        brought anything means the next result comes alone. ``completed`` changes nothing: it
        follows the last result of a pull whose batch filled, which ended that pull already (a next
        pull may be out). ``refused``: the consumer's pulls ask for one result alone from now on;
        refused even so, ``stuck``."""
        if kind == "heartbeat":
            if self.out:
                self.until = now + self.lost_after
            return
        if kind == "completed":
            return
        if kind == "refused":
            self.stuck = self.alone
            self.alone = True
        if kind == "too_big" and self.got == 0:
            self.one_big = True
        self.out = False

    def busy_retry(self) -> float | None:
        """A pull ended ``busy`` having brought nothing: seconds to wait before sending it again, or
        None once that happened ``busy_max`` times in a row (give up: a retry without end would be
        a pull loop against a server that keeps refusing, and no other reader stays in the budget).
        A give-up ends the run: the shell reads on otherwise (by subject) or not at all, and a later
        consumer's busy pull is retried again (left past the bound, it was given up at once)."""
        self.busy += 1
        if self.busy > self.busy_max:
            self.busy = 0
            return None
        return self.busy_backoff * 2 ** (self.busy - 1)

    def silent(self, now: float) -> bool:
        """The pull out had no word for ``lost_after``: it is over (lost, or used up exactly)."""
        return self.out and now > self.until

    def renew(self) -> bool:
        """The consumer is to be made again: False once that happened ``renewals_max`` times in a
        row without an answer (give up)."""
        self.renewals += 1
        return self.renewals <= self.renewals_max
