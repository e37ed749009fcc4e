"""Property laws every codec inherits.

Subclass :class:`CodecLaws` in a test module, name the subclass ``Test...`` and set ``codec_name``
(and ``worker`` if the simulated worker is not the one registered under the same name)::

    class TestMyCodecLaws(CodecLaws):
        codec_name = "my-format"

Each law runs ``LAW_EXAMPLES`` hypothesis cases (512 unless ``STREAMPROC_LAW_EXAMPLES`` says
otherwise; CI runs the default). The laws drive the real correlator through the pure harness, so
they cover ordering, duplicates, timeouts and omission end to end, not just the codec functions.

1. Aggregated passthrough is byte-identical, opaque and undecodable values included.
2. Folding the joined stream equals the joined unary response (less the fields no stream chunk carries,
   ``SimulatedWorker.streamed_unary``).
3. The P/D join reproduces the aggregated run of the same ground truth.
4. Dropping or corrupting either leg's sequence payload never yields stale rows: the field is the
   ground truth or absent with a reason.
5. Any reordering or duplication of input chunks yields the same results.
6. Interrupting any leg after any chunk, once or several times, and resuming (seal-then-resume)
   yields the uninterrupted run's result stream, for aggregated and P/D attempts in any mix.
7. The migration session is a function of the published bodies alone: a processor that takes the
   request over at any point (durable mode's adoption, ``Correlator.resume`` with the stored bodies
   and seal points, which replays them through ``absorb``/``seal``) then publishes, seals and
   rebuilds the resumed request exactly as the processor that lived through it.

A codec under development (or a law's own test) can set ``codec_class`` to run the laws against a
class that is not registered under ``codec_name``.
"""

from __future__ import annotations

import os
import random
from typing import ClassVar

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..catalog import Catalog, worker_for
from ..core.codec import UNAVAILABLE_SUFFIX, Codec, CodecOptions, Emitted, OmissionReason
from ..core.correlator import CodecResolver, Correlator, CorrelatorConfig
from ..core.errors import MigrationRefused
from ..sim.simulation import Damage, SimulatedWorker, Truth
from ..core.wire import Chunk, MigrateError, MigrateErrorCode, Result, Role, Sealed, Verdict
from .harness import Run, leg, run_pipeline, shuffle_with_duplicates
from .strategies import truths


def stitch_omitted(result: object, expected: object) -> bool:
    """Take every field a stitch omitted as ``stitch_incomplete`` (its marker in ``result``, its value
    in ``expected``, at the same place) out of both canonical bodies; True when there was one. Such a
    field covers the whole output and the earlier attempts never published theirs (the format's
    docs): the law then holds for every other field, exactly."""
    found = False
    if isinstance(result, dict) and isinstance(expected, dict):
        for key in [k for k in result if isinstance(k, str) and k.endswith(UNAVAILABLE_SUFFIX)]:
            if result[key] == OmissionReason.STITCH_INCOMPLETE:
                del result[key]
                expected.pop(key[:-len(UNAVAILABLE_SUFFIX)], None)
                found = True
        for key, value in result.items():
            if key in expected:
                found |= stitch_omitted(value, expected[key])
    return found

LAW_EXAMPLES = int(os.environ.get("STREAMPROC_LAW_EXAMPLES", "512"))
PREFILL_TIMEOUT = 30.0

law_settings = settings(
    max_examples=LAW_EXAMPLES,
    deadline=None,
    # Every CodecLaws subclass shares these test functions, which hypothesis would otherwise flag.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
    derandomize=os.environ.get("CI") == "true",
)


class CodecLaws:
    codec_name: ClassVar[str]
    worker: ClassVar[SimulatedWorker | None] = None
    # The codec class to test under ``codec_name``; None: the one registered under that name.
    codec_class: ClassVar[type[Codec] | None] = None
    # Small enough that the laws can build decompression bombs cheaply.
    options: ClassVar[CodecOptions] = CodecOptions(max_decompressed_bytes=256 * 1024)

    # ----------------------------------------------------------------- helpers

    def _worker(self) -> SimulatedWorker:
        return type(self).worker or worker_for(self.codec_name)

    def _catalog(self) -> CodecResolver:
        """A fresh processor's codecs (one instance per name, as ``Catalog`` gives a processor)."""
        catalog = Catalog(self.options)
        cls = type(self).codec_class
        if cls is None:
            return catalog
        own = cls(self.options)
        return lambda name: own if name == self.codec_name else catalog(name)

    def _codec(self):
        return self._catalog()(self.codec_name)

    def _correlator(self, codecs: CodecResolver | None = None) -> Correlator:
        """A fresh processor's correlator (``codecs``: its codecs, when the law needs to reach them)."""
        config = CorrelatorConfig(prefill_timeout=PREFILL_TIMEOUT)
        return Correlator(codecs or self._catalog(), self.codec_name, config)

    def _pd_chunks(self, truth: Truth, stream: bool, *, prefill_damage: Damage | None = None,
                   decode_damage: Damage | None = None, with_prefill: bool = True):
        w = self._worker()
        chunks = []
        if with_prefill:
            chunks += leg(truth.request_id, Role.PREFILL, w.prefill(truth, stream=stream, damage=prefill_damage))
        chunks += leg(truth.request_id, Role.DECODE, w.decode(truth, stream=stream, damage=decode_damage))
        return chunks

    def _run(self, chunks, *, settle: bool = True):
        return run_pipeline(chunks, format=self.codec_name, options=self.options, resolve=self._catalog(),
                            config=CorrelatorConfig(prefill_timeout=PREFILL_TIMEOUT),
                            settle_at=PREFILL_TIMEOUT + 1 if settle else None)

    @staticmethod
    def _assert_complete(results: list[Result], expected: int | None = None) -> None:
        assert results, "no results"
        assert [r.seq for r in results] == list(range(len(results))), "seqs not contiguous from 0"
        assert [r.final for r in results] == [False] * (len(results) - 1) + [True], "final must be last, once"
        assert all(r.error is None for r in results), f"unexpected error result: {results[-1].body!r}"
        if expected is not None:
            assert len(results) == expected

    # -------------------------------------------------------------------- laws

    @law_settings
    @given(truth=truths(), stream=st.booleans(), opaque=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def test_law1_aggregated_passthrough_is_byte_identical(self, truth, stream, opaque, seed):
        rng = random.Random(seed)
        w = self._worker()
        bodies = w.opaque_agg(truth, stream=stream, rng=rng) if opaque else w.agg(truth, stream=stream)
        chunks = shuffle_with_duplicates(leg(truth.request_id, Role.AGG, bodies), rng)
        results = self._run(chunks).of(truth.request_id)
        self._assert_complete(results, len(bodies))
        for result, body in zip(results, bodies):
            assert result.body == body, "aggregated body changed"
            assert result.verdict is Verdict.PASSTHROUGH

    @law_settings
    @given(truth=truths())
    def test_law2_folding_the_joined_stream_equals_the_joined_unary_response(self, truth):
        w, codec = self._worker(), self._codec()
        streamed = self._run(self._pd_chunks(truth, True)).of(truth.request_id)
        unary = self._run(self._pd_chunks(truth, False)).of(truth.request_id)
        self._assert_complete(streamed)
        self._assert_complete(unary, 1)
        folded = codec.fold([r.body for r in streamed])
        assert w.canonical(folded) == w.canonical(w.streamed_unary(unary[0].body))
        agg_stream = w.agg(truth, stream=True)
        agg_unary = w.agg(truth, stream=False)[0]
        assert w.canonical(codec.fold(agg_stream)) == w.canonical(w.streamed_unary(agg_unary))

    @law_settings
    @given(truth=truths(), stream=st.booleans())
    def test_law3_pd_join_reproduces_the_aggregated_run(self, truth, stream):
        w = self._worker()
        expected = w.agg(truth, stream=stream)
        results = self._run(self._pd_chunks(truth, stream)).of(truth.request_id)
        self._assert_complete(results, len(expected))
        for result, agg_body in zip(results, expected):
            assert w.canonical(result.body) == w.canonical(agg_body)
            assert result.verdict in (Verdict.PASSTHROUGH, Verdict.JOINED)
        rows, reason = w.expert_view(results[-1].body)
        if truth.return_experts:
            assert rows == truth.experts and reason is None

    @law_settings
    @given(
        truth=truths(),
        stream=st.booleans(),
        target=st.sampled_from(["prefill", "decode", "both", "no_prefill_leg"]),
        damage=st.sampled_from(list(Damage)),
    )
    def test_law4_missing_or_corrupt_sequence_data_never_yields_stale_rows(self, truth, stream, target, damage):
        w = self._worker()
        chunks = self._pd_chunks(
            truth, stream,
            prefill_damage=damage if target in ("prefill", "both") else None,
            decode_damage=damage if target in ("decode", "both") else None,
            with_prefill=target != "no_prefill_leg",
        )
        results = self._run(chunks).of(truth.request_id)
        self._assert_complete(results, len(w.agg(truth, stream=stream)))
        for result in results:
            rows, reason = w.expert_view(result.body)
            if rows is not None:
                assert rows == truth.experts, "published rows differ from the ground truth"
                assert reason is None
        rows, reason = w.expert_view(results[-1].body)
        # When neither leg carries the field at all, the request is indistinguishable from one that
        # never asked for it (law 3 then demands no marker), so only absence is required.
        prefill_lacks = target == "no_prefill_leg" or (target in ("prefill", "both") and damage is Damage.DROP)
        decode_lacks = (target in ("decode", "both") and damage is Damage.DROP) or (
            truth.output_len == 1 and truth.decode_omits_one_token_experts)
        if truth.return_experts and rows is None and not (prefill_lacks and decode_lacks):
            assert isinstance(reason, str) and reason, "omitted without a reason"
            assert results[-1].verdict is Verdict.OMITTED

    @law_settings
    @given(
        batch=st.lists(
            st.tuples(truths(max_prompt=6, max_output=6), st.sampled_from(["agg", "pd"]), st.booleans()),
            min_size=1, max_size=4,
        ),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_law5_reordering_and_duplication_yield_the_same_results(self, batch, seed):
        w = self._worker()
        chunks, rids = [], []
        for i, (truth, mode, stream) in enumerate(batch):
            truth = msgspec.structs.replace(truth, request_id=f"q{i}")
            rids.append(truth.request_id)
            if mode == "agg":
                chunks += leg(truth.request_id, Role.AGG, w.agg(truth, stream=stream))
            else:
                chunks += self._pd_chunks(truth, stream)
        in_order = self._run(chunks)
        shuffled = self._run(shuffle_with_duplicates(chunks, random.Random(seed)))

        def view(run, rid):
            return [(r.seq, r.final, r.verdict, r.error, r.body) for r in run.of(rid)]

        for rid in rids:
            self._assert_complete(in_order.of(rid))
            assert view(shuffled, rid) == view(in_order, rid)
        # Every input chunk (duplicates included) is settled exactly by the end: nothing leaks.
        assert sorted(map(repr, set(shuffled.settled))) == sorted(map(repr, {c.token for c in chunks}))

    def _attempt_legs(self, truth: Truth, emitted: int, attempt: int, pd: bool, stream: bool) -> list[list[Chunk]]:
        """The legs a worker (pair) publishes for the request resumed after ``emitted`` tokens."""
        w, rid = self._worker(), truth.request_id
        if not pd:
            return [leg(rid, Role.AGG, w.agg_resumed(truth, emitted, stream=stream), attempt=attempt)]
        return [leg(rid, Role.PREFILL, w.prefill_resumed(truth, emitted, stream=stream), attempt=attempt),
                leg(rid, Role.DECODE, w.decode_resumed(truth, emitted, stream=stream), attempt=attempt)]

    @law_settings
    @given(truth=truths(), stream=st.booleans(), data=st.data())
    def test_law6_interrupted_and_resumed_requests_give_the_uninterrupted_stream(self, truth, stream, data):
        w, rid = self._worker(), truth.request_id
        expected = w.agg(truth, stream=stream)
        spans = truth.chunk_spans() if stream else [(0, truth.output_len)]
        correlator = self._correlator()
        run = Run(correlator)
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        interruptions = data.draw(st.integers(1, 3), label="interruptions")
        late: list[Chunk] = []  # chunks of sealed attempts, still in flight
        sent: list[Chunk] = []
        attempt = emitted = 0

        def deliver(chunks: list[Chunk]) -> None:
            stragglers = [late.pop(rng.randrange(len(late))) for _ in range(rng.randint(0, len(late)))]
            batch = shuffle_with_duplicates(chunks, rng, dup_rate=0.2) + stragglers
            rng.shuffle(batch)
            for chunk in batch:
                sent.append(chunk)
                run.absorb(correlator.receive(chunk, 0.0))

        for interrupted in range(interruptions + 1):
            pd = data.draw(st.booleans(), label="pd")
            legs = self._attempt_legs(truth, emitted, attempt, pd, stream)
            if interrupted == interruptions:  # the last attempt completes
                deliver([c for chunks in legs for c in chunks])
                break
            cuts = [data.draw(st.integers(0, len(chunks)), label="cut") for chunks in legs]
            broken = data.draw(st.integers(0, len(legs) - 1), label="leg")
            cuts[broken] = min(cuts[broken], len(legs[broken]) - 1)  # that worker dies before its final chunk
            if attempt == 0 and not any(cuts) and not data.draw(st.booleans(), label="lost before any chunk"):
                other = (broken + 1) % len(legs)  # let the processor hear of the request first
                top = len(legs[other]) - (other == broken)
                if top:
                    cuts[other] = data.draw(st.integers(1, top), label="cut")
            deliver([c for chunks, cut in zip(legs, cuts) for c in chunks[:cut]])
            reply, decisions = correlator.migrate(rid, 0.0)
            run.absorb(decisions)
            published = run.of(rid)
            if isinstance(reply, MigrateError):
                # Only a request the processor never heard of: nothing was sent, the same attempt is reissued.
                assert reply.code is MigrateErrorCode.UNKNOWN_REQUEST and attempt == 0 and not sent, reply
                continue
            assert isinstance(reply, Sealed)
            assert reply.attempt == attempt + 1 and reply.result_seq == len(published)
            # Exactly what the client was sent: the tokens of the results published so far.
            assert reply.emitted_tokens == (spans[len(published) - 1][1] if published else 0) >= emitted
            assert reply.emitted_token_ids == truth.output_ids[:reply.emitted_tokens]
            late.extend(c for chunks, cut in zip(legs, cuts) for c in chunks[cut:])
            attempt, emitted = reply.attempt, reply.emitted_tokens
        deliver(late[:])  # whatever of the dead attempts is still in flight arrives after all
        if data.draw(st.booleans(), label="migrate after the end"):
            reply, decisions = correlator.migrate(rid, 0.0)
            assert isinstance(reply, MigrateError) and reply.code is MigrateErrorCode.FINISHED and not decisions

        results = run.of(rid)
        self._assert_complete(results, len(expected))
        for result, agg_body in zip(results, expected):
            got, want = w.canonical(result.body), w.canonical(agg_body)
            omitted = stitch_omitted(got, want)
            assert got == want
            assert result.verdict in (Verdict.PASSTHROUGH, Verdict.JOINED, Verdict.STITCHED) or (
                omitted and result.verdict is Verdict.OMITTED)
        rows, reason = w.expert_view(results[-1].body)
        if truth.return_experts:
            assert rows == truth.experts and reason is None
        assert correlator.inflight == 0
        # Every chunk is settled, sealed and duplicate ones included.
        assert set(map(repr, run.settled)) == {repr(c.token) for c in sent}

    def _resumed_request(self, codec, truth: Truth, reply: Sealed) -> bytes | str | None:
        """The request the serving layer rebuilds from a seal (None when the worker renders no
        requests; a refusal's reason when the format refuses it)."""
        try:
            request = self._worker().request(truth)
        except NotImplementedError:
            return None
        try:
            return codec.resume_request(request, Emitted(reply.emitted_token_ids, reply.state))
        except MigrationRefused as exc:
            return f"refused: {exc.reason}"

    @law_settings
    @given(truth=truths(), stream=st.booleans(), data=st.data())
    def test_law7_a_session_rebuilt_from_the_published_bodies_continues_as_the_live_one(self, truth, stream, data):
        self.check_law7(truth, stream, data)

    def check_law7(self, truth: Truth, stream: bool, data: st.DataObject) -> None:
        """Law 7 for one example (callable under other hypothesis settings: the law's own test).

        Run a migrating request through one processor (``live``), recording the state before
        every step (a chunk delivered, or a migrate). Then before each step in turn another processor
        (``heir``) takes it over as durable mode does: ``Correlator.resume`` with the seal points and
        the stored result bodies (its migration session replayed through ``absorb``/``seal``; without a
        seal, the bodies only where ``Correlator.needs_published`` asks, the rest restored before a migrate),
        and every chunk ``live`` had not settled redelivered (JetStream redelivers unacknowledged
        chunks). Fed the remaining steps, the heir must publish the same results, answer every
        migrate with the same seal and so rebuild the same resumed request, step by step."""
        w, rid = self._worker(), truth.request_id
        live_codecs = self._catalog()
        live = self._correlator(live_codecs)
        run = Run(live)
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        interruptions = data.draw(st.integers(1, 3), label="interruptions")
        steps: list[Chunk | None] = []  # a chunk delivered, or None: a migrate
        before: list[tuple[int, tuple[int, ...], int]] = []  # (results, seal points, settled tokens)
        outcomes: list[tuple[list[Result], object]] = []  # each step's new results and migrate reply
        seals: list[int] = []
        attempt = emitted = 0

        def step(chunk: Chunk | None) -> object:
            published = len(run.of(rid))
            before.append((published, tuple(seals), len(run.settled)))
            steps.append(chunk)
            reply = None
            if chunk is None:
                reply, decisions = live.migrate(rid, 0.0)
            else:
                decisions = live.receive(chunk, 0.0)
            run.absorb(decisions)
            outcomes.append((run.of(rid)[published:], reply))
            return reply

        for interrupted in range(interruptions + 1):
            legs = self._attempt_legs(truth, emitted, attempt, data.draw(st.booleans(), label="pd"), stream)
            last = interrupted == interruptions
            cuts = [len(chunks) for chunks in legs]
            if not last:
                cuts = [data.draw(st.integers(0, len(chunks)), label="cut") for chunks in legs]
                broken = data.draw(st.integers(0, len(legs) - 1), label="leg")
                cuts[broken] = min(cuts[broken], len(legs[broken]) - 1)  # that worker dies before its final chunk
            # The legs' workers publish concurrently: any interleaving that keeps each leg's order.
            queues = [chunks[:cut] for chunks, cut in zip(legs, cuts)]
            while any(queues):
                step(rng.choice([q for q in queues if q]).pop(0))
            if last:
                break
            reply = step(None)
            if isinstance(reply, MigrateError):  # never heard of: the same attempt is reissued
                assert reply.code is MigrateErrorCode.UNKNOWN_REQUEST, reply
                continue
            assert isinstance(reply, Sealed), reply
            seals.append(reply.result_seq)
            attempt, emitted = reply.attempt, reply.emitted_tokens
        self._assert_complete(run.of(rid))

        expected_bodies = w.agg(truth, stream=stream)
        got, want = [w.canonical(r.body) for r in run.of(rid)], [w.canonical(b) for b in expected_bodies]
        for result, agg_body in zip(got, want):
            stitch_omitted(result, agg_body)
        assert got == want
        codec = live_codecs(self.codec_name)
        for switch in range(len(steps)):  # every step: the live run is the costly part, a take-over is cheap
            self._take_over(truth, run, codec, steps, before[switch], outcomes, switch)

    def _take_over(self, truth: Truth, run: Run, codec: Codec, steps: list[Chunk | None],
                   before: tuple[int, tuple[int, ...], int], outcomes: list[tuple[list[Result], object]],
                   switch: int) -> None:
        """Law 7's heir: adopt the request as it stood before ``steps[switch]``, then replay the rest."""
        rid = truth.request_id
        results, points, settled = before
        history = run.of(rid)[:results]
        heir_codecs = self._catalog()
        heir = self._correlator(heir_codecs)
        taken = Run(heir)
        final, bodies = any(r.final for r in history), [r.body for r in history]
        # As the durable shell adopts (nats/durable/recovery.py, Recovery.adopt): a sealed request with
        # its stored bodies; an unsealed one with them only when its codec's session counts across them
        # (Adoption.RESUME), the rest read back before a migrate (Correlator.missing, restore).
        wanted = bool(points) or heir.needs_published(rid, results, final)
        heir.resume(rid, results, final, 0.0, seals=points, history=bodies if wanted else None)
        done = set(run.settled[:settled])
        received = [c for c in steps[:switch] if c is not None and c.token not in done]
        for chunk in received:  # the redelivered chunks restore what the dead processor held
            taken.absorb(heir.receive(chunk, 0.0))
        where = f"taken over before step {switch}"
        assert taken.of(rid) == [], f"{where}: a redelivered chunk published a result again"

        def view(results: list[Result]) -> list[tuple]:
            return [(r.seq, r.final, r.verdict, r.error, r.body) for r in results]

        for n in range(switch, len(steps)):
            chunk, (expected, live_reply) = steps[n], outcomes[n]
            published = len(taken.of(rid))
            at = f"{where}, step {n}"
            if chunk is None:
                missing = heir.missing(rid)
                restored = not missing or heir.restore(rid, bodies[:missing])
                assert restored, f"{at}: the stored bodies were not restored"
                reply, decisions = heir.migrate(rid, 0.0)
                assert reply == live_reply, f"{at}: the heir sealed {reply!r}, the live processor {live_reply!r}"
                if isinstance(reply, Sealed):
                    rebuilt = self._resumed_request(heir_codecs(self.codec_name), truth, reply)
                    assert rebuilt == self._resumed_request(codec, truth, live_reply), \
                        f"{at}: the resumed requests differ"
            else:
                received.append(chunk)
                decisions = heir.receive(chunk, 0.0)
            taken.absorb(decisions)
            assert view(taken.of(rid)[published:]) == view(expected), f"{at}: the heir published otherwise"
        assert view(history + taken.of(rid)) == view(run.of(rid)), where
        assert heir.inflight == 0, where
        assert {c.token for c in received} <= set(taken.settled), f"{where}: the heir left a chunk unsettled"
