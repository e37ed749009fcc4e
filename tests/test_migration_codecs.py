"""Format-owned migration hooks: rebuilding the native request, refusals, and stitching a resumed stream.

The end-to-end property (law 6) runs with every codec in the laws; these tests pin the individual
rules, including the ones the simulated workers never exercise (rows published by a sealed attempt,
foreign ids, budgets).
"""

from __future__ import annotations

import re
import struct

import msgspec
import numpy as np
import pytest

from streamproc.catalog import Catalog, codec_names, worker_for
from streamproc.codec import Emitted, MigrationRefused
from streamproc.simulation import make_truth
from streamproc.wire import Verdict

from migration_helpers import SGLANG_0523_TIMINGS, without_attempt_values, without_timings

SGLANG_FORMATS = [name for name in ("sglang", "sglang-zstd") if name in codec_names()]


def loads(body: bytes) -> dict:
    return msgspec.json.decode(body)


def dumps(obj: object) -> bytes:
    return msgspec.json.encode(obj)


def sealed_session(codec, bodies: list[bytes]):
    session = codec.open_migration()
    session.absorb(bodies)
    return session, session.seal()


# --------------------------------------------------------------------- Truth.resumed

def test_a_resumed_truth_extends_the_prompt_and_splits_the_chunk_that_straddles_k():
    truth = make_truth(1, prompt_len=3, output_len=7, chunk_sizes=[3, 2, 2])
    resumed = truth.resumed(4)
    assert resumed.prompt_ids == truth.prompt_ids + truth.output_ids[:4]
    assert resumed.output_ids == truth.output_ids[4:]
    assert resumed.chunk_sizes == [1, 2]
    assert resumed.prompt_logprobs == truth.prompt_logprobs + truth.output_logprobs[:4]
    assert resumed.experts == truth.experts and resumed.rows == truth.rows
    assert truth.resumed(0) is truth
    with pytest.raises(ValueError):
        truth.resumed(7)


# --------------------------------------------------------------------------- SGLang

def sglang_request(truth, **params) -> bytes:
    return dumps({"rid": truth.request_id, "input_ids": truth.prompt_ids, "stream": True, "return_logprob": True,
                  "logprob_start_len": 0, "sampling_params": {"max_new_tokens": truth.output_len, **params},
                  "bootstrap_host": "10.0.0.7", "bootstrap_room": 42})


@pytest.mark.parametrize("name", SGLANG_FORMATS)
def test_sglang_resumed_request_is_the_prompt_plus_emitted_tokens_with_the_remaining_budget(name):
    codec = Catalog()(name)
    truth = make_truth(2, prompt_len=5, output_len=9)
    k = 4
    body = codec.resume_request(sglang_request(truth, min_new_tokens=6, temperature=0.5),
                                Emitted(truth.output_ids[:k], {"prompt_tokens": 5}))
    doc = loads(body)
    resumed = truth.resumed(k)  # what the simulated engine then produces
    assert doc["input_ids"] == resumed.prompt_ids
    assert doc["sampling_params"] == {"max_new_tokens": resumed.output_len, "min_new_tokens": 2, "temperature": 0.5}
    assert doc["logprob_start_len"] == 0 and doc["rid"] == truth.request_id  # absolute positions, same rid
    assert "bootstrap_host" not in doc and "bootstrap_room" not in doc  # the lost P/D pair's rendezvous


def test_sglang_budget_defaults_to_128_and_an_exhausted_budget_is_refused():
    codec = Catalog()("sglang")
    doc = loads(codec.resume_request(dumps({"input_ids": [1, 2]}), Emitted([7, 8, 9])))
    assert doc["sampling_params"]["max_new_tokens"] == 125
    with pytest.raises(MigrationRefused, match="no token budget left"):
        codec.resume_request(dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}), Emitted([4, 5, 6]))


@pytest.mark.parametrize("name", SGLANG_FORMATS)
def test_sglang_an_explicitly_unbounded_budget_stays_unbounded_when_resumed(name):
    """SGLang 0.5.23 reads an absent ``max_new_tokens`` and a null one differently: the field defaults
    to 128 (``SamplingParams.max_new_tokens: Optional[int] = 128``; ``__post_init__`` resets None to the
    default for the other parameters, not this one) while ``Scheduler.init_req_max_new_tokens`` takes a
    null as ``1 << 30``, clipped only by the context (``max_req_len - input_len - 1``). A resumed
    request with ``128 - k`` stopped an unbounded answer at 128 tokens."""
    codec = Catalog()(name)
    doc = loads(codec.resume_request(dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": None,
                                                                                      "min_new_tokens": 5}}),
                                     Emitted([7, 8, 9])))
    assert doc["sampling_params"] == {"max_new_tokens": None, "min_new_tokens": 2}
    absent = loads(codec.resume_request(dumps({"input_ids": [1, 2], "sampling_params": {}}), Emitted([7, 8, 9])))
    assert absent["sampling_params"] == {"max_new_tokens": 125}  # the 128 default, less what was emitted


def test_sglang_resume_refuses_a_request_whose_prompt_is_not_the_one_the_client_was_served():
    codec = Catalog()("sglang")
    with pytest.raises(MigrationRefused, match="not the request being resumed"):
        codec.resume_request(dumps({"input_ids": [1, 2, 3]}), Emitted([9], {"prompt_tokens": 4}))


SESSION_TURN = {"input_ids": [5, 6], "session_params": {"id": "s-1", "rid": "turn-1"}}


def test_sglang_a_session_request_is_refused_naming_session_params():
    """An SGLang session's prompt is the history its worker holds (``SessionController``
    ``Session.create_req``: the parent request's tokens, then ``input_ids``), so the body's
    ``prompt_tokens`` counts more than ``input_ids``, and another worker has no such session
    (``Scheduler.handle_generate_request``: "session id ... does not exist", an abort). The refusal
    names ``session_params``, up front and at the resume (it read "not the request being resumed")."""
    codec = Catalog()("sglang")
    with pytest.raises(MigrationRefused, match="session_params"):
        codec.check_migratable(dumps(SESSION_TURN))
    with pytest.raises(MigrationRefused, match="session_params"):
        codec.resume_request(dumps(SESSION_TURN), Emitted([9], {"prompt_tokens": 7}))


@pytest.mark.parametrize("name", SGLANG_FORMATS)
@pytest.mark.parametrize("params", [{"beam_width": 4}, {"beam_width": 4, "n": 2}], ids=["one_returned", "n_returned"])
def test_sglang_a_beam_search_request_is_refused_naming_beam_width(name, params):
    """SGLang 0.5.23 has beam search (``SamplingParams.beam_width`` > 1; ``n`` is then the number of
    returned sequences, ``n <= beam_width``). Its output reaches the client only once, in the final
    body: ``_GenerationStreamAccumulator._beam_admits`` streams only the group's leader once the group
    finished, and ``_wait_one_response`` skips unfinished beam outputs. That body
    (``build_beam_search_out``) carries ``meta_info.beam_results``, each beam with its own ``meta_info``,
    the best one a copy of the attempt's (timings included), which the stitch does not restate: it
    marked the top-level timings ``stitch_incomplete`` beside beam_results' copy of them. A resumed
    prompt + emitted tokens would also not be the same search. Refused up front, naming the
    parameter; with ``n`` 2 it used to read "parallel samples", which beam's ``n`` is not."""
    codec = Catalog()(name)
    request = dumps({"input_ids": [5, 6], "stream": True, "sampling_params": {**params, "max_new_tokens": 8}})
    with pytest.raises(MigrationRefused, match=r"beam search \(sampling_params\.beam_width = 4\)"):
        codec.check_migratable(request)
    with pytest.raises(MigrationRefused, match="beam_width"):
        codec.resume_request(request, Emitted([], {"prompt_tokens": 2}))


@pytest.mark.parametrize("width", [None, 1])
def test_sglang_a_beam_width_of_1_is_no_beam_search_and_resumes(width):
    """``BeamCoordinator.request_beam_width``: ``beam_width or 1``; only a width above 1 is a beam request."""
    request = dumps({"input_ids": [5, 6], "sampling_params": {"beam_width": width, "max_new_tokens": 8}})
    doc = loads(Catalog()("sglang").resume_request(request, Emitted([9], {"prompt_tokens": 2})))
    assert doc["input_ids"] == [5, 6, 9] and doc["sampling_params"]["max_new_tokens"] == 7


@pytest.mark.parametrize("request_doc", [
    {"input_ids": [5, 6], "session_params": None},
    {"input_ids": [5, 6], "session_params": {"id": None}},  # no session: ``session_params.id`` is None
    {"input_ids": [5, 6], "session_id": "s-1"},  # an identity only: "does not alter or reconstruct the prompt"
])
def test_sglang_a_request_that_names_no_session_history_still_resumes(request_doc):
    doc = loads(Catalog()("sglang").resume_request(dumps(request_doc), Emitted([9], {"prompt_tokens": 2})))
    assert doc["input_ids"] == [5, 6, 9]


@pytest.mark.parametrize("request_doc, reason", [
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n = 2"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "guided decoding (json_schema)"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "guided decoding (regex)"),
    ({"input_ids": [1], "sampling_params": {"ebnf": "r ::= 'a'"}}, "guided decoding (ebnf)"),
    ({"input_ids": [1], "sampling_params": {"structural_tag": "{}"}}, "guided decoding (structural_tag)"),
    ({"input_ids": [1], "return_hidden_states": True}, "hidden states"),
    ({"text": "hello"}, "text prompt"),
    ({"input_ids": [[1, 2], [3]]}, "batched request"),
    ({"input_ids": [1], "sampling_params": [{"max_new_tokens": 2}]}, "batched request"),
])
def test_sglang_requests_that_cannot_move_are_refused_before_anything_is_sealed(request_doc, reason):
    with pytest.raises(MigrationRefused, match=re.escape(reason)):
        Catalog()("sglang").check_migratable(dumps(request_doc))


@pytest.mark.parametrize("body, reason", [
    (b"\xff not json", "not a JSON object"),
    (b'[{"text": "a", "output_ids": [1]}, {"text": "b", "output_ids": [2]}]', "n > 1"),
    (b'{"text": "a", "meta_info": {}}', "no integer output_ids"),
    (b'{"text": "a", "output_ids": [1], "meta_info": {"hidden_states": [[0.1]]}}', "hidden states"),
])
def test_sglang_published_bodies_that_hide_the_emitted_tokens_refuse_migration(body, reason):
    session = Catalog()("sglang").open_migration()
    with pytest.raises(MigrationRefused, match=reason):
        session.absorb([body])


def test_sglang_stitch_restates_counts_ids_finish_and_input_logprobs_in_the_original_terms():
    codec = Catalog()("sglang")
    first = {"text": " a b", "output_ids": [11, 12], "meta_info": {
        "id": "client-rid", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,
        "reasoning_tokens": 2, "input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.7, 3, None]],
        "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None]], "output_token_logprobs_length": 2}}
    session, emitted = sealed_session(codec, [dumps(first)])
    assert emitted == Emitted([11, 12], {"prompt_tokens": 3})
    # The resumed attempt, as its engine reports it: a 5-token prompt, counting from 0, a fresh rid.
    retry = {"text": " c", "output_ids": [13], "meta_info": {
        "id": "worker-b-rid", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 5,
        "completion_tokens": 1, "cached_tokens": 5, "reasoning_tokens": 1,
        "input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.7, 3, None], [-0.1, 11, None],
                                 [-0.2, 12, None]],
        "output_token_logprobs": [[-0.3, 13, None]], "output_token_logprobs_length": 1}}
    body, verdict = session.stitch(dumps(retry), True)
    meta = loads(body)["meta_info"]
    assert verdict is Verdict.STITCHED
    assert meta["id"] == "client-rid"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs_length"]) == (3, 3, 3)
    assert meta["reasoning_tokens"] == 3
    assert meta["cached_tokens"] == 1  # the count the client was sent: SGLang repeats it on every chunk
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]
    assert meta["output_token_logprobs"] == [[-0.3, 13, None]]  # deltas are never touched


def test_sglang_stitch_drops_the_replayed_tokens_input_logprobs_when_the_client_saw_none():
    codec = Catalog()("sglang")
    session, _ = sealed_session(codec, [dumps({"text": " a", "output_ids": [11], "meta_info": {"id": "r"}})])
    retry = dumps({"text": " b", "output_ids": [12], "meta_info": {
        "id": "r", "input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.1, 11, None]]}})
    body, _ = session.stitch(retry, False)
    assert loads(body)["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]


def test_sglang_stitch_changes_nothing_when_nothing_was_emitted():
    codec = Catalog()("sglang")
    session, emitted = sealed_session(codec, [])
    assert emitted.token_ids == []
    body = dumps({"text": " a", "output_ids": [5], "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}})
    assert session.stitch(body, True) is None
    assert session.stitch(b"\x00 opaque", True) is None


@pytest.mark.parametrize("name", SGLANG_FORMATS)
def test_sglang_stitch_decodes_with_its_own_sequence_codec_not_the_join_threads(name):
    """A stitch runs in the correlator (on the event loop when joins are not offloaded) and the joins'
    sequence codec serves every join session; sglang-zstd's decompression context is not thread safe,
    so the two never share an instance."""
    codec = Catalog()(name)
    joins = codec.sequences["routed_experts"]
    stitches = {id(codec.open_migration()._experts) for _ in range(3)}
    assert id(joins) not in stitches and len(stitches) == 1  # one for every migration session
    assert type(codec.stitch_experts()) is type(joins)


@pytest.mark.parametrize("name", SGLANG_FORMATS)
def test_sglang_rows_an_earlier_attempt_published_win_over_the_resumed_attempts_recomputation(name):
    codec = Catalog()(name)
    encode = codec.sequences["routed_experts"].encode
    row = lambda *values: struct.pack("<2i", *values)  # noqa: E731 - one row: 1 layer, top-2
    sampled = row(1, 2) + row(3, 4)  # rows of positions 0-1, from the passes that sampled the tokens
    recomputed = row(9, 9) + row(8, 8) + row(5, 6) + row(7, 0)  # the retry's prefill recomputed 0-1 differently
    first = {"text": " a", "output_ids": [11], "meta_info": {"id": "r", "routed_experts": encode(sampled)}}
    session, _ = sealed_session(codec, [dumps(first)])
    retry = {"text": " b", "output_ids": [12], "meta_info": {"id": "r", "routed_experts": encode(recomputed)}}
    body, verdict = session.stitch(dumps(retry), True)
    rows = codec.sequences["routed_experts"].decode(loads(body)["meta_info"]["routed_experts"])
    assert rows == sampled + row(5, 6) + row(7, 0) and verdict is Verdict.STITCHED
    short = {"text": " b", "output_ids": [12], "meta_info": {"id": "r", "routed_experts": encode(row(1, 2))}}
    body, verdict = session.stitch(dumps(short), True)
    meta = loads(body)["meta_info"]
    assert verdict is Verdict.OMITTED and "routed_experts" not in meta
    assert meta["routed_experts_unavailable_reason"] == "length_mismatch"


def test_sglang_zstd_inherits_every_migration_hook():
    if "sglang-zstd" not in codec_names():
        pytest.skip("sglang-zstd is not installed")
    sglang, zstd = Catalog()("sglang"), Catalog()("sglang-zstd")
    for hook in ("open_migration", "check_migratable", "resume_request"):
        assert getattr(type(zstd), hook) is getattr(type(sglang), hook)
    w = worker_for("sglang-zstd")
    assert type(w).agg_resumed is type(worker_for("sglang")).agg_resumed


# ----------------------------------------------------------------------------- vLLM

def vllm_request(truth, **params) -> bytes:
    return dumps({"request_id": truth.request_id, "token_ids": truth.prompt_ids, "stream": True,
                  "sampling_params": {"max_tokens": truth.output_len, "prompt_logprobs": 0, **params},
                  "kv_transfer_params": {"do_remote_decode": True}})


def test_vllm_resumed_request_is_the_prompt_plus_emitted_tokens_with_the_remaining_budget():
    codec = Catalog()("vllm")
    truth = make_truth(3, prompt_len=4, output_len=8)
    doc = loads(codec.resume_request(vllm_request(truth, min_tokens=5), Emitted(truth.output_ids[:3])))
    assert doc["token_ids"] == truth.resumed(3).prompt_ids
    assert doc["sampling_params"] == {"max_tokens": 5, "prompt_logprobs": 0, "min_tokens": 2}
    assert "kv_transfer_params" not in doc and doc["request_id"] == truth.request_id
    unbounded = loads(codec.resume_request(dumps({"token_ids": [1], "sampling_params": {"max_tokens": None}}),
                                           Emitted([2])))
    assert unbounded["sampling_params"]["max_tokens"] is None


@pytest.mark.parametrize("request_doc, reason", [
    ({"token_ids": [1], "sampling_params": {"n": 3}}, "n = 3"),
    ({"token_ids": [1], "sampling_params": {"structured_outputs": {"json": {}}}}, "structured_outputs"),
    ({"token_ids": [1], "sampling_params": {"guided_regex": "a"}}, "guided_regex"),
    ({"prompt": "hi"}, "no token_ids"),
])
def test_vllm_requests_that_cannot_move_are_refused(request_doc, reason):
    with pytest.raises(MigrationRefused, match=reason):
        Catalog()("vllm").check_migratable(dumps(request_doc))


def test_vllm_several_choices_in_a_published_body_refuse_migration():
    body = dumps({"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}, {"index": 1, "token_ids": [2]}]})
    with pytest.raises(MigrationRefused, match="n > 1"):
        Catalog()("vllm").open_migration().absorb([body])


@pytest.mark.parametrize("codec, body", [
    ("sglang", {"text": "a", "output_ids": [1, 2**63], "meta_info": {}}),
    ("sglang", {"text": "a", "output_ids": [-(2**63) - 1], "meta_info": {}}),
    ("vllm", {"request_id": "r", "choices": [{"index": 0, "token_ids": [1, 2**64]}]}),
])
def test_a_published_token_id_past_64_bits_refuses_migration_with_a_reason_not_an_overflow(codec, body):
    """A worker's token id the progress state cannot hold (8 bytes a token) is the worker's fault: the
    refusal says so, where an ``OverflowError`` read as the codec's own failure."""
    with pytest.raises(MigrationRefused, match="token id outside the 64-bit range"):
        Catalog()(codec).open_migration().absorb([dumps(body)])


def test_vllm_stitch_restates_usage_and_sends_prompt_logprobs_only_once():
    codec = Catalog()("vllm")
    first = {"request_id": "client", "choices": [{"index": 0, "token_ids": [11, 12]}],
             "prompt_logprobs": [None, {"2": {"logprob": -1.0}}]}
    session, emitted = sealed_session(codec, [dumps(first)])
    assert emitted.token_ids == [11, 12]
    retry = {"request_id": "worker-b", "choices": [{"index": 0, "token_ids": [13], "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
             "prompt_logprobs": [None, {"2": {"logprob": -1.0}}, {"11": {"logprob": -0.1}}, {"12": {"logprob": -0.2}}]}
    body, verdict = session.stitch(dumps(retry), True)
    obj = loads(body)
    assert verdict is Verdict.STITCHED and obj["request_id"] == "client"
    assert obj["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert "prompt_logprobs" not in obj  # the client got them with the first result
    assert obj["choices"] == retry["choices"]


def test_vllm_rows_an_earlier_attempt_published_win_over_the_recomputation():
    codec = Catalog()("vllm")
    encode = codec.sequences["routed_experts"].encode
    sampled = np.array([[[1, 2]], [[3, 4]]], dtype=np.uint8)
    recomputed = np.array([[[9, 9]], [[8, 8]], [[5, 6]]], dtype=np.uint8)
    session, _ = sealed_session(codec, [dumps({"request_id": "r", "choices": [
        {"index": 0, "token_ids": [11], "routed_experts": encode(sampled)}]})])
    body, verdict = session.stitch(dumps({"request_id": "r", "choices": [
        {"index": 0, "token_ids": [12], "routed_experts": encode(recomputed)}]}), True)
    rows = codec.sequences["routed_experts"].decode(loads(body)["choices"][0]["routed_experts"])
    assert verdict is Verdict.STITCHED
    assert rows.tolist() == [[[1, 2]], [[3, 4]], [[5, 6]]] and rows.dtype == np.uint8


@pytest.mark.parametrize("name", [*SGLANG_FORMATS, "vllm"])
def test_progress_bytes_grow_with_the_emitted_tokens_and_single_body_values_stay_bounded(name):
    """The migration state the correlator charges (MigrationSession.progress_bytes): 8 bytes a token
    id, plus at most a few bodies' worth of values kept from single bodies (and, for an incremental
    SGLang stream, its text: 100 bytes a body here; the next test)."""
    session = Catalog()(name).open_migration()
    assert session.progress_bytes() == 0
    sizes = []
    for start in range(0, 50_000, 1_000):
        ids = list(range(start, start + 1_000))
        if name == "vllm":
            body = dumps({"request_id": "r", "choices": [{"index": 0, "token_ids": ids}],
                          "usage": {"prompt_tokens": 3}})
        else:
            body = dumps({"text": "x" * 100, "output_ids": ids,
                          "meta_info": {"id": "r", "prompt_tokens": 3, "input_token_logprobs": [[-0.1, 1, None]]}})
        session.absorb([body])
        sizes.append(session.progress_bytes())
    told = 0 if name == "vllm" else 100 * 50
    assert 8 * 50_000 + told <= sizes[-1] <= 8 * 50_000 + told + 3 * len(body)
    assert sizes == sorted(sizes)


def test_an_incremental_sglang_stream_charges_the_text_and_lists_it_keeps_for_an_abort_body():
    """An incremental stream's session keeps everything the client was told of the text and the
    lists ``_handle_abort_req`` restates (the stitch puts them in front of a resumed attempt's abort
    body): charged at their UTF-8/JSON size, on top of 8 bytes an id, and once more for the sealed copy."""
    session = Catalog()("sglang").open_migration()
    entry = [-0.125, 7, "wörd"]
    told = 0
    for n in range(1, 2_001):
        session.absorb([dumps({"text": "wörd", "output_ids": [7], "meta_info": {
            "id": "r", "prompt_tokens": 3, "completion_tokens": n, "output_token_logprobs": [entry]}})])
        told += len("wörd".encode()) + len(dumps([entry])) - 2 + (1 if n > 1 else 0)
    assert session.progress_bytes() >= 8 * 2_000 + told
    session.seal()
    assert session.progress_bytes() >= 8 * 2_000 + 2 * told


def test_a_sealed_cumulative_sglang_stream_counts_the_restated_ids_it_keeps():
    session = Catalog()("sglang").open_migration()
    ids: list[int] = []
    for start in range(0, 3_000, 1_000):  # cumulative: each body restates every id so far
        ids += list(range(1_000 + start, 2_000 + start))
        session.absorb([dumps({"text": "", "output_ids": ids, "meta_info": {"id": "r", "completion_tokens": len(ids)}})])
    before = session.progress_bytes()
    session.seal()
    assert session.progress_bytes() >= before + 8 * 3_000  # the base's list of the 3,000 ids the client saw


def test_sglang_0523_weight_versions_of_a_stitched_request_are_omitted_not_the_resumed_attempts_alone():
    """SGLang 0.5.23 puts ``weight_versions`` (``[{"version", "start", "end"}]`` over the output tokens,
    ``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``) on a finished body only. The
    resumed attempt's spans cover its own tokens from 0; the weights that produced the k tokens before
    the seal were never published (that attempt did not finish), so no exact value exists for the
    whole request: passed on, the client read ``end: 1`` for a 3-token answer."""
    codec = Catalog()("sglang")
    first = {"text": " a b", "output_ids": [11, 12], "meta_info": {
        "id": "rid", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2}}
    session, _ = sealed_session(codec, [dumps(first)])
    retry = {"text": " c", "output_ids": [13], "meta_info": {
        "id": "rid", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 5,
        "completion_tokens": 1, "weight_version": "v2",
        "weight_versions": [{"version": "v2", "start": 0, "end": 1}]}}
    body, verdict = session.stitch(dumps(retry), True)
    meta = loads(body)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert "weight_versions" not in meta and meta["weight_versions_unavailable_reason"] == "stitch_incomplete"
    assert meta["weight_version"] == "v2"  # the version the request finished with: exact
    # Migrated before any token: the resumed attempt's spans are the whole request's.
    session, _ = sealed_session(codec, [])
    assert session.stitch(dumps(retry), True) is None


def test_sglang_0523_flat_prompt_top_logprobs_of_a_stitched_request_are_the_original_prompts():
    """``return_flat_raw_top_logprobs`` (SGLang 0.5.23, ``tokenizer_manager._build_flat_top_logprobs_fields``)
    writes the prompt's top logprobs as flat arrays with ``input_top_logprobs_shape`` [rows, k]. The
    resumed attempt's prompt holds the k emitted tokens too, so its arrays had their rows: the client
    read an output token's top logprobs as a prompt position's (found by the upstream-shape laws)."""
    codec = Catalog()("sglang")
    flat = {"input_top_logprobs_val_flat": [-0.5, -1.5], "input_top_logprobs_idx_flat": [2, 7],
            "input_top_logprobs_shape": [1, 2], "input_top_logprobs_null_prefix": 1}
    first = {"text": " a", "output_ids": [11], "meta_info": {"id": "rid", "prompt_tokens": 2, **flat}}
    session, _ = sealed_session(codec, [dumps(first)])
    retry = {"text": " b", "output_ids": [12], "meta_info": {
        "id": "rid", "prompt_tokens": 3, "input_top_logprobs_val_flat": [-0.5, -1.5, -0.1, -2.1],
        "input_top_logprobs_idx_flat": [2, 7, 11, 3], "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 1}}
    meta = loads(session.stitch(dumps(retry), True)[0])["meta_info"]
    assert {key: meta[key] for key in flat} == flat
    # Bodies that did not show them (and the base64 form): the replayed rows are cut off.
    import base64

    import numpy as np
    session, _ = sealed_session(codec, [dumps({"text": " a", "output_ids": [11], "meta_info": {"id": "rid"}})])
    packed = {"input_top_logprobs_val_flat_b64": base64.b64encode(np.array([-0.5, -1.5, -0.1, -2.1], "<f4").tobytes()).decode(),
              "input_top_logprobs_val_flat_b64_dtype": "float32", "input_top_logprobs_shape": [2, 2]}
    meta = loads(session.stitch(dumps({"text": " b", "output_ids": [12], "meta_info": {"id": "rid", **packed}}), True)[0])["meta_info"]
    assert meta["input_top_logprobs_shape"] == [1, 2]
    assert np.frombuffer(base64.b64decode(meta["input_top_logprobs_val_flat_b64"]), "<f4").tolist() == [-0.5, -1.5]


@pytest.mark.parametrize("fields, reason", [
    # the list form with fewer values than its shape states (2 x 2 = 4): cut to 2, it passed as whole
    ({"input_top_logprobs_val_flat": [-0.5, -1.5, -0.1]}, "length_mismatch"),
    # not a list: left as sent under the cut shape
    ({"input_top_logprobs_val_flat": "-0.5,-1.5,-0.1,-2.1"}, "stitch_corrupt"),
    # a packed array whose dtype marker names no 4-byte width (upstream: "the dtype marker fields let the
    # widths change later"; 2 x 2 float64 here): left uncut under the cut shape
    ({"input_top_logprobs_val_flat_b64": "A" * 43 + "=", "input_top_logprobs_val_flat_b64_dtype": "float64"},
     "stitch_corrupt"),
    # packed values that are not Base64 text
    ({"input_top_logprobs_val_flat_b64": 12345, "input_top_logprobs_val_flat_b64_dtype": "float32"},
     "stitch_corrupt"),
])
def test_sglang_flat_prompt_top_logprobs_that_cannot_be_cut_to_their_shape_are_omitted(fields, reason):
    """SGLang 0.5.23 ``_build_flat_top_logprobs_fields``: each flat array holds exactly
    ``input_top_logprobs_shape`` = [rows, k] values (``val_arr.reshape(-1)``, rectangular rows,
    ``flat_top_logprobs_layout``). The stitch cuts the rows of the replayed tokens and states the new
    shape; an array it cannot cut to that shape must not be published under it as whole: it is omitted
    with a reason, as the Base64 form that holds fewer values than its shape states is."""
    codec = Catalog()("sglang")
    session, _ = sealed_session(codec, [dumps({"text": " a", "output_ids": [11], "meta_info": {"id": "rid"}})])
    retry = {"text": " b", "output_ids": [12], "meta_info": {"id": "rid", **fields,
                                                              "input_top_logprobs_shape": [2, 2]}}
    body, verdict = session.stitch(dumps(retry), True)
    meta = loads(body)["meta_info"]
    field = next(iter(fields))
    assert field not in meta and meta[f"{field}_unavailable_reason"] == reason, meta
    assert meta["input_top_logprobs_shape"] == [1, 2]
    assert verdict is Verdict.OMITTED


# ------------------------------------------------ vLLM 0.34.0 bodies of a resumed attempt

def vllm_034_migrated(shape, truth, before: int) -> tuple[list[bytes], list[bytes], Verdict | None]:
    """The uninterrupted 0.34.0 stream of ``truth`` and the one a client reads when the worker is
    lost after ``before`` chunks and a fresh worker serves ``truth.resumed(k)`` (both rendered by
    ``streamproc_vllm.upstream``, ``serve_tokens_stream_generator``), with the strongest verdict."""
    from streamproc_vllm import upstream

    codec = Catalog()("vllm")
    uninterrupted = upstream.agg(truth, shape, stream_=True)
    k = truth.chunk_spans()[before - 1][1]
    session, emitted = sealed_session(codec, uninterrupted[:before])
    assert emitted.token_ids == truth.output_ids[:k]
    resumed = upstream.agg(truth.resumed(k), shape, stream_=True)
    stitched, verdict = [], None
    for index, body in enumerate(resumed):
        out = session.stitch(body, index == len(resumed) - 1)
        if out is not None:
            body, verdict = out[0], Verdict.OMITTED if Verdict.OMITTED in (verdict, out[1]) else out[1]
        stitched.append(body)
    return uninterrupted, uninterrupted[:before] + stitched, verdict


def test_vllm_0340_prompt_token_ids_reach_the_client_once_not_again_extended_by_the_emitted_tokens():
    """0.34.0 ``serve_tokens_stream_generator`` with ``return_token_ids``: ``chunk.prompt_token_ids =
    prompt_token_ids`` on the first token-bearing chunk, then ``prompt_token_ids = None`` (excluded from
    the dump). A resumed attempt's first chunk carries its own prompt, the original one plus the k
    emitted tokens: passed on, the client read a second, longer prompt mid-stream."""
    from streamproc_vllm.upstream import Shape

    truth = make_truth(11, prompt_len=5, output_len=9, chunk_sizes=[2, 3, 4])
    uninterrupted, migrated, _ = vllm_034_migrated(Shape(version="0.34.0", return_token_ids=True), truth, 1)
    assert [loads(body) for body in migrated] == [loads(body) for body in uninterrupted]
    assert sum("prompt_token_ids" in loads(body) for body in migrated) == 1


def test_vllm_0340_weight_versions_of_a_stitched_request_are_omitted_not_the_resumed_attempts_alone():
    """0.34.0 ``RequestState._new_completion_output``: ``weight_versions=self._weight_version_spans() if
    finished else None``, spans ``WeightVersionSpan(version, start, end)`` over the request's own output
    tokens, from 0 (``track_weight_version`` starts them at ``detokenizer.num_output_tokens()``). The
    lost attempt never finished, so the weights of the k tokens before the seal were never published
    and the whole request has no exact value; passed on, the client read the resumed attempt's spans
    (``end`` = its own token count) as the whole answer's. Same rule as SGLang 0.5.23's."""
    from streamproc_vllm.upstream import Shape

    truth = make_truth(12, prompt_len=4, output_len=7, chunk_sizes=[3, 4])
    uninterrupted, migrated, verdict = vllm_034_migrated(Shape(version="0.34.0", weight_version="v7"), truth, 1)
    assert verdict is Verdict.OMITTED
    finishing = loads(migrated[-2])["choices"][0]  # the last body is the usage-only chunk
    assert finishing["weight_versions"] is None
    assert finishing["weight_versions_unavailable_reason"] == "stitch_incomplete"
    expected = loads(uninterrupted[-2])["choices"][0]
    assert {key: finishing[key] for key in expected if key != "weight_versions"} == \
        {key: value for key, value in expected.items() if key != "weight_versions"}
    assert [loads(body) for body in migrated[:-2]] == [loads(body) for body in uninterrupted[:-2]]
    # Migrated before any token: the resumed attempt's spans are the whole request's.
    session, _ = sealed_session(Catalog()("vllm"), [])
    assert session.stitch(uninterrupted[-2], True) is None


# ---------------------------------------------- SGLang 0.5.23 bodies of a resumed attempt

def sglang_0523_migrated(shape, resumed_shape, truth, before: int) -> tuple[list[dict], list[dict]]:
    """The uninterrupted 0.5.23 stream of ``truth`` (``shape``) and the one a client reads when the
    worker is lost after ``before`` bodies and another worker (``resumed_shape``: its own cache) serves
    ``truth.resumed(k)``; both rendered by ``streamproc_sglang.upstream`` (``_handle_batch_output``)."""
    from streamproc_sglang import upstream

    codec = Catalog()("sglang")
    uninterrupted = upstream.agg(truth, shape, stream=True)
    k = truth.chunk_spans()[before - 1][1]
    session, emitted = sealed_session(codec, uninterrupted[:before])
    assert emitted.token_ids == truth.output_ids[:k]
    resumed = upstream.agg(truth.resumed(k), resumed_shape, stream=True)
    stitched = [(session.stitch(body, index == len(resumed) - 1) or (body,))[0] for index, body in enumerate(resumed)]
    return [loads(b) for b in uninterrupted], [loads(b) for b in uninterrupted[:before] + stitched]


@pytest.mark.parametrize("streaming", ["incremental", "cumulative"])
@pytest.mark.parametrize("resumed_hits", [0, 5, 9])
def test_sglang_0523_a_migrated_streams_cached_tokens_stay_those_the_client_was_sent(streaming, resumed_hits):
    """SGLang 0.5.23 counts a request's prompt cache hits once, at prefill (``ScheduleBatch.
    prepare_for_extend``: "Only calculate cached_tokens once"; the tier split ``split_cached_prefix_by_tier``
    on the first chunk only) and ``TokenizerManager._handle_batch_output`` repeats ``cached_tokens`` and
    ``cached_tokens_details`` on every chunk: an uninterrupted stream never changes them. The resumed
    attempt's worker counts its own hits over the original prompt plus the emitted tokens (a cold
    worker: 0; one that holds them: up to prompt + k). The stitch published that count, capped at the
    prompt, so the client saw the count change mid-stream, and the details (uncapped) disagree with it."""
    from msgspec.structs import replace

    from streamproc_sglang.upstream import Shape

    truth = make_truth(13, prompt_len=6, output_len=8, chunk_sizes=[3, 2, 3], return_logprob=True)
    shape = Shape(version="0.5.23", streaming=streaming, cached_tokens=4)
    # After 2 bodies: the second shows a cumulative stream's mode (one alone needs --format-option streaming).
    uninterrupted, migrated = sglang_0523_migrated(shape, replace(shape, cached_tokens=resumed_hits), truth, 2)
    for body in (uninterrupted[-1], migrated[-1]):  # spans the lost attempt never published: omitted
        meta = body["meta_info"]
        meta.pop("weight_versions", None), meta.pop("weight_versions_unavailable_reason", None)
    assert [without_attempt_values(doc) for doc in migrated] == [without_attempt_values(doc) for doc in uninterrupted]
    assert {(m["meta_info"]["cached_tokens"], str(m["meta_info"]["cached_tokens_details"])) for m in migrated} == \
        {(4, str({"device": 4, "host": 0}))}


def test_sglang_a_resumed_attempts_cached_tokens_cap_at_the_prompt_when_the_client_was_sent_none():
    """No published body said ``cached_tokens`` (an older worker, or a P/D join that omitted it): the
    resumed attempt's count is all there is, restated to the original prompt (hits on the replayed
    emitted tokens are not prompt cache hits)."""
    session, _ = sealed_session(Catalog()("sglang"), [dumps({"text": " a b", "output_ids": [11, 12], "meta_info": {
        "id": "r", "prompt_tokens": 3, "completion_tokens": 2}})])
    retry = {"text": " c", "output_ids": [13], "meta_info": {"id": "r", "prompt_tokens": 5, "completion_tokens": 1,
                                                           "cached_tokens": 5}}
    assert loads(session.stitch(dumps(retry), True)[0])["meta_info"]["cached_tokens"] == 3


@pytest.mark.parametrize("name, prompt_key, extra", [
    ("sglang", "input_ids", {"sampling_seed": 7, "custom_params": {"thinking_budget": 32}}),
    ("vllm", "token_ids", {"seed": 7, "thinking_token_budget": 32, "repetition_penalty": 1.1}),
])
def test_resumed_requests_carry_penalties_seeds_and_thinking_budgets_unchanged(name, prompt_key, extra):
    """The documented limits' safe side (docs/protocol.md, cost and limits): frequency/presence
    penalties (output tokens only, in both engines) and seeds cannot be carried over, so they are sent
    as they were, never dropped or rescaled; thinking budgets are exact as sent, because both engines
    count the reasoning already in the prompt (vLLM ``_thinking_budget_kernel``: "If the request
    resumes from a prompt that already contains generated reasoning content, count it against the
    remaining budget"; SGLang ``ThinkingBudgetLogitProcessor``: ``[*req.origin_input_ids, *req.output_ids]``).
    A vLLM request without ``max_tokens`` stays without one: the server's context bound
    (``get_max_tokens``: ``max_model_len - input_length``) already accounts for the longer prompt."""
    codec = Catalog()(name)
    params = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "temperature": 0.0, **extra}
    doc = loads(codec.resume_request(dumps({prompt_key: [1, 2], "sampling_params": params}), Emitted([7, 8])))
    budget = {"max_new_tokens": 126} if name == "sglang" else {}  # SGLang's 128 default, less k
    assert doc["sampling_params"] == {**params, **budget}
    assert doc[prompt_key] == [1, 2, 7, 8]


# After 1 body a cumulative stream's mode is not shown yet (--format-option streaming decides): after 2.
@pytest.mark.parametrize("streaming, before", [("incremental", 1), ("incremental", 2), ("cumulative", 2)])
def test_sglang_0523_speculative_decoding_stats_of_a_migrated_request_are_omitted_not_the_resumed_attempts(
        streaming, before):
    """SGLang 0.5.23 writes ``spec_accept_rate``, ``spec_accept_length``, ``spec_num_correct_drafts``,
    ``spec_num_proposed_drafts``, ``spec_verify_ct`` and ``spec_correct_drafts_histogram`` on a finished
    body only (``TokenizerManager._calculate_spec_decoding_metrics``), from counters the scheduler adds
    per verify step of that ``Req`` (``batch_result_processor``: ``req.spec_verify_ct += 1``). A resumed
    attempt's counters cover its own steps; the lost attempt's were never published (it did not
    finish), so no exact total exists: passed on, the client read the resumed attempt's alone (and an
    ``spec_accept_length`` over its own ``completion_tokens``) as the whole request's."""
    from msgspec.structs import replace

    from streamproc_sglang.upstream import Shape

    truth = make_truth(14, prompt_len=5, output_len=12, chunk_sizes=[3, 4, 5])
    shape = Shape(version="0.5.23", streaming=streaming, spec_draft_tokens=4)
    uninterrupted, migrated = sglang_0523_migrated(shape, replace(shape), truth, before)
    spec = [key for key in uninterrupted[-1]["meta_info"] if key.startswith("spec_")]
    assert len(spec) == 6  # the shape renders every counter 0.5.23 writes
    final = migrated[-1]["meta_info"]
    assert {key: final.get(key + "_unavailable_reason") for key in spec} == dict.fromkeys(spec, "stitch_incomplete")
    assert not any(key in final for key in spec)
    for body in (uninterrupted[-1], migrated[-1]):  # spans the lost attempt never published: omitted alike
        meta = body["meta_info"]
        for key in ("weight_versions", *spec):
            meta.pop(key, None), meta.pop(key + "_unavailable_reason", None)
    assert [without_attempt_values(doc) for doc in migrated] == [without_attempt_values(doc) for doc in uninterrupted]
    # Migrated before any token: the resumed attempt ran every verify step of the request, so its
    # counters pass unchanged (its timings are still its own: omitted whatever k).
    session, _ = sealed_session(Catalog()("sglang"), [])
    body, _ = session.stitch(upstream_final(truth, shape), True)
    assert all(key in loads(body)["meta_info"] for key in spec)
    assert without_timings(loads(body)) == without_timings(loads(upstream_final(truth, shape)))


def upstream_final(truth, shape) -> bytes:
    from streamproc_sglang import upstream

    return upstream.agg(truth, shape, stream=True)[-1]


@pytest.mark.parametrize("before", [1, 2])
def test_vllm_0340_speculative_decoding_metrics_of_a_migrated_request_are_omitted_not_the_resumed_attempts(before):
    """vLLM 0.34.0 (``per_request_spec_decode_metrics``) answers a finished request with ``metrics:
    PerRequestMetrics(speculative_decoding=build_spec_decoding_metrics(final_res))``: the stream's usage
    chunk, the unary body. Its counters are the engine ``Request``'s own (``RequestSpecDecodeMetrics.
    observe`` once per verify step, ``Scheduler.update_from_output``), so a resumed attempt's cover its
    own steps; the lost attempt's were never published. Passed on, the client read them as the whole
    request's."""
    from streamproc_vllm import upstream
    from streamproc_vllm.upstream import Shape

    truth = make_truth(15, prompt_len=4, output_len=11, chunk_sizes=[2, 4, 5])
    shape = Shape(version="0.34.0", num_spec_tokens=3)
    uninterrupted, migrated, verdict = vllm_034_migrated(shape, truth, before)
    assert "speculative_decoding" in loads(uninterrupted[-1])["metrics"]  # the usage-only chunk
    assert verdict is Verdict.OMITTED
    final = loads(migrated[-1])
    assert final["metrics"] is None and final["metrics_unavailable_reason"] == "stitch_incomplete"
    expected = loads(uninterrupted[-1])
    assert {key: value for key, value in final.items() if not key.startswith("metrics")} == \
        {key: value for key, value in expected.items() if key != "metrics"}
    assert [loads(body) for body in migrated[:-1]] == [loads(body) for body in uninterrupted[:-1]]
    # A unary answer of the resumed attempt alike.
    session, _ = sealed_session(Catalog()("vllm"), uninterrupted[:before])
    k = truth.chunk_spans()[before - 1][1]
    body, _ = session.stitch(upstream.agg(truth.resumed(k), shape, stream_=False)[0], True)
    assert loads(body)["metrics"] is None and loads(body)["metrics_unavailable_reason"] == "stitch_incomplete"
    # Migrated before any token: the resumed attempt ran every verify step of the request.
    session, _ = sealed_session(Catalog()("vllm"), [])
    assert session.stitch(uninterrupted[-1], True) is None


def sglang_unsaid_cache_then(resumed_meta: dict, verdict: Verdict = Verdict.STITCHED) -> dict:
    """A stream whose published bodies never said ``cached_tokens`` (prompt 3, 2 tokens emitted), then
    the resumed attempt's finished body with ``resumed_meta``: the stitched ``meta_info`` (``verdict``)."""
    session, _ = sealed_session(Catalog()("sglang"), [dumps({"text": " a b", "output_ids": [11, 12], "meta_info": {
        "id": "r", "prompt_tokens": 3, "completion_tokens": 2}})])
    retry = {"text": " c", "output_ids": [13], "meta_info": {"id": "r", "prompt_tokens": 5, "completion_tokens": 1,
                                                           **resumed_meta}}
    body, stitched = session.stitch(dumps(retry), True)
    assert stitched is verdict
    return loads(body)["meta_info"]


@pytest.mark.parametrize("hits", [4, 5])
def test_sglang_a_capped_cached_tokens_count_caps_its_single_tier_details_alike(hits):
    """SGLang 0.5.23 ``OutputStreamer.get_cached_tokens_details``: ``{"device": n, "host": m}`` (+
    ``storage``, ``storage_backend`` with HiCache storage) from ``split_cached_prefix_by_tier`` over the
    request's cached prefix, or ``{"device": req.cached_tokens, "host": 0}``; written beside
    ``cached_tokens`` on every body (``_handle_batch_output``). When no published body said the count,
    the stitch caps the resumed attempt's ``cached_tokens`` (hits over prompt + emitted tokens) at the
    original prompt but passed the details on uncapped: ``{"device": 5}`` beside ``cached_tokens: 3``,
    more hits than the prompt has tokens. With every hit in one tier, that tier holds the whole capped
    prefix: it is capped alike."""
    from streamproc_sglang import upstream
    from streamproc_sglang.upstream import Shape

    truth = make_truth(16, prompt_len=3, output_len=3, chunk_sizes=[2, 1])
    resumed = loads(upstream.agg(truth.resumed(2), Shape(version="0.5.23", cached_tokens=hits), stream=True)[-1])
    assert resumed["meta_info"]["cached_tokens_details"] == {"device": hits, "host": 0}
    meta = sglang_unsaid_cache_then({key: resumed["meta_info"][key] for key in ("cached_tokens", "cached_tokens_details")})
    assert (meta["cached_tokens"], meta["cached_tokens_details"]) == (3, {"device": 3, "host": 0})
    # HiCache storage on: the one tier that holds the hits, whichever it is.
    meta = sglang_unsaid_cache_then({"cached_tokens": hits, "cached_tokens_details": {
        "device": 0, "host": 0, "storage": hits, "storage_backend": "HiCacheFile"}})
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 3, "storage_backend": "HiCacheFile"}
    # Within the prompt: nothing to cap.
    meta = sglang_unsaid_cache_then({"cached_tokens": 2, "cached_tokens_details": {"device": 1, "host": 1}})
    assert (meta["cached_tokens"], meta["cached_tokens_details"]) == (2, {"device": 1, "host": 1})


def test_sglang_capped_cached_tokens_details_split_over_tiers_are_omitted_not_guessed():
    """Hits split over tiers (``split_cached_prefix_by_tier``: device, then host-loaded and storage-loaded
    spans whose order the body does not tell) past the original prompt: which tier the cut-off hits
    were in is unknown, so the details are omitted, never left above the capped count."""
    meta = sglang_unsaid_cache_then({"cached_tokens": 5, "cached_tokens_details": {"device": 2, "host": 3}},
                                    Verdict.OMITTED)
    assert meta["cached_tokens"] == 3
    assert "cached_tokens_details" not in meta
    assert meta["cached_tokens_details_unavailable_reason"] == "length_mismatch"


# ------------------------------------------------------------- timings of a resumed attempt

@pytest.mark.parametrize("streaming, before", [("incremental", 1), ("incremental", 2), ("cumulative", 2)])
def test_sglang_0523_timings_of_a_migrated_request_are_omitted_not_the_resumed_attempts(streaming, before):
    """SGLang 0.5.23 times a request from its own worker's receipt (``APIServerReqTimeStats.created_time``):
    ``e2e_latency`` (``get_e2e_latency``) on every finished body, and with --enable-metrics the
    scheduler's ``queue_time`` / ``forward_entry_time`` / ``prefill_finished_time`` / storage waits on
    every body and ``request_received_ts``, ``first_token_latency``, ``decode_throughput`` ... on the
    finished one; ``response_sent_to_client_ts`` on the first body sent. The resumed attempt's worker
    received it later and ran its own queue and prefill: passed on, the client read the resumed
    attempt's clock as the request's (a shorter e2e_latency, a later receipt, a second "first response
    sent" mid-stream). Each is omitted on every stitched body; everything else is the run's."""
    from msgspec.structs import replace

    from streamproc_sglang import upstream
    from streamproc_sglang.upstream import Shape

    truth = make_truth(16, prompt_len=5, output_len=12, chunk_sizes=[3, 4, 5])
    shape = Shape(version="0.5.23", streaming=streaming, metrics=True)
    uninterrupted = upstream.agg(truth, shape, stream=True)
    assert set(SGLANG_0523_TIMINGS) <= set(loads(uninterrupted[-1])["meta_info"])  # the shape renders each
    k = truth.chunk_spans()[before - 1][1]
    session, _ = sealed_session(Catalog()("sglang"), uninterrupted[:before])
    resumed = upstream.agg(truth.resumed(k), replace(shape), stream=True)
    migrated = []
    for index, body in enumerate(resumed):
        out = session.stitch(body, index == len(resumed) - 1)
        assert out is not None and out[1] is Verdict.OMITTED
        meta, own = loads(out[0])["meta_info"], loads(body)["meta_info"]
        timed = [key for key in SGLANG_0523_TIMINGS if key in own]
        assert timed and not any(key in meta for key in SGLANG_0523_TIMINGS)
        assert {key: meta.get(key + "_unavailable_reason") for key in timed} == dict.fromkeys(timed, "stitch_incomplete")
        migrated.append(loads(out[0]))
    assert len(timed) == len(SGLANG_0523_TIMINGS)  # the finished body: every one
    expected = [loads(body) for body in uninterrupted]
    for body in (expected[-1], migrated[-1]):  # spans the lost attempt never published: omitted alike
        body["meta_info"].pop("weight_versions", None), body["meta_info"].pop("weight_versions_unavailable_reason", None)
    assert [without_attempt_values(doc) for doc in [loads(b) for b in uninterrupted[:before]] + migrated] == \
        [without_attempt_values(doc) for doc in expected]


def test_sglang_0523_timings_are_omitted_when_migrated_before_any_token_too():
    """With nothing emitted before the seal the resumed attempt produced every token, so its counts
    and spans are the request's (kept), but not its clock: the request was received, queued and
    maybe prefilled by the lost worker first."""
    from streamproc_sglang.upstream import Shape

    truth = make_truth(17, prompt_len=4, output_len=6, chunk_sizes=[6])
    shape = Shape(version="0.5.23", metrics=True, spec_draft_tokens=2)
    final = upstream_final(truth, shape)
    session, _ = sealed_session(Catalog()("sglang"), [])
    body, verdict = session.stitch(final, True)
    meta = loads(body)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert {key: meta.get(key + "_unavailable_reason") for key in SGLANG_0523_TIMINGS} == \
        dict.fromkeys(SGLANG_0523_TIMINGS, "stitch_incomplete")
    assert not any(key in meta for key in SGLANG_0523_TIMINGS)
    assert meta["weight_versions"] == loads(final)["meta_info"]["weight_versions"]
    assert without_timings(loads(body)) == without_timings(loads(final))


def test_vllm_0340_created_of_a_resumed_unary_answer_is_omitted_not_the_resumed_workers_clock():
    """vLLM 0.34.0 ``serve_tokens_full_generator``: ``created_time = int(time.time())`` as the answering
    worker starts, returned as ``GenerateResponseBase.created`` (``_build_response_fields``). A unary
    request is migrated with nothing emitted (a P/D prefill leg reached the processor, its decode was
    lost): the resumed worker's ``created`` is later than the request's. Passed on, the client read it
    as the request's creation time. ``metrics`` holds no timing on this endpoint
    (``PerRequestMetrics(speculative_decoding=...)`` only): with nothing emitted it stays."""
    from streamproc_vllm import upstream
    from streamproc_vllm.upstream import Shape

    truth = make_truth(18, prompt_len=4, output_len=5)
    shape = Shape(version="0.34.0", num_spec_tokens=2)
    unary = upstream.agg(truth, shape, stream_=False)[0]
    assert loads(unary)["created"] is not None
    session, _ = sealed_session(Catalog()("vllm"), [])
    body, verdict = session.stitch(unary, True)
    doc, expected = loads(body), loads(unary)
    assert verdict is Verdict.OMITTED
    assert doc["created"] is None and doc["created_unavailable_reason"] == "stitch_incomplete"
    assert doc["metrics"] == expected["metrics"]
    del doc["created_unavailable_reason"]
    assert doc == {**expected, "created": None}
    # A stream has no timing to omit: its chunks pass as before.
    for chunk in upstream.agg(truth, shape, stream_=True):
        assert "created" not in loads(chunk)
# ------------------------------------------------------------- the verdict of a stitched body
#
# ``Streamproc-Join: omitted`` means the body carries a ``<field>_unavailable_reason`` marker
# (docs/protocol.md); ``stitched`` a resumed attempt's body restated without one. The stitch reads
# the joined body, the join's markers included, and may drop one (the client's prompt logprobs put
# back), so its verdict is the body's.

def _sglang_meta(prompt: int, out: list[int], first: int, count: int, pd: bool, finish=None) -> dict:
    """An incremental SGLang chunk of an attempt (output positions ``[first, first + len(out))``,
    the attempt's running ``count``), with ``return_logprob``; a P/D decode's prompt lists are ``[]``."""
    inp = [[None, 12, None], [-0.5, 13, None], [-0.25, 14, None]]
    return {"id": "r1", "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
            "input_token_logprobs": [] if pd else inp,
            "output_token_logprobs": [[-0.125 * (first + i + 1), t, None] for i, t in enumerate(out)],
            "output_token_logprobs_length": count, "completion_tokens": count, "cached_tokens": 0}


def _markers(body: bytes) -> list[str]:
    meta = loads(body).get("meta_info", {})
    return [key for key in meta if key.endswith("_unavailable_reason")]


def test_sglang_a_resumed_pd_body_is_omitted_exactly_when_it_still_carries_a_marker():
    """Through the correlator: a P/D resumed attempt whose prefill leg aborted. Its chunks' only
    marker, ``input_logprobs_unavailable_reason``, is replaced by the client's prompt logprobs in the
    stitch, so they are ``stitched`` (they were published ``omitted`` with no marker); the final one
    keeps ``routed_experts_unavailable_reason`` and is ``omitted``."""
    from toy_codec import feed

    from streamproc.correlator import Correlator, CorrelatorConfig
    from streamproc.testing.harness import Run, leg
    from streamproc.wire import Role

    codec = Catalog()("sglang")
    run = Run(Correlator(lambda name: codec, "sglang", CorrelatorConfig()))
    seen = dumps({"text": "a", "output_ids": [201], "meta_info": _sglang_meta(4, [201], 0, 1, False)})
    feed(run, leg("r1", Role.AGG, [seen, b"{}"])[:1])
    reply, decisions = run.correlator.migrate("r1", 0.0)
    run.absorb(decisions)
    assert reply.emitted_token_ids == [201]
    prefill = dumps({"text": "", "output_ids": [], "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "x"}, "prompt_tokens": 5, "completion_tokens": 0}})
    decode = [dumps({"text": t, "output_ids": [i], "meta_info": _sglang_meta(5, [i], n, n, True, finish)})
              for n, (t, i, finish) in enumerate([("b", 202, None), ("c", 203, None),
                                                  ("d", 204, {"type": "length", "length": 3})], start=1)]
    feed(run, leg("r1", Role.PREFILL, [prefill], attempt=1))
    feed(run, leg("r1", Role.DECODE, decode, attempt=1))
    got = [(r.seq, _markers(r.body), r.verdict) for r in run.of("r1")]
    assert got == [(0, [], Verdict.PASSTHROUGH), (1, [], Verdict.STITCHED), (2, [], Verdict.STITCHED),
                   (3, ["routed_experts_unavailable_reason"], Verdict.OMITTED)]


def test_sglang_stitch_of_a_joined_body_that_carries_a_marker_says_omitted():
    session, _ = sealed_session(Catalog()("sglang"), [
        dumps({"text": "a", "output_ids": [201], "meta_info": _sglang_meta(4, [201], 0, 1, False)})])
    meta = {**_sglang_meta(5, [202], 1, 1, False, {"type": "length", "length": 1}),
            "routed_experts_unavailable_reason": "prefill_timeout"}
    body, verdict = session.stitch(dumps({"text": "b", "output_ids": [202], "meta_info": meta}), True)
    assert _markers(body) == ["routed_experts_unavailable_reason"]
    assert verdict is Verdict.OMITTED


def test_vllm_stitch_of_a_joined_body_that_carries_a_marker_says_omitted():
    session, _ = sealed_session(Catalog()("vllm"), [dumps({"request_id": "r", "choices": [
        {"index": 0, "token_ids": [11]}]})])
    retry = {"request_id": "w", "choices": [{"index": 0, "token_ids": [12], "finish_reason": "stop",
                                              "routed_experts": None,
                                              "routed_experts_unavailable_reason": "prefill_timeout"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    body, verdict = session.stitch(dumps(retry), True)
    assert loads(body)["choices"][0]["routed_experts_unavailable_reason"] == "prefill_timeout"
    assert verdict is Verdict.OMITTED


def test_vllm_stitch_of_a_body_whose_usage_carries_the_joins_marker_says_omitted():
    """The vLLM join puts ``prompt_tokens_details_unavailable_reason`` in ``usage`` (join.py
    ``_join_prompt_tokens_details``: a P/D attempt whose prefill leg was unavailable), not in the body or a
    choice. The stitch restates ``usage`` (k > 0) and so rewrites the body: the marker is still there,
    so the verdict is ``omitted`` (the correlator publishes the stitch's verdict as is)."""
    session, _ = sealed_session(Catalog()("vllm"), [dumps({"request_id": "r", "choices": [
        {"index": 0, "token_ids": [11]}]})])
    retry = {"request_id": "w", "choices": [{"index": 0, "token_ids": [12], "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                       "prompt_tokens_details": None,
                       "prompt_tokens_details_unavailable_reason": "prefill_timeout"}}
    body, verdict = session.stitch(dumps(retry), True)
    assert loads(body)["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_timeout"
    assert verdict is Verdict.OMITTED


def test_sglang_flat_prompt_top_logprobs_cut_past_their_rows_cut_the_null_prefix_too():
    """SGLang 0.5.23 ``_build_flat_top_logprobs_fields``: "the covered range spans null_prefix + rows
    positions", the leading null positions counted by ``input_top_logprobs_null_prefix``
    (``flat_top_logprobs_layout``). A resumed attempt whose prompt has k = 2 replayed tokens but one
    covered row (``logprob_start_len`` past the null positions' end leaves 2 positions: 1 null, 1 row)
    restates the original prompt's positions, 2 - 2 = 0: shape [0, k] and null_prefix 0, not 1."""
    codec = Catalog()("sglang")
    session, _ = sealed_session(codec, [dumps({"text": " a b", "output_ids": [11, 12], "meta_info": {"id": "rid"}})])
    retry = {"text": " c", "output_ids": [13], "meta_info": {
        "id": "rid", "input_top_logprobs_val_flat": [-0.1, -2.1], "input_top_logprobs_idx_flat": [12, 3],
        "input_top_logprobs_shape": [1, 2], "input_top_logprobs_null_prefix": 1}}
    meta = loads(session.stitch(dumps(retry), True)[0])["meta_info"]
    assert meta["input_top_logprobs_shape"] == [0, 2]
    assert meta["input_top_logprobs_val_flat"] == [] and meta["input_top_logprobs_idx_flat"] == []
    assert meta["input_top_logprobs_null_prefix"] == 0
    # With rows enough the null positions stay: 1 null + 3 rows, k = 2 -> 1 null + 1 row.
    session, _ = sealed_session(codec, [dumps({"text": " a b", "output_ids": [11, 12], "meta_info": {"id": "rid"}})])
    retry["meta_info"].update({"input_top_logprobs_val_flat": [-0.5, -1.5, -0.1, -2.1, -0.2, -2.2],
                               "input_top_logprobs_idx_flat": [2, 7, 11, 3, 12, 4], "input_top_logprobs_shape": [3, 2]})
    meta = loads(session.stitch(dumps(retry), True)[0])["meta_info"]
    assert meta["input_top_logprobs_shape"] == [1, 2] and meta["input_top_logprobs_val_flat"] == [-0.5, -1.5]
    assert meta["input_top_logprobs_null_prefix"] == 1
