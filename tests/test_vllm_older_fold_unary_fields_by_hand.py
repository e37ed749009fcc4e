"""Which unary fields a fold of an older vLLM ``/inference/v1/generate`` stream (``serve/disagg``, no
``output_mode``) can say, built by hand from upstream source, not from ``streamproc.simulation``.

Sources read (the stored ``vllm/entrypoints/serve/disagg/`` versions: vllm-project/vllm @ 06408932,
343bacaf, 0001948b, fef8b03f; furionw/vllm @ 9cdf7782; moreh-dev/vllm @ 46791a75 / 2f585f1b; AIvashov,
alexeldeib, eigen-hub, fake0fan, andylolu2, FermatGo, intellistream, mmgaggle, xhx1022,
red-hat-data-services/vllm-cpu):

* ``protocol.py``: ``GenerateResponse(BaseModel)`` (pydantic's ``BaseModel``, default ``extra="ignore"``)
  declares ``request_id: str = Field(default_factory=lambda: f"{random_uuid()}")``, ``choices``,
  ``prompt_logprobs`` and ``kv_transfer_params`` (moreh-dev adds ``usage`` after ``choices``); no version
  declares ``created`` or ``ec_transfer_params``. ``GenerateStreamResponse`` declares ``request_id, choices,
  usage``.
* ``serving.py`` ``serve_tokens_full_generator``::

      response = GenerateResponse(
          id=request_id,
          created=created_time,
          model=model_name,
          choices=choices,
          usage=usage,
          prompt_logprobs=clamp_prompt_logprobs(final_res.prompt_logprobs),
          kv_transfer_params=final_res.kv_transfer_params,
      )

  ``id`` and ``created`` are no fields, so they are dropped and ``request_id`` is the default factory's fresh
  ``random_uuid()`` (moreh-dev/vllm @ 2f585f1b passes ``request_id=request_id`` instead: the chunks' id);
  ``prompt_logprobs`` is a list when the request asked for them, ``kv_transfer_params`` the connector's value.
  ``serve_tokens_stream_generator`` builds each chunk as ``GenerateStreamResponse(request_id=request_id,
  choices=[...])`` with ``request_id = f"generate-tokens-{...}"``.

So the aggregated unary answer's ``request_id`` is a uuid no chunk shows (or, in one fork, the chunks' id: the
stream does not say which), and its ``prompt_logprobs`` / ``kv_transfer_params`` are values no chunk carries:
the fold wrote the stream's id and two bare ``null``s, which a client took for the engine's. Each is now
``null`` with ``<field>_unavailable_reason``: ``fold_ambiguous`` for the id, ``not_streamed`` for the others.
``created`` and ``ec_transfer_params`` are in no older unary body, so the fold writes neither (the doubt that
it should was wrong for these versions; vLLM 0.34.0's fold writes both, see
test_vllm_034_derender_fold_by_hand.py).
"""

from __future__ import annotations

import json

from streamproc_vllm.fold import fold_objects
from vllm_older_bodies import CODEC, RID, dump, stream

NOT_STREAMED = "not_streamed"


def folds() -> list[dict]:
    return [json.loads(CODEC.fold(stream(include_usage))) for include_usage in (False, True)]


def test_an_older_stream_fold_omits_prompt_logprobs_it_cannot_say():
    """Asked, the unary body has ``clamp_prompt_logprobs(final_res.prompt_logprobs)``, a list; not asked,
    ``null``. The stream is the same either way, so a bare ``null`` claimed the second."""
    for folded in folds():
        assert (folded["prompt_logprobs"], folded.get("prompt_logprobs_unavailable_reason")) == (
            None, NOT_STREAMED)


def test_an_older_stream_fold_omits_kv_transfer_params_it_cannot_say():
    """``kv_transfer_params=final_res.kv_transfer_params`` on the unary body only (no stream chunk field)."""
    for folded in folds():
        assert (folded["kv_transfer_params"], folded.get("kv_transfer_params_unavailable_reason")) == (
            None, NOT_STREAMED)


def test_an_older_stream_fold_does_not_pass_the_stream_id_off_as_the_unary_uuid():
    """The unary ``request_id`` is ``GenerateResponse``'s own ``random_uuid()`` (``id=request_id`` is
    dropped; vllm-project, furionw) or the chunks' ``generate-tokens-...`` id (moreh-dev passes
    ``request_id=request_id``): the stream fits both, so the fold says neither."""
    for folded in folds():
        assert (folded["request_id"], folded.get("request_id_unavailable_reason")) == (None, "fold_ambiguous")
        assert RID not in json.dumps(folded)


def test_an_older_stream_fold_writes_no_created_or_ec_transfer_params():
    """No older ``GenerateResponse`` declares them (``created=created_time`` is dropped): the fold invents
    neither key nor a reason for one. Passed before the change too: it guards the finding that upstream has
    no such fields in these versions."""
    for folded in folds():
        assert not {key for key in folded if key.startswith(("created", "ec_transfer_params"))}


def test_the_reasons_follow_the_keys_and_the_fold_keeps_the_choices():
    for folded in folds():
        keys = list(folded)
        assert keys.index("kv_transfer_params") < keys.index("request_id_unavailable_reason")
        assert folded["choices"][0]["token_ids"] == [21, 22]


def test_an_older_unary_body_keeps_its_own_uuid_and_values():
    """The join folds a prefill leg, a unary body, with the same function: it says every field itself."""
    unary = {"request_id": "9b2f4c0e5d6a47f1b3c2d1e0f9a8b7c6",
             "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": [21],
                          "routed_experts": None}],
             "prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": 1, "decoded_token": "token_id:7"}}],
             "kv_transfer_params": {"do_remote_decode": False, "remote_block_ids": [1]}}
    assert fold_objects([unary]) == unary
    assert json.loads(CODEC.fold([dump(unary)])) == unary


def test_chunks_that_carry_model_fold_by_the_same_rule():
    """No older ``GenerateStreamResponse`` declares ``model``; chunks that carry it (the simulator's default
    streams did until 2026-12-07) kept the earlier rule: the stream's id as the unary one and bare ``null``
    prompt logprobs and KV parameters. One rule now: ``model`` said, the rest omitted as for any stream."""
    for include_usage in (False, True):
        chunks = [dump({**json.loads(body), "model": "m"}) for body in stream(include_usage)]
        folded = json.loads(CODEC.fold(chunks))
        assert folded["model"] == "m" and "model_unavailable_reason" not in folded
        assert (folded["request_id"], folded.get("request_id_unavailable_reason")) == (None, "fold_ambiguous")
        for field in ("prompt_logprobs", "kv_transfer_params"):
            assert (folded[field], folded.get(f"{field}_unavailable_reason")) == (None, NOT_STREAMED)
