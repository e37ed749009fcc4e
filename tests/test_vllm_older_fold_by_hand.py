"""Folds of the older vLLM ``/inference/v1/generate`` bodies (``vllm/entrypoints/serve/disagg/``, no
``output_mode``), built by hand from upstream source, not from ``streamproc.simulation``.

Sources read:

* furionw/vllm @ 9cdf7782f6aef4de62cb51a2740169d4555ee483 (the same ``protocol.py`` is in vllm-project/vllm's
  stored history; vllm-project/vllm @ 343bacaf has the same ``GenerateResponse``) ``protocol.py``:
  ``GenerateResponse(BaseModel)`` declares ``request_id, choices, prompt_logprobs, kv_transfer_params`` and
  nothing else; ``GenerateStreamResponse(BaseModel)`` declares ``request_id, choices, usage``.
  ``serving.py`` ``serve_tokens_full_generator`` builds ``GenerateResponse(id=..., created=..., model=model_name,
  choices=..., usage=usage, prompt_logprobs=..., kv_transfer_params=...)``: pydantic's default
  ``extra="ignore"`` drops ``id``, ``created``, ``model`` and ``usage``, and ``api_router.generate`` answers
  ``JSONResponse(content=generator.model_dump())``: four keys. ``serve_tokens_stream_generator`` yields
  ``chunk.model_dump_json()`` (``usage: null`` kept) per delta and, with ``include_usage``, a ``choices: []``
  chunk dumped ``exclude_none=True``.
* A later ``serve/disagg/protocol.py`` (read 2026-12-07: a stored version with the derender requests,
  search-index file 56210460203, commit not named by the index; not vllm-project/vllm @ 06408932 / 343bacaf,
  which declare no stream type at all, their ``serving.py`` @ fef8b03f being unary only) declares
  ``GenerateResponse(request_id, model: str | None, created: int | None, choices, usage, prompt_logprobs,
  kv_transfer_params, ec_transfer_params)``: ``model``, ``created`` and ``usage`` filled by the same call
  (``model_name`` a string, ``usage`` a ``UsageInfo`` always), and ``ec_transfer_params`` too; its stream chunks are the same
  ``GenerateStreamResponse(request_id, choices, usage)``. moreh-dev/vllm @ 46791a75 adds ``usage`` alone.

So no older stream chunk carries ``model``, and a stream without a usage chunk carries no usage; the unary
answer has either no such key or a string / object there, never ``null``. The fold wrote ``"model": null``
and ``"usage": null`` as if they were the engine's values; it now leaves them ``null`` with
``<field>_unavailable_reason: not_streamed`` (the omission policy: the stream does not say which), and a
unary body, which carries what its engine wrote, folds to itself.
"""

from __future__ import annotations

import json

from streamproc_vllm.fold import fold_objects
from vllm_older_bodies import CODEC, dump, stream



def test_an_older_stream_folds_to_no_invented_model_or_usage_null():
    folded = json.loads(CODEC.fold(stream(include_usage=False)))
    assert folded["choices"][0]["token_ids"] == [21, 22]
    assert (folded["model"], folded.get("model_unavailable_reason")) == (None, "not_streamed")
    assert (folded["usage"], folded.get("usage_unavailable_reason")) == (None, "not_streamed")


def test_an_older_stream_with_its_usage_chunk_keeps_that_usage_and_omits_model():
    folded = json.loads(CODEC.fold(stream(include_usage=True)))
    assert folded["usage"] == {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
    assert "usage_unavailable_reason" not in folded
    assert (folded["model"], folded.get("model_unavailable_reason")) == (None, "not_streamed")


def test_an_older_unary_body_folds_to_itself_without_model_or_usage_keys():
    """``JSONResponse(content=GenerateResponse(...).model_dump())`` at furionw/vllm @ 9cdf7782: four keys. The
    join folds a prefill leg with the same function; neither may gain keys the engine did not write."""
    unary = {"request_id": "3f0c", "choices": [{"index": 0, "logprobs": None, "finish_reason": "length",
                                                "token_ids": [21], "routed_experts": None}],
             "prompt_logprobs": None, "kv_transfer_params": None}
    assert fold_objects([unary]) == unary
    assert json.loads(CODEC.fold([dump(unary)])) == unary


def test_a_chunk_that_carries_model_keeps_it_without_a_reason():
    chunks = [json.loads(body) for body in stream(include_usage=True)]
    chunks[0]["model"] = "m"
    folded = fold_objects(chunks)
    assert folded["model"] == "m" and "model_unavailable_reason" not in folded
