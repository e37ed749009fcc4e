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
from streamproc.wire import MigrateErrorCode

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


def test_a_text_stream_that_holds_back_text_for_stop_strings_refuses_migration():
    """The lost worker's detokenizer held back the last ``len(stop) - 1`` characters of what it had
    decoded, text of tokens the client already has as ``token_ids``; the resumed worker decodes only its
    own output, so those characters never reach the client. Resumed, the client read ``"cd"`` where the
    engine answers ``"abcd"``: the request is refused before anything is sealed."""
    uninterrupted = held_back_text(["a", "b", "c", "d"], ["xyz"], include=False)
    resumed = held_back_text(["c", "d"], ["xyz"], include=False)
    assert "".join(uninterrupted) == "abcd" and "".join(uninterrupted[:2] + resumed) == "cd"
    codec = Catalog()("vllm")
    with pytest.raises(MigrationRefused, match="held back"):
        codec.check_migratable(text_request(stop=["xyz"]))
    with pytest.raises(MigrationRefused, match="held back"):
        codec.check_migratable(text_request(stop="xyz", include_stop_str_in_output=False))
    # Nothing is held back: one-character stop strings, stop strings kept in the output, tokens mode.
    for params, mode in [({"stop": ["x", "y"]}, "text"), ({"stop": ["xyz"], "include_stop_str_in_output": True}, "text"),
                         ({"stop": ["xyz"]}, "tokens"), ({}, "text"), ({"stop": []}, "text")]:
        codec.check_migratable(text_request(mode, **params))
        joined = held_back_text(["a", "b", "c", "d"], params.get("stop") or [], params.get("include_stop_str_in_output", False))
        assert "".join(joined) == "abcd"


def test_a_derender_stream_refuses_migration():
    """0.34.0 ``serve_tokens_stream_generator``, ``output_mode="derender"``: ``role_sent = [False] * n`` per
    request and ``if not role_sent[i]: delta.role = "assistant"``, one ``ChatStreamProcessor`` per choice
    fed the request's own output: a resumed attempt's first chunk says ``role: "assistant"`` again mid
    stream, and its parser starts with none of the lost attempt's reasoning or tool-call progress."""
    with pytest.raises(MigrationRefused, match="derender"):
        Catalog()("vllm").check_migratable(text_request("derender"))


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
