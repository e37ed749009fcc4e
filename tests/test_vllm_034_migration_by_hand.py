"""vLLM 0.34.0 migration against the uninterrupted engine, bodies and requests written by hand.

Nothing here uses the simulator or ``streamproc_vllm.upstream``: every body is spelled out from the
vLLM 0.34.0 wheel (``pip download --no-deps vllm==0.34.0``), ``vllm/entrypoints/scale_out/
token_in_token_out/serving.py`` ``ServingTokens.serve_tokens_stream_generator`` (tokens mode): a token
chunk ``{request_id, usage, output_mode, choices}`` per engine delta (``model_dump_json(exclude=...)``,
nulls kept) and, with ``stream_options.include_usage``, a last ``choices: []`` chunk with the usage
(``model_dump_json(exclude_none=True)``).
"""

from __future__ import annotations

import json

import pytest
from helpers import upstream_json as dumps

from streamproc.catalog import Catalog
from streamproc.client.migration import MigrationError, MigrationRefused, Migrator
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.codec import Emitted
from streamproc.wire import MigrateErrorCode, Verdict

RID = "generate-tokens-m1"
PROMPT = [300, 301, 302, 303]


def token_chunk(ids: list[int], finish: str | None = None, stop_reason: int | str | None = None) -> bytes:
    """``GenerateTokensStreamResponse(request_id, choices=[GenerateTokensStreamChoice(...)])`` without
    continuous usage: ``usage`` null, ``prompt_token_ids``/``mm_placeholders``/``metrics`` excluded."""
    return dumps({"request_id": RID, "usage": None, "output_mode": "tokens", "choices": [{
        "index": 0, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
        "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}]})


def request(**params: object) -> bytes:
    """A ``GenerateRequest`` body as the serving layer sends it."""
    return dumps({"request_id": "m1", "token_ids": PROMPT, "stream": True,
                  "stream_options": {"include_usage": True}, "sampling_params": {"max_tokens": 10, **params}})


# ------------------------------------------- a death after the last token, before the usage chunk

@pytest.mark.parametrize("finish, stop_reason", [("stop", None), ("stop", 7), ("length", None)])
def test_a_stream_whose_finishing_chunk_was_published_is_not_resumed_past_its_end(finish, stop_reason):
    """0.34.0 ``serve_tokens_stream_generator``: the finishing output's chunk (``finish_reason`` set) is a
    token chunk, and with ``include_usage`` the usage chunk (``choices=[]``) follows it, after the engine's
    loop ends. A worker lost between the two leaves a stream whose every token and finish the client has
    but which is not final. Resumed, the request (prompt + 3 tokens, ``max_tokens`` 7) generated tokens
    after a ``finish_reason: "stop"`` the client had already read: the refusal ends the stream with a
    ``migration_refused`` error instead."""
    codec = Catalog()("vllm")
    session = codec.open_migration()
    with pytest.raises(MigrationRefused, match="already finished"):
        session.absorb([token_chunk([11, 12]), token_chunk([13], finish, stop_reason)])
        session.seal()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_a_worker_lost_before_the_usage_chunk_ends_the_stream_with_a_refusal_not_more_tokens(
        client, start_processor):
    """The same over a real nats-server and processor: the client reads the two token chunks, then a
    final ``migration_refused`` error result naming why; the Migrator raises (``refused``), sending nothing."""
    sent = []

    async def send(resumed):
        sent.append(resumed)

    async with start_processor("in-process", format="vllm", mode="core") as rp:
        pub = ChunkPublisher(client, rp.subjects)
        async with follow(client, rp.subjects, "m1", timeout=15) as stream:
            await pub.publish("m1", "agg", 0, token_chunk([11, 12]))
            await pub.publish("m1", "agg", 1, token_chunk([13], "stop"))
            with pytest.raises(MigrationError, match="already finished") as refused:
                await Migrator(client, rp.subjects, format="vllm").migrate("m1", request(), send=send)
            results = await stream.collect()
    assert sent == [] and refused.value.code is MigrateErrorCode.REFUSED
    assert [r.seq for r in results] == [0, 1, 2]
    assert results[1].body == token_chunk([13], "stop")
    assert results[-1].final and results[-1].error == "migration_refused"
    assert b"already finished" in results[-1].body


# ------------------------------------------------------- detokenizer state that does not move

def text_request(output_mode: str = "text", **params: object) -> bytes:
    return dumps({"request_id": "m1", "token_ids": PROMPT, "stream": True, "output_mode": output_mode,
                  "sampling_params": {"max_tokens": 10, **params}})


def held_back_text(texts: list[str], stop: list[str], include: bool) -> list[str]:
    """0.34.0 ``BaseIncrementalDetokenizer``: ``stop_buffer_length = max(len(s) for s in self.stop) - 1``
    when ``self.stop and not self.include_stop_str_in_output`` (else 0), and ``get_next_output_text``
    (delta) returns ``self.output_text[last_offset:len(self.output_text) - buffer_length]``, the whole
    rest once finished. One stream chunk per token (``GenerateTextStreamChoice.text``)."""
    buffer = max(len(s) for s in stop) - 1 if stop and not include else 0
    out, sent, text = [], 0, ""
    for i, piece in enumerate(texts):
        text += piece
        end = len(text) if i == len(texts) - 1 else max(len(text) - buffer, sent)
        out.append(text[sent:end])
        sent = end
    return out


def test_a_text_stream_that_holds_back_text_for_stop_strings_refuses_migration_once_tokens_were_emitted():
    """The lost worker's detokenizer held back the last ``len(stop) - 1`` characters of what it had
    decoded, text of tokens the client already has as ``token_ids``; the resumed worker decodes only its
    own output, so those characters never reach the client. Resumed, the client read ``"cd"`` where the
    engine answers ``"abcd"``: the rebuild is refused once the seal says tokens were emitted. Up front
    (``check_migratable``) the request is not refused: nothing there says how many were."""
    uninterrupted = held_back_text(["a", "b", "c", "d"], ["xyz"], include=False)
    resumed = held_back_text(["c", "d"], ["xyz"], include=False)
    assert "".join(uninterrupted) == "abcd" and "".join(uninterrupted[:2] + resumed) == "cd"
    codec = Catalog()("vllm")
    for held in (text_request(stop=["xyz"]), text_request(stop="xyz", include_stop_str_in_output=False)):
        codec.check_migratable(held)
        with pytest.raises(MigrationRefused, match="stop strings and 2 tokens emitted: the text the lost worker held back"):
            codec.resume_request(held, Emitted([11, 12]))
    # Nothing is held back: one-character stop strings, stop strings kept in the output, tokens mode.
    for params, mode in [({"stop": ["x", "y"]}, "text"), ({"stop": ["xyz"], "include_stop_str_in_output": True}, "text"),
                         ({"stop": ["xyz"]}, "tokens"), ({}, "text"), ({"stop": []}, "text")]:
        codec.check_migratable(text_request(mode, **params))
        assert json.loads(codec.resume_request(text_request(mode, **params), Emitted([11, 12])))["token_ids"] == \
            PROMPT + [11, 12]
        joined = held_back_text(["a", "b", "c", "d"], params.get("stop") or [], params.get("include_stop_str_in_output", False))
        assert "".join(joined) == "abcd"


def test_a_derender_stream_refuses_migration_once_tokens_were_emitted():
    """0.34.0 ``serve_tokens_stream_generator``, ``output_mode="derender"``: ``role_sent = [False] * n`` per
    request and ``if not role_sent[i]: delta.role = "assistant"``, one ``ChatStreamProcessor`` per choice
    fed the request's own output: a resumed attempt's first chunk says ``role: "assistant"`` again mid
    stream, and its parser starts with none of the lost attempt's reasoning or tool-call progress."""
    codec = Catalog()("vllm")
    codec.check_migratable(text_request("derender"))
    with pytest.raises(MigrationRefused, match="derender with 1 tokens emitted"):
        codec.resume_request(text_request("derender"), Emitted([11]))


# -------------------------- nothing emitted before the seal: no detokenizer state is lost (k = 0)
#
# Bodies of ``output_mode`` ``derender`` and ``text`` (stop string ``"xyz"``, not included), as 0.34.0
# writes them. Unary: ``serve_tokens_full_generator`` -> ``GenerateDerenderResponse`` /
# ``GenerateTextResponse`` (``GenerateResponseBase`` fields, ``output_mode``, ``choices``),
# ``JSONResponse(content=model_dump())``; ``GenerateDerenderChoice`` is ``GenerateChoiceBase``'s fields then
# ``message`` (``ChatMessage``: ``annotations`` ``exclude_if`` None, empty ``tool_calls`` popped) and
# ``logprobs``; ``GenerateTextChoice`` ``text`` then ``logprobs``. Stream: one
# ``GenerateDerenderStreamResponse`` / ``GenerateTextStreamResponse`` per output (``request_id``,
# ``usage``, ``output_mode``, ``choices``; ``model_dump_json(exclude={prompt_token_ids, mm_placeholders,
# metrics})``), ``delta`` dumped ``exclude_none`` with ``role: "assistant"`` on the first chunk only, then
# the ``choices: []`` usage chunk (``exclude_none=True``). The text of ``"abcd"`` under stop ``"xyz"``:
# ``held_back_text`` (``"a"``, ``""``, ``""``, ``"bcd"`` once finished).

OUT_IDS = [11, 12, 13, 14]
TEXTS = ["a", "b", "c", "d"]
HOLDING = {"stop": ["xyz"]}
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4]],
              "remote_engine_id": "p0", "remote_request_id": RID, "remote_host": "10.0.0.1", "remote_port": 5600,
              "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(PROMPT),
              "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
              "remote_prefill_cached_tokens": 0}


def mode_request(mode: str, *, stream: bool) -> bytes:
    """The client's ``GenerateRequest`` as the serving layer sent it to the lost P/D pair."""
    stream_fields = {"stream": True, "stream_options": {"include_usage": True}} if stream else {"stream": False}
    return dumps({"request_id": "m2", "token_ids": PROMPT, **stream_fields, "output_mode": mode,
                  "sampling_params": {"max_tokens": 10, **HOLDING}, "kv_transfer_params": {"do_remote_decode": True}})


def unary_body(mode: str, ids: list[int], text: str, finish: str, kv: dict | None = None) -> bytes:
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": ids, "routed_experts": None,
              "sampling_mask": None, "weight_versions": None}
    if mode == "derender":
        choice["message"] = {"role": "assistant", "content": text, "refusal": None, "audio": None,
                             "function_call": None, "reasoning": None}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    return dumps({"request_id": RID, "model": "m", "created": 1700000000,
                  "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + len(ids),
                            "completion_tokens": len(ids), "completion_tokens_details": None},
                  "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
                  "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
                  "output_mode": mode, "choices": [choice]})


def stream_bodies(mode: str) -> list[bytes]:
    """The uninterrupted stream of ``OUT_IDS``, one token per output, and the usage chunk."""
    texts = held_back_text(TEXTS, HOLDING["stop"], include=False)
    bodies = []
    for i, (token, text) in enumerate(zip(OUT_IDS, texts)):
        last = i == len(OUT_IDS) - 1
        choice = {"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None, "token_ids": [token],
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None}
        if mode == "derender":
            choice["delta"] = {"role": "assistant", "content": TEXTS[i]} if i == 0 else {"content": TEXTS[i]}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        bodies.append(dumps({"request_id": RID, "usage": None, "output_mode": mode, "choices": [choice]}))
    bodies.append(dumps({"request_id": RID, "usage": {"prompt_tokens": len(PROMPT),
                                                      "total_tokens": len(PROMPT) + len(OUT_IDS),
                                                      "completion_tokens": len(OUT_IDS)},
                         "output_mode": mode, "choices": []}))
    return bodies


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["derender", "text"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_pd_request_whose_decode_was_lost_before_any_token_migrates_exactly_in_derender_and_text_modes(
        client, start_processor, mode, stream):
    """The prefill leg (``max_tokens=1``, unary) reached the processor, the decode worker was lost before
    its first chunk: k = 0, the only way a unary request is migrated. No text was held back and no
    parser state exists, so the resumed request is the original one (minus the lost pair's
    ``kv_transfer_params``) and a fresh aggregated worker's answer is what the uninterrupted run would
    have sent: a stream byte for byte (its first chunk says the role, once), a unary answer but its
    ``created`` (the resumed worker's clock, omitted on every stitched body). Until 2026-12-05 both
    modes were refused up front and the client got a ``migration_refused`` error instead."""
    sent = []
    request = mode_request(mode, stream=stream)
    answer = stream_bodies(mode) if stream else [unary_body(mode, OUT_IDS, "abcd", "stop")]

    async with start_processor("in-process", format="vllm", mode="core") as rp:
        pub = ChunkPublisher(client, rp.subjects)

        async def serve(resumed):
            sent.append(resumed)
            await pub.publish_leg("m2", "agg", answer, attempt=resumed.attempt)

        async with follow(client, rp.subjects, "m2", timeout=15) as results_stream:
            await pub.publish("m2", "prefill", 0, unary_body(mode, OUT_IDS[:1], "a", "length", PREFILL_KV),
                              final=True)
            await Migrator(client, rp.subjects, format="vllm").migrate("m2", request, send=serve)
            results = await results_stream.collect()
    [resumed] = sent
    assert resumed.emitted_tokens == 0 and resumed.attempt == 1
    assert json.loads(resumed.body) == {k: v for k, v in json.loads(request).items() if k != "kv_transfer_params"}
    assert [r.error for r in results] == [None] * len(answer)
    if stream:
        assert [r.body for r in results] == answer
        if mode == "derender":
            roles = [json.loads(r.body)["choices"][0]["delta"].get("role") for r in results[:-1]]
            assert roles == ["assistant", None, None, None]
    else:
        [result] = results
        doc = json.loads(result.body)
        assert doc.pop("created_unavailable_reason") == "stitch_incomplete"
        assert doc == {**json.loads(answer[0]), "created": None}
        assert result.verdict is Verdict.OMITTED


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode, why", [("derender", "derender with 1 tokens emitted"),
                                       ("text", "stop strings and 1 tokens emitted")])
async def test_a_stream_that_emitted_tokens_in_derender_or_holding_text_mode_is_refused_when_rebuilt(
        client, start_processor, mode, why):
    """With a token sent the lost worker's parser or held-back text is gone: the seal reports k = 1, the
    rebuild is refused, and the client's stream ends after what it read with the same final
    ``migration_refused`` error result as any rebuild-time refusal; nothing is sent to a worker."""
    sent = []

    async def send(resumed):
        sent.append(resumed)

    async with start_processor("in-process", format="vllm", mode="core") as rp:
        pub = ChunkPublisher(client, rp.subjects)
        first = stream_bodies(mode)[0]
        async with follow(client, rp.subjects, "m3", timeout=15) as results_stream:
            await pub.publish("m3", "agg", 0, first)
            with pytest.raises(MigrationRefused, match=why):
                await Migrator(client, rp.subjects, format="vllm").migrate("m3", mode_request(mode, stream=True),
                                                                           send=send)
            results = await results_stream.collect()
    assert sent == []
    assert [r.seq for r in results] == [0, 1] and results[0].body == first
    assert results[-1].final and results[-1].error == "migration_refused"
    assert why.encode() in results[-1].body


def test_output_side_stop_rules_are_sent_unchanged_and_min_tokens_keeps_their_positions():
    """A documented engine limit (docs/protocol.md "Cost and limits"): vLLM 0.34.0 matches stop strings
    (``check_stop_strings(output_text=self.output_text, ...)``), multi-token ``bad_words``
    (``_bad_words_kernel``: the prefix from ``all_token_ids + prompt_len``) and ``repetition_detection``
    (``check_sequence_repetition(request.output_token_ids, ...)``) against the request's own output, so
    no request field can show the resumed worker a match begun before the seal: they go on unchanged.
    ``min_tokens`` counts output tokens (``check_stop``: ``num_output_tokens < min_tokens``; the
    detokenizer's ``stop_check_offset``): minus k, the checks start at the same absolute position."""
    rules = {"stop": ["xyz"], "bad_words": ["foo bar"], "include_stop_str_in_output": True,
             "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}}
    body = Catalog()("vllm").resume_request(request(min_tokens=5, **rules), Emitted([11, 12, 13]))
    params = json.loads(body)["sampling_params"]
    assert params == {"max_tokens": 7, "min_tokens": 2, **rules}
    assert json.loads(body)["token_ids"] == PROMPT + [11, 12, 13]
