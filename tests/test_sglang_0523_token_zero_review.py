"""Review of the token-0 join rules (fd6625d ``_disown_another_slots_leg``, ce1d2a4
``_check_first_top_width``): cases those commits did not cover, bodies written by hand from upstream
SGLang (read 2026-12-07).

- ``managers/tokenizer_manager.py`` ``_handle_batch_output``: with ``stream_output`` (incremental) each
  ``out_dict`` carries ``"output_ids": output_token_ids`` = ``state.output_ids[state.last_output_offset:]``,
  cumulative ``meta_info["completion_tokens"]``; a request with ``n > 1`` or a list of prompts streams each
  item's chunks tagged ``"index": i`` (``_wait_one_response`` / ``_handle_batch_request``).
- ``disaggregation/utils.py`` ``MetadataBuffers.set_buf``: ``self.output_ids[...][0] = req.output_ids[0]``;
  ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req``: ``staged_output_id =
  output_id[0].item()`` is decode's first id. A prefill leg naming another token 0 is another slot's.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import pd_rows
from sglang_0523_pd_legs import (CODECS, OPTIONS, OUT, OUTPUT_LP, OUTPUT_TOP, PROMPT, RETRACT_ABORT, SPANS,
                              TEXTS, _body, legs)
from sglang_0523_prompt_legs import PREFILL_ONLY, PROMPT_LP, _prompt_legs

from streamproc.wire import Verdict

# ------------------------------------------- 1. a streamed batch's item: its first chunk names token 0


def _batch_legs(codec_cls, *, apart: set[int], streamed: bool | str,
                items: int = 2) -> tuple[list[bytes], list[bytes]]:
    """A streamed batch (``"index": i`` on every chunk) asking routed experts without logprobs: each
    item's decode chunks (incremental ``output_ids``, item after item at each step, as the scheduler's
    batch steps them), its rows and ``weight_versions`` on the finishing chunk; the prefill leg one body per
    item (``FINISH_LENGTH(0)``, token 0, the prompt's rows). Items in ``apart``: prefill's ``output_ids[0]``
    is 8, not decode's 201."""
    experts = codec_cls(OPTIONS).sequences["routed_experts"]

    def encode(r: np.ndarray) -> str:
        return experts.encode(np.frombuffer(r.tobytes(), np.uint8))

    prefill = []
    for i in range(items):
        leg = _body(0, 1, rid="prefill", finished=True, logprobs=False,
                    finish={"type": "length", "length": 0})
        leg["meta_info"]["routed_experts"] = encode(pd_rows(len(PROMPT), 1))
        if i in apart:
            leg["output_ids"][0] = 8
        leg["index"] = i
        prefill.append(dumps(leg))
    spans = SPANS[streamed]
    decode = []
    for step, (lo, n) in enumerate(spans):
        for i in range(items):
            body = _body(lo, n, rid="agg", finished=step == len(spans) - 1, logprobs=False)
            if body["meta_info"]["finish_reason"] is not None:
                body["meta_info"]["routed_experts"] = encode(pd_rows(len(PROMPT), len(OUT), stale=True))
            body["index"] = i
            decode.append(dumps(body))
    return prefill, decode


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [True, "coalesced"], ids=["stream", "coalesced"])
def test_streamed_batch_item_whose_token_0_disagrees_gives_no_prompt_rows(codec_cls, streamed):
    """An item's first chunk (its ``output_ids`` from token 0) wants no prefill (no logprob list, no rows,
    not final), so it reached neither the join nor the item's session, and the finishing chunk's
    incremental ids do not start at token 0: the item's decode token 0 was never known, and a prefill
    item naming another token 0 gave its prompt rows and token 0's version. Item 1 (the honest pair) joins."""
    codec = codec_cls(OPTIONS)
    pre, dec = _batch_legs(codec_cls, apart={0}, streamed=streamed)
    out = join(codec, dec, pre)
    finals = {}
    for (got, verdict), raw in zip(out, dec):
        body = json.loads(got)
        if body["meta_info"]["finish_reason"] is not None:
            finals[body["index"]] = (body["meta_info"], verdict)
    apart_meta, apart_verdict = finals[0]
    assert apart_verdict is Verdict.OMITTED
    assert "routed_experts" not in apart_meta
    assert apart_meta["routed_experts_unavailable_reason"] == "prefill_corrupt"
    assert "weight_versions" not in apart_meta
    assert apart_meta["weight_versions_unavailable_reason"] == "prefill_corrupt"
    honest, _verdict = finals[1]
    rows = codec.sequences["routed_experts"].decode_within(honest["routed_experts"], 1 << 20)
    assert bytes(rows) == pd_rows(len(PROMPT), len(OUT)).tobytes()
    assert honest["weight_versions"] == [{"version": "default", "start": 0, "end": len(OUT)}]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [True, "coalesced"], ids=["stream", "coalesced"])
def test_streamed_batch_items_of_the_honest_pair_join(codec_cls, streamed):
    """The control: every item's prefill names its decode's token 0, so every item gets its rows."""
    codec = codec_cls(OPTIONS)
    pre, dec = _batch_legs(codec_cls, apart=set(), streamed=streamed)
    for got, _verdict in join(codec, dec, pre):
        meta: dict[str, Any] = json.loads(got)["meta_info"]
        assert not any(key.endswith("_unavailable_reason") for key in meta)
        if meta["finish_reason"] is not None:
            rows = codec.sequences["routed_experts"].decode_within(meta["routed_experts"], 1 << 20)
            assert bytes(rows) == pd_rows(len(PROMPT), len(OUT)).tobytes()


# ------------------------- 2. a prefill leg whose output_ids[0] names no token cannot be this slot's


# What ``set_buf`` writes into the slot is prefill's ``req.output_ids[0]``, a sampled vocabulary index (int32
# slot); the tokenizer's ``output_ids`` are ints (``list(recv_obj.output_ids[i])``). None of these is one.
NO_TOKEN = [-1, 2**31, 201.0, True, "201", None, [201]]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("bad", NO_TOKEN + ["not a list"], ids=repr)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_prompt_side_of_a_leg_whose_token_0_is_no_token_is_not_spliced(codec_cls, streamed, bad):
    """fd6625d compares decode's token 0 with prefill's ``output_ids[0]`` only where the latter is an id the
    slot holds; a leg naming ``201.0``, ``-1``, ``2^31``, ``true``... (or an ``output_ids`` that is no list)
    skipped the comparison, and its prompt logprobs, prompt top rows, ``token_ids_logprob`` row 0, token 0's
    version and prompt expert rows were spliced. No SGLang prefill body names such a token 0: it is not the
    leg that fed this decode's slot, and nothing is taken from it (``prefill_corrupt``)."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=None)
    leg = json.loads(pre[0])
    if bad == "not a list":
        leg["output_ids"] = 201
    else:
        leg["output_ids"][0] = bad
    out = join(codec_cls(OPTIONS), dec, [dumps(leg)])
    metas = [json.loads(got)["meta_info"] for got, _verdict in out]
    text = json.dumps(metas)
    for value in PREFILL_ONLY:
        assert value not in text
    for meta, (_got, verdict) in zip(metas, out):
        assert verdict is Verdict.OMITTED
        assert meta["input_logprobs_unavailable_reason"] == "prefill_corrupt"
    last = metas[-1]
    assert "routed_experts" not in last and last["routed_experts_unavailable_reason"] == "prefill_corrupt"
    assert "weight_versions" not in last and last["weight_versions_unavailable_reason"] == "prefill_corrupt"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_prompt_side_of_a_leg_without_output_ids_is_spliced(codec_cls, streamed):
    """The control: a leg without ``output_ids`` at all (no token 0 stated either way) joins as before."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=None)
    leg = json.loads(pre[0])
    del leg["output_ids"]
    out = join(codec_cls(OPTIONS), dec, [dumps(leg)])
    for got, _verdict in out:
        meta = json.loads(got)["meta_info"]
        assert meta["input_token_logprobs"] == PROMPT_LP


# ----------------------------------------- 3. honest one-token answers keep joining (max_new_tokens=1)


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("apart", [False, True], ids=["pair", "apart"])
@pytest.mark.parametrize("finish", [{"type": "length", "length": 1}, {"type": "stop", "matched": 201}],
                         ids=["max_new_tokens_1", "token_0_is_a_stop_token"])
def test_one_token_answer_takes_prefills_rows_only_from_its_own_leg(codec_cls, apart, finish):
    """``max_new_tokens=1`` (or token 0 a stop token): decode's one body holds token 0 alone and may omit
    ``routed_experts`` (SGLang #39146: ``process_batch_result_prebuilt`` collects none), so the answer's rows
    are prefill's prompt rows. The pair's own leg gives them; a leg naming another token 0 gives nothing."""
    experts = codec_cls(OPTIONS).sequences["routed_experts"]
    leg = _body(0, 1, rid="prefill", finished=True, logprobs=False, finish={"type": "length", "length": 0})
    prompt_rows = np.frombuffer(pd_rows(len(PROMPT), 1).tobytes(), np.uint8)
    leg["meta_info"]["routed_experts"] = experts.encode(prompt_rows)
    if apart:
        leg["output_ids"][0] = 8
    body = _body(0, 1, rid="agg", finished=True, logprobs=False, finish=finish)
    (got, verdict), = join(codec_cls(OPTIONS), [dumps(body)], [dumps(leg)])
    meta = json.loads(got)["meta_info"]
    if apart:
        assert verdict is Verdict.OMITTED
        assert "routed_experts" not in meta and meta["routed_experts_unavailable_reason"] == "prefill_corrupt"
        return
    assert not any(key.endswith("_unavailable_reason") for key in meta)
    rows = experts.decode_within(meta["routed_experts"], 1 << 20)
    assert bytes(rows) == pd_rows(len(PROMPT), 1).tobytes()


# ------------------------------------------- a count that is not an int does not place token 0


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("count", [True, 1.0], ids=["true", "float"])
def test_a_chunk_whose_completion_tokens_is_no_int_does_not_name_token_0(codec_cls, count):
    """Decode's token 0 is read from ``output_ids`` only where they hold every token so far
    (``completion_tokens == len(output_ids)``). ``True == 1`` and ``1.0 == 1`` in Python: where the
    first chunk's count said nothing (a string), the next incremental chunk of one id (token 1) with such
    a count was taken for token 0, and the honest prefill leg of this pair was disowned (its prompt rows
    omitted ``prefill_corrupt``). No SGLang body sends either (``completion_tokens`` is
    ``len(req.output_ids)``); token 0 stays unknown and the pair joins."""
    experts = codec_cls(OPTIONS).sequences["routed_experts"]

    def encode(r: np.ndarray) -> str:
        return experts.encode(np.frombuffer(r.tobytes(), np.uint8))

    prefill = _body(0, 1, rid="prefill", finished=True, logprobs=False, finish={"type": "length", "length": 0})
    prefill["meta_info"]["routed_experts"] = encode(pd_rows(len(PROMPT), 1))
    decode = []
    for step, (lo, n) in enumerate(SPANS[True]):
        body = _body(lo, n, rid="agg", finished=step == len(SPANS[True]) - 1, logprobs=False)
        if step == 0:
            body["meta_info"]["completion_tokens"] = "1"
        if step == 1:
            body["meta_info"]["completion_tokens"] = count
        if body["meta_info"]["finish_reason"] is not None:
            body["meta_info"]["routed_experts"] = encode(pd_rows(len(PROMPT), len(OUT), stale=True))
        decode.append(dumps(body))
    out = join(codec_cls(OPTIONS), decode, [dumps(prefill)])
    final, verdict = out[-1]
    meta = json.loads(final)["meta_info"]
    assert verdict is Verdict.JOINED, meta
    assert "routed_experts_unavailable_reason" not in meta, meta


# ------------------------- 4. an abort body whose completion_tokens is no int restates no ids


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("count", [True, 1.0], ids=["true", "float"])
def test_abort_body_whose_completion_tokens_is_no_int_does_not_name_its_last_id_token_0(codec_cls, count):
    """``_decode_first`` reads an abort body's ``output_ids[0]`` as token 0 only where they are every id
    (``completion_tokens == len(output_ids)``); 0.5.23's ``_handle_abort_req`` cuts them to ``[last]`` with
    ``--incremental-streaming-output``. ``True == 1`` and ``1.0 == 1`` in Python: an abort body of two tokens
    (``[202]``) with such a count named 202 token 0, and the pair's honest prefill leg (token 0 = 201) was
    disowned, its prompt side omitted ``prefill_corrupt`` (ab24416 fixed the other copy of the rule)."""
    _agg, pre, _dec = legs(streamed=True, prefill_logprobs=True, stale="zeros")
    lp, top = list(OUTPUT_LP[:2]), list(OUTPUT_TOP[:2])
    meta = {"id": "agg", "finish_reason": RETRACT_ABORT, "weight_version": "default", "e2e_latency": 0.5,
            "input_token_logprobs": [], "output_token_logprobs": lp, "output_token_logprobs_length": 2,
            "input_top_logprobs": [], "output_top_logprobs": top, "completion_tokens": count}
    abort = {"text": "".join(TEXTS[:2]), "output_ids": OUT[1:2], "meta_info": meta}
    (got, _verdict), = join(codec_cls(OPTIONS), [dumps(abort)], pre)
    out = json.loads(got)["meta_info"]
    assert not any(key.endswith("_unavailable_reason") for key in out), out
    assert out["output_token_logprobs"] == OUTPUT_LP[:2]
    assert out["output_top_logprobs"] == OUTPUT_TOP[:2]


# ---------------- 5. the prompt side as the scheduler shapes it: one-position windows copied as sent


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
@pytest.mark.parametrize("text", [False, True], ids=["ids", "text"])
def test_one_position_prompt_window_is_copied_as_prefill_sent_it(codec_cls, streamed, text):
    """Upstream (sgl-project/sglang, read 2026-12-07): ``Scheduler.handle_generate_request`` leaves
    ``logprob_start_len = -1`` (the last prompt position only) where ``return_logprob`` comes with
    ``token_ids_logprob`` and no start (older trees: ``len(origin_input_ids) - 1`` for every default
    request); ``_process_input_token_logprobs`` writes ``[None] + input_token_logprobs[:-1]`` with ids
    ``origin_input_ids[logprob_start_len:]``, ``_process_input_top_logprobs`` and
    ``_process_input_token_ids_logprobs`` start at ``[None]`` and pop the sampling position, and ``detokenize_top_logprobs_tokens``
    turns a falsy row into ``None``: one entry ``[null, <last prompt id>, <text or null>]``, top row and
    token-ids row ``null``. Decode sends ``[]`` ("Decode server does not send input logprobs"). The join
    copies prefill's lists whatever their window: each equals prefill's on every chunk."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=None, experts=False)
    leg = json.loads(pre[0])
    meta = leg["meta_info"]
    one = [[None, PROMPT[-1], "!" if text else None]]
    meta["input_token_logprobs"], meta["input_top_logprobs"] = one, [None]
    meta["input_token_ids_logprobs"] = [None]
    out = join(codec_cls(OPTIONS), dec, [dumps(leg)])
    for got, _verdict in out:
        joined = json.loads(got)["meta_info"]
        assert joined["input_token_logprobs"] == one
        assert joined["input_top_logprobs"] == [None]
        assert joined["input_token_ids_logprobs"] == [None]
        assert "input_logprobs_unavailable_reason" not in joined
        keys = list(joined)
        assert keys.index("input_token_logprobs") < keys.index("output_token_logprobs")
        assert keys.index("input_token_ids_logprobs") < keys.index("output_token_ids_logprobs")


# ------------------------- 5. a completion_tokens that is no int is no count at the other two sites


def _failed_before_token_0(count: Any) -> dict[str, Any]:
    """Decode's body for a request aborted before output token 0 (``_handle_abort_req``: no ids, ``[]``
    lists), its ``completion_tokens`` ``count`` (upstream: ``len(state.output_ids)``, int; None: none)."""
    meta: dict[str, Any] = {"id": "agg", "finish_reason": RETRACT_ABORT, "weight_version": "default",
                            "input_token_logprobs": [], "output_token_logprobs": [],
                            "output_token_logprobs_length": 0, "input_top_logprobs": [],
                            "output_top_logprobs": []}
    if count is not None:
        meta["completion_tokens"] = count
    return {"text": "", "output_ids": [], "meta_info": meta}


def _prompt_scored_prefill() -> list[bytes]:
    """The honest prefill leg with a scored prompt (``logprob_start_len`` 0) and token 0's entries."""
    _agg, pre, _dec = legs(streamed=False, prefill_logprobs=True, stale="zeros")
    leg = json.loads(pre[0])
    leg["meta_info"]["input_token_logprobs"] = PROMPT_LP
    return [dumps(leg)]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("count", [False, 0.0], ids=["false", "float"])
def test_a_failed_body_whose_completion_tokens_is_no_int_is_not_read_as_failed_before_token_0(codec_cls,
                                                                                             count):
    """``_fill_input_logprobs`` keeps decode's ``[]`` for a request that failed before token 0
    (``completion_tokens`` 0). Upstream always sends an int there (``_handle_batch_output``:
    ``"completion_tokens": len(state.output_ids)``; ``_handle_abort_req`` the same), so ``false`` or ``0.0``
    (``False == 0``, ``0.0 == 0`` in Python) is a corrupt count and, as in ``_decode_first`` (0d535c1) and
    ``_first_of_every_token``, no count: the chunk is joined as one without a count (prefill's prompt side),
    not passed as a failure's empty answer."""
    pre = _prompt_scored_prefill()
    (want, _), = join(codec_cls(OPTIONS), [dumps(_failed_before_token_0(None))], pre)
    (got, _), = join(codec_cls(OPTIONS), [dumps(_failed_before_token_0(count))], pre)
    (zero, _), = join(codec_cls(OPTIONS), [dumps(_failed_before_token_0(0))], pre)
    wanted, out = json.loads(want)["meta_info"], json.loads(got)["meta_info"]
    assert json.loads(zero)["meta_info"]["input_token_logprobs"] == []  # the int 0: the failure's own answer
    assert out["input_token_logprobs"] == wanted["input_token_logprobs"] == PROMPT_LP, out


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("count", [True, 1.0], ids=["true", "float"])
def test_weight_version_of_a_body_whose_completion_tokens_is_no_int_is_not_read_as_token_0s(codec_cls, count):
    """``_join_weight_versions`` removes ``weight_version`` with ``weight_versions`` only for a one-token
    answer (``completion_tokens == 1``: its last token is token 0, whose version only prefill knows). ``true``
    and ``1.0`` equal 1 in Python, yet upstream's count is an int (``len(state.output_ids)``): a corrupt count
    is no count (``_decode_first``, 0d535c1), so the body is judged as one without a count."""
    _agg, _pre, dec = legs(streamed=False, prefill_logprobs=True, stale="zeros")

    def final(value: Any) -> bytes:
        body = json.loads(dec[0])
        if value is None:
            del body["meta_info"]["completion_tokens"]
        else:
            body["meta_info"]["completion_tokens"] = value
        return dumps(body)

    (want, _), = join(codec_cls(OPTIONS), [final(None)], None)
    (got, _), = join(codec_cls(OPTIONS), [final(count)], None)
    (one, _), = join(codec_cls(OPTIONS), [final(1)], None)
    wanted, out = json.loads(want)["meta_info"], json.loads(got)["meta_info"]
    assert "weight_version" not in json.loads(one)["meta_info"]  # the int 1: token 0's version, unknown
    assert "weight_versions_unavailable_reason" in out, out
    assert out.get("weight_version") == wanted.get("weight_version") == "default", out
