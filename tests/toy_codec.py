"""The toy format that drives the pure correlator in tests, so every rule shows in the bytes.

Join: a decode body starting with ``need:`` needs the prefill leg; the join appends
``|<prefill bodies joined by +>``, or ``|omitted:<reason>`` when the prefill leg is unavailable.
Anything else passes through. A decode body ``explode`` makes the codec raise (a codec bug).

Migration (:class:`MigratingToyCodec` only): a body lists token ids (``b"1 2"``, ``need:`` and the
``|...`` join suffix ignored); a body starting with ``!`` cannot move. The stitch appends ``|+<k>``
(k = tokens emitted before the attempt) so a stitched body is recognisable.

Correlators to drive: :func:`make` (the toy formats ``toy`` and ``other``, with a :class:`Run`) and
:func:`correlator` (the ``inflating`` format, whose prefill leg ``inflate:<n>`` keeps n decoded
bytes, for the byte budgets), with :func:`chunk` and :func:`errors` to feed and read it.
"""

from __future__ import annotations

from typing import Iterable

from streamproc.codec import Codec, Emitted, ErrorKind, JoinSession, MigrationRefused, MigrationSession
from streamproc.core.events import Chunk, Result, Role, Verdict
from streamproc.correlator import Correlator, CorrelatorConfig, UnknownFormat
from streamproc.testing.harness import Run


class ToySession(JoinSession):
    def __init__(self) -> None:
        self.prefill: bytes | None = None
        self.reason = ""

    def needs_prefill(self, body: bytes, final: bool) -> bool:
        if body == b"explode":
            raise RuntimeError("toy codec bug")
        return body.startswith(b"need:")

    def absorb_prefill(self, bodies):
        self.prefill = b"+".join(bodies)

    def prefill_unavailable(self, reason: str) -> None:
        self.reason = reason

    def join(self, body: bytes, final: bool):
        if not body.startswith(b"need:"):
            return body, Verdict.PASSTHROUGH
        if self.prefill is None:
            return body + b"|omitted:" + self.reason.encode(), Verdict.OMITTED
        return body + b"|" + self.prefill, Verdict.JOINED


class ToyMigration(MigrationSession):
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.absorbed: list[list[bytes]] = []  # each absorb call's bodies, as handed over
        self.k = 0

    def absorb(self, bodies):
        self.absorbed.append(list(bodies))
        for body in bodies:
            if body.startswith(b"!"):
                raise MigrationRefused("toy: this body cannot move")
            text = body.split(b"|")[0].removeprefix(b"need:")
            self.ids.extend(int(t) for t in text.split())

    def seal(self) -> Emitted:
        self.k = len(self.ids)
        return Emitted(list(self.ids), {"bodies": sum(map(len, self.absorbed))})

    def stitch(self, body: bytes, final: bool):
        if not self.k:
            return None
        # the rewritten body's verdict: omitted while it carries the join's marker (MigrationSession.stitch)
        return body + b"|+" + str(self.k).encode(), Verdict.OMITTED if b"|omitted:" in body else Verdict.STITCHED

    def progress_bytes(self) -> int:
        return 8 * len(self.ids)  # as an array("q") of the ids would take


class ToyCodec(Codec):
    """The toy join; migration refused (the :class:`Codec` default)."""

    name = "toy"

    def open_session(self) -> JoinSession:
        return ToySession()

    def fold(self, bodies):
        return b"".join(bodies)

    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        return f"ERR[{kind.value}]{message}".encode()

    reads = 0  # omissions() calls so far

    def omissions(self, body: bytes) -> dict[str, str]:
        """``<body>|omitted:<reason>``: one marker, for the field ``toy``."""
        self.reads += 1
        _, sep, reason = body.rpartition(b"|omitted:")
        return {"toy": reason.decode()} if sep else {}


class MigratingToyCodec(ToyCodec):
    """The toy join plus migration; ``sessions`` keeps every migration session it opened."""

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.sessions: list[ToyMigration] = []

    def open_migration(self) -> MigrationSession:
        self.sessions.append(ToyMigration())
        return self.sessions[-1]


def feed(run: Run, chunks: Iterable[Chunk], now: float = 0.0) -> Run:
    """Hand ``chunks`` to the run's correlator one by one at time ``now``, collecting its decisions."""
    for chunk in chunks:
        run.absorb(run.correlator.receive(chunk, now))
    return run


def bodies(results: list[Result]) -> list[bytes]:
    return [r.body for r in results]


# ------------------------------------------------------------ correlators over the toy formats

class OtherToy(ToyCodec):
    name = "other"

    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        return b"OTHER-ERR"


CODECS = {"toy": ToyCodec(), "other": OtherToy()}


def resolve(name: str) -> Codec:
    if name not in CODECS:
        raise UnknownFormat(name, sorted(CODECS))
    return CODECS[name]


def make(**config) -> tuple[Correlator, Run]:
    c = Correlator(resolve, "toy", CorrelatorConfig(**config))
    return c, Run(c)


# ------------------------------------------------------------ the inflating format (byte budgets)

class InflatingSession(JoinSession):
    """Absorbing a prefill leg ``inflate:<n>`` keeps n decoded bytes (like an expert-row payload)."""

    def __init__(self) -> None:
        self.rows = b""

    def needs_prefill(self, body: bytes, final: bool) -> bool:
        return True

    def absorb_prefill(self, bodies):
        text = b"".join(bodies)
        if text.startswith(b"inflate:"):
            self.rows = bytes(int(text[len(b"inflate:"):]))

    def prefill_unavailable(self, reason: str) -> None:
        pass

    def join(self, body: bytes, final: bool):
        return body + b"|%d" % len(self.rows), Verdict.JOINED

    def retained_bytes(self) -> int:
        return len(self.rows)


class InflatingCodec(ToyCodec):
    """The toy's fold and error bodies; sessions that decode (inflate) rows."""

    name = "inflating"

    def open_session(self) -> JoinSession:
        return InflatingSession()


def correlator(**config: object) -> Correlator:
    return Correlator(lambda name: InflatingCodec(), "inflating", CorrelatorConfig(**config))


class CountingSession(InflatingSession):
    """Counts its decodes (JoinSession.decodes): a decode chunk ``rows...`` decodes sequence data."""

    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0

    def join(self, body: bytes, final: bool):
        if body.startswith(b"rows"):
            self.decodes += 1
        return super().join(body, final)


class CountingCodec(InflatingCodec):
    name = "counting"

    def open_session(self) -> JoinSession:
        return CountingSession()


def counting_correlator(**config: object) -> Correlator:
    return Correlator(lambda name: CountingCodec(), "counting", CorrelatorConfig(**config))


def chunk(rid: str, role: str, seq: int, body: bytes, final: bool = False) -> Chunk:
    return Chunk(rid, Role(role), seq, body, final)


def errors(decisions) -> list[tuple[str, str]]:
    return [(d.request_id, d.error) for d in decisions if isinstance(d, Result) and d.error]
