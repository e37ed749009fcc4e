"""Token 0 of a P/D pair: what the join may publish from decode's copy of the metadata slot.

Independent check, bodies written by hand from upstream SGLang (``sglang_0523_pd_legs``, the legs of
``test_sglang_0523_pd_legs_driven_apart``, not the simulator), mutated as a hostile or broken leg would be.
Upstream shapes relied on (sgl-project/sglang, ``python/sglang/srt/``, read 2026-12-07):

- ``disaggregation/utils.py`` ``MetadataBuffers``: ``self.output_ids = torch.zeros((size, 16),
  dtype=torch.int32)``; ``set_buf``: ``self.output_ids[...][0] = req.output_ids[0]`` always, and ``if
  req.return_logprob:`` ``self.output_top_logprobs_val[idx][: len(req.output_top_logprobs_val[0])] = ...``
  (prefill's own ``top_logprobs_num`` wide; the rest of the 128 columns keep what was there).
- ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req``: ``staged_output_id =
  output_id[0].item()`` (a Python int from the int32 slot) and, ``if decode_req.req.return_logprob:``,
  ``top_logprobs_num = decode_req.req.logprob.top_logprobs_num`` then
  ``output_top_logprobs_val[:top_logprobs_num].tolist()``: decode's own width, whatever prefill wrote.
- ``managers/tokenizer_manager.py`` ``_handle_batch_output``, ``BatchStrOutput``: every ``out_dict`` it
  builds, incremental (``"output_ids": output_token_ids``), cumulative or finished
  (``state.output_ids``), carries ``output_ids``, a list of ints (``list(recv_obj.output_ids[i])``).

So no SGLang body has a float or bool token id, a chunk holding output position 0 always names its token
0, and decode's token-0 top row is only prefill's where decode asked no more than prefill.
"""

from __future__ import annotations

import base64
import copy
import json
import struct
from typing import Any

import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_0523_bodies import pd_rows
from sglang_0523_prompt_legs import PREFILL_IDS_ROW, PREFILL_ONLY, PROMPT_LP, PROMPT_TOP, _prompt_legs
from sglang_0523_pd_legs import (CODECS, OPTIONS, OUT, OUTPUT_LP, OUTPUT_TOP, PROMPT, STALE, _flat_output_top,
                                 _leg_that_says_nothing, legs)
from streamproc_sglang import native

from streamproc.wire import Verdict

MARK = "output_token_logprobs_unavailable_reason"
TOP_MARK = "output_top_logprobs_unavailable_reason"
LEGS = ["timeout", "frame", "field", "failed", "disagreeing"]


def _first(out: list) -> dict[str, Any]:
    return json.loads(out[0][0])["meta_info"]


def _exact(a: object, b: object) -> bool:
    """Equal with the same JSON types (``5.0 == 5`` and ``True == 1`` in Python, not on the wire)."""
    return json.dumps(a) == json.dumps(b)


# -------------------------------------------------------------- 1. token 0 is an int32 id, not 201.0 or true


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", LEGS)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_token_0_entry_whose_id_is_no_int_is_not_trusted(codec_cls, leg, kind):
    """Decode's token 0 entry names its token as ``201.0`` (or ``true`` for token 1): equal in Python,
    never written by ``detokenize_logprob_tokens`` from the int32 slot. The entry is not published as
    sent: ``[null, <token 0>, null]``, top row null, ``decode_corrupt``."""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=True, stale="left_over")
    body = json.loads(dec[0])
    meta = body["meta_info"]
    if kind == "float":
        token: int = OUT[0]
        meta["output_token_logprobs"][0][1] = float(token)
    else:
        token = 1
        body["output_ids"][0] = 1
        meta["output_token_logprobs"][0][1] = True
    first = _first(join(codec_cls(OPTIONS), [dumps(body)], _leg_that_says_nothing(leg, pre)))
    assert _exact(first["output_token_logprobs"][0], [None, token, None])
    assert first["output_top_logprobs"][0] is None
    assert first[MARK] == "decode_corrupt"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", LEGS)
@pytest.mark.parametrize("own", [float(OUT[0]), True, "201"], ids=["float", "bool", "str"])
def test_decode_output_id_that_is_no_int_does_not_let_a_left_over_pass(codec_cls, leg, own):
    """Decode's ``output_ids[0]`` is ``201.0`` / ``true`` / ``"201"`` and its token 0 entry is a left-over
    (``[-3.25, 555, null]``): the leg is corrupt, nothing checks the entry, so it is not published."""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=False, stale="left_over")
    body = json.loads(dec[0])
    body["output_ids"][0] = own
    out = join(codec_cls(OPTIONS), [dumps(body)], _leg_that_says_nothing(leg, pre))
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_token_logprobs"][0][0] is None
    assert first["output_top_logprobs"][0] is None
    assert MARK in first


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_prefill_entry_is_not_spliced_on_an_id_that_is_no_int(codec_cls, kind):
    """A decode entry ``[null, 201.0, null]`` (a build that does not copy the slot's logprob) beside an
    honest prefill leg: prefill's entry was put there as if the ids matched. Not confirmed by an int id,
    nothing is spliced; the entry is omitted as ``decode_corrupt``."""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=True, stale="zeros")
    body = json.loads(dec[0])
    token = OUT[0]
    if kind == "bool":
        token = 1
        body["output_ids"][0] = 1
        leg = json.loads(pre[0])
        leg["output_ids"][0] = 1
        leg["meta_info"]["output_token_logprobs"][0][1] = 1
        pre = [dumps(leg)]
    body["meta_info"]["output_token_logprobs"][0] = [None, True if kind == "bool" else float(token), None]
    body["meta_info"]["output_top_logprobs"][0] = None
    first = _first(join(codec_cls(OPTIONS), [dumps(body)], pre))
    assert _exact(first["output_token_logprobs"][0], [None, token, None])
    assert first["output_top_logprobs"][0] is None
    assert first[MARK] == "decode_corrupt"


# ---------------------------------------------- 2. a chunk holding position 0 without output_ids


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", LEGS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_chunk_holding_position_0_without_output_ids_does_not_pass_a_left_over(codec_cls, leg, streamed):
    """``_handle_batch_output`` always sends ``output_ids``; a decode chunk that holds position 0 without
    them (and no chunk before it) names no token 0. Its entry is a left-over (``set_buf`` wrote no
    logprobs): it passed unchecked. Now the entry is judged by prefill's ``output_ids[0]`` (what
    ``set_buf`` wrote into the slot's ids) where the prefill leg has one, and omitted where nothing can
    check it."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale="left_over")
    body = json.loads(dec[0])
    del body["output_ids"]
    out = join(codec_cls(OPTIONS), [dumps(body), *dec[1:]], _leg_that_says_nothing(leg, pre))
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_token_logprobs"][0][0] is None
    assert first["output_top_logprobs"][0] is None
    assert MARK in first
    assert "555" not in json.dumps(first)


# ------------------------------------------------------------------------- the honest pair


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_honest_pair_joins_byte_for_byte_as_the_aggregated_engine(codec_cls, streamed):
    """Both legs asked alike (mini_lb): every joined body is the aggregated engine's bytes."""
    agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="left_over")
    out = join(codec_cls(OPTIONS), dec, pre)
    assert [got for got, _verdict in out] == [dumps(copy.deepcopy(want)) for want in agg]


# ------------------------------------------- 3. token 0 is an id an int32 slot holds: [0, 2^31)


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", [None, *LEGS])
@pytest.mark.parametrize("bad", [-5, 2**31, 10**30], ids=["negative", "past-int32", "huge"])
def test_token_0_named_as_an_id_no_int32_slot_holds_is_corrupt(codec_cls, leg, bad):
    """Decode's ``output_ids[0]`` and its token 0 entry both name ``-5`` (or ``2^31``, ``10^30``): no
    ``output_id[0].item()`` of the int32 slot (``MetadataBuffers.output_ids``) is that, no sampled
    vocabulary index either. Published as sent before (nothing named a token 0 to judge the entry by);
    now ``[null, <prefill's output_ids[0]> or null, null]``, top row null, ``decode_corrupt``."""
    _agg, pre, dec = legs(streamed=False, prefill_logprobs=True, stale="left_over")
    body = json.loads(dec[0])
    body["output_ids"][0] = bad
    body["meta_info"]["output_token_logprobs"][0][1] = bad
    out = join(codec_cls(OPTIONS), [dumps(body)], pre if leg is None else _leg_that_says_nothing(leg, pre))
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_token_logprobs"][0] in ([None, OUT[0], None], [None, None, None])
    assert first["output_top_logprobs"][0] is None
    assert first[MARK] == "decode_corrupt"
    assert str(bad) not in json.dumps(first)


# ------------------------------------ 4. decode's token 0 is prefill's output_ids[0] (staged_output_id)


def _token_0_apart(kind: str, streamed: bool | str) -> tuple[list[bytes], list[bytes], int]:
    """Legs whose token 0 disagree (``set_buf`` writes prefill's ``req.output_ids[0]`` into the slot,
    ``_commit_transfer_to_req`` makes ``output_id[0].item()`` decode's first id: one pair never does).
    ``decode``: decode's id and entry name 8 (decode read another request's slot, the mix-up
    ``_commit_transfer_to_req``'s bootstrap_room check exists for), prefill's say 201. ``prefill``:
    prefill's ``output_ids[0]`` is 8 (another request's leg, or corrupt), decode's entry as written.
    ``splice``: the same, decode's entry ``[null, 201, null]`` without a top row (prefill's put in it
    when the entries' ids match). Returns (prefill leg, decode leg, decode's token 0)."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="left_over")
    body = json.loads(dec[0])
    token = OUT[0]
    if kind == "decode":
        token = 8
        body["output_ids"][0] = 8
        body["meta_info"]["output_token_logprobs"][0] = [-0.125, 8, None]
        body["meta_info"]["output_top_logprobs"][0] = [[-0.125, 8, None], [-2.5, 7, None]]
    else:
        leg = json.loads(pre[0])
        leg["output_ids"][0] = 8
        pre = [dumps(leg)]
        if kind == "splice":
            body["meta_info"]["output_token_logprobs"][0] = [None, OUT[0], None]
            body["meta_info"]["output_top_logprobs"][0] = None
    return pre, [dumps(body), *dec[1:]], token


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("kind", ["decode", "prefill", "splice"])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_legs_whose_token_0_disagree_publish_no_token_0_values(codec_cls, kind, streamed):
    """Decode's first output id is not the prefill leg's ``output_ids[0]``: not one slot's pair. Neither
    leg's token 0 logprob or top row is published (a splice put prefill's on decode's token; decode's own
    entry came from a slot this prefill did not write): ``[null, <decode's token 0>, null]``, top row
    null, ``prefill_corrupt``; the other positions are decode's own."""
    pre, dec, token = _token_0_apart(kind, streamed)
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert _exact(first["output_token_logprobs"][0], [None, token, None])
    assert first["output_top_logprobs"][0] is None
    assert first[MARK] == "prefill_corrupt"
    assert "-0.125" not in json.dumps(first["output_token_logprobs"])


# ------------------------------------------------------------- 5. legs asked different top_logprobs_num


def _widths(k_prefill: int, k_decode: int, *, streamed: bool | str = False, null_first: bool = False,
            prefill_top: bool = True) -> tuple[list[bytes], list[bytes]]:
    """Prefill asked ``top_logprobs_num`` ``k_prefill`` (no top rows at all without ``prefill_top``:
    ``add_logprob_to_meta_info`` writes them only for a positive number), decode ``k_decode``: prefill's
    body and slot hold ``k_prefill`` top entries for token 0, decode copies ``k_decode`` columns of the
    slot (the ones past ``k_prefill`` a left-over), and its own steps' rows are ``k_decode`` wide.
    ``null_first``: decode's token 0 entry ``[null, 201, null]`` without a top row (prefill's is spliced)."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="zeros")
    leg = json.loads(pre[0])
    if prefill_top:
        leg["meta_info"]["output_top_logprobs"] = [OUTPUT_TOP[0][:k_prefill]]
    else:
        del leg["meta_info"]["output_top_logprobs"]
    left_over = STALE["left_over"][1]
    decode = []
    for raw in dec:
        body = json.loads(raw)
        meta = body["meta_info"]
        top = meta["output_top_logprobs"]
        start = meta["output_token_logprobs_length"] - len(meta["output_token_logprobs"])
        for at, row in enumerate(top):
            top[at] = (list(row) + [list(e) for e in left_over][len(row):])[:k_decode]
        if start == 0:
            written = OUTPUT_TOP[0][:k_prefill] if prefill_top else []
            top[0] = (written + left_over[len(written):])[:k_decode]
            if null_first:
                meta["output_token_logprobs"][0] = [None, OUT[0], None]
                top[0] = None
        decode.append(dumps(body))
    return [dumps(leg)], decode


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_decode_asking_more_top_logprobs_than_prefill_gets_no_left_over_columns(codec_cls, streamed):
    """Prefill asked 1, decode 2: decode's token 0 row is prefill's one entry and a slot column prefill
    never wrote (here the last request's ``[-4.5, 556]``). Published as sent before; now the row is
    null, ``output_top_logprobs_unavailable_reason: shape_mismatch``, the entry (prefill's) kept."""
    pre, dec = _widths(1, 2, streamed=streamed)
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_top_logprobs"][0] is None
    assert first["output_top_logprobs"][1:] == OUTPUT_TOP[1:len(first["output_top_logprobs"])]
    assert first[TOP_MARK] == "shape_mismatch"
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]
    assert MARK not in first
    assert "556" not in json.dumps([json.loads(got)["meta_info"] for got, _verdict in out])


@pytest.mark.parametrize("codec_cls", CODECS)
def test_decode_asking_top_logprobs_prefill_was_not_asked_for_gets_no_left_over_row(codec_cls):
    """Prefill asked no top logprobs (its body has no ``output_top_logprobs``), decode 2: every column
    decode copied is a left-over. The row is null, ``prefill_missing``."""
    pre, dec = _widths(0, 2, prefill_top=False)
    first = _first(join(codec_cls(OPTIONS), dec, pre))
    assert first["output_top_logprobs"][0] is None
    assert first[TOP_MARK] == "prefill_missing"
    assert "555" not in json.dumps(first) and "556" not in json.dumps(first)


@pytest.mark.parametrize("codec_cls", CODECS)
def test_decode_top_row_that_is_not_prefills_is_not_published(codec_cls):
    """Decode asked 2 like prefill, yet its token 0 row's second column is not prefill's (``[-4.5, 556]``
    where prefill wrote ``[-2.5, 7]``): not this slot's values. Null, ``prefill_corrupt``."""
    pre, dec = _widths(2, 2)
    body = json.loads(dec[0])
    body["meta_info"]["output_top_logprobs"][0][1] = list(STALE["left_over"][1][1])
    first = _first(join(codec_cls(OPTIONS), [dumps(body)], pre))
    assert first["output_top_logprobs"][0] is None
    assert first[TOP_MARK] == "prefill_corrupt"


@pytest.mark.parametrize("codec_cls", CODECS)
def test_prefill_top_row_of_another_width_is_not_spliced(codec_cls):
    """Decode's token 0 entry with a null logprob and no top row, its other rows 2 wide; prefill's row is
    1 wide (it asked 1): spliced, the client's token 0 row was narrower than the rest. Not spliced now."""
    pre, dec = _widths(1, 2, null_first=True)
    first = _first(join(codec_cls(OPTIONS), dec, pre))
    assert first["output_top_logprobs"][0] is None
    assert first[TOP_MARK] == "shape_mismatch"
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]


@pytest.mark.parametrize("codec_cls", CODECS)
def test_prefill_top_row_spliced_at_decodes_width(codec_cls):
    """The control: prefill asked 2, decode 1; spliced into a null row, prefill's row is cut to decode's
    width (the first of prefill's top entries are decode's top 1)."""
    pre, dec = _widths(2, 1, null_first=True)
    first = _first(join(codec_cls(OPTIONS), dec, pre))
    assert first["output_top_logprobs"][0] == OUTPUT_TOP[0][:1]
    assert TOP_MARK not in first and MARK not in first


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize(("k_prefill", "k_decode"), [(2, 2), (2, 1)])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_decode_asking_no_more_top_logprobs_than_prefill_keeps_its_row(codec_cls, k_prefill, k_decode,
                                                                      streamed):
    """The control: decode's columns are all ones prefill wrote; every body passes as sent."""
    pre, dec = _widths(k_prefill, k_decode, streamed=streamed)
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert first["output_top_logprobs"][0] == OUTPUT_TOP[0][:k_decode]
    assert TOP_MARK not in first and MARK not in first
    assert [got for got, _verdict in out] == dec


def _flat_widths(k_prefill: int, k_decode: int, *, b64: bool,
                 prefill_flat: bool) -> tuple[list[bytes], list[bytes]]:
    """:func:`_widths` (unary) as ``return_flat_raw_output_top_logprobs`` answers it (``_flat_output_top``:
    the nested rows replaced by ``[rows, k]`` arrays): decode's always, prefill's where ``prefill_flat``
    (else its nested row, as a leg asked without the flag answers)."""
    pre, dec = _widths(k_prefill, k_decode)
    body = json.loads(dec[0])
    body["meta_info"] = _flat_output_top(body["meta_info"], b64=b64)
    if prefill_flat:
        leg = json.loads(pre[0])
        leg["meta_info"] = _flat_output_top(leg["meta_info"], b64=b64)
        pre = [dumps(leg)]
    return pre, [dumps(body)]


def _flat_row_0(meta: dict[str, Any]) -> list[list[Any]]:
    """Row 0 of a flat top logprobs layout as ``[logprob, id]`` pairs (float32/int32 for Base64)."""
    k = meta["output_top_logprobs_shape"][1]
    if "output_top_logprobs_val_flat" in meta:
        vals, idxs = meta["output_top_logprobs_val_flat"], meta["output_top_logprobs_idx_flat"]
    else:
        raw_v = base64.b64decode(meta["output_top_logprobs_val_flat_b64"])
        raw_i = base64.b64decode(meta["output_top_logprobs_idx_flat_b64"])
        vals = list(struct.unpack(f"<{len(raw_v) // 4}f", raw_v))
        idxs = list(struct.unpack(f"<{len(raw_i) // 4}i", raw_i))
    return [[v, i] for v, i in zip(vals[:k], idxs[:k])]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
@pytest.mark.parametrize("prefill_flat", [True, False], ids=["prefill_flat", "prefill_nested"])
@pytest.mark.parametrize(("k_prefill", "k_decode", "reason"), [(1, 2, "shape_mismatch"),
                                                             (2, 2, "prefill_corrupt")])
def test_flat_top_row_0_is_published_only_as_a_prefix_of_prefills(codec_cls, b64, prefill_flat, k_prefill,
                                                                  k_decode, reason):
    """``return_flat_raw_output_top_logprobs`` (unary): decode's flat arrays start with the slot's token 0
    row, ``k_decode`` wide whatever prefill wrote (``_commit_transfer_to_req``:
    ``output_top_logprobs_val[:top_logprobs_num].tolist()``). Asking more than prefill, its second column
    is the last request's ``[-4.5, 556]``; asking as many, a row whose column is not prefill's (the same
    left-over put there) is not this slot's either. Both were published as sent; now row 0 leaves the
    arrays as ``_null_first_flat_row`` writes a null row (``output_top_logprobs_null_prefix`` 1, shape
    ``[2, k]``), ``output_top_logprobs_unavailable_reason`` after the flat fields, the entry kept."""
    pre, dec = _flat_widths(k_prefill, k_decode, b64=b64, prefill_flat=prefill_flat)
    if reason == "prefill_corrupt":
        body = json.loads(dec[0])
        meta = body["meta_info"]
        if b64:
            raw = bytearray(base64.b64decode(meta["output_top_logprobs_val_flat_b64"]))
            raw[4:8] = struct.pack("<f", -4.5)
            meta["output_top_logprobs_val_flat_b64"] = base64.b64encode(bytes(raw)).decode()
            raw = bytearray(base64.b64decode(meta["output_top_logprobs_idx_flat_b64"]))
            raw[4:8] = struct.pack("<i", 556)
            meta["output_top_logprobs_idx_flat_b64"] = base64.b64encode(bytes(raw)).decode()
        else:
            meta["output_top_logprobs_val_flat"][1] = -4.5
            meta["output_top_logprobs_idx_flat"][1] = 556
        dec = [dumps(body)]
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_top_logprobs_null_prefix"] == 1
    assert first["output_top_logprobs_shape"] == [2, k_decode]
    assert _flat_row_0(first) == [[e[0], e[1]] for e in OUTPUT_TOP[1][:k_decode]]
    assert first[TOP_MARK] == reason
    keys = list(first)
    assert keys.index(TOP_MARK) == keys.index("output_top_logprobs_null_prefix") + 1
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]
    assert MARK not in first


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
def test_nested_top_row_0_beside_a_flat_prefill_row_is_compared(codec_cls, b64):
    """Decode's nested row 0 (asked 2) beside a prefill leg whose row 0 is flat (asked 1): the slot's
    second column is a left-over whatever form prefill answered in. Passed unchecked before."""
    pre, dec = _widths(1, 2)
    leg = json.loads(pre[0])
    leg["meta_info"] = _flat_output_top(leg["meta_info"], b64=b64)
    out = join(codec_cls(OPTIONS), dec, [dumps(leg)])
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_top_logprobs"][0] is None
    assert first[TOP_MARK] == "shape_mismatch"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
def test_flat_top_row_0_beside_a_prefill_leg_without_top_rows_is_not_published(codec_cls, b64):
    """Prefill asked no top logprobs (no rows in either form): decode's flat row 0 is all left-over
    columns. It leaves the arrays, ``prefill_missing``; the other rows are decode's own."""
    pre, dec = _widths(0, 2, prefill_top=False)
    body = json.loads(dec[0])
    body["meta_info"] = _flat_output_top(body["meta_info"], b64=b64)
    first = _first(join(codec_cls(OPTIONS), [dumps(body)], pre))
    assert first["output_top_logprobs_null_prefix"] == 1
    assert _flat_row_0(first) == [[e[0], e[1]] for e in OUTPUT_TOP[1]]
    assert first[TOP_MARK] == "prefill_missing"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("b64", [False, True], ids=["list", "b64"])
@pytest.mark.parametrize("prefill_flat", [True, False], ids=["prefill_flat", "prefill_nested"])
@pytest.mark.parametrize(("k_prefill", "k_decode"), [(2, 2), (2, 1)])
def test_flat_top_row_0_within_prefills_width_passes_as_sent(codec_cls, b64, prefill_flat, k_prefill,
                                                             k_decode):
    """The control: decode's flat row 0 is prefill's row or its prefix (the aggregated top-k): as sent."""
    pre, dec = _flat_widths(k_prefill, k_decode, b64=b64, prefill_flat=prefill_flat)
    out = join(codec_cls(OPTIONS), dec, pre)
    assert [got for got, _verdict in out] == dec
    assert TOP_MARK not in _first(out)


# ------------------------------------------------------------------------- hostile variants (hypothesis)

# None drawn half the time: a single mutant in an otherwise honest pair is the case most worth hitting.
ID_MUTANTS = st.sampled_from([None] * 5 + ["float", "bool", "str", "other", "negative"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streamed=st.sampled_from([False, True, "coalesced"]), prefill_logprobs=st.booleans(),
       stale=st.sampled_from(sorted(STALE)), leg=st.sampled_from([None] * 5 + LEGS), entry_id=ID_MUTANTS,
       own_id=ID_MUTANTS, drop_ids=st.booleans(), k=st.sampled_from([(2, 2), (1, 2), (2, 1)]),
       sglang=st.booleans())
def test_no_unconfirmed_token_0_value_is_published(streamed, prefill_logprobs, stale, leg, entry_id, own_id,
                                                   drop_ids, k, sglang):
    """Whatever the legs: the published token 0 entry is the sampled token's own ``[logprob, 201, null]``
    (exact JSON types) or omitted (``[null, id, null]`` with a marker); the top row is the true one (as
    wide as decode asked) or null; a slot left-over's values (555/556, -3.25/-4.5) are never published.
    A prefill leg that says nothing about the slot is drawn with both legs asking 2 top logprobs: a
    left-over column past prefill's width cannot be told from a written one without prefill's row."""
    codec_cls = CODECS[0].values[0] if sglang else CODECS[1].values[0]
    if leg is not None:
        k = (2, 2)
    pre, dec = _widths(*k, streamed=streamed)
    if not prefill_logprobs:
        _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=False, stale=stale)
    body = json.loads(dec[0])
    meta = body["meta_info"]
    mutants: dict[str, Any] = {"float": float(OUT[0]), "bool": True, "str": str(OUT[0]), "negative": -201}
    if entry_id is not None:  # "other": a token no leg sampled
        meta["output_token_logprobs"][0][1] = mutants.get(entry_id, 7)
    if own_id is not None:  # "other": decode says it sampled another token than the slot's (prefill's)
        body["output_ids"][0] = mutants.get(own_id, 8)
    if drop_ids:
        del body["output_ids"]
    honest = leg is None and entry_id is None and own_id is None and not drop_ids
    prefill = pre if leg is None else _leg_that_says_nothing(leg, pre)
    out = join(codec_cls(OPTIONS), [dumps(body), *dec[1:]], prefill)
    first = _first(out)
    entry, top = first["output_token_logprobs"][0], first["output_top_logprobs"][0]
    if entry[0] is not None:
        assert _exact(entry, OUTPUT_LP[0]), entry
    else:
        assert MARK in first
        assert entry[1] is None or _exact(entry[1], OUT[0]) or _exact(entry[1], 8), entry
    if top is not None:
        assert _exact(top, OUTPUT_TOP[0][:k[1]]), top
    text = json.dumps([json.loads(got)["meta_info"] for got, _verdict in out])
    for value in ("555", "556", "-3.25", "-4.5", "-201"):
        assert value not in text
    if honest and prefill_logprobs and k[0] >= k[1]:
        assert [got for got, _verdict in out] == [dumps(body), *dec[1:]]  # nothing to join: as sent


# --------------------------- 6. nothing is taken from a prefill leg whose token 0 is not decode's token 0
#
# ``MetadataBuffers.set_buf`` writes ``self.output_ids[req.metadata_buffer_index][0] = req.output_ids[0]`` and
# ``_commit_transfer_to_req`` makes ``staged_output_id = output_id[0].item()`` decode's first id: a leg naming
# another token did not feed this decode, so its prompt side is another request's (or stale) too.
@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("top", ["nested", "list", "b64"])
@pytest.mark.parametrize("apart", ["decode", "prefill"])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_prompt_side_of_a_leg_whose_token_0_disagrees_is_not_spliced(codec_cls, streamed, apart, top):
    """Legs whose token 0 disagree are not one slot's pair (784ba25 stopped splicing their token 0), yet the
    prefill leg's prompt logprobs, prompt top rows (nested or flat), ``token_ids_logprob`` row 0, token 0's
    weight version and prompt expert rows were still put in the answer. Now none is: every field taken from
    that leg is omitted with its marker, ``prefill_corrupt``; decode's own positions stay."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=apart, top=top)
    out = join(codec_cls(OPTIONS), dec, pre)
    metas = [json.loads(got)["meta_info"] for got, _verdict in out]
    text = json.dumps(metas)
    for value in PREFILL_ONLY:
        assert value not in text
    if top == "b64":  # the flat Base64 arrays hold prefill's float32 values as bytes
        assert json.loads(pre[0])["meta_info"]["input_top_logprobs_val_flat_b64"] not in text
    for meta, (_got, verdict) in zip(metas, out):
        assert verdict is Verdict.OMITTED
        assert meta["input_logprobs_unavailable_reason"] == "prefill_corrupt"
        for key in ("input_token_logprobs", "input_top_logprobs", *native.INPUT_TOP_FLAT_FIELDS):
            assert key not in meta
        entries = meta["output_token_logprobs"]
        lo = meta["output_token_logprobs_length"] - len(entries)
        assert [e for p, e in enumerate(entries, lo) if p > 0] == OUTPUT_LP[max(lo, 1):lo + len(entries)]
    first, last = metas[0], metas[-1]
    assert first[MARK] == "prefill_corrupt"
    assert first["output_token_ids_logprobs"][0] is None
    assert first["output_token_ids_logprobs_unavailable_reason"] == "prefill_corrupt"
    assert "routed_experts" not in last and last["routed_experts_unavailable_reason"] == "prefill_corrupt"
    assert "weight_versions" not in last and last["weight_versions_unavailable_reason"] == "prefill_corrupt"


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("top", ["nested", "list", "b64"])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_prompt_side_of_the_pairs_own_leg_is_spliced(codec_cls, streamed, top):
    """The control: the honest pair (token 0 one id on both legs) gets prefill's prompt side, token 0's
    ``token_ids_logprob`` row and the prompt's expert rows, as the aggregated engine answers."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=None, top=top)
    codec = codec_cls(OPTIONS)
    out = join(codec, dec, pre)
    metas = [json.loads(got)["meta_info"] for got, _verdict in out]
    prefill_meta = json.loads(pre[0])["meta_info"]
    for meta in metas:
        assert meta["input_token_logprobs"] == PROMPT_LP
        if top == "nested":
            assert meta["input_top_logprobs"] == PROMPT_TOP
        else:
            for key in native.INPUT_TOP_FLAT_FIELDS:
                assert meta.get(key) == prefill_meta.get(key)
        assert not any(key.endswith("_unavailable_reason") for key in meta)
    assert metas[0]["output_token_ids_logprobs"][0] == PREFILL_IDS_ROW
    rows = codec.sequences["routed_experts"].decode_within(metas[-1]["routed_experts"], 1 << 20)
    assert bytes(rows) == pd_rows(len(PROMPT), len(OUT)).tobytes()
    assert metas[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": len(OUT)}]


# A prefill leg naming decode's token 0 or one drawn apart from it, by either leg, in either form; the token
# ids drawn in range (an id no int32 slot holds names no token 0: sections 1 and 3).
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streamed=st.sampled_from([False, True, "coalesced"]),
       apart=st.sampled_from([None, "decode", "prefill"]), top=st.sampled_from(["nested", "list", "b64"]),
       experts=st.booleans(), other=st.integers(0, 2**31 - 1), sglang=st.booleans())
def test_no_prompt_value_of_another_slots_leg_is_published(streamed, apart, top, experts, other, sglang):
    """Whatever token the legs disagree on: where decode's token 0 is not prefill's ``output_ids[0]`` no
    value only prefill has reaches any chunk, and each field it would give is marked ``prefill_corrupt``;
    where they agree, prefill's prompt logprobs are the answer."""
    codec_cls = CODECS[0].values[0] if sglang else CODECS[1].values[0]
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=None, top=top, experts=experts)
    if apart == "prefill":
        leg = json.loads(pre[0])
        leg["output_ids"][0] = other
        pre = [dumps(leg)]
    elif apart == "decode":
        body = json.loads(dec[0])
        body["output_ids"][0] = other
        dec = [dumps(body), *dec[1:]]
    out = join(codec_cls(OPTIONS), dec, pre)
    metas = [json.loads(got)["meta_info"] for got, _verdict in out]
    if apart is None or other == OUT[0]:
        assert all(meta["input_token_logprobs"] == PROMPT_LP for meta in metas)
        return
    text = json.dumps(metas)
    for value in PREFILL_ONLY:
        assert value not in text
    assert all(meta["input_logprobs_unavailable_reason"] == "prefill_corrupt" for meta in metas)
    assert metas[-1]["weight_versions_unavailable_reason"] == "prefill_corrupt"
    assert metas[-1]["routed_experts_unavailable_reason"] == "prefill_corrupt"



@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("apart", ["decode", "prefill", None])
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_expert_rows_of_a_leg_whose_token_0_disagrees_without_logprobs(codec_cls, streamed, apart):
    """Routed experts asked without logprobs: decode's token 0 is its ``output_ids[0]`` on the chunk whose ids
    hold every token so far (``completion_tokens == len(output_ids)``; an incremental stream's first chunk,
    which the join never sees, told at ``needs_prefill``). A leg naming another token gave its prompt rows and
    token 0's version before; now both are ``prefill_corrupt``. The honest pair's rows are joined."""
    pre, dec = _prompt_legs(codec_cls, streamed=streamed, apart=apart)
    lists = ("input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
             "input_top_logprobs", "output_top_logprobs", "output_token_ids_logprobs")

    def strip(raw: bytes) -> bytes:
        body = json.loads(raw)
        body["meta_info"] = {k: v for k, v in body["meta_info"].items() if k not in lists}
        return dumps(body)

    codec = codec_cls(OPTIONS)
    out = join(codec, [strip(raw) for raw in dec], [strip(pre[0])])
    last = json.loads(out[-1][0])["meta_info"]
    if apart is None:
        rows = codec.sequences["routed_experts"].decode_within(last["routed_experts"], 1 << 20)
        assert bytes(rows) == pd_rows(len(PROMPT), len(OUT)).tobytes()
        return
    assert out[-1][1] is Verdict.OMITTED
    assert "routed_experts" not in last and last["routed_experts_unavailable_reason"] == "prefill_corrupt"
    assert "weight_versions" not in last and last["weight_versions_unavailable_reason"] == "prefill_corrupt"

# ------------------------- 7. decode's token 0 top row is as wide as its own others (top_logprobs_num)


def _wide_row_0(k_prefill: int, *, streamed: bool | str) -> tuple[list[bytes], list[bytes]]:
    """Decode asked 2 (its later rows 2 wide) and its token 0 row holds 3 entries: prefill's two and the
    slot's third column (``[-4.5, 556]``, the last request's). ``_commit_transfer_to_req`` copies
    ``output_top_logprobs_val[:top_logprobs_num]``, decode's own number, so no decode sends it."""
    pre, dec = _widths(k_prefill, 2, streamed=streamed)
    body = json.loads(dec[0])
    body["meta_info"]["output_top_logprobs"][0] = [*OUTPUT_TOP[0], list(STALE["left_over"][1][1])]
    return pre, [dumps(body), *dec[1:]]


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", ["timeout", "frame", "field", "failed", "honest"])
@pytest.mark.parametrize("streamed", [False, "coalesced"], ids=["unary", "coalesced"])
def test_decode_top_row_0_wider_than_its_other_rows_is_corrupt(codec_cls, leg, streamed):
    """Beside a prefill leg that says nothing about token 0 (no top row to compare with) such a row passed
    as sent, another request's column with it. Now null, ``output_top_logprobs_unavailable_reason:
    decode_corrupt``; the entry and the other rows are kept. With an honest leg (prefill asked 2) the row
    is not prefill's prefix either: already null (``shape_mismatch``), the reason that came first kept."""
    pre, dec = _wide_row_0(2, streamed=streamed)
    out = join(codec_cls(OPTIONS), dec, pre if leg == "honest" else _leg_that_says_nothing(leg, pre))
    first = _first(out)
    assert out[0][1] is Verdict.OMITTED
    assert first["output_top_logprobs"][0] is None
    assert first["output_top_logprobs"][1] == OUTPUT_TOP[1]
    assert first[TOP_MARK] == ("shape_mismatch" if leg == "honest" else "decode_corrupt")
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]
    assert "556" not in json.dumps(first)


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("leg", ["timeout", "frame", "field", "failed"])
@pytest.mark.parametrize("streamed", [False, "coalesced"], ids=["unary", "coalesced"])
def test_decode_top_row_0_as_wide_as_its_other_rows_passes(codec_cls, leg, streamed):
    """The control: row 0 as wide as decode's others beside a leg that says nothing: as sent."""
    pre, dec = _widths(2, 2, streamed=streamed)
    first = _first(join(codec_cls(OPTIONS), dec, _leg_that_says_nothing(leg, pre)))
    assert first["output_top_logprobs"][0] == OUTPUT_TOP[0]
    assert TOP_MARK not in first


# --------------------- 8. a row spliced from prefill takes decode's width where the chunk shows it


@pytest.mark.parametrize("codec_cls", CODECS)
@pytest.mark.parametrize("streamed", [False, True, "coalesced"], ids=["unary", "stream", "coalesced"])
def test_spliced_top_row_0_is_cut_to_decodes_width_where_the_chunk_shows_it(codec_cls, streamed):
    """Pins the behaviour (no fix needed): decode's token 0 entry ``[null, 201, null]`` without a top row
    (a build that does not copy the slot's logprob: 0.5.23 ``_commit_transfer_to_req`` always stages
    ``output_token_logprobs_val[0].item()``, a float) takes prefill's row (prefill asked 2), cut to the
    width of decode's other rows in the chunk (1). A stream's first chunk holds row 0 alone: no width of
    decode's is in it, and prefill's whole row is published (docs/codecs.md, known limit)."""
    pre, dec = _widths(2, 1, streamed=streamed, null_first=True)
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert first["output_token_logprobs"][0] == OUTPUT_LP[0]
    assert first["output_top_logprobs"][0] == OUTPUT_TOP[0][:2 if streamed is True else 1]
    assert TOP_MARK not in first and MARK not in first


# ------------------- 9. a stream's first chunk (row 0 alone) is judged by prefill's row, not by a width


@pytest.mark.parametrize("codec_cls", CODECS)
def test_stream_first_chunk_row_0_wider_than_prefills_is_nulled(codec_cls):
    """A stream's first chunk holds row 0 alone, so ``_check_first_top_width`` has no other row to read
    decode's ``top_logprobs_num`` from, and no body states it (``TokenizerManager.add_logprob_to_meta_info``
    writes the lists only; the request's number stays in ``state.obj``). Where the prefill leg has its row 0
    (the legs asked alike), the prefix rule (``_check_first_top``) still judges that chunk: a third column
    past prefill's two is not this slot's, ``shape_mismatch``, before any later chunk shows the width."""
    pre, dec = _wide_row_0(2, streamed=True)
    out = join(codec_cls(OPTIONS), dec, pre)
    first = _first(out)
    assert len(first["output_top_logprobs"]) == 1
    assert out[0][1] is Verdict.OMITTED
    assert first["output_top_logprobs"][0] is None
    assert first[TOP_MARK] == "shape_mismatch"
    assert "556" not in json.dumps(first)
