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
