"""A vLLM P/D stream taken over mid-attempt: the heir counts the published chunks' tokens.

Upstream stream chunks carry no usage unless the client asks (``serve_tokens_stream_generator`` yields
``GenerateStreamResponse(request_id=request_id, choices=[...])``: usage null), so the final chunk's
expert rows are checked against the token_ids seen in every chunk. The chunks published before a
take-over are settled and never redelivered: the heir must read their count from the stored bodies
(``JoinSession.published``), or it omits the rows the live processor joined (law 7, found with
prompt 1, output 2, chunks [1, 1])."""

import pytest

from streamproc.core.correlator import Correlator, CorrelatorConfig
from streamproc.catalog import Catalog
from streamproc.codec import CodecOptions
from streamproc.sim.simulation import Truth
from streamproc.testing.harness import Run, leg
from streamproc.wire import Role
from streamproc_vllm import VLLMWorker

ROWS = b"\x02\x00\x00\x00\x04\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00"  # 2 positions, 1 layer, top 2


def _correlator() -> Correlator:
    return Correlator(Catalog(CodecOptions()), "vllm", CorrelatorConfig())


@pytest.mark.parametrize("coverage", ["full", "suffix"])
def test_a_heir_joins_the_final_chunks_rows_as_the_live_processor_did(coverage):
    truth = Truth("r1", [24936], [14729, 15475], [1, 1], 1, 2, 8, ROWS, [-5.2], [-6.3, -0.75],
                  return_logprob=False, decode_coverage=coverage)
    w = VLLMWorker()
    prefill = leg("r1", Role.PREFILL, w.prefill(truth, stream=True))
    decode = leg("r1", Role.DECODE, w.decode(truth, stream=True))
    assert len(decode) == 2 and b'"usage":null' in decode[-1].body  # the shape under test: no usage

    live = Run(_correlator())
    for chunk in [*prefill, *decode]:
        live.absorb(live.correlator.receive(chunk, 0.0))
    results = live.of("r1")
    assert [r.verdict.value for r in results] == ["passthrough", "joined"]

    heir = Run(_correlator())  # took over after result 0 was stored and its chunk settled
    heir.correlator.resume("r1", 1, False, 0.0, history=[results[0].body])
    for chunk in [*prefill, decode[1]]:
        heir.absorb(heir.correlator.receive(chunk, 0.0))
    assert [(r.seq, r.verdict, r.body) for r in heir.of("r1")] == [(1, results[1].verdict, results[1].body)]


def test_a_session_whose_published_hook_fails_still_adopts_the_request(monkeypatch):
    """A codec bug in ``JoinSession.published`` costs the heir the counts, not the request: it is
    adopted with a fresh session, stored results are not published again, and the rest is answered."""
    from streamproc_vllm.join import VLLMJoinSession

    def broken(self, bodies):
        raise RuntimeError("a codec bug")

    truth = Truth("r2", [24936], [14729, 15475], [1, 1], 1, 2, 8, ROWS, [-5.2], [-6.3, -0.75],
                  return_logprob=False, decode_coverage="full")
    w = VLLMWorker()
    prefill = leg("r2", Role.PREFILL, w.prefill(truth, stream=True))
    decode = leg("r2", Role.DECODE, w.decode(truth, stream=True))
    live = Run(_correlator())
    for chunk in [*prefill, *decode]:
        live.absorb(live.correlator.receive(chunk, 0.0))
    stored = live.of("r2")[0].body

    monkeypatch.setattr(VLLMJoinSession, "published", broken)
    heir = Run(_correlator())
    heir.correlator.resume("r2", 1, False, 0.0, history=[stored])
    assert heir.correlator._active["r2"].session is None  # the failed session is not kept
    for chunk in [*prefill, *decode]:  # chunk 0 again: a duplicate of a stored result, settled
        heir.absorb(heir.correlator.receive(chunk, 0.0))
    results = heir.of("r2")
    assert [(r.seq, r.final, r.error) for r in results] == [(1, True, None)], results
