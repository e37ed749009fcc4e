"""A partition's hand-over NAKs, held until its pulls are gone from the server, then sent in stream order (pure).

nats-server redelivers NAKed messages from the consumer's redelivery queue in the order the NAKs
arrived (``server/consumer.go`` ``processNak`` → ``addToRedeliverQueue``, which appends), and a
redelivery it cannot place goes to the *back* of that queue (``loopAndGatherMsgs``:
``o.decDeliveryCount(pmsg.seq); o.addToRedeliverQueue(pmsg.seq)`` when ``nextWaiting`` returns no
pull). A hand-over used to NAK in two ways that reordered a request's chunks for the next owner:

- **to the pulls of the subscription being closed.** NAKs sent while the old inbox still had
  interest (the fence NAKs at once) were served to the old pulls still waiting with credit; the
  closing partition NAKed each again as it arrived, so they went behind every other NAKed chunk
  (the 6 MiB test: ``naks`` > ``redelivered``, ``invalid_chunk`` at the first NAKed seq).
- **behind the dead pulls.** After the old inbox's UNSUB its waiting pulls stay in the consumer's
  waiting queue until something looks at them: ``loopAndGatherMsgs`` sees the queue not empty, takes
  the front of the redelivery queue, ``nextWaiting`` drops every pull without interest and returns
  none, and that redelivery is appended to the back. Also, chunks that arrived while the
  subscription drained were NAKed at once, before the chunks held earlier.

So the shell holds every NAK of a closing partition here (:meth:`HandBack.hold`) while it drains
the subscription (UNSUB, a round trip, the deliveries in flight handled) and makes the server drop
its now uninterested pulls (a consumer info request: ``infoWithSnapAndReply`` calls
``o.processWaiting(false)``, which removes the waiting requests without interest), and then NAKs
them all at once, ordered by stream sequence (:meth:`HandBack.release`), so the redelivery queue
holds them in stream order and no redelivery is offered to a pull that cannot take it. What
arrives after the release passes straight through.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

__all__ = ["HandBack", "in_stream_order", "stream_sequence"]

T = TypeVar("T")

UNKNOWN = 1 << 64  # sorts after every stream sequence


def stream_sequence(reply: str | None) -> int:
    """The stream sequence of a delivery, from its ack subject; ``UNKNOWN`` when it has none.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`` (9 tokens, v1) or
    ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<stream seq>...`` (v2), as
    nats-py's ``Msg.Metadata._from_reply`` reads it (``tokens[5]`` for v1, ``tokens[7]`` for v2).
    """
    if not reply:
        return UNKNOWN
    tokens = reply.split(".")
    try:
        return int(tokens[5] if len(tokens) == 9 else tokens[7])
    except (IndexError, ValueError):
        return UNKNOWN


def in_stream_order(tokens: list[T], reply_of: Callable[[T], str | None]) -> list[T]:
    """``tokens`` sorted by the stream sequence of their ack subjects, in place (ties and unknown
    sequences keep their order, last)."""
    tokens.sort(key=lambda t: stream_sequence(reply_of(t)))
    return tokens


class HandBack(Generic[T]):
    """The NAKs of one partition being handed over. ``reply_of`` gives a token's ack subject."""

    __slots__ = ("_held", "_reply_of", "released")

    def __init__(self, reply_of: Callable[[T], str | None]) -> None:
        self._held: list[T] = []
        self._reply_of = reply_of
        self.released = False

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, tokens: Iterable[T]) -> list[T]:
        """Tokens to NAK: kept until :meth:`release` (returns none), or, after it, returned to NAK now."""
        if self.released:
            return list(tokens)
        self._held.extend(tokens)
        return []

    def release(self, tokens: Iterable[T] = ()) -> list[T]:
        """Everything held, with ``tokens``, in stream order (ties and unknown sequences in the order
        given, last): NAK them now. Later :meth:`hold` calls pass their tokens straight through."""
        out, self._held = self._held, []
        out.extend(tokens)
        self.released = True
        return in_stream_order(out, self._reply_of)
