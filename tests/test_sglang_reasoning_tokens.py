"""Independent format-fidelity review: SGLang ``meta_info.reasoning_tokens`` in P/D.

Bodies are written by hand from upstream SGLang (no simulator, no ``upstream.py`` builders):

* ``tokenizer_manager.py`` ``_handle_batch_output`` (sgl-project/sglang @ 001067ff): ``meta_info``
  gets ``reasoning_tokens`` = the scheduler's ``req.reasoning_tokens`` on every body
  (``scheduler_components/output_streamer.py`` ``_GenerationStreamAccumulator.accept``).
* ``Req.update_reasoning_tokens(token_id, think_end_id)`` counts every output token of a request
  with ``require_reasoning`` until and including ``think_end_id`` (``end_pos + 1``), then stops.
* Aggregated: ``SchedulerBatchResultProcessor.process_batch_result_prefill``
  (``scheduler_components/batch_result_processor.py`` @ 003ddbce) appends output token 0 and calls
  ``_maybe_update_reasoning_tokens(req, next_token_id)``, so token 0 is counted.
* P/D prefill: ``disaggregation/prefill.py`` ``process_batch_result_disagg_prefill`` (@ 000c2b94)
  appends token 0 and never calls it: prefill's body says ``reasoning_tokens: 0``.
* P/D decode: ``DecodeTransferQueue._commit_transfer_to_req`` (``disaggregation/decode.py``) appends
  prefill's token 0 (``output_ids.append(committed_output_id)``) without counting it, and
  ``process_batch_result_prebuilt`` does not either; decode's own steps count tokens 1.. only. When
  token 0 is the think-end token, decode never sees it and counts every later token as reasoning.

So decode's ``reasoning_tokens`` is not what the aggregated engine returns, and no leg has the
aggregated value. The mission rule: equal to the aggregated answer, or omitted with a reason.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from streamproc_sglang import SGLangCodec

from streamproc.codec import CodecOptions

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
THINK_END = 151668  # the model's think_end_id (any id; Qwen3's "</think>")
PROMPT_TOKENS = 6  # reasoning started in the prompt (chat template opened "<think>")


def body(out: list[int], text: str, finish: Any, reasoning: int, prompt: int = PROMPT_TOKENS) -> bytes:
    """``_handle_batch_output`` for a unary request without logprobs or experts (BatchStrOutput);
    ``prompt``: a resumed attempt's is the original prompt plus the tokens emitted before it."""
    meta = {"id": "r1", "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
            "num_retractions": 0, "reasoning_tokens": reasoning, "completion_tokens": len(out),
            "cached_tokens": 0, "e2e_latency": 0.5}
    return dumps({"text": text, "output_ids": out, "meta_info": meta})


def reasoning_count(out: list[int], *, skip_first: bool) -> int:
    """``Req.update_reasoning_tokens`` applied token by token (decode never sees token 0)."""
    count, over = 0, False
    for token in out[1:] if skip_first else out:
        if over:
            break
        count += 1
        over = token == THINK_END
    return count


@pytest.mark.parametrize("out", [[11, THINK_END, 13, 14], [THINK_END, 12, 13, 14]],
                         ids=["token0-reasoning", "token0-think-end"])
def test_pd_reasoning_tokens_equal_the_aggregated_count_or_are_omitted(out):
    """Reasoning asked: no leg has the aggregated count, so the joined body says why instead, in the
    count's place; every other key as the aggregated body has it, in its order."""
    finish = {"type": "length", "length": len(out)}
    agg = body(out, "abcd", finish, reasoning_count(out, skip_first=False))
    prefill = body(out[:1], "a", {"type": "length", "length": 0}, 0)
    decode = body(out, "abcd", finish, reasoning_count(out, skip_first=True))
    [(joined, verdict)] = join(SGLangCodec(OPTIONS), [decode], [prefill])
    want = json.loads(agg)["meta_info"]["reasoning_tokens"]
    meta = json.loads(joined)["meta_info"]
    if "reasoning_tokens" in meta:
        assert meta["reasoning_tokens"] == want, (
            f"P/D publishes reasoning_tokens={meta['reasoning_tokens']} (verdict {verdict.value}); "
            f"the aggregated engine returns {want}")
    else:
        assert meta.get("reasoning_tokens_unavailable_reason") == "prefill_missing"
        assert verdict.value == "omitted"
        agg_meta = json.loads(agg)["meta_info"]
        assert list(meta) == [k if k != "reasoning_tokens" else "reasoning_tokens_unavailable_reason"
                              for k in agg_meta]
        assert {k: v for k, v in meta.items() if k != "reasoning_tokens_unavailable_reason"} == \
            {k: v for k, v in agg_meta.items() if k != "reasoning_tokens"}


def test_pd_reasoning_tokens_of_a_request_without_reasoning_pass_through():
    """0 (reasoning not asked, the common case) is the aggregated value on every leg: kept as sent."""
    out = [11, 12, 13]
    finish = {"type": "length", "length": 3}
    decode = body(out, "abc", finish, 0)
    [(joined, verdict)] = join(SGLangCodec(OPTIONS), [decode], [body(out[:1], "a", {"type": "length", "length": 0}, 0)])
    assert joined == decode and verdict.value == "passthrough"


def test_every_streamed_pd_chunk_with_a_reasoning_count_omits_it():
    """Streamed: each decode chunk restates the running count; each one above 0 is removed."""
    finish = {"type": "length", "length": 3}
    chunks = [body([11], "a", None, 0), body([11, 12], "ab", None, 1), body([11, 12, 13], "abc", finish, 2)]
    joined = join(SGLangCodec(OPTIONS), chunks, [body([11], "a", {"type": "length", "length": 0}, 0)])
    metas = [json.loads(j)["meta_info"] for j, _ in joined]
    # the first chunk's 0 is the documented limit: a one-token count reads 0 on both legs
    assert [m.get("reasoning_tokens") for m in metas] == [0, None, None]
    assert [m.get("reasoning_tokens_unavailable_reason") for m in metas] == [None, "prefill_missing", "prefill_missing"]


def test_a_resumed_attempt_after_a_pd_attempt_whose_count_was_omitted_omits_it_too():
    """Migration adds what the client saw before the seal to the resumed attempt's count; after a
    P/D attempt whose chunks said the count is unavailable, that sum cannot be made: the stitched
    body says so (stitch_incomplete) instead of adding 0."""
    codec = SGLangCodec(OPTIONS)
    published = [joined for joined, _ in join(codec, [body([11], "a", None, 0), body([11, 12], "ab", None, 1)],
                                               [body([11], "a", {"type": "length", "length": 0}, 0)])]
    session = codec.open_migration()
    session.absorb(published)
    session.seal()
    stitched, verdict = session.stitch(body([13], "c", {"type": "length", "length": 1}, 1,
                                                 prompt=PROMPT_TOKENS + 2), True)
    meta = json.loads(stitched)["meta_info"]
    assert "reasoning_tokens" not in meta and verdict.value == "omitted"
    assert meta["reasoning_tokens_unavailable_reason"] == "stitch_incomplete"


def test_a_resumed_attempt_after_an_attempt_with_a_count_adds_it():
    """Aggregated attempts: the count the client saw is added to the resumed attempt's, as before."""
    codec = SGLangCodec(OPTIONS)
    session = codec.open_migration()
    session.absorb([body([11, 12], "ab", None, 2)])
    session.seal()
    stitched, _ = session.stitch(body([13], "c", {"type": "length", "length": 1}, 1, prompt=PROMPT_TOKENS + 2),
                                 True)
    assert json.loads(stitched)["meta_info"]["reasoning_tokens"] == 3


def test_a_folded_pd_stream_has_the_count_or_its_reason_never_both():
    """The unary body a stream folds to: the first chunk's 0 and the later chunks' omission reason
    are one field's states, and the later one wins (a reviewer saw both keys in a folded body)."""
    codec = SGLangCodec(OPTIONS)
    finish = {"type": "length", "length": 3}
    chunks = [body([11], "a", None, 0), body([11, 12], "ab", None, 1), body([11, 12, 13], "abc", finish, 2)]
    joined = [j for j, _ in join(codec, chunks, [body([11], "a", {"type": "length", "length": 0}, 0)])]
    meta = json.loads(codec.fold(joined))["meta_info"]
    assert "reasoning_tokens" not in meta and meta["reasoning_tokens_unavailable_reason"] == "prefill_missing"
