"""vLLM 0.34.0 ``output_mode="derender"`` and one-chunk streams folded into the unary body, built by hand from
the vLLM 0.34.0 wheel (``pip download --no-deps vllm==0.34.0``), not from ``streamproc.simulation``.

Sources read (vLLM 0.34.0):

* ``entrypoints/scale_out/token_in_token_out/serving.py``: ``ServingTokens.serve_tokens_stream_generator``
  (a chunk is ``response_cls(request_id=..., choices=[choice])`` dumped with ``exclude`` of the ``None``
  ``prompt_token_ids`` / ``mm_placeholders`` / ``metrics``; a derender choice's ``delta`` is
  ``ChatStreamProcessor.step``'s ``DeltaMessage``, ``model_dump(exclude_none=True)``) and
  ``serve_tokens_full_generator`` / ``_build_full_response_fields`` (the unary body, ``JSONResponse(content=
  generator.model_dump())`` in ``api_router.generate``).
* ``parser/cohere_command.py`` ``CohereCommandParser._tool_call_deltas``: a call's name piece carries an id
  only ``if resolved_id is not None`` (``tc.id or self._pending_tool_ids.pop(tc.index, None)``), so a real
  stream can announce a call with no ``id`` at all.
* ``entrypoints/openai/chat_completion/message_assembly.py`` ``_to_tool_calls``: the unary message's calls are
  ``ToolCall(id=tc.id or make_tool_call_id(), function=tc)``: always a string id, made per answer
  (``renderers/chat_utils/tool_call.py`` ``make_tool_call_id``: ``chatcmpl-tool-<uuid>`` or kimi's
  ``functions.<name>:<idx>``), never ``null``.
"""

from __future__ import annotations

import json

from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc_vllm import VLLMCodec

CODEC = VLLMCodec(CodecOptions(max_decompressed_bytes=1 << 20))
RID = "generate-tokens-r1"


def derender_chunk(delta: dict, token: int, finish: str | None) -> bytes:
    """``GenerateDerenderStreamResponse`` of ``serve_tokens_stream_generator``: ``request_id``, ``usage`` (None
    without continuous usage), ``output_mode``, ``choices``; the choice is ``GenerateStreamChoiceBase``'s fields,
    then ``delta``, then ``logprobs``."""
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [token], "routed_experts": None,
              "sampling_mask": None, "weight_versions": None, "delta": delta, "logprobs": None}
    return dumps({"request_id": RID, "usage": None, "output_mode": "derender", "choices": [choice]})


def test_a_derender_tool_call_streamed_without_an_id_folds_to_no_id_with_its_reason_not_a_null_id():
    """``CohereCommandParser._tool_call_deltas`` (vLLM 0.34.0) streams a call's name piece without ``id`` when
    melody has none for it yet; the unary message of the same request holds a string id that
    ``_to_tool_calls`` made (``tc.id or make_tool_call_id()``), which no stream says. The fold wrote
    ``"id": null``, a value no vLLM unary body holds; now the id stays ``null`` in its place with
    ``id_unavailable_reason: fold_ambiguous`` behind the call's keys, as the fold omits an unknown content."""
    deltas = [{"role": "assistant", "tool_calls": [{"type": "function", "index": 0,
                                                    "function": {"name": "get_weather"}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": \"Oslo\"}"}}]}]
    chunks = [derender_chunk(delta, 40 + k, "tool_calls" if k == len(deltas) - 1 else None)
              for k, delta in enumerate(deltas)]
    message = json.loads(CODEC.fold(chunks))["choices"][0]["message"]
    assert list(message["tool_calls"][0].items()) == [
        ("id", None), ("type", "function"),
        ("function", {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}),
        ("id_unavailable_reason", "fold_ambiguous")]


def test_a_derender_tool_call_streamed_with_its_id_folds_to_that_id_and_no_reason():
    """``extract_named_tool_call_streaming`` / ``extract_required_tool_call_streaming`` / ``compute_tool_delta``
    (vLLM 0.34.0, ``tool_parsers/streaming.py`` and ``tool_parsers/utils.py``) write ``id``, ``type`` and the
    name on a call's first piece: the folded call has that id and no reason."""
    deltas = [{"role": "assistant", "tool_calls": [{"id": "chatcmpl-tool-7", "type": "function", "index": 0,
                                                    "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    chunks = [derender_chunk(delta, 50 + k, "tool_calls" if k else None) for k, delta in enumerate(deltas)]
    call = json.loads(CODEC.fold(chunks))["choices"][0]["message"]["tool_calls"][0]
    assert call == {"id": "chatcmpl-tool-7", "type": "function", "function": {"name": "f", "arguments": "{}"}}


# ``GenerateResponseBase`` then ``GenerateTokensResponse`` / ``GenerateTextResponse`` (vLLM 0.34.0
# ``token_in_token_out/protocol.py``): pydantic dumps the base class's fields first, every one of them
# (``JSONResponse(content=generator.model_dump())``, no ``exclude_none``).
UNARY_TOP_KEYS = ["request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                  "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
                  "output_mode", "choices"]


def tokens_chunk(token: int, finish: str | None, mode: str = "tokens", **top: object) -> bytes:
    """``GenerateTokensStreamResponse`` / ``GenerateTextStreamResponse`` of ``serve_tokens_stream_generator``:
    ``request_id``, ``usage``, the set ones of ``prompt_token_ids`` / ``mm_placeholders`` / ``metrics``,
    ``output_mode``, ``choices`` (``GenerateStreamChoiceBase``'s fields, ``text`` in text mode, ``logprobs``)."""
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [token], "routed_experts": None,
              "sampling_mask": None, "weight_versions": None, **({"text": "x"} if mode == "text" else {}),
              "logprobs": None}
    return dumps({"request_id": RID, "usage": None, **top, "output_mode": mode, "choices": [choice]})


def usage_chunk(prompt: int, completion: int, mode: str = "tokens") -> bytes:
    """The final chunk with ``stream_options.include_usage``: ``model_dump_json(exclude_none=True)`` of
    ``response_cls(request_id=..., choices=[], usage=final_usage_info, metrics=None)``."""
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    return dumps({"request_id": RID, "usage": usage, "output_mode": mode, "choices": []})


def test_a_folded_034_stream_has_the_unary_bodys_top_level_keys_in_their_order():
    """The unary body of a 0.34.0 request always writes every ``GenerateResponseBase`` field, then
    ``output_mode`` and ``choices``; the fold wrote ``request_id, model, choices, usage, prompt_logprobs,
    kv_transfer_params`` and then what the chunks had (``output_mode``, the first chunk's
    ``prompt_token_ids``), without ``created``, ``prompt_token_id_logprobs``, ``mm_placeholders``,
    ``metrics`` or ``ec_transfer_params``: a client reading ``body["created"]`` of a folded answer failed.
    Now the keys are the unary body's, in its order; what no chunk carried is ``null`` (with its reason)."""
    for mode in ("tokens", "text"):
        chunks = [tokens_chunk(11, None, mode, prompt_token_ids=[1, 2, 3]), tokens_chunk(12, "length", mode),
                  usage_chunk(3, 2, mode)]
        folded = json.loads(CODEC.fold(chunks))
        assert list(folded)[:len(UNARY_TOP_KEYS)] == UNARY_TOP_KEYS, mode  # then the reasons (test below)
        assert (folded["model"], folded["created"], folded["prompt_token_ids"], folded["output_mode"]) == (
            None, None, [1, 2, 3], mode)
        assert folded["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                   "completion_tokens_details": None}
        assert folded["choices"][0]["token_ids"] == [11, 12]


def test_a_folded_034_stream_has_the_unary_usage_and_metrics_with_their_null_fields():
    """The usage chunk is ``model_dump_json(exclude_none=True)`` (``serve_tokens_stream_generator``, vLLM 0.34.0):
    ``UsageInfo`` without ``completion_tokens_details``, ``PromptTokenUsageInfo`` (``--enable-prompt-tokens-details``)
    with only ``cached_tokens``, ``PerRequestMetrics`` (``build_spec_decoding_metrics``, ``n == 1``) with only
    ``speculative_decoding``, itself without the ``detailed``-level ``per_step_*`` arrays. The unary body
    (``JSONResponse(content=model_dump())``) writes each of those ``None`` fields as ``null``, in declaration
    order (``prompt_tokens_details`` stays out when ``None``: ``exclude_if``). The fold kept the chunk's dump, so
    a client reading ``usage["completion_tokens_details"]`` of a folded answer failed; now it writes them."""
    spec = {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.5, "acceptance_histogram": [1, 1, 0],
            "num_spec_steps": 2, "num_accepted_draft_tokens": 1, "num_draft_tokens": 4, "num_spec_tokens": 2}
    final = dumps({"request_id": RID, "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                                "prompt_tokens_details": {"cached_tokens": 2}},
                   "metrics": {"speculative_decoding": spec}, "output_mode": "tokens", "choices": []})
    folded = json.loads(CODEC.fold([tokens_chunk(11, None), tokens_chunk(12, "length"), final]))
    unary_usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                   "prompt_tokens_details": {"cached_tokens": 2, "created_cache_tokens": None,
                                             "multimodal_tokens": None},
                   "completion_tokens_details": None}
    unary_metrics = {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": None,
                     "mean_itl_ms": None, "tokens_per_second": None,
                     "speculative_decoding": {**spec, "per_step_accepted": None, "per_step_drafted": None}}
    assert dumps(folded["usage"]) == dumps(unary_usage)
    assert dumps(folded["metrics"]) == dumps(unary_metrics)
    # Without prompt token details (the default) the unary usage has no such key at all.
    plain = dumps({"request_id": RID, "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
                   "output_mode": "tokens", "choices": []})
    folded = json.loads(CODEC.fold([tokens_chunk(11, None), tokens_chunk(12, "length"), plain]))
    assert dumps(folded["usage"]) == dumps({"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                            "completion_tokens_details": None})


# vLLM 0.34.0 ``GenerateResponseBase`` fields that ``serve_tokens_stream_generator`` never writes in a chunk
# (``response_cls(request_id=..., choices=[choice])``, then only ``prompt_token_ids`` / ``mm_placeholders`` /
# ``usage`` / ``metrics`` are set), while ``_build_response_fields`` fills each for the unary body: ``model``
# (the served name) and ``created`` (``int(time.time())``) always, the prompt-side scores and the transfer
# params from the ``RequestOutput``.
NEVER_STREAMED = ["model", "created", "prompt_logprobs", "prompt_token_id_logprobs", "kv_transfer_params",
                  "ec_transfer_params"]


def stream_of(mode: str, include_usage: bool) -> list[bytes]:
    """Two token chunks (``finish_reason`` on the second), then with ``include_usage`` the usage chunk."""
    if mode == "derender":
        chunks = [derender_chunk({"role": "assistant", "content": "H"}, 11, None),
                  derender_chunk({"content": "i"}, 12, "length")]
    else:
        chunks = [tokens_chunk(11, None, mode), tokens_chunk(12, "length", mode)]
    return chunks + ([usage_chunk(3, 2, mode)] if include_usage else [])


def test_a_folded_034_stream_omits_with_a_reason_each_unary_field_no_chunk_carries():
    """A stream never carries ``model``, ``created``, ``prompt_logprobs``, ``prompt_token_id_logprobs``,
    ``kv_transfer_params``, ``ec_transfer_params``, and without ``stream_options.include_usage`` not ``usage``
    nor ``metrics`` either (the usage chunk is their only carrier); the unary body of the same request has a
    value there (``model`` a string and ``created`` an int always, ``usage`` a ``UsageInfo`` always), or
    ``null`` only on paths no chunk tells. The fold wrote a bare ``null``, which a client took for the
    unary value; now each is ``null`` with ``<field>_unavailable_reason: not_streamed`` (the omission policy).
    A ``null`` the stream determines stays bare: ``prompt_token_ids`` / ``mm_placeholders`` without
    ``return_token_ids`` (the first chunk has them when it is set), ``metrics`` when the usage chunk has none
    (it is dumped from the same ``per_request_metrics`` the unary body writes)."""
    for mode in ("tokens", "text", "derender"):
        for include_usage in (True, False):
            folded = json.loads(CODEC.fold(stream_of(mode, include_usage)))
            unstreamed = NEVER_STREAMED + ([] if include_usage else ["usage", "metrics"])
            reasons = {key: value for key, value in folded.items() if key.endswith("_unavailable_reason")}
            assert reasons == {f"{field}_unavailable_reason": "not_streamed" for field in unstreamed}, (
                mode, include_usage)
            assert list(folded)[:len(UNARY_TOP_KEYS)] == UNARY_TOP_KEYS  # the reasons follow the unary keys
            assert all(folded[field] is None for field in unstreamed)
            bare_nulls = {key for key in UNARY_TOP_KEYS if folded[key] is None} - set(unstreamed)
            assert bare_nulls == {"prompt_token_ids", "mm_placeholders"} | ({"metrics"} if include_usage else set())


def test_a_folded_034_stream_keeps_a_value_a_chunk_carries_without_a_reason():
    """What a chunk does carry is the value, with no reason beside it: ``prompt_token_ids`` from the first
    chunk (``return_token_ids``), ``usage`` / ``metrics`` from the usage chunk."""
    metrics = {"speculative_decoding": {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.5,
                                        "acceptance_histogram": [1, 1, 0], "num_spec_steps": 2,
                                        "num_accepted_draft_tokens": 1, "num_draft_tokens": 4, "num_spec_tokens": 2}}
    final = dumps({"request_id": RID, "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
                   "metrics": metrics, "output_mode": "tokens", "choices": []})
    folded = json.loads(CODEC.fold([tokens_chunk(11, None, prompt_token_ids=[1, 2, 3], mm_placeholders={}),
                                    tokens_chunk(12, "length"), final]))
    assert (folded["prompt_token_ids"], folded["mm_placeholders"]) == ([1, 2, 3], {})
    assert folded["usage"]["completion_tokens"] == 2 and folded["metrics"]["speculative_decoding"]
    assert sorted(key for key in folded if key.endswith("_unavailable_reason")) == sorted(
        f"{field}_unavailable_reason" for field in NEVER_STREAMED)
