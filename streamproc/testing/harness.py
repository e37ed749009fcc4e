"""A pure pipeline harness: worker legs in, the correlator's results out, no NATS involved.

The same correlator object runs in production behind the NATS shell, so what the laws prove
here holds for the wire too; the integration tests then only have to prove the shell is faithful.
"""

from __future__ import annotations

import random
from typing import Iterable, Sequence

from ..catalog import Catalog
from ..core.codec import CodecOptions
from ..core.correlator import CodecResolver, Correlator, CorrelatorConfig, Notice, Settle
from ..core.wire import Chunk, Result, Role


def leg(request_id: str, role: Role | str, bodies: Sequence[bytes], *, attempt: int = 0,
        format: str | None = None) -> list[Chunk]:
    """Number a leg's bodies as a worker would (seq from 0, the last one final)."""
    role = Role(role)
    last = len(bodies) - 1
    return [
        Chunk(request_id, role, seq, body, final=seq == last, attempt=attempt, format=format,
              token=(request_id, role.value, attempt, seq))
        for seq, body in enumerate(bodies)
    ]


def shuffle_with_duplicates(chunks: Sequence[Chunk], rng: random.Random, dup_rate: float = 0.3) -> list[Chunk]:
    """Any order, with some chunks delivered more than once (at-least-once transport)."""
    out = list(chunks)
    out.extend(c for c in chunks if rng.random() < dup_rate)
    rng.shuffle(out)
    return out


class Run:
    """The outcome of feeding chunks through one correlator."""

    def __init__(self, correlator: Correlator) -> None:
        self.correlator = correlator
        self.results: list[Result] = []
        self.settled: list[object] = []
        self.notices: list[Notice] = []

    def absorb(self, decisions: Iterable[object]) -> None:
        for d in decisions:
            if isinstance(d, Result):
                self.results.append(d)
                self.settled.extend(d.settles)
            elif isinstance(d, Settle):
                self.settled.extend(d.tokens)
            elif isinstance(d, Notice):
                self.notices.append(d)
            else:  # pragma: no cover - a new decision type must be handled here first
                raise TypeError(f"unknown decision {d!r}")

    def of(self, request_id: str) -> list[Result]:
        return [r for r in self.results if r.request_id == request_id]


def run_pipeline(
    chunks: Iterable[Chunk],
    *,
    format: str,
    options: CodecOptions | None = None,
    config: CorrelatorConfig | None = None,
    now: float = 0.0,
    settle_at: float | None = None,
    resolve: CodecResolver | None = None,
) -> Run:
    """Feed ``chunks`` at time ``now``; then, if ``settle_at`` is given, fire timeouts due by then.
    ``resolve`` replaces the registered codecs (``Catalog(options)``)."""
    correlator = Correlator(resolve or Catalog(options), format, config)
    run = Run(correlator)
    for chunk in chunks:
        run.absorb(correlator.receive(chunk, now))
    if settle_at is not None:
        run.absorb(correlator.tick(settle_at))
    return run
