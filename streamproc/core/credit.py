"""Pull credit of one JetStream pull consumer: when to ask for more, when the server forgot us.

Pure bookkeeping the durable input's shell consults on every delivery, status message and
watchdog round. A pull asks for ``batch`` messages; a new one goes out when the outstanding
credit falls to ``low`` (half a batch), so credit never exceeds ``low + batch``. The server may
forget waiting pulls (a restart: nats-io/nats.py#504): that shows as no message and no idle
heartbeat for ``lost_after`` while credit is outstanding, as a reconnect, or as the pull's
expiry; the credit is then written off and asked for again. Two misses in a row (lost pulls,
"consumer deleted", no responders) mean the consumer itself may be gone: repair it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PullCredit", "Watch"]


class Watch(NamedTuple):
    """What a watchdog round found for one partition."""

    lost: bool  # outstanding credit went unanswered: pulls written off
    repair: bool  # ensure the consumer exists again
    pull: bool  # ask for more now


class PullCredit:
    __slots__ = ("batch", "low", "expires", "lost_after", "retry_after", "requested", "expires_at", "last_seen",
                 "retry_at", "misses")

    def __init__(self, batch: int, *, expires: float, lost_after: float, retry_after: float,
                 now: float = 0.0) -> None:
        self.batch = batch
        self.low = batch // 2
        self.expires = expires  # seconds a pull lives on the server
        self.lost_after = lost_after
        self.retry_after = retry_after  # pause after a failed pull or an error status
        self.requested = 0  # messages asked for and not delivered yet
        self.expires_at = 0.0
        self.last_seen = now
        self.retry_at = 0.0
        self.misses = 0

    def pulled(self, now: float) -> None:
        """A pull for ``batch`` messages went out."""
        self.requested += self.batch
        self.expires_at = now + self.expires

    def pull_failed(self, now: float) -> None:
        """The pull just counted by :meth:`pulled` did not leave."""
        self.requested -= self.batch
        self.retry_at = now + self.retry_after

    def delivered(self, now: float) -> bool:
        """A message arrived; True when a pull should go out now."""
        self.last_seen = now
        self.requested -= 1
        return self.requested <= self.low

    def dropped(self) -> None:
        """The client dropped a delivery (slow consumer): it used up credit all the same."""
        self.requested = max(0, self.requested - 1)

    def status(self, code: str, pending: str | None, description: str, now: float) -> bool:
        """A status message on the pull inbox (``Status``, ``Nats-Pending-Messages``, ``Description``
        headers); True when a pull should go out now. Counts a miss when the consumer may be gone."""
        self.last_seen = now
        if code == "100":  # idle heartbeat
            return self.requested <= self.low and now >= self.retry_at
        if code in ("408", "409") and pending is not None and pending.isdigit():
            self.requested = max(0, self.requested - int(pending))  # a pull ended unfilled
            if code == "408":
                return self.requested <= self.low and now >= self.retry_at
        else:
            self.requested = 0
            self.retry_at = now + self.retry_after
        lowered = description.lower()
        if "consumer deleted" in lowered or code == "503" or "no responders" in lowered:
            self.misses += 1
        return self.requested <= self.low and now >= self.retry_at

    def watch(self, now: float, reconnected: bool) -> Watch:
        """A watchdog round: write off forgotten pulls, decide on repair and a new pull."""
        lost = self.requested > 0 and now - self.last_seen > self.lost_after
        if reconnected or lost or now >= self.expires_at:
            if lost:
                self.misses += 1
            self.requested = 0
            self.last_seen = now
        repair = self.misses >= 2
        if repair:
            self.misses = 0
        return Watch(lost, repair, self.requested <= self.low and now >= self.retry_at)
