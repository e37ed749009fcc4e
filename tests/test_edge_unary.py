"""Unary mode of `streamproc edge`: one JSON body per request instead of an event stream.

``Accept: application/json`` (or ``?stream=false``) waits for the final result and answers with the
single result of a unary request, or the codec's fold of a streamed one; an error result becomes
its native body with an HTTP error status.
"""

from __future__ import annotations

import json

import anyio
import httpx
import nats
import pytest
from edge_harness import publish_result, publish_results, running_edge
from helpers import rid, upstream_json
from sglang_0523_bodies import TOO_LONG, stream_error_frame, unary_value_error

from streamproc.catalog import Catalog, worker_for
from streamproc.codec import ErrorKind
from streamproc.simulation import make_truth
from streamproc.wire import Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

DURABLE = Subjects("streamproc")
CORE = Subjects("core")
JSON = {"Accept": "application/json"}


async def get(edge, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
        return await client.get(path, headers=headers)


async def test_a_unary_request_gets_its_single_result_verbatim(edge, nc):
    request_id = rid("unary")
    [body] = worker_for("sglang").agg(make_truth(3, request_id=request_id), stream=False)
    await publish_results(nc, DURABLE, request_id, [body])

    response = await get(edge, f"/v1/results/{request_id}", JSON)

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == body
    assert response.headers["streamproc-join"] == "passthrough"


async def test_a_unary_answer_forbids_content_sniffing(edge, nc):
    """A unary answer is a worker's bytes under the edge's origin: a browser must take them as the
    Content-Type says (JSON, plain text), never sniff HTML in them and run it. Answers and error results
    alike carry ``X-Content-Type-Options: nosniff``; they carried none."""
    request_id = rid("nosniff")
    await publish_results(nc, DURABLE, request_id, [b"<html><script>alert(1)</script></html>"])
    error_id = rid("nosniff-error")
    await publish_result(nc, DURABLE, error_id, 0, b'{"error": {"message": "<script>x</script>"}}', final=True,
                         verdict=None, error="internal")
    await nc.flush()

    answers = [await get(edge, f"/v1/results/{request_id}", JSON), await get(edge, f"/v1/results/{error_id}", JSON)]

    assert [(r.headers["content-type"], r.headers.get("x-content-type-options")) for r in answers] == [
        ("application/json", "nosniff")] * 2


async def test_a_streamed_request_is_folded_by_the_codec_into_the_unary_response(edge, nc):
    request_id = rid("folded")
    worker = worker_for("sglang")
    truth = make_truth(4, request_id=request_id, output_len=9)
    bodies = worker.agg(truth, stream=True)
    assert len(bodies) > 1
    await publish_results(nc, DURABLE, request_id, bodies, verdict=Verdict.JOINED)

    response = await get(edge, f"/v1/results/{request_id}?stream=false")

    assert response.status_code == 200
    assert response.content == Catalog()("sglang").fold(bodies)
    [unary] = worker.agg(truth, stream=False)
    assert worker.canonical(response.content) == worker.canonical(unary)
    assert response.headers["streamproc-join"] == "joined"
    assert response.headers["streamproc-results"] == str(len(bodies))


async def test_a_streamed_request_whose_stream_ends_in_the_workers_error_frame_is_answered_the_unary_error(edge, nc):
    """SGLang 0.5.23 ``serve_generate_request``: a ``ValueError`` mid-stream ends the stream with
    ``data: {"error": {"message", "type", "code", "retryable"}}``; unary, the same failure answers
    ``_create_error_response``, ``{"error": {"message": ...}}`` alone. The edge used to answer the chunks
    sent before it folded together, with the ``error`` key beside them (a partial answer with status
    200), then the frame as sent, with 200 where SGLang's status line says 400."""
    request_id = rid("worker-error")
    bodies = worker_for("sglang").agg(make_truth(4, request_id=request_id, output_len=9), stream=True)[:2]
    await publish_results(nc, DURABLE, request_id, [*bodies, upstream_json(stream_error_frame("boom"))])

    response = await get(edge, f"/v1/results/{request_id}", JSON)

    assert (response.status_code, response.content) == (400, upstream_json(unary_value_error("boom")))
    assert response.headers["streamproc-results"] == "3"


async def test_a_stream_that_is_only_the_workers_error_frame_is_answered_the_unary_error(edge, nc):
    """The common case: ``_validate_one_request`` raises before the first chunk, so the stream's only
    chunk is the frame; the edge served a one-result stream verbatim, the frame, where the unary request
    answers ``{"error": {"message": ...}}``. SGLang's unary error body itself is still served verbatim.
    Both with SGLang's status, 400 (``_create_error_response``)."""
    request_id = rid("worker-error-only")
    await publish_results(nc, DURABLE, request_id, [upstream_json(stream_error_frame(TOO_LONG))])
    response = await get(edge, f"/v1/results/{request_id}", JSON)
    assert (response.status_code, response.content) == (400, upstream_json(unary_value_error(TOO_LONG)))

    request_id = rid("worker-unary-error")
    await publish_results(nc, DURABLE, request_id, [upstream_json(unary_value_error(TOO_LONG))])
    response = await get(edge, f"/v1/results/{request_id}", JSON)
    assert (response.status_code, response.content) == (400, upstream_json(unary_value_error(TOO_LONG)))


async def test_a_vllm_stream_ending_in_the_workers_error_frame_is_answered_the_unary_error(server, nc):
    """vLLM 0.34.0 ``serve_tokens_stream_generator``: a ``GenerationError`` (``_raise_if_error``, a
    ``finish_reason`` of ``"error"``) or any exception of the engine ends the stream with
    ``data: {"error": {...}}`` (``create_streaming_error_response``: ``json.dumps``, spaces); unary, the
    same failure answers ``ErrorResponse`` alone through ``JSONResponse`` (compact). The edge's fold served
    the chunks before it with the ``error`` key beside them (a partial answer with status 200), then the
    frame as ``json.dumps`` wrote it; a stream whose only chunk is the frame was served verbatim. Both
    answered with 200, where vLLM's status line is ``error.code``."""
    error = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                       "code": 500}}
    frame = json.dumps(error).encode()
    request_id = rid("vllm-worker-error")
    alone = rid("vllm-worker-error-alone")
    bodies = worker_for("vllm").agg(make_truth(4, request_id=request_id, output_len=9), stream=True)[:2]
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as vllm_edge:
        await publish_results(nc, DURABLE, request_id, [*bodies, frame])
        await publish_results(nc, DURABLE, alone, [frame])

        response = await get(vllm_edge, f"/v1/results/{request_id}?stream=false")
        only = await get(vllm_edge, f"/v1/results/{alone}?stream=false")

    assert (response.status_code, response.content) == (500, upstream_json(error))
    assert response.headers["streamproc-results"] == "3"
    assert (only.status_code, only.content) == (500, upstream_json(error))


async def test_a_vllm_derender_stream_of_one_chunk_is_answered_the_unary_message(server, nc):
    """vLLM 0.34.0 ``serve_tokens_stream_generator`` with ``output_mode="derender"``: a stream whose whole
    output comes in one engine step (``max_tokens=1``, an EOS at once, an abort before any token; no
    ``stream_options.include_usage``, the default) is one chunk, its choice a ``GenerateDerenderStreamChoice``
    with ``delta`` (``DeltaMessage``, ``model_dump(exclude_none=True)``; ``delta.role = "assistant"`` on
    the first chunk), dumped with ``exclude`` of the ``None`` ``prompt_token_ids`` / ``mm_placeholders`` /
    ``metrics`` (with ``return_token_ids`` the prompt's ids stand before ``output_mode``). Unary, the same
    request answers a ``GenerateDerenderChoice`` with ``message`` (``ChatMessage``, as ``fold`` builds it):
    the edge served the only chunk verbatim, ``delta`` and no ``message``. A unary derender body is
    still served byte for byte."""
    def chunk(request_id: str, **top: object) -> bytes:
        choice = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [9906],
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                  "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None}
        return upstream_json({"request_id": request_id, "usage": None, **top, "output_mode": "derender",
                              "choices": [choice]})

    message = {"role": "assistant", "content": "Hi", "refusal": None, "audio": None, "function_call": None,
               "reasoning": None}
    unary_id = rid("vllm-derender-unary")
    unary = upstream_json({
        "request_id": unary_id, "model": "m", "created": 1765000000,
        "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
        "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "derender",
        "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [9906],
                     "routed_experts": None, "sampling_mask": None, "weight_versions": None, "message": message,
                     "logprobs": None}]})
    plain, with_ids = rid("vllm-derender-one"), rid("vllm-derender-one-ids")
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as vllm_edge:
        await publish_results(nc, DURABLE, plain, [chunk(plain)])
        await publish_results(nc, DURABLE, with_ids, [chunk(with_ids, prompt_token_ids=list(range(5000)))])
        await publish_results(nc, DURABLE, unary_id, [unary])
        answers = [await get(vllm_edge, f"/v1/results/{request_id}?stream=false") for request_id in (plain, with_ids)]
        verbatim = await get(vllm_edge, f"/v1/results/{unary_id}?stream=false")

    for answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert "delta" not in choice
        assert json.dumps(choice["message"]) == json.dumps(message)
    assert answers[1].json()["prompt_token_ids"] == list(range(5000))
    assert (verbatim.status_code, verbatim.content) == (200, unary)


async def test_a_vllm_tokens_or_text_stream_of_one_chunk_is_answered_with_the_keys_a_longer_one_folds_to(server, nc):
    """vLLM 0.34.0 ``serve_tokens_stream_generator``, ``output_mode`` ``tokens`` or ``text``, no
    ``stream_options.include_usage`` (the default): a request whose whole output comes in one engine step
    (``max_tokens=1``, an EOS at once) is one chunk, ``request_id, usage, output_mode, choices`` (the
    ``None`` ``prompt_token_ids`` / ``mm_placeholders`` / ``metrics`` excluded). The unary body of the same
    request writes every ``GenerateResponseBase`` key (``model``, ``created``, ``prompt_logprobs``,
    ``kv_transfer_params``...) before ``output_mode`` and ``choices``. The edge served the chunk as sent, so a
    unary client's body lacked those keys when the stream was one chunk and had them when it was two; now
    both are folded to the unary keys."""
    def chunk(request_id: str, mode: str, token: int, finish: str | None) -> bytes:
        choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [token],
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                  **({"text": "Hi"} if mode == "text" else {}), "logprobs": None}
        return upstream_json({"request_id": request_id, "usage": None, "output_mode": mode, "choices": [choice]})

    unary_keys = ["request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                  "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
                  "output_mode", "choices"]
    streams = {}
    for mode in ("tokens", "text"):
        one, two = rid(f"vllm-{mode}-one"), rid(f"vllm-{mode}-two")
        streams[one] = [chunk(one, mode, 9906, "length")]
        streams[two] = [chunk(two, mode, 9905, None), chunk(two, mode, 9906, "length")]
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as vllm_edge:
        for request_id, chunks in streams.items():
            await publish_results(nc, DURABLE, request_id, chunks)
        answers = {request_id: await get(vllm_edge, f"/v1/results/{request_id}?stream=false")
                   for request_id in streams}

    for request_id, answer in answers.items():
        assert answer.status_code == 200, answer.text
        # the unary keys, then a reason for each one no chunk carries (a bare null read as the unary value)
        assert list(answer.json())[:len(unary_keys)] == unary_keys, request_id
        assert answer.json()["created_unavailable_reason"] == "not_streamed"
        assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_a_vllm_lone_result_that_opens_as_a_stream_chunk_but_is_no_json_is_served_as_sent(server, nc):
    """``folds_alone`` sends every body that opens ``{"request_id":...,"usage":`` (a vLLM 0.34.0 stream
    chunk, any ``output_mode``) to the fold; a worker's chunk that opens so and then is cut short raised
    there, and the unary client got a 500 ``cannot fold 1 results`` for a body the edge serves as sent when
    its opening differs. It is served as sent (200), as any lone body."""
    request_id = rid("vllm-cut-chunk")
    body = b'{"request_id":"' + request_id.encode() + b'","usage":null,"output_mode":"tokens","choices":[{"ind'
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as vllm_edge:
        await publish_results(nc, DURABLE, request_id, [body])
        answer = await get(vllm_edge, f"/v1/results/{request_id}?stream=false")

    assert (answer.status_code, answer.content) == (200, body)


async def test_a_sglang_lone_result_with_an_index_tag_but_no_json_is_served_as_sent(edge, nc):
    """``folds_alone`` sends a lone body with ``"index"`` in its last bytes to the fold (a streamed batch
    of one's chunk); a worker's body that ends so but is cut short, not UTF-8 or nested past the parser's
    stack raised there, and the unary client got a 500 ``cannot fold 1 results`` for a body the edge
    serves as sent when the tag is missing. It is served as sent (200), as any lone body."""
    for body in (b'{"text":"Hi","output_ids":[211],"meta_info":{"id":"r"},"index":0',
                 b"[" * 100_000 + b'"index":0'):
        request_id = rid("sglang-cut-chunk")
        await publish_results(nc, DURABLE, request_id, [body])
        response = await get(edge, f"/v1/results/{request_id}", JSON)
        assert (response.status_code, response.content) == (200, body)


async def test_a_streamed_batch_of_one_whose_stream_is_one_chunk_answers_a_list_of_one(edge, nc):
    """SGLang 0.5.23: ``text: ["..."]`` is a batch of one (``GenerateReqInput._determine_batch_size``:
    ``is_single = False``). Streamed, ``TokenizerManager._stream_batch_responses`` tags each chunk
    ``result["index"] = rid_to_index[...]``; unary, ``_handle_batch_request`` answers ``yield outputs``,
    a list of the items' bodies. The edge served a stream of one result verbatim, so such a stream of
    one chunk was answered as the bare tagged chunk, not the list. A body that already is a unary
    answer (a single request's, a unary batch's list, one whose text is the word ``index``) is still
    served byte for byte."""
    meta = {"id": "rid-0", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 4,
            "completion_tokens": 1, "cached_tokens": 0}
    item = {"text": "Hi", "output_ids": [211], "meta_info": meta}
    tagged = json.dumps({**item, "index": 0}, separators=(",", ":")).encode()
    request_id = rid("batch-of-one")
    await publish_results(nc, DURABLE, request_id, [tagged])
    response = await get(edge, f"/v1/results/{request_id}", JSON)
    assert response.status_code == 200, response.text
    assert response.json() == [item]
    assert response.headers["streamproc-results"] == "1"
    verbatim = [b'{"text": "index", "output_ids": [7], "meta_info": {"id": "rid-1"}}',  # spaces: not re-encoded
                b'[{"text": "index", "meta_info": {"id": "rid-2"}}]',  # a unary batch's answer
                b'not json',  # opaque bytes: passed on as they came
                b'{"text": "\\"index\\"", "meta_info": {}}']
    for body in verbatim:
        request_id = rid("one-verbatim")
        await publish_results(nc, DURABLE, request_id, [body])
        response = await get(edge, f"/v1/results/{request_id}", JSON)
        assert (response.status_code, response.content) == (200, body)


async def test_a_sglang_stream_that_is_only_a_coalesced_abort_body_is_answered_the_unary_abort(edge, nc):
    """SGLang 0.5.23, ``--incremental-streaming-output``: a stream whose consumer was behind from the start
    and that the scheduler aborted without a status yields one body, ``_coalesce_streaming_chunks`` over the
    queued deltas and ``_handle_abort_req``'s (whole text, ``[output_ids[-1]]``): text doubled, last id
    repeated. The edge served it as sent; unary the same request answers the abort body, every id once."""
    abort_meta = {"id": "rid-a", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                  "weight_version": "default", "e2e_latency": 0.5, "completion_tokens": 2,
                  "response_sent_to_client_ts": 1765000000.5}
    lone = {"text": "a" + "b" + "ab", "output_ids": [7, 8, 8], "meta_info": abort_meta}
    request_id = rid("coalesced-abort")
    await publish_results(nc, DURABLE, request_id, [upstream_json(lone)])
    response = await get(edge, f"/v1/results/{request_id}", JSON)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": "ab", "output_ids": [7, 8], "meta_info": abort_meta}


async def test_unary_mode_waits_for_results_published_after_the_request(server):
    with running_edge(server.url, "--prefix", CORE.prefix) as core_edge:
        request_id = rid("wait")
        bodies = [
            b'{"text":"a","output_ids":[1],"meta_info":{}}',
            b'{"text":"b","output_ids":[2],"meta_info":{}}',
        ]
        async with await nats.connect(server.url) as nc:
            async with anyio.create_task_group() as tg:
                responses = []

                async def ask():
                    responses.append(await get(core_edge, f"/v1/results/{request_id}", JSON))

                tg.start_soon(ask)
                with anyio.fail_after(5):  # core mode: results published before the open are lost
                    # fed from the edge's wildcard subscription (fanout.py): registered, then live
                    while core_edge.metrics()["streamproc_edge_streams_dispatched"] < 1:
                        await anyio.sleep(0.02)
                await publish_results(nc, CORE, request_id, bodies)

    assert responses[0].status_code == 200
    assert responses[0].content == Catalog()("sglang").fold(bodies)


@pytest.fixture(scope="module")
def zstd_edge(server):
    with running_edge(server.url, "--ensure-results-stream", "--format", "sglang-zstd") as running:
        yield running


# SGLang 0.5.23 bodies, written by hand: ``_handle_batch_output`` chunks, then the finished body of a
# request the scheduler aborted with an HTTP status (``FINISH_ABORT.to_json()``), and what the same
# request answers unary (``TokenizerManager._handle_abort_finish_reason`` raises ``HTTPException``,
# rendered by ``@app.exception_handler(HTTPException)`` as ``ErrorResponse``; for 400 a ``ValueError``,
# ``_create_error_response``: ``{"error": {"message"}}``). tests/test_sglang_error_bodies.py has the
# upstream quotes.
CHUNKS = [(b'{"text":"A","output_ids":[301],"meta_info":{"id":"r","finish_reason":null,"prompt_tokens":4,'
           b'"completion_tokens":1}}'),
          (b'{"text":"b","output_ids":[302],"meta_info":{"id":"r","finish_reason":null,"prompt_tokens":4,'
           b'"completion_tokens":2}}')]
RETRACTED = (b'{"text":"","output_ids":[],"meta_info":{"id":"r","finish_reason":{"type":"abort","message":'
             b'"Retracted under decode memory pressure without a KV backup. Retry later.","status_code":503,'
             b'"err_type":null},"prompt_tokens":4,"completion_tokens":2}}')
RETRACTED_UNARY = (b'{"object":"error","message":"Retracted under decode memory pressure without a KV backup. '
                   b'Retry later.","type":"503","param":null,"code":503}')
# _handle_abort_req with the scheduler's own dict (type, status_code, message), before any token
REJECTED = (b'{"text":"","output_ids":[],"meta_info":{"id":"r","finish_reason":{"type":"abort","status_code":400,'
            b'"message":"Input is too long."},"weight_version":"default","e2e_latency":0.5,'
            b'"completion_tokens":0}}')
REJECTED_UNARY = b'{"error":{"message":"Input is too long."}}'
# _handle_abort_req's own reason (no status_code): the unary request answers this body itself
IN_QUEUE = (b'{"text":"","output_ids":[],"meta_info":{"id":"r","finish_reason":{"type":"abort","message":'
            b'"Abort in waiting queue"},"weight_version":"default","e2e_latency":0.5,"completion_tokens":0}}')

# A failed P/D handshake (``prepare_abort(..., status_code=500)``) for a client's 5,000-character rid,
# which ``meta_info.id`` and the message both carry: its status stands past the first 4 KiB.
LONG_RID = b"r" * 5000
LONG_HANDSHAKE_MESSAGE = (b"Decode handshake failed for request rank=0 decode_req.req.rid='%s' "
                          b"decode_req.req.bootstrap_room=7" % LONG_RID)
LONG_HANDSHAKE = (b'{"text":"","output_ids":[],"meta_info":{"id":"%s","finish_reason":{"type":"abort",'
                  b'"message":"%s","status_code":500,"err_type":null},"prompt_tokens":4,'
                  b'"weight_version":"default","num_retractions":0,"reasoning_tokens":0,'
                  b'"completion_tokens":0,"cached_tokens":0}}'
                  % (LONG_RID, LONG_HANDSHAKE_MESSAGE))
LONG_HANDSHAKE_UNARY = (b'{"object":"error","message":"%s","type":"500","param":null,"code":500}'
                        % LONG_HANDSHAKE_MESSAGE)

# A running request with logprobs aborted by the running timeout after 2,000 tokens
# (``Scheduler.abort_request``: ``FINISH_ABORT("Request running timeout reached.",
# HTTPStatus.SERVICE_UNAVAILABLE)``, then ``_handle_batch_output``), its stream's only chunk (the
# consumer behind: the last cumulative body): ~20 KiB of text and ids in front of its finish reason,
# ~36 KiB of logprobs behind it.
LONG_IDS = list(range(1000, 3000))
RUNNING_TIMEOUT = upstream_json({
    "text": "word " * len(LONG_IDS), "output_ids": LONG_IDS,
    "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Request running timeout reached.",
                                               "status_code": 503, "err_type": None},
                  "prompt_tokens": 4, "weight_version": "default", "num_retractions": 0,
                  "input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.5, 3, None], [-0.5, 4, None]],
                  "output_token_logprobs": [[-0.25, t, None] for t in LONG_IDS],
                  "output_token_logprobs_length": len(LONG_IDS), "reasoning_tokens": 0,
                  "completion_tokens": len(LONG_IDS), "cached_tokens": 0}})
RUNNING_TIMEOUT_UNARY = (b'{"object":"error","message":"Request running timeout reached.","type":"503",'
                         b'"param":null,"code":503}')


def tagged(body: bytes, index: int) -> bytes:
    """``_stream_batch_responses``: ``result["index"] = ...``, the last key."""
    return body[:-1] + b',"index":%d}' % index


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd"])
@pytest.mark.parametrize(("stream", "want", "status"), [
    pytest.param([*CHUNKS, RETRACTED], RETRACTED_UNARY, 503, id="retracted_after_tokens"),
    pytest.param([REJECTED], REJECTED_UNARY, 400, id="rejected_before_any_token"),
    pytest.param([tagged(CHUNKS[0], 0), tagged(REJECTED, 1), tagged(CHUNKS[1], 0)], REJECTED_UNARY, 400,
                 id="batch_item_rejected"),
    pytest.param([IN_QUEUE], IN_QUEUE, 200, id="aborted_without_status_verbatim"),
    pytest.param([LONG_HANDSHAKE], LONG_HANDSHAKE_UNARY, 500, id="status_past_the_first_4_kib"),
    pytest.param([RUNNING_TIMEOUT], RUNNING_TIMEOUT_UNARY, 503, id="status_with_kibibytes_on_both_sides"),
])
async def test_a_stream_the_scheduler_aborted_with_an_http_status_is_answered_its_unary_error(
        edge, zstd_edge, nc, fmt, stream, want, status):
    """The edge answered the tokens sent before the abort folded together with the abort's finish
    reason (or, for a stream of one chunk, that chunk as sent); the same request unary answers the
    error alone, with the abort's status (it answered 200). An abort without a status is still
    answered by its body, with 200."""
    request_id = rid("status-abort")
    await publish_results(nc, DURABLE, request_id, stream)

    response = await get(edge if fmt == "sglang" else zstd_edge, f"/v1/results/{request_id}?stream=false")

    assert (response.status_code, response.content) == (status, want)
    assert response.headers["streamproc-results"] == str(len(stream))


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ("timeout", 504),
        ("overloaded", 503),
        ("invalid_request", 400),
        ("internal", 500),
        ("invalid_chunk", 502),
        ("unknown_format", 502),
        ("something_new", 500),
    ],
)
async def test_an_error_result_becomes_its_native_body_with_an_http_error_status(edge, nc, error, status):
    request_id = rid("failed")
    error_body = json.dumps({"error": {"message": f"{error} happened", "type": error}}).encode()
    await publish_result(nc, DURABLE, request_id, 0, b'{"text":"partial"}')
    await publish_result(nc, DURABLE, request_id, 1, error_body, final=True, verdict=None, error=error)
    await nc.flush()

    response = await get(edge, f"/v1/results/{request_id}", JSON)

    assert response.status_code == status
    assert response.content == error_body
    assert response.headers["streamproc-error"] == error


async def test_no_final_result_within_result_timeout_is_a_504_with_the_native_error(server):
    with running_edge(server.url, "--result-timeout", "1") as short:
        with anyio.fail_after(5):
            response = await get(short, f"/v1/results/{rid('never')}?stream=false")
    assert response.status_code == 504
    error = response.json()["error"]
    assert (
        error["type"] == json.loads(Catalog()("sglang").error_body("x", ErrorKind.TIMEOUT))["error"]["type"]
    )


async def test_a_unary_client_that_gives_up_frees_its_stream_at_once(edge):
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(base_url=edge.url, timeout=0.5) as client:
            await client.get(f"/v1/results/{rid('abandoned')}", headers=JSON)
    with anyio.fail_after(2):
        while edge.metrics()["streamproc_edge_streams_active"] != 0:
            await anyio.sleep(0.02)


async def test_accept_header_chooses_between_event_stream_and_json(edge, nc):
    request_id = rid("accept")
    await publish_results(nc, DURABLE, request_id, [b'{"text":"only"}'])

    as_events = await get(edge, f"/v1/results/{request_id}", {"Accept": "text/event-stream"})
    both = await get(edge, f"/v1/results/{request_id}", {"Accept": "application/json, text/event-stream"})
    default = await get(edge, f"/v1/results/{request_id}")
    forced = await get(edge, f"/v1/results/{request_id}?stream=true", JSON)
    as_json = await get(edge, f"/v1/results/{request_id}", JSON)

    for response in (as_events, both, default, forced):
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.content == b'id: 0\ndata: {"text":"only"}\n\ndata: [DONE]\n\n'
    assert as_json.content == b'{"text":"only"}'


# Unary error answers and the status the engine's status line gives them (SGLang 0.5.23 ``/generate``,
# vLLM 0.34.0 ``/inference/v1/generate``; tests/test_answer_status.py has the upstream quotes).
SGLANG_STATUS_BODIES = [
    (upstream_json(unary_value_error(TOO_LONG)), 400),  # _create_error_response
    (b'{"error":"missing field `text` or `input_ids`"}', 400),  # generate_request's contract check
    (RETRACTED_UNARY, 503),  # validation_exception_handler(HTTPException): ErrorResponse, status = code
    (b'{"object":"error","message":"KV transfer failed","type":"500","param":null,"code":500}', 500),
    # A worker claiming a status no error is answered with: the body as a result like any other.
    (b'{"object":"error","message":"m","type":"200","param":null,"code":200}', 200),
    (b'{"object":"error","message":"m","type":"99","param":null,"code":99}', 200),
    (b'{"object":"error","message":"m","type":"999","param":null,"code":999}', 200),
    (b'{"object":"error","message":"m","type":"abc","param":null,"code":"abc"}', 200),
    (b'{"object":"error","message":"m","type":"x","param":null,"code":%d}' % 10**30, 200),
    (b'{"text":"Hi","output_ids":[211],"meta_info":{"id":"r"}}', 200),
]
VLLM_STATUS_BODIES = [
    (b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}', 500),
    (b'{"error":{"message":"retry","type":"ServiceUnavailableError","param":null,"code":503}}', 503),
    (b'{"error":{"message":"too many","type":"BadRequestError","param":"prompt_logprobs","code":400}}', 400),
    (b'{"error":{"message":"m","type":"X","param":null,"code":200}}', 200),
    (b'{"error":{"message":"m","type":"X","param":null,"code":99}}', 200),
    (b'{"error":{"message":"m","type":"X","param":null,"code":999}}', 200),
    (b'{"error":{"message":"m","type":"X","param":null,"code":"abc"}}', 200),
    (b'{"error":{"message":"m","type":"X","param":null,"code":%d}}' % 10**30, 200),
]


async def unary_statuses(edge, nc, bodies: list[tuple[bytes, int]], label: str) -> None:
    """Each body a request's only result: the unary answer is the body with the engine's status, headers
    kept; the same result read as a stream is 200 (sent before any result, as the engines' streams)."""
    ids = [rid(label) for _ in bodies]
    for request_id, (body, _) in zip(ids, bodies):
        await publish_results(nc, DURABLE, request_id, [body])
    for request_id, (body, status) in zip(ids, bodies):
        response = await get(edge, f"/v1/results/{request_id}?stream=false")
        assert (response.status_code, response.content) == (status, body), body
        assert response.headers["content-type"] == "application/json"
        assert response.headers["streamproc-results"] == "1"
        assert "streamproc-error" not in response.headers
        events = await get(edge, f"/v1/results/{request_id}", {"Accept": "text/event-stream"})
        assert (events.status_code, events.content) == (200, b"id: 0\ndata: %s\n\ndata: [DONE]\n\n" % body)


async def test_a_workers_error_body_is_answered_with_the_status_the_engine_answers_it_with(edge, nc, server):
    """The edge's unary answer is what the aggregated engine answers: a worker's error body with the
    engine's status line, which the codec reads from the body (``Codec.answer_status``). It answered
    every one with 200. A body claiming a status outside ``[400, 600)`` is answered with 200, and the
    requests beside it are answered as ever; SSE streams keep 200."""
    await unary_statuses(edge, nc, SGLANG_STATUS_BODIES, "sglang-status")
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as vllm_edge:
        await unary_statuses(vllm_edge, nc, VLLM_STATUS_BODIES, "vllm-status")


async def test_sglangs_plain_text_internal_server_error_is_answered_as_the_engine_answers_it(edge, nc):
    """SGLang 0.5.23's unary ``/generate`` answers an exception that is no ``ValueError`` with Starlette's
    ``PlainTextResponse("Internal Server Error", status_code=500)`` (``ServerErrorMiddleware``). Published as
    a request's only result, the edge answered it 200 as ``application/json``; now 500 as the engine's
    ``text/plain; charset=utf-8``. An SSE stream keeps 200 (sent before any result)."""
    request_id = rid("plain-500")
    body = b"Internal Server Error"
    await publish_results(nc, DURABLE, request_id, [body])

    response = await get(edge, f"/v1/results/{request_id}?stream=false")

    assert (response.status_code, response.content) == (500, body)
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.headers["streamproc-results"] == "1"
    assert response.headers["x-content-type-options"] == "nosniff"
    events = await get(edge, f"/v1/results/{request_id}", {"Accept": "text/event-stream"})
    assert (events.status_code, events.content) == (200, b"id: 0\ndata: %s\n\ndata: [DONE]\n\n" % body)
