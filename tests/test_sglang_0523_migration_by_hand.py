"""SGLang 0.5.23 migration against the uninterrupted engine, bodies and requests written by hand.

Nothing here uses the simulator or ``streamproc_sglang.upstream``: every body is spelled out from the
SGLang 0.5.23 wheel (``pip download --no-deps sglang==0.5.23``), ``srt/managers/tokenizer_manager.py``
``TokenizerManager._handle_batch_output`` with ``--incremental-streaming-output`` (text and
``output_ids`` are deltas; ``meta_info`` in its key order: ``id``, ``finish_reason``,
``prompt_tokens``, ``weight_version``, ``num_retractions``, ``reasoning_tokens``,
``completion_tokens``, ``cached_tokens``, ``cached_tokens_details``).
"""

from __future__ import annotations

import json

import pytest
from helpers import upstream_json as dumps

from streamproc.catalog import Catalog
from streamproc.codec import Emitted
from streamproc.wire import Verdict

RID = "m1"
PROMPT = [300, 301, 302, 303]


def body(text: str, ids: list[int], *, done: int, prompt: int = len(PROMPT), retractions: int = 0,
         finish: object = None, key: str = "num_retractions") -> bytes:
    """One ``_handle_batch_output`` body: ``"num_retractions": recv_obj.retraction_counts[i]`` (the
    ``Req.retraction_count`` that ``reset_for_retract`` adds to; ``total_retractions`` before 0.5.23),
    ``completion_tokens`` the attempt's own count so far (``len(output_ids_)``)."""
    return dumps({"text": text, "output_ids": ids, "meta_info": {
        "id": RID, "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
        key: retractions, "reasoning_tokens": 0, "completion_tokens": done, "cached_tokens": 0,
        "cached_tokens_details": None}})


def sealed(bodies: list[bytes]):
    session = Catalog()("sglang").open_migration()
    session.absorb(bodies)
    return session, session.seal()


# ------------------------------------------------------------------------------ num_retractions

@pytest.mark.parametrize("key", ["num_retractions", "total_retractions"])
def test_a_resumed_attempts_retraction_count_is_omitted_not_restarted_from_zero(key):
    """``Req.retraction_count`` counts the retractions of one ``Req`` on one worker
    (``reset_for_retract``: ``self.retraction_count += 1``); the resumed attempt is a new ``Req`` on
    another worker and starts at 0. The client had read 1 (the lost worker retracted the request
    once); passed on, the stitched stream read 0 after it. No whole-request count exists: the lost
    worker's retractions after its last body were never published, and the resumed worker schedules
    another run. So it is omitted (``stitch_incomplete``), like the other attempt-scoped values."""
    session, emitted = sealed([body("Hi", [11], done=1, key=key), body(" there", [12], done=2, retractions=1, key=key)])
    assert emitted.token_ids == [11, 12]
    resumed = body(",", [13], done=1, prompt=len(PROMPT) + 2, key=key)  # a fresh Req: count 0
    out, verdict = session.stitch(resumed, False)
    meta = json.loads(out)["meta_info"]
    assert key not in meta and meta[key + "_unavailable_reason"] == "stitch_incomplete"
    assert list(meta).index(key + "_unavailable_reason") == 4  # where the count stood
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 3)
    assert verdict is Verdict.OMITTED


def test_a_retraction_count_passes_unchanged_when_nothing_was_emitted_before_the_seal():
    """Sealed before any body: the client never read a count, and the resumed attempt's is the only
    one published (as ``weight_versions`` and the ``spec_*`` counters are kept then)."""
    session, emitted = sealed([])
    assert emitted.token_ids == []
    first = body("Hi", [11], done=1, retractions=2)
    out = session.stitch(first, False)
    assert out is None or json.loads(out[0])["meta_info"]["num_retractions"] == 2


# ------------------------------------------------- text the lost worker's detokenizer held back

# A byte-level vocabulary: "中" (E4 B8 AD) is split over two tokens, as byte-level BPE splits a rare
# character (``decode`` replaces an incomplete UTF-8 sequence with one U+FFFD, as the tokenizer does).
VOCAB = {300: b"Say", 301: b" it", 302: b" in", 303: b" full", 11: b"Hi", 12: b" wor", 13: b"\xe4\xb8",
         14: b"\xad", 15: b"ld", 16: b"!"}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def find_printable_text(text: str) -> str:
    """``sglang/utils.py`` ``find_printable_text`` (the CJK test ``_is_chinese_char`` cut to its main block)."""
    if text.endswith("\n"):
        return text
    if text and 0x4E00 <= ord(text[-1]) <= 0x9FFF:
        return text
    if len(text) > 1 and 0x4E00 <= ord(text[-2]) <= 0x9FFF:
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def detokenized(prompt: list[int], bodies: list[list[int]]) -> list[str]:
    """The text of each body of one worker's stream: ``Req.init_incremental_detokenize`` (first
    iteration: ``read_offset = len(origin_input_ids)``, ``surr_offset = read_offset -
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET`` (5)), then ``DetokenizerManager._decode_batch_token_id_output``:
    ``new_text = read_texts[i][len(surr_texts[i]):]``; unfinished, a clean ``new_text`` is committed and
    sent, one ending in U+FFFD ("Incomplete UTF-8") sends only ``find_printable_text(new_text)`` and
    commits nothing; finished (the last body, no matched stop), ``(decoded_text + new_text)[sent_offset:]``."""
    start = max(len(prompt) - 5, 0)
    ids, surr, read = prompt[start:], 0, len(prompt) - start  # offsets into ``ids`` (decode_ids)
    decoded, sent, out = "", 0, []
    for n, new in enumerate(bodies):
        ids = ids + new
        new_text = decode(ids[surr:])[len(decode(ids[surr:read])):]
        if n == len(bodies) - 1:
            out.append((decoded + new_text)[sent:])
            break
        pending = sent - len(decoded)
        if new_text and not new_text.endswith("\ufffd"):
            decoded += new_text
            surr, read, sent = read, len(ids), len(decoded)
            out.append(new_text[pending:])
        else:
            printable = find_printable_text(new_text)
            sent = len(decoded) + len(printable)
            out.append(printable[pending:])
    return out


def stitched_text(bodies: list[list[int]], before: int) -> tuple[str, str]:
    """(the uninterrupted engine's text, the text the client reads when the worker is lost after
    ``before`` bodies and another serves prompt + emitted): every body through the codec."""
    whole = detokenized(PROMPT, bodies)
    session, emitted = sealed([body(t, ids, done=0) for t, ids in zip(whole[:before], bodies[:before])])
    resumed = detokenized(PROMPT + emitted.token_ids, bodies[before:])
    client = whole[:before]
    for n, (text, ids) in enumerate(zip(resumed, bodies[before:])):
        out = session.stitch(body(text, ids, done=0, prompt=len(PROMPT) + len(emitted.token_ids)), False)
        client.append(json.loads(out[0])["text"] if out else text)
    return "".join(whole), "".join(client)


@pytest.mark.parametrize("before", [1, 2, 4, 5])
def test_a_seal_between_whole_characters_stitches_the_engines_text(before):
    """The resumed worker decodes from the emitted tokens on (its prompt's last 5 tokens as context):
    with nothing held at the seal, the client's text is the uninterrupted engine's."""
    assert stitched_text([[11], [12], [13], [14], [15], [16]], before) == ("Hi wor中ld!",) * 2


def test_a_seal_inside_a_split_character_loses_the_text_the_detokenizer_held_back():
    """A documented limit (docs/protocol.md "Cost and limits"): sealed after the first byte-token of
    "中", the lost worker had sent "" for it (``new_text`` "\\ufffd" is incomplete UTF-8) and the
    resumed worker's context ends in that U+FFFD, which "中" replaces one for one, so neither sends
    "中". With two tokens a body (``stream_interval`` 2) the printable prefix ends at the last space,
    so " wor" is held too. The processor has token ids and no tokenizer: the text passes as the
    resumed worker wrote it (the ids are exact)."""
    assert stitched_text([[11], [12], [13], [14], [15], [16]], 3) == ("Hi wor中ld!", "Hi world!")
    assert stitched_text([[11, 12], [13], [14, 15], [16]], 2) == ("Hi wor中ld!", "Hi world!")
    assert stitched_text([[11], [12, 13], [14, 15], [16]], 2) == ("Hi wor中ld!", "Hi ld!")


# ---------------------------------------------------------- output-side rules and min_new_tokens

def test_output_side_stop_rules_are_sent_unchanged_and_min_new_tokens_keeps_their_positions():
    """SGLang 0.5.23 ``Req.update_finish_state`` checks stop strings and ``stop_regex`` on
    ``tail_str`` (``tokenizer.decode(self.output_ids[-tail_len:])``: the request's own output only).
    Stop strings cannot span the seal: ``OutputStreamer.accept`` sends no body while the tail ends
    with a stop string's prefix (``should_output &= not req.check_match_stop_str_prefix()``), so a
    published body never ends inside one. A ``stop_regex`` has no such hold: a match begun before the
    seal is invisible to the resumed worker (a documented limit). ``stop_token_ids`` and EOS are
    single tokens. ``min_new_tokens`` only masks stop tokens while the request's own output is shorter
    (``BatchedMinNewTokensPenalizer``: ``len_output_tokens < min_new_tokens``, counted from 0 per
    ``Req``), so minus k keeps the mask to the same absolute positions; everything else goes on unchanged."""
    rules = {"stop": ["xyz"], "stop_regex": ["a+b"], "stop_token_ids": [2], "no_stop_trim": True,
             "skip_special_tokens": False, "spaces_between_special_tokens": False, "stream_interval": 4,
             "ignore_eos": False}
    request = dumps({"rid": RID, "input_ids": PROMPT, "stream": True,
                     "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 5, **rules}})
    Catalog()("sglang").check_migratable(request)
    doc = json.loads(Catalog()("sglang").resume_request(request, Emitted([11, 12, 13])))
    assert doc["sampling_params"] == {"max_new_tokens": 7, "min_new_tokens": 2, **rules}
    assert doc["input_ids"] == PROMPT + [11, 12, 13]
    doc = json.loads(Catalog()("sglang").resume_request(request, Emitted([11] * 7)))
    assert doc["sampling_params"]["min_new_tokens"] == 0  # past the minimum: stop tokens allowed at once
