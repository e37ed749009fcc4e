"""Independent fidelity review: SGLang request options that change P/D body shapes (SGLang 0.5.23 wheel).

Bodies are written by hand from the 0.5.23 source (no simulator, no ``upstream.py`` renderer):

* ``managers/tokenizer_manager.py`` ``add_logprob_to_meta_info`` writes ``input_token_logprobs``,
  ``output_token_logprobs``, ``output_token_logprobs_length``, then (``top_logprobs_num > 0``)
  ``input_top_logprobs`` / ``output_top_logprobs`` (or the flat ``input_top_logprobs_*`` fields of
  ``_build_flat_top_logprobs_fields`` with ``return_flat_raw_top_logprobs``), then (``token_ids_logprob``)
  ``input_token_ids_logprobs`` / ``output_token_ids_logprobs``, on every body of a ``return_logprob``
  request, whatever the window: the prompt-side lists are whatever the scheduler sent, ``[]`` when none.
* ``managers/scheduler_components/output_streamer.py`` ``_GenerationStreamAccumulator.accept``: a P/D
  decode worker never sends input logprobs ("Decode server does not send input logprobs"), so its
  prompt-side lists are ``[]`` whatever ``logprob_start_len`` is; the prefill worker sends the
  window ``LogprobResultProcessor._process_input_token_logprobs`` computed (``[None] + ...``, the
  token ids ``origin_input_ids[logprob_start_len:]``), as the aggregated engine does.
* ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req``: token 0's logprob and
  top logprobs come from the metadata buffer; its ``token_ids_logprob`` row is reserved empty
  (``detokenize_top_logprobs_tokens`` sends ``null``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from streamproc_sglang import SGLangCodec

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict

CODEC = SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20))
PROMPT = [101, 102, 103, 104]
OUT = [11, 12, 13]
TOP_K = 2
TOKEN_IDS = [5, 7]
INPUT_SIDE = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def entry(position: int, token: int) -> list[Any]:
    """``detokenize_logprob_tokens`` without ``return_text_in_logprobs``: ``(logprob, id, None)``."""
    return [-0.25 * (position + 1), token, None]


def decode_body(*, flat: bool = False) -> bytes:
    """The finished unary body of a P/D decode worker for a request with ``return_logprob``,
    ``logprob_start_len=1``, ``top_logprobs_num=2`` and ``token_ids_logprob=[5, 7]``
    (``_handle_batch_output`` + ``add_logprob_to_meta_info``; BatchStrOutput). Its prompt-side lists
    are ``[]``: the decode scheduler sends none. ``flat``: ``return_flat_raw_top_logprobs``, whose
    zero prompt rows ``_build_flat_top_logprobs_fields("input", [], [], 2)`` writes as shape ``[0, 2]``."""
    out = [entry(i, t) for i, t in enumerate(OUT)]
    meta: dict[str, Any] = {
        "id": "r1", "finish_reason": {"type": "length", "length": len(OUT)}, "prompt_tokens": len(PROMPT),
        "weight_version": "default", "num_retractions": 0,
        "input_token_logprobs": [], "output_token_logprobs": out, "output_token_logprobs_length": len(out),
    }
    if flat:
        meta.update({"input_top_logprobs_val_flat": [], "input_top_logprobs_idx_flat": [],
                     "input_top_logprobs_shape": [0, TOP_K], "input_top_logprobs_null_prefix": 0})
    else:
        meta["input_top_logprobs"] = []
    meta["output_top_logprobs"] = [[entry(i, t), entry(i + 5, 99)] for i, t in enumerate(OUT)]
    meta["input_token_ids_logprobs"] = []
    # token 0's row reserved empty by _commit_transfer_to_req: null
    meta["output_token_ids_logprobs"] = [None] + [[entry(i, 5), entry(i, 7)] for i in range(1, len(OUT))]
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(OUT), "cached_tokens": 0,
                 "weight_versions": [{"version": "default", "start": 0, "end": len(OUT)}], "e2e_latency": 0.2})
    return dumps({"text": "abc", "output_ids": OUT, "meta_info": meta})


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("prefill", ["timeout", "no_logprobs"])
def test_decode_empty_prompt_logprobs_are_never_published_beside_the_unavailable_reason(prefill, flat):
    """With ``logprob_start_len=1`` the aggregated answer has three prompt positions; P/D decode's
    ``[]`` says none. Without a usable prefill answer the field is omitted, and decode's empty lists
    (and flat fields of zero rows) must go with it: kept beside the reason they read as an empty
    window, which is what a ``logprob_start_len=-1`` request would get. Before the fix they were kept."""
    if prefill == "timeout":
        legs = None
    else:  # a prefill answer without the prompt-side lists (process_disagg_prefill_inflight_queue's body)
        legs = [dumps({"text": "a", "output_ids": OUT[:1], "meta_info": {
            "id": "r1", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(PROMPT),
            "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": 1,
            "cached_tokens": 0, "weight_versions": [{"version": "default", "start": 0, "end": 1}]}})]
    (body, verdict), = join(CODEC, [decode_body(flat=flat)], legs)
    meta = json.loads(body)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert meta["input_logprobs_unavailable_reason"] == ("prefill_timeout" if legs is None else "prefill_missing")
    leftovers = [key for key in meta if key.startswith("input_") and not key.endswith("_unavailable_reason")]
    assert leftovers == []
    # the reason takes the list's place (before output_token_logprobs, as the field was)
    keys = list(meta)
    assert keys.index("input_logprobs_unavailable_reason") == keys.index("output_token_logprobs") - 1
    own = [entry(i, t) for i, t in enumerate(OUT)]
    if legs is None:  # nothing tells whether prefill wrote token 0's metadata slot: decode's, kept
        assert meta["output_token_logprobs"] == own
    else:  # a prefill without logprob lists never wrote it (MetadataBuffers.set_buf): position 0 unknown
        assert meta["output_token_logprobs"] == [[None, OUT[0], None], *own[1:]]
        assert meta["output_token_logprobs_unavailable_reason"] == "prefill_missing"


def rejected_at_intake(*, finish_message: str) -> bytes:
    """A streamed request ``Scheduler.handle_generate_request`` rejects (``logprob_start_len`` past the
    prompt) as a P/D worker answers it: ``Req.set_finish_with_abort`` swaps the prompt for a one-token
    stub, clears ``return_logprob`` and leaves the verdict in ``to_finish``; ``_add_request_to_queue``
    hands it to ``PrefillBootstrapQueue.add`` / ``DecodePreallocQueue.add``, whose
    ``is_unadmitted_reject`` sends it to ``retire_unadmitted_request``: streamed unrun, so
    ``_handle_batch_output`` writes the tokenizer state's empty lists (``add_logprob_to_meta_info``),
    no output token and no ``routed_experts``. ``_wait_one_response`` yields a stream's abort body as
    is. The prefill and the decode worker send this same body.

    The aggregated engine does not: its waiting queue runs the stub (``Scheduler.abort_request``,
    "Abort method 2 ... will still run one prefill forward pass"), so ``process_batch_result_prefill``
    appends the sampled token before ``update_finish_state`` turns ``to_finish`` into the abort, and
    collects routed experts (``_maybe_collect_routed_experts``) if they were asked: its body has
    ``output_ids`` ``[t]`` (a token sampled after the stub), ``completion_tokens`` 1, and one stub row
    (none past a ``routed_experts_start_len`` of 0). Its logprob lists are ``[]`` as here
    (``return_logprob`` was cleared). No P/D leg has that token or row (docs/codecs.md, known limit)."""
    meta = {"id": "r1", "finish_reason": {"type": "abort", "message": finish_message, "status_code": 400,
                                          "err_type": "BadRequestError"},
            "prompt_tokens": 1, "weight_version": "default", "num_retractions": 0,
            "input_token_logprobs": [], "output_token_logprobs": [], "output_token_logprobs_length": 0,
            "input_top_logprobs": [], "output_top_logprobs": [],
            "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "weight_versions": [{"version": "default", "start": 0, "end": 0}], "e2e_latency": 0.01}
    return dumps({"text": "", "output_ids": [], "meta_info": meta})


def test_a_request_rejected_before_any_token_keeps_its_empty_prompt_logprobs_without_a_reason():
    """``logprob_start_len=9`` on a 4-token prompt: both legs answer the same abort body with
    ``input_token_logprobs: []``, and so does the aggregated engine (``set_finish_with_abort`` cleared
    ``return_logprob`` before its stub forward): the join must not call those lists unavailable
    (before the fix: ``input_logprobs_unavailable_reason: prefill_error``, and with the first fix of
    this file the lists removed). No routed-experts marker either (it used to read ``prefill_error``):
    the aggregated body has a stub row only if experts were asked, and nothing in either leg says
    whether they were, so the join leaves the body as the legs sent it (docs/codecs.md, known limit)."""
    message = "req.logprob_start_len=9 is higher than the number of input tokens len(req.origin_input_ids)=4."
    body = rejected_at_intake(finish_message=message)
    (joined, _), = join(CODEC, [body], [body])
    meta = json.loads(joined)["meta_info"]
    want = json.loads(body)["meta_info"]
    assert "input_logprobs_unavailable_reason" not in meta
    assert "routed_experts_unavailable_reason" not in meta
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs"):
        assert meta[key] == want[key] == []
    assert list(meta)[:list(meta).index("e2e_latency")] == list(want)[:list(want).index("e2e_latency")]


def test_a_decode_aborted_before_token_0_keeps_its_empty_prompt_logprobs_not_prefills():
    """``_handle_abort_req`` for a decode request aborted in its queue (no token): the aggregated
    engine's abort before token 0 has ``input_token_logprobs: []`` (no prompt logprobs before token 0),
    so prefill's window, though computed, is not what the aggregated answer shows."""
    decode = dumps({"text": "", "output_ids": [], "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default", "e2e_latency": 0.3, "input_token_logprobs": [],
        "output_token_logprobs": [], "output_token_logprobs_length": 0, "completion_tokens": 0}})
    prefill = dumps({"text": "a", "output_ids": OUT[:1], "meta_info": {
        "id": "r1", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(PROMPT),
        "weight_version": "default", "num_retractions": 0,
        "input_token_logprobs": [[None, PROMPT[1], None], entry(2, PROMPT[2]), entry(3, PROMPT[3])],
        "output_token_logprobs": [entry(0, OUT[0])], "output_token_logprobs_length": 1,
        "reasoning_tokens": 0, "completion_tokens": 1, "cached_tokens": 0}})
    (joined, _), = join(CODEC, [decode], [prefill])
    meta = json.loads(joined)["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert "input_logprobs_unavailable_reason" not in meta


def test_a_resumed_pd_attempt_without_prefill_gets_the_prompt_logprobs_the_client_was_sent():
    """Migration (``migration.py``): the resumed request's prompt is the original plus the k emitted
    tokens (``logprob_start_len`` is absolute, so its window covers them too); the stitch restates
    the original prompt's lists as the client saw them. When the resumed attempt is P/D and its
    prefill leg timed out, its joined body has ``input_logprobs_unavailable_reason`` and no lists;
    the original's are still known exactly (the uninterrupted engine restates them on every body), so
    the stitched body carries them, in ``add_logprob_to_meta_info``'s places, and no reason. Before:
    the reason (and, before this file's first fix, decode's empty lists replaced by the client's
    beside it)."""
    inp = [[None, PROMPT[1], None], entry(2, PROMPT[2]), entry(3, PROMPT[3])]
    itop = [None, [entry(2, PROMPT[2]), entry(7, 99)], [entry(3, PROMPT[3]), entry(7, 99)]]
    iids = [None, [entry(2, 5), entry(2, 7)], [entry(3, 5), entry(3, 7)]]

    def meta_of(*, prompt: int, out: list[int], first: int, count: int, pd: bool, finish: Any) -> dict[str, Any]:
        """An incremental chunk of an attempt: the request's output positions ``[first, first +
        len(out))``, the attempt's running ``count`` of tokens (its lists' length and completion)."""
        m: dict[str, Any] = {"id": "r1", "finish_reason": finish, "prompt_tokens": prompt,
                             "weight_version": "default", "num_retractions": 0}
        m["input_token_logprobs"] = [] if pd else inp
        m["output_token_logprobs"] = [entry(first + i, t) for i, t in enumerate(out)]
        m["output_token_logprobs_length"] = count
        m["input_top_logprobs"] = [] if pd else itop
        m["output_top_logprobs"] = [[entry(first + i, t)] for i, t in enumerate(out)]
        m["input_token_ids_logprobs"] = [] if pd else iids
        # a P/D decode's row for its token 0 is reserved empty (_commit_transfer_to_req): null
        m["output_token_ids_logprobs"] = [None if pd and count == len(out) and i == 0 else [entry(first + i, 5)]
                                          for i in range(len(out))]
        m.update({"reasoning_tokens": 0, "completion_tokens": count, "cached_tokens": 0})
        return m

    # the lost attempt (aggregated) published token 0 with the prompt's window
    seen = dumps({"text": "a", "output_ids": OUT[:1],
                  "meta_info": meta_of(prompt=len(PROMPT), out=OUT[:1], first=0, count=1, pd=False,
                                       finish=None)})
    session = CODEC.open_migration()
    session.absorb([seen])
    assert list(session.seal().token_ids) == OUT[:1]
    # the resumed attempt, P/D: its token 0 is the request's token 1
    decode_meta = meta_of(prompt=len(PROMPT) + 1, out=OUT[1:2], first=1, count=1, pd=True, finish=None)
    decode = dumps({"text": "b", "output_ids": OUT[1:2], "meta_info": decode_meta})
    (joined, _), = join(CODEC, [decode], None)  # its prefill leg timed out
    assert "input_logprobs_unavailable_reason" in json.loads(joined)["meta_info"]
    stitched, _ = session.stitch(joined, False)
    got = json.loads(stitched)["meta_info"]
    want = meta_of(prompt=len(PROMPT), out=OUT[1:2], first=1, count=2, pd=False, finish=None)
    # token 1's row was decode's reserved null: kept null, the join's reasons stay
    want = dict(item for key, value in want.items() for item in
                ([(key, [None]), (key + "_unavailable_reason", "prefill_timeout")]
                 if key == "output_token_ids_logprobs" else [(key, value)]))
    want.update(routed_experts_unavailable_reason="prefill_timeout")
    # the resumed attempt's own Req's retraction count (test_sglang_0523_migration_by_hand.py), in its place
    want = {(k + "_unavailable_reason" if k == "num_retractions" else k): ("stitch_incomplete" if k == "num_retractions" else v)
            for k, v in want.items()}
    assert "input_logprobs_unavailable_reason" not in got
    assert list(got.items()) == list(want.items())
