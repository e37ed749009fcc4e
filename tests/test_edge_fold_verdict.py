"""The ``Streamproc-Join`` header of a unary answer the edge folded (docs/protocol.md: ``passthrough`` is "the
body is the input chunk's bytes, untouched", ``omitted`` "a field was unavailable ... left ``null`` ... and a
``<field>_unavailable_reason`` marker explains why").

An aggregated stream's results are each ``passthrough``; the edge took the strongest of them for the answer's
header, also when the codec's fold had added ``not_streamed`` markers (vLLM 0.34.0: ``model``, ``created``,
``prompt_logprobs``...; the older ``serve/disagg`` format: ``model``): a body with omission markers was said to
be the worker's bytes untouched. The header is now ``omitted`` when the fold added a marker that no result
carried. Bodies from upstream shapes (vLLM 0.34.0 ``serve_tokens_stream_generator``; furionw/vllm @ 9cdf7782
``serve/disagg/serving.py``), against a real nats-server and edge.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from edge_harness import publish_results, running_edge
from helpers import rid, upstream_json

from streamproc.codec import fold_added_markers, marker_names
from streamproc.wire import Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

DURABLE = Subjects("streamproc")


def chunk_034(request_id: str, token: int, finish: str | None) -> bytes:
    """vLLM 0.34.0 ``GenerateTokensStreamResponse``: ``request_id, usage, output_mode, choices``."""
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [token], "routed_experts": None,
              "sampling_mask": None, "weight_versions": None, "logprobs": None}
    return upstream_json({"request_id": request_id, "usage": None, "output_mode": "tokens", "choices": [choice]})


def chunk_older(request_id: str, token: int, finish: str | None) -> bytes:
    """``GenerateStreamResponse(request_id, choices=[GenerateResponseStreamChoice(...)])``, ``usage`` dumped."""
    return json.dumps({"request_id": request_id, "choices": [{"index": 0, "logprobs": None, "finish_reason": finish,
                                                              "token_ids": [token]}], "usage": None},
                      separators=(",", ":")).encode()


def chunk_with_every_key(request_id: str, token: int, finish: str | None) -> bytes:
    """An older-format body that carries every key the fold writes (nothing for it to omit). No upstream
    stream chunk has ``model``, ``prompt_logprobs`` or ``kv_transfer_params``: the fold takes such bodies as
    unary (``is_unary``) and keeps what they say. Until 2026-12-07 chunks with ``model`` alone were the fold's
    special case (the simulator's streams), which no longer exists."""
    usage = {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1} if finish else None
    return json.dumps({"request_id": request_id, "model": "m", "choices": [
        {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": [token]}], "usage": usage,
        "prompt_logprobs": None, "kv_transfer_params": None}, separators=(",", ":")).encode()


async def test_a_folded_answer_with_markers_the_fold_added_says_omitted(server, nc):
    cases = {rid("v034"): (chunk_034, Verdict.PASSTHROUGH, "omitted"),
             rid("older"): (chunk_older, Verdict.PASSTHROUGH, "omitted"),
             rid("older-joined"): (chunk_older, Verdict.JOINED, "omitted"),
             rid("nothing-added"): (chunk_with_every_key, Verdict.PASSTHROUGH, "passthrough"),
             rid("nothing-added-joined"): (chunk_with_every_key, Verdict.JOINED, "joined")}
    with running_edge(server.url, "--format", "vllm", "--ensure-results-stream") as edge:
        for request_id, (chunk, verdict, _) in cases.items():
            bodies = [chunk(request_id, 9905, None), chunk(request_id, 9906, "length")]
            await publish_results(nc, DURABLE, request_id, bodies, verdict=verdict)
        async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
            answers = {request_id: await client.get(f"/v1/results/{request_id}?stream=false")
                       for request_id in cases}
    seen = {}
    for request_id, answer in answers.items():
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == [9905, 9906]
        seen[request_id] = (answer.headers["Streamproc-Join"],
                            sorted(k for k in answer.json() if k.endswith("_unavailable_reason")))
    assert {request_id: header for request_id, (header, _) in seen.items()} == {
        request_id: want for request_id, (_, _, want) in cases.items()}, seen


def test_only_marker_keys_count_not_values_that_read_like_one():
    """``marker_names`` is a byte search: a string value ending in the suffix (its closing quote is followed by
    no colon) or holding ``_unavailable_reason":`` (the quote escaped) is no marker; a key is, at any depth."""
    values = json.dumps({"text": 'x_unavailable_reason": 1', "y": "z_unavailable_reason"}).encode()
    assert marker_names(values) == set()
    assert marker_names(b'{"a":[{"model_unavailable_reason" : "not_streamed"}]}') == {b"model"}
    assert fold_added_markers([b'{"model_unavailable_reason":"x"}'], b'{"model_unavailable_reason":"x"}') is False


# The rule marker_names implements, as the regex it replaced (which backtracks over a whole long string value).
MARKER_KEY_REGEX = re.compile(rb'"([^"\\]*)_unavailable_reason"\s*:')
MARKER_PIECES = [b'"', b"\\", b":", b" ", b"\n", b"a", b"model", b"_unavailable_reason", b'_unavailable_reason"',
                 b'_unavailable_reason":', b'"x_unavailable_reason" :', b"{", b"}", b",", b"\xff"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(MARKER_PIECES), max_size=40))
def test_marker_names_finds_exactly_the_keys_the_marker_key_regex_finds(pieces):
    """Any bytes, JSON or not (quotes, escapes, colons and whitespace around the suffix, names that hold it):
    the find/rfind scan gives the regex's non-overlapping matches, no more and no fewer."""
    body = b"".join(pieces)
    assert marker_names(body) == set(MARKER_KEY_REGEX.findall(body)), body


def test_marker_names_on_long_values_and_repeated_suffixes_matches_the_regex():
    """The shapes that make the scan walk far: a 1 MB string value before a key, a value ending in the suffix,
    thousands of suffixes in one value, whitespace before the colon."""
    bodies = [
        json.dumps({"text": "x" * 1_000_000, "model_unavailable_reason": "not_streamed"}).encode(),
        json.dumps({"text": "x" * 1_000_000 + "_unavailable_reason", "i": 1}).encode(),
        json.dumps({"text": "_unavailable_reason" * 5000, "created_unavailable_reason": "x"}).encode(),
        b'{"a_unavailable_reason"' + b" " * 100_000 + b': 1, "b_unavailable_reason"' + b" " * 10 + b"}",
    ]
    for body in bodies:
        assert marker_names(body) == set(MARKER_KEY_REGEX.findall(body))
    assert marker_names(bodies[0]) == {b"model"} and marker_names(bodies[2]) == {b"created"}
