"""A P/D pair whose router asks only the decode leg for logprobs: token 0's logprob is not decode's to give.

Independent check, bodies written by hand from upstream code (not the simulator, ``streamproc_sglang.upstream``
or another test's fixtures). SGLang 0.5.23 PyPI wheel, paths relative to ``sglang/srt/``:

- ``disaggregation/utils.py`` ``MetadataBuffers.set_buf`` (prefill side) writes token 0's id always, but its
  logprob, id-in-logprob and top logprobs only ``if req.return_logprob:``; the buffers are
  ``torch.zeros`` at start-up and never cleared, so a slot keeps what the last request with logprobs
  wrote there (or zeros).
- ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req`` (decode side):
  ``if decode_req.req.return_logprob and not replayed_boundary:`` appends
  ``output_token_logprobs_val[0]``, ``output_token_logprobs_idx[0]`` and
  ``output_top_logprobs_val/idx[: top_logprobs_num]`` from that slot, whatever prefill was asked.
- ``managers/tokenizer_manager.py`` ``detokenize_logprob_tokens`` / ``detokenize_top_logprobs_tokens``:
  ``(logprob, id, None)`` triples; a top-logprob position with values is a list (``if token_logprobs_val[i]``).

How routers drive the legs (read from their source):

- ai-dynamo/dynamo ``components/src/dynamo/sglang/request_handlers/llm/prefill_handler.py``
  ``PrefillWorkerHandler.generate`` (commits ``02266e71`` and ``209c9e83``) calls
  ``engine.async_generate(**input_param, sampling_params=..., stream=True, bootstrap_*=..., rid=...)``
  with no ``return_logprob``, ``top_logprobs_num`` or ``return_routed_experts``, and consumes the results
  without yielding them; ``components/src/dynamo/sglang/engine_generate.py`` (commit ``060aa6a4``)
  ``build_generate_kwargs`` forwards ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
  ``return_routed_experts``, ``routed_experts_start_len`` from the native request, and
  ``clamp_prefill_sampling_params`` sets ``n = 1``, ``max_new_tokens = 1`` for the prefill leg.
  A deployment where the decode leg gets ``return_logprob`` and the prefill leg does not is this case.
- sgl-project/sglang ``sgl-router/py_src/sglang_router/mini_lb.py`` ``handle_generate_request`` posts
  the same ``modified_request`` (the client's body plus ``bootstrap_host/port/room``) to both servers:
  both legs are asked the same, the control case below.

The request: ``{"input_ids": [11, 12, 13, 14], "return_logprob": true, "top_logprobs_num": 2,
"sampling_params": {"max_new_tokens": 3}}``, unary, and the same streamed with
``--incremental-streaming-output`` and ``stream_interval`` 1.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import drive_stitch
from helpers import upstream_json as dumps
from sglang_0523_bodies import coalesced
from sglang_0523_pd_legs import (
    CODECS,
    DYNAMO_BOOTSTRAP_FRAME,
    OPTIONS,
    OUT,
    OUTPUT_LP,
    OUTPUT_TOP,
    RETRACT_ABORT,
    SPANS,
    STALE,
    TEXTS,
    _body,
    _flat_output_top,
    _leg_that_says_nothing,
    legs,
)

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "stream"])
def test_legs_asked_alike_join_to_the_aggregated_answer(codec_cls, streamed):
    """mini_lb sends both servers the same body: the join equals the aggregated engine's answer."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="zeros")
    for (got, _verdict), want in zip(join(codec_cls(OPTIONS), dec, pre), agg):
        assert_same_body(got, dumps(want))


def _omitted_first_token(want: dict[str, Any], reason: str = "prefill_missing") -> dict[str, Any]:
    """The aggregated body with what no leg of this pair has, omitted as the join documents it:
    the prompt-side lists (``input_logprobs_unavailable_reason``), and on the chunk holding output
    position 0 token 0's logprob and top logprobs (``null``, as a position without values), with
    ``output_token_logprobs_unavailable_reason`` after ``output_token_logprobs_length``. ``reason``
    ``prefill_corrupt``: a prefill leg that is not this decode's (its ``output_ids[0]`` another token),
    from which nothing is taken, token 0's version (``weight_versions``) and expert rows neither."""
    want = copy.deepcopy(want)
    meta = want["meta_info"]
    items = []
    for key, value in meta.items():
        if key == "input_token_logprobs":
            items.append(("input_logprobs_unavailable_reason", reason))
        elif key == "input_top_logprobs":
            continue
        elif key == "weight_versions" and reason == "prefill_corrupt":
            items.append(("weight_versions_unavailable_reason", reason))
        else:
            items.append((key, value))
        if key == "output_token_logprobs_length" and value == len(meta["output_token_logprobs"]):
            items.append(("output_token_logprobs_unavailable_reason", reason))
    if reason == "prefill_corrupt" and meta["finish_reason"] is not None:
        items.append(("routed_experts_unavailable_reason", reason))  # only prefill's leg tells if asked
    meta = dict(items)
    if "output_token_logprobs_unavailable_reason" in meta:
        meta["output_token_logprobs"][0] = [None, OUT[0], None]
        meta["output_top_logprobs"][0] = None
    want["meta_info"] = meta
    return want


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("stale", sorted(STALE))
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_decode_first_token_logprob_from_an_unwritten_slot_is_not_published(codec_cls, streamed, stale):
    """Prefill ran without ``return_logprob`` (its body has no logprob lists), decode with it: decode's
    token 0 entries are whatever the metadata slot held, never the sampled token's logprob."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale=stale)
    out = join(codec_cls(OPTIONS), dec, pre)
    for (got, verdict), want in zip(out, agg):
        assert verdict is Verdict.OMITTED
        assert_same_body(got, dumps(_omitted_first_token(want)))
    first = json.loads(out[0][0])["meta_info"]
    assert first["output_token_logprobs"][0] != list(STALE[stale][0])


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "stream"])
def test_dynamo_bootstrap_frame_ahead_of_the_prefill_body_leaves_the_join_unchanged(codec_cls, streamed):
    """A publisher that puts the handler's frame in the prefill leg before SGLang's body: the leg
    folds to the body, and the join equals the aggregated answer as without the frame."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="zeros")
    for (got, _verdict), want in zip(join(codec_cls(OPTIONS), dec, [dumps(DYNAMO_BOOTSTRAP_FRAME), *pre]), agg):
        assert_same_body(got, dumps(want))


@pytest.mark.parametrize("codec_cls", CODECS)
def test_dynamo_bootstrap_frame_alone_is_no_prefill_answer(codec_cls):
    """The frame without SGLang's body (the handler's output as Dynamo forwards it) carries no prompt
    logprobs: omitted as ``prefill_corrupt``, decode's token 0 entry kept (nothing says the slot was
    not written)."""
    agg, _pre, dec = legs(streamed=False, prefill_logprobs=True, stale="zeros")
    (got, verdict), = join(codec_cls(OPTIONS), dec, [dumps(DYNAMO_BOOTSTRAP_FRAME)])
    meta = json.loads(got)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert meta["input_logprobs_unavailable_reason"] == "prefill_corrupt"
    assert meta["output_token_logprobs"] == agg[0]["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_fold_keeps_output_token_logprobs_beside_the_first_token_marker(codec_cls, streamed):
    """The edge's unary answer of a joined stream (``Codec.fold``) is the joined unary body: the
    position-0 marker leaves ``output_token_logprobs`` in place (it is not a removed field), so the
    fold keeps the whole list, position 0 ``null``, and the marker."""
    codec = codec_cls(OPTIONS)
    agg, pre, dec = legs(streamed=False, prefill_logprobs=False, stale="left_over")
    (unary, _verdict), = join(codec, dec, pre)
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale="left_over")
    chunks = [body for body, _verdict in join(codec_cls(OPTIONS), dec, pre)]
    folded = json.loads(codec.fold(chunks))["meta_info"]
    want = json.loads(unary)["meta_info"]
    assert folded["output_token_logprobs"] == want["output_token_logprobs"] == [[None, OUT[0], None],
                                                                               *OUTPUT_LP[1:]]
    assert folded["output_token_logprobs_unavailable_reason"] == "prefill_missing"
    assert_same_body(codec.fold(chunks), dumps(_omitted_first_token(agg[0])))


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("first", [999, -5, 10**30, "x", None], ids=["other", "negative", "huge", "string", "null"])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_first_token_entry_names_the_token_decode_sent_whatever_prefill_says(codec_cls, streamed, first):
    """Decode's ``output_ids[0]`` comes from the slot's ids, which ``set_buf`` writes whatever prefill was
    asked: it is the token the client got. Token 0's omitted entry names it, as the aggregated body's
    entry names its ``output_ids[0]``, not a prefill body's disagreeing or malformed ``output_ids[0]``.
    A leg naming another token (999), or a value no int32 slot holds as a token (-5, 10^30, "x", null:
    ``set_buf`` writes a sampled index), is not this slot's: every field it would give is ``prefill_corrupt``
    (until 2026-12-07 the malformed ones were ``prefill_missing``, token 0's version taken from them)."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale="left_over")
    leg = json.loads(pre[0])
    leg["output_ids"] = [first]
    out = join(codec_cls(OPTIONS), dec, [dumps(leg)])
    reason = "prefill_corrupt"
    for (got, verdict), want in zip(out, agg):
        assert verdict is Verdict.OMITTED
        assert_same_body(got, dumps(_omitted_first_token(want, reason)))
    doc = json.loads(out[0][0])
    assert doc["meta_info"]["output_token_logprobs"][0] == [None, doc["output_ids"][0], None]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
@pytest.mark.parametrize("stale", sorted(STALE))
def test_flat_output_top_logprobs_of_an_unwritten_slot_are_not_published(codec_cls, stale, b64):
    """``return_flat_raw_output_top_logprobs``: decode's flat output rows start with the slot's top
    logprobs for token 0, the same unwritten slot as the nested form's; the join nulls that row as the
    flat form writes a null row (``output_top_logprobs_null_prefix`` 1, one row fewer)."""
    agg, pre, dec = legs(streamed=False, prefill_logprobs=False, stale=stale)
    decode = json.loads(dec[0])
    decode["meta_info"] = _flat_output_top(decode["meta_info"], b64=b64)
    (got, verdict), = join(codec_cls(OPTIONS), [dumps(decode)], pre)
    want = _omitted_first_token(agg[0])
    want["meta_info"] = _flat_output_top(want["meta_info"], b64=b64)
    assert verdict is Verdict.OMITTED
    assert json.loads(got)["meta_info"]["output_top_logprobs_null_prefix"] == 1
    assert_same_body(got, dumps(want))


# ``token_ids_logprob=[9, 42]``: one ``[[lp, 9, None], [lp, 42, None]]`` row per output position.
IDS_ROWS = [[[-3.0, 9, None], [-8.0, 42, None]], [[-1.0, 9, None], [-9.0, 42, None]],
            [[-2.0, 9, None], [-9.5, 42, None]]]


def _with_token_ids(body: dict[str, Any], lo: int, n: int, *, reserved: bool) -> dict[str, Any]:
    """``body`` as ``token_ids_logprob`` answers it: ``input_token_ids_logprobs`` (``[]``) and the sliced
    ``output_token_ids_logprobs`` after the top logprobs (``convert_logprob_style`` step 3). ``reserved``:
    decode's row for token 0 is the empty one ``_commit_transfer_to_req`` reserves ("Prefill omits these
    scores"), sent as ``null`` (``detokenize_top_logprobs_tokens``)."""
    rows = [None if reserved and i == 0 else row for i, row in enumerate(IDS_ROWS)]
    body = copy.deepcopy(body)
    items = []
    for key, value in body["meta_info"].items():
        items.append((key, value))
        if key == "output_top_logprobs":
            items += [("input_token_ids_logprobs", []), ("output_token_ids_logprobs", rows[lo:n])]
    body["meta_info"] = dict(items)
    return body


def _token_ids_legs(streamed: bool | str) -> tuple[list[dict], list[bytes], list[bytes]]:
    """:func:`legs` with ``token_ids_logprob`` asked of decode only (prefill has no logprob lists)."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale="left_over")
    spans = SPANS[streamed]
    agg = [_with_token_ids(body, lo, n, reserved=False) for body, (lo, n) in zip(agg, spans)]
    dec = [dumps(_with_token_ids(json.loads(body), lo, n, reserved=True)) for body, (lo, n) in zip(dec, spans)]
    return agg, pre, dec


def _omitted_token_ids_row(want: dict[str, Any]) -> dict[str, Any]:
    """:func:`_omitted_first_token`, and on the chunk holding output position 0 that position's
    ``output_token_ids_logprobs`` row ``null`` with ``output_token_ids_logprobs_unavailable_reason`` after
    the list; decode's own prompt-side ``input_token_ids_logprobs`` removed as its other input lists."""
    want = _omitted_first_token(want)
    meta = want["meta_info"]
    meta.pop("input_token_ids_logprobs")
    if "output_token_logprobs_unavailable_reason" in meta:
        items = []
        for key, value in meta.items():
            items.append((key, value))
            if key == "output_token_ids_logprobs":
                items.append(("output_token_ids_logprobs_unavailable_reason", "prefill_missing"))
        meta = want["meta_info"] = dict(items)
        meta["output_token_ids_logprobs"][0] = None
    return want


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_token_ids_logprobs_keep_decodes_rows_with_only_token_0s_row_null(codec_cls, streamed):
    """The aggregated engine scores ``token_ids_logprob`` at every output position, token 0's included
    (``add_logprob_return_values``); decode's rows from position 1 are its own steps', its row 0 is the
    reserved empty one, and a prefill leg asked for no logprobs has none to put there. The list stays
    with row 0 ``null`` and its marker, as ``output_token_logprobs`` keeps its positions: before, the
    whole list was removed for one row no leg had."""
    agg, pre, dec = _token_ids_legs(streamed)
    out = join(codec_cls(OPTIONS), dec, pre)
    for (got, verdict), want in zip(out, agg):
        assert verdict is Verdict.OMITTED
        assert_same_body(got, dumps(_omitted_token_ids_row(want)))


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [True, "coalesced"], ids=["stream", "coalesced"])
def test_fold_keeps_token_ids_logprobs_beside_their_row_0_marker(codec_cls, streamed):
    """The edge's unary answer of the joined stream is the joined unary body: the marker beside
    ``output_token_ids_logprobs`` removes nothing, so the fold keeps every row, row 0 ``null``."""
    codec = codec_cls(OPTIONS)
    agg, pre, dec = _token_ids_legs(False)
    (unary, _verdict), = join(codec, dec, pre)
    _agg, pre, dec = _token_ids_legs(streamed)
    chunks = [body for body, _verdict in join(codec_cls(OPTIONS), dec, pre)]
    folded = json.loads(codec.fold(chunks))["meta_info"]
    assert folded["output_token_ids_logprobs"] == [None, *IDS_ROWS[1:]]
    assert folded["output_token_ids_logprobs_unavailable_reason"] == "prefill_missing"
    assert_same_body(codec.fold(chunks), unary)


# ``Scheduler.abort_request`` on a retracted decode request (``_make_abort_req``), as
# ``TokenizerManager._handle_abort_req`` (0.5.23) words it.
def _abort_body(seen: int, first: tuple) -> dict[str, Any]:
    """``_handle_abort_req`` (0.5.23, ``--incremental-streaming-output``) once the tokenizer holds ``seen``
    tokens: no ``prompt_tokens``, the WHOLE logprob lists (``add_logprob_to_meta_info``), ``output_ids``
    cut to ``[last]``; decode's token 0 entries are the metadata slot's (``first``)."""
    lp, top = list(OUTPUT_LP[:seen]), list(OUTPUT_TOP[:seen])
    lp[0], top[0] = first
    meta = {"id": "agg", "finish_reason": RETRACT_ABORT, "weight_version": "default", "e2e_latency": 0.5,
            "weight_versions": [{"version": "default", "start": 0, "end": seen}], "input_token_logprobs": [],
            "output_token_logprobs": lp, "output_token_logprobs_length": seen, "input_top_logprobs": [],
            "output_top_logprobs": top, "completion_tokens": seen}
    return {"text": "".join(TEXTS[:seen]), "output_ids": OUT[seen - 1:seen], "meta_info": meta}


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("first", [999, -5, 2**31, 10**30, "x", None],
                         ids=["other", "negative", "past-int32", "huge", "string", "null"])
@pytest.mark.parametrize(("sent", "seen"), [(1, 2), (1, 3), (0, 2)])
def test_abort_body_first_token_entry_names_the_token_decode_sent_whatever_prefill_says(codec_cls, sent, seen,
                                                                                        first):
    """The client got ``sent`` one-token chunks, ``seen - sent`` more were queued when the abort came and
    ``_coalesce_streaming_chunks`` put them in front of the abort body, whose whole lists restate position
    0 with the slot's values. Its omitted entry there names token 0 as decode sent it (``output_ids[0]``
    of the chunk that started at 0, or of the queued ones when nothing was sent), never a prefill body's
    ``output_ids[0]``: another token, a negative id, one no int32 slot holds, a string or ``null``."""
    stale = STALE["left_over"]
    chunks = [_body(k, k + 1, rid="agg", finished=False, logprobs=True, first=stale) for k in range(sent)]
    queued = [_body(k, k + 1, rid="agg", finished=False, logprobs=True, first=stale) for k in range(sent, seen)]
    dec = [*chunks, coalesced([*queued, _abort_body(seen, stale)])]
    _agg, pre, _dec = legs(streamed=True, prefill_logprobs=False, stale="left_over")
    leg = json.loads(pre[0])
    leg["output_ids"] = [first]
    out = join(codec_cls(OPTIONS), [dumps(d) for d in dec], [dumps(leg)])
    meta = json.loads(out[-1][0])["meta_info"]
    entries = meta["output_token_logprobs"]
    assert out[-1][1] is Verdict.OMITTED
    # 999: a valid token that is not decode's token 0, the others no token at all: not this slot's leg
    # (_disown_another_slots_leg; until 2026-12-07 the malformed ones were prefill_missing)
    assert meta["output_token_logprobs_unavailable_reason"] == "prefill_corrupt"
    assert entries[len(entries) - seen] == [None, OUT[0], None]
    if sent == 0:
        assert entries[0] == [None, OUT[0], None]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize(("first", "named"), [(OUT[0], OUT[0]), (-5, None), (2**31, None), (10**30, None),
                                              (True, None)],
                         ids=["token", "negative", "past-int32", "huge", "bool"])
def test_abort_body_with_no_decode_token_0_names_prefills_only_if_a_slot_could_hold_it(codec_cls, first, named):
    """An abort body with ``[last]`` of two tokens and no earlier chunk of the attempt: decode's token 0 is
    in no body, so prefill's ``output_ids[0]`` is named, only where an int32 slot (``MetadataBuffers.output_ids``)
    could have carried it; else the entry names no token."""
    _agg, pre, _dec = legs(streamed=True, prefill_logprobs=False, stale="left_over")
    leg = json.loads(pre[0])
    leg["output_ids"] = [first]
    (got, verdict), = join(codec_cls(OPTIONS), [dumps(_abort_body(2, STALE["left_over"]))], [dumps(leg)])
    meta = json.loads(got)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert meta["output_token_logprobs"][0] == [None, named, None]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streaming", ["incremental", "cumulative"])
def test_resumed_attempts_first_token_is_the_one_from_an_unwritten_slot(codec_cls, streaming):
    """A migrated request resumed as a P/D attempt (``input_ids`` = prompt + the emitted token, attempt
    joined in its own session, then stitched): the attempt's prefill leg samples the attempt's first token,
    the request's output position 1, and its slot is the unwritten one. That position is nulled, naming
    the attempt's own ``output_ids[0]``, and the marker sits on the chunk whose stitched
    ``output_token_logprobs_length`` starts there; the client's position 0 keeps its logprob."""
    codec = codec_cls(CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("streaming", streaming),)))
    cumulative = streaming == "cumulative"
    stale = STALE["left_over"]

    def attempt(lo: int, n: int, *, prompt: int, first: tuple | None, finished: bool, base: int) -> dict:
        body = _body(base + lo, base + n, rid="agg", finished=finished, logprobs=True)
        meta = body["meta_info"]
        lp, top = list(OUTPUT_LP[base:base + n]), list(OUTPUT_TOP[base:base + n])
        if first is not None:
            lp[0], top[0] = first
        start = 0 if cumulative else lo
        body.update(text="".join(TEXTS[base + start:base + n]), output_ids=OUT[base + start:base + n])
        meta.update(prompt_tokens=prompt, output_token_logprobs=lp[start:n], output_top_logprobs=top[start:n],
                    output_token_logprobs_length=n, completion_tokens=n)
        return body

    lost = [attempt(0, 1, prompt=4, first=None, finished=False, base=0)]
    resumed = [attempt(0, 1, prompt=5, first=stale, finished=False, base=1),
               attempt(1, 2, prompt=5, first=stale, finished=True, base=1)]
    pre = {"text": TEXTS[1], "output_ids": [OUT[1]],
           "meta_info": {"id": "prefill", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 5,
                         "completion_tokens": 1}}
    joined = [json.loads(body) for body, _verdict in join(codec, [dumps(d) for d in resumed], [dumps(pre)])]
    out = [json.loads(body)["meta_info"] for body in drive_stitch(codec, lost, joined)]
    assert out[0]["output_token_logprobs"] == OUTPUT_LP[:1]
    assert out[1]["output_token_logprobs_length"] == 2
    assert out[1]["output_token_logprobs"][-1] == [None, OUT[1], None]
    assert out[1]["output_top_logprobs"][-1] is None
    assert out[1]["output_token_logprobs_unavailable_reason"] == "prefill_missing"
    if cumulative:
        assert out[1]["output_token_logprobs"] == [OUTPUT_LP[0], [None, OUT[1], None]]
        assert out[2]["output_token_logprobs"] == [OUTPUT_LP[0], [None, OUT[1], None], OUTPUT_LP[2]]
    else:
        assert out[2]["output_token_logprobs"] == OUTPUT_LP[2:]
        assert "output_token_logprobs_unavailable_reason" not in out[2]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("stale", sorted(STALE))
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
@pytest.mark.parametrize(("leg", "reason"), [("timeout", "prefill_timeout"), ("frame", "prefill_corrupt"),
                                             ("field", "prefill_corrupt"), ("failed", "prefill_error"),
                                             ("disagreeing", "prefill_corrupt")])
def test_first_token_entry_naming_another_token_than_decodes_is_not_published_whatever_the_prefill_leg(
        codec_cls, streamed, stale, leg, reason):
    """A prefill leg that says nothing about the slot (timed out, Dynamo's frame alone, its list unreadable,
    failed), or whose lists name the left-over token, with a decode body whose token 0 entry names another
    token than its own ``output_ids[0]``: ``set_buf`` writes the slot's ``output_ids`` always and its
    logprobs only ``if req.return_logprob``, so that entry is the values a previous request left in the
    slot (or zeros), never this token's. It becomes ``[null, <token 0>, null]`` with its top logprobs null,
    marked with the leg's reason, as where the prefill leg has no logprob lists; before, another request's
    logprob and token id were published as token 0's."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale=stale)
    out = join(codec_cls(OPTIONS), dec, _leg_that_says_nothing(leg, pre))
    first = json.loads(out[0][0])["meta_info"]
    assert out[0][1] is Verdict.OMITTED
    assert first["output_token_logprobs"][0] == [None, OUT[0], None]
    assert first["output_top_logprobs"][0] is None
    assert first["output_token_logprobs_unavailable_reason"] == reason
    assert first["output_token_logprobs"][1:] == OUTPUT_LP[1:len(first["output_token_logprobs"])]
    for got, _verdict in out[1:]:  # later chunks hold no token 0 (their slices start past it)
        assert "output_token_logprobs_unavailable_reason" not in json.loads(got)["meta_info"]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
@pytest.mark.parametrize("leg", ["timeout", "frame", "field", "failed", "disagreeing"])
def test_first_token_entry_naming_decodes_token_passes_whatever_the_prefill_leg(codec_cls, streamed, leg):
    """The control: prefill was asked for logprobs and wrote the slot, so decode's token 0 entry names its
    own ``output_ids[0]``; a prefill leg that says nothing leaves it as decode sent it."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="left_over")
    out = join(codec_cls(OPTIONS), dec, _leg_that_says_nothing(leg, pre))
    first = json.loads(out[0][0])["meta_info"]
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]
    assert first["output_top_logprobs"][0] == OUTPUT_TOP[0]
    assert "output_token_logprobs_unavailable_reason" not in first


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("own", [-5, 2**31, 10**30], ids=["negative", "past-int32", "huge"])
@pytest.mark.parametrize("leg", ["timeout", "frame", "field", "failed", "disagreeing"])
def test_decode_output_id_no_int32_slot_holds_is_corrupt(codec_cls, own, leg):
    """A decode chunk whose ``output_ids[0]`` is no id the slot's int32 ``MetadataBuffers.output_ids``
    holds did not get it from the slot (``_commit_transfer_to_req``: ``staged_output_id =
    output_id[0].item()``; ``set_buf`` writes ``req.output_ids[0]``, a sampled vocabulary index, never
    negative): the leg is corrupt. Token 0's entry is not published as sent, nor does it name the
    impossible id: ``[null, <prefill's output_ids[0]> or null, null]``, top row null, ``decode_corrupt``.
    (Until this change the entry passed unchecked, as a41219c's version of this test asserted.)"""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=True, stale="left_over")
    body = json.loads(dec[0])
    body["output_ids"][0] = own
    out = join(codec_cls(OPTIONS), [dumps(body)], _leg_that_says_nothing(leg, pre))
    first = json.loads(out[0][0])["meta_info"]
    assert out[0][1] is Verdict.OMITTED
    assert first["output_token_logprobs"][0] in ([None, OUT[0], None], [None, None, None])
    assert first["output_token_logprobs"][1:] == OUTPUT_LP[1:]
    assert first["output_top_logprobs"] == [None, *OUTPUT_TOP[1:]]
    assert first["output_token_logprobs_unavailable_reason"] == "decode_corrupt"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("own", [-5, 2**31, 10**30], ids=["negative", "past-int32", "huge"])
def test_decode_output_id_no_int32_slot_holds_is_not_named_for_an_unwritten_slot(codec_cls, own):
    """A prefill leg without logprob lists (the slot's logprobs unwritten) and a decode chunk whose
    ``output_ids[0]`` no int32 slot holds: token 0's entry is omitted naming prefill's ``output_ids[0]``
    (the id ``set_buf`` wrote into the slot), as an abort body without decode's own does, not the
    impossible id."""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=False, stale="left_over")
    body = json.loads(dec[0])
    body["output_ids"][0] = own
    out = join(codec_cls(OPTIONS), [dumps(body)], pre)
    first = json.loads(out[0][0])["meta_info"]
    assert first["output_token_logprobs"][0] == [None, OUT[0], None]
    assert first["output_token_logprobs_unavailable_reason"] == "prefill_missing"
