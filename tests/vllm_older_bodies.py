"""Older ``serve/disagg`` stream bodies written by hand from upstream vLLM (not the simulator), shared by
the older-format fold tests (test modules do not import each other).

``serving.py`` ``serve_tokens_stream_generator``: one ``GenerateStreamResponse(request_id,
choices=[GenerateResponseStreamChoice(index, logprobs, finish_reason, token_ids)])`` per delta,
``chunk.model_dump_json()`` (``usage: null`` kept); then, with ``include_usage``, the ``choices: []`` chunk
dumped ``exclude_none`` (``UsageInfo`` order ``prompt_tokens, total_tokens, completion_tokens``). Nothing
in it says whether prompt logprobs were asked."""

from __future__ import annotations

import json

from streamproc.codec import CodecOptions
from streamproc_vllm import VLLMCodec

CODEC = VLLMCodec(CodecOptions(max_decompressed_bytes=1 << 20))
# serve_tokens: request_id = f"generate-tokens-{self._base_request_id(raw_request, request.request_id)}"
RID = "generate-tokens-r1"


def dump(obj: dict) -> bytes:
    """``model_dump_json``'s compact separators."""
    return json.dumps(obj, separators=(",", ":")).encode()


def stream(include_usage: bool) -> list[bytes]:
    """Two deltas (tokens 21, 22, the second ``stop``), then the usage chunk if ``include_usage``."""
    bodies = [dump({"request_id": RID, "choices": [{"index": 0, "logprobs": None, "finish_reason": finish,
                                                    "token_ids": [token]}], "usage": None})
              for token, finish in ((21, None), (22, "stop"))]
    if include_usage:
        bodies.append(dump({"request_id": RID, "choices": [],
                            "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}}))
    return bodies
