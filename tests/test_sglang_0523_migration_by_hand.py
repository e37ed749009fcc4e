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
