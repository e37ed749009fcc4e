"""A hostile worker's joins must not hold the whole byte budget while they run.

A join that runs off the event loop reserves what its encodings declare (``JoinSession.join_bytes``),
capped at what is left of ``--max-total-bytes``, and the request whose join runs is no eviction
victim. A worker that sends sglang-zstd P/D requests whose frames declare (or really inflate to) more
than the budget therefore held all of it for as long as its joins ran, and every other request's
chunk that had to be buffered meanwhile (a prefill leg waiting for its decode leg, an out-of-order
chunk) met a full budget and was ended ``overloaded``: a steady stream of such bombs ended 145 of 146
honest P/D requests and 89 of 146 out-of-order ones beside it (2026-12-05, 8 s, one bomb every 20 ms).
Now one request whose join runs holds at most three quarters of the budget, its reservation
included, and its join decodes within that share (the codec omits ``too_large`` past it).
"""

from __future__ import annotations

import base64
import struct
import time

import anyio
import msgspec
import nats
import pytest
from helpers import expert_pd_legs, inflating_pd_legs, peak_rss

from streamproc.catalog import Catalog
from streamproc.core.wire import ERROR, FINAL, Subjects, chunk_headers
from streamproc.correlator import Correlator, CorrelatorConfig, Work
from streamproc.wire import Chunk, Result, Role, Verdict

MiB = 1 << 20
FMT = "sglang-zstd"
SUBJECTS = Subjects()
ATTACKER_OUTCOMES = {"omitted:too_large", "omitted:prefill_corrupt", "error:overloaded"}


def lying_frame(declared: int) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes of content and that holds four."""
    payload = b"abcd"
    return (b"\x28\xb5\x2f\xfd" + bytes([0x80, 0x00]) + struct.pack("<I", declared)
            + struct.pack("<I", 1 | (len(payload) << 3))[:3] + payload)


def lying_pd_legs() -> tuple[bytes, bytes]:
    """A sglang-zstd P/D request whose legs' ``routed_experts`` frames declare 512 MiB (a 32,768-token
    prompt allows that many) and hold a few bytes: its join fails fast, having reserved all it could."""
    value = base64.b64encode(lying_frame(512 * MiB)).decode()
    legs = []
    for body in inflating_pd_legs(prompt=16, layers=1):
        doc = msgspec.json.decode(body)
        doc["meta_info"].update(routed_experts=value, prompt_tokens=32768)
        legs.append(msgspec.json.encode(doc))
    return legs[0], legs[1]


def test_while_a_bombs_join_runs_other_requests_can_still_buffer_their_chunks():
    """Pure: a real sglang-zstd bomb (64 MiB of prefill rows, as much declared on decode) handed out at
    the default budget; 20 honest P/D prefill legs (790 KB each, 15 MiB: within the quarter the bomb
    leaves) and 20 out-of-order chunks arrive while it runs."""
    c = Correlator(Catalog(), FMT, CorrelatorConfig())
    c.offload_joins = True  # as core and durable mode run joins
    limit = c.config.max_total_bytes
    bomb_prefill, bomb_decode = inflating_pd_legs()
    assert c.receive(Chunk("bomb", Role.PREFILL, 0, bomb_prefill, True), 0.0) == []
    works = [d for d in c.receive(Chunk("bomb", Role.DECODE, 0, bomb_decode, True), 0.0) if isinstance(d, Work)]
    assert len(works) == 1
    prefill, _ = expert_pd_legs()
    ended = []
    for k in range(20):
        for decision in (*c.receive(Chunk(f"pd{k}", Role.PREFILL, 0, prefill, True), 0.0),
                         *c.receive(Chunk(f"ooo{k}", Role.AGG, 1, b"x" * 2000, True), 0.0)):
            if isinstance(decision, Result) and decision.error:
                ended.append(decision.request_id)
        assert c.charged_bytes <= limit
    assert not ended, f"{len(ended)} bystanders ended while the bomb's join ran: {ended[:4]}"
    assert works[0].reserved <= limit - limit // 4
    works[0].run()
    (result,) = [d for d in c.finish(works[0], 0.0) if isinstance(d, Result)]
    assert result.request_id == "bomb" and not result.error
    assert b'"routed_experts_unavailable_reason":"too_large"' in result.body
    assert c.charged_bytes <= limit


class Outcomes:
    """The final outcome of every request on ``P.results.>`` and its latency from ``started``."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.done: dict[str, tuple[str, float]] = {}

    async def on_message(self, msg) -> None:
        rid = SUBJECTS.request_id_of_result(msg.subject)
        headers = msg.headers or {}
        if rid in self.done:
            return
        if ERROR in headers:
            outcome = "error:" + headers[ERROR]
        elif headers.get(FINAL) == "true":
            outcome = headers.get("Streamproc-Join") or "ok"
            if outcome == "omitted":
                reason = msgspec.json.decode(msg.data)["meta_info"].get("routed_experts_unavailable_reason")
                outcome += f":{reason}"
        else:
            return
        self.done[rid] = (outcome, time.perf_counter() - self.started[rid])


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(180)
async def test_a_steady_stream_of_zstd_bombs_ends_no_honest_bystander(nats_url, streamproc_run):
    """Real nats-server and `streamproc run --format sglang-zstd` at the default budgets: for ~4 s a
    hostile worker publishes a P/D request every 25 ms whose frames inflate to 64 MiB (a real bomb,
    decoded) or declare 512 MiB and hold a few bytes (a lie, refused fast), alternately. Beside it,
    every 50 ms: an honest P/D request whose prefill leg waits 10 ms for its decode leg, an
    out-of-order aggregated request and an in-order one. Every bystander is answered in full and
    none is ended; every attacker request gets a clear omission or an ``overloaded`` error. Not bounded
    here: the honest joins' latency (p50 0.8-1.5 s in 3 runs, against ~20 ms idle): joins run one at a
    time in arrival order, so each waits behind the bombs queued before it."""
    bomb = inflating_pd_legs()
    lie = lying_pd_legs()
    honest_prefill, honest_decode = expert_pd_legs(prompt=300, output=64)
    outcomes = Outcomes()
    kinds: dict[str, str] = {}
    with streamproc_run("--mode", "core", "--format", FMT) as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            await nc.subscribe(SUBJECTS.all_results, cb=outcomes.on_message, pending_msgs_limit=1_000_000)
            await nc.flush()

            async def publish(rid: str, role: str, seq: int, body: bytes, final: bool) -> None:
                outcomes.started.setdefault(rid, time.perf_counter())
                await nc.publish(SUBJECTS.chunk(rid, role), body,
                                 headers=chunk_headers(rid, role, seq, final=final, format=FMT))

            async def attacker(rounds: int) -> None:
                for k in range(rounds):
                    rid, (prefill, decode) = (f"bomb{k}", bomb) if k % 2 == 0 else (f"lie{k}", lie)
                    kinds[rid] = "attacker"
                    await publish(rid, "prefill", 0, prefill, True)
                    await publish(rid, "decode", 0, decode, True)
                    await anyio.sleep(0.025)

            async def bystanders(rounds: int) -> None:
                for i in range(rounds):
                    kinds[f"pd{i}"], kinds[f"ooo{i}"], kinds[f"agg{i}"] = "pd", "ooo", "agg"
                    await publish(f"pd{i}", "prefill", 0, honest_prefill, True)
                    await anyio.sleep(0.01)
                    await publish(f"pd{i}", "decode", 0, honest_decode, True)
                    await publish(f"ooo{i}", "agg", 1, b'{"text":"b","meta_info":{}}' + b" " * 2000, True)
                    await publish(f"ooo{i}", "agg", 0, b'{"text":"a","meta_info":{}}', False)
                    for seq in range(3):
                        await publish(f"agg{i}", "agg", seq, b'{"text":"c","meta_info":{}}', seq == 2)
                    await anyio.sleep(0.04)

            async with anyio.create_task_group() as tg:
                tg.start_soon(attacker, 160)
                tg.start_soon(bystanders, 80)
            await nc.flush()
            with anyio.move_on_after(120):
                while len(outcomes.done) < len(kinds):
                    await anyio.sleep(0.1)
        finally:
            await nc.close()
        hwm = peak_rss(proc.pid)
        log_tail = log_path.read_text(errors="replace")[-2000:]
    by_kind: dict[str, dict[str, int]] = {}
    latency: dict[str, list[float]] = {}
    for rid, kind in kinds.items():
        outcome, seconds = outcomes.done.get(rid, ("unanswered", 0.0))
        by_kind.setdefault(kind, {}).setdefault(outcome, 0)
        by_kind[kind][outcome] += 1
        latency.setdefault(kind, []).append(seconds)
    for kind, times in sorted(latency.items()):
        times.sort()
        print(f"{kind}: {by_kind[kind]} latency p50 {times[len(times) // 2] * 1e3:.0f} ms, "
              f"max {times[-1] * 1e3:.0f} ms")
    print(f"VmHWM {hwm / MiB:.0f} MiB")
    assert by_kind["pd"] == {"joined": 80}, (by_kind, log_tail)
    assert by_kind["ooo"] == {"passthrough": 80} and by_kind["agg"] == {"passthrough": 80}, by_kind
    assert set(by_kind["attacker"]) <= ATTACKER_OUTCOMES, by_kind["attacker"]
    assert hwm < 200 * MiB, hwm / MiB


HONEST = b'{"text":"h","meta_info":{}}'


async def flood_then_ask(nc, legs: list[tuple[str, str, bytes]], answered: dict[str, bytes]) -> None:
    """Publish ``(request id, leg, body)`` chunks, each alone (seq 0, final for a prefill leg), then
    one honest aggregated request, and wait for its answer. Paced: every 100 chunks an aggregated
    ``pace<i>`` request is asked and answered first, so at most ~100 chunks wait for the processor.
    Unpaced, a loaded machine let nats-server drop the core-mode processor as a slow consumer
    (its documented limit, operations.md "Limits and abuse") and the honest chunk was lost in the
    reconnect: the test then timed out without saying anything about the budget."""
    for i, (request_id, leg, body) in enumerate(legs, 1):
        await nc.publish(SUBJECTS.chunk(request_id, leg), body,
                         headers=chunk_headers(request_id, leg, 0, final=leg == "prefill", format="sglang"))
        if i % 100 == 0 or i == len(legs):
            await ask(nc, f"pace{i}", answered)
    await ask(nc, "honest", answered)


async def flooded(streamproc_run, nats_url: str, legs: list[tuple[str, str, bytes]]
                  ) -> tuple[dict[str, bytes], list[str], int]:
    """Run ``streamproc run --mode core --format sglang``, :func:`flood_then_ask` it with ``legs``:
    the answers to the paced and honest requests, the error kinds of the flood's results, VmHWM."""
    errors: list[str] = []
    answered: dict[str, bytes] = {}

    async def on_result(msg) -> None:
        request_id = msg.subject.rpartition(".")[2]
        if request_id.startswith(("pace", "honest")):
            answered[request_id] = msg.data
        elif msg.headers and msg.headers.get(ERROR):
            errors.append(msg.headers[ERROR])

    with streamproc_run("--mode", "core", "--format", "sglang") as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            await nc.subscribe(SUBJECTS.all_results, cb=on_result, pending_msgs_limit=1_000_000)
            await nc.flush()
            await flood_then_ask(nc, legs, answered)
        finally:
            await nc.close()
        return answered, errors, peak_rss(proc.pid)


async def ask(nc, request_id: str, answered: dict[str, bytes]) -> None:
    await nc.publish(SUBJECTS.chunk(request_id, "agg"), HONEST,
                     headers=chunk_headers(request_id, "agg", 0, final=True, format="sglang"))
    with anyio.fail_after(60):
        while request_id not in answered:
            await anyio.sleep(0.02)


def logprob_prefill_leg(prompt: int = 4096) -> bytes:
    """An sglang prefill leg with ``prompt`` prompt logprobs (``[logprob, id, null]`` each, 0.5.23's
    ``input_token_logprobs`` with ``return_text_in_logprobs`` off) and no rows: ~100 KB of JSON that
    parses into ~6x its length of Python objects."""
    meta = {"id": "p", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": prompt,
            "completion_tokens": 1, "input_token_logprobs": [[-1.2345678, 10_000 + i, None] for i in range(prompt)]}
    return msgspec.json.encode({"text": "a", "output_ids": [1], "meta_info": meta})


def pathological_prefill_leg(prompt: int = 4096) -> bytes:
    """An sglang prefill leg whose ``input_token_logprobs`` are one-entry dicts under distinct wide
    keys holding empty dicts (``{"中":{}}``): ~45 KB of JSON that parses into ~30x its length."""
    scores = [{chr(0x4E00 + i): {}} for i in range(prompt)]
    meta = {"id": "p", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": prompt,
            "completion_tokens": 1, "input_token_logprobs": scores}
    return msgspec.json.encode({"text": "a", "output_ids": [1], "meta_info": meta})


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", ["honest", "pathological"])
async def test_absorbed_prefill_legs_are_charged_as_parsed_so_a_flood_stays_within_the_budget(
        nats_url, streamproc_run, shape):
    """A prefill leg was charged at its body length once absorbed, while its parsed prompt logprobs
    hold ~6x that: 1,000 legs of 4,096 prompt logprobs with no decode leg (88 MiB charged, under the
    96 MiB default) took `streamproc run` to 805 MiB VmHWM (an attack session). Charged then at a
    fixed 6x, legs of ``[{"<key>":{}},...]``, which parse to ~30x, held 5x what they were charged.
    The codecs now charge ``parsed_json_bound`` (``retained_bytes``), so the budget ends the biggest
    holders (``overloaded``) instead. Bound: VmHWM under 300 MiB; a later honest request is answered."""
    leg = logprob_prefill_leg() if shape == "honest" else pathological_prefill_leg()
    answered, errors, hwm = await flooded(streamproc_run, nats_url, [(f"leg{i}", "prefill", leg) for i in range(1_000)])
    print(f"VmHWM {hwm / MiB:.0f} MiB, {len(errors)} legs ended ({set(errors)})")
    assert answered["honest"] == HONEST
    assert errors and set(errors) == {"overloaded"}, errors[:3]
    assert hwm < 300 * MiB, hwm / MiB


def vllm_logprob_prefill_leg(prompt: int = 4096) -> bytes:
    """A vllm prefill leg with ``prompt_logprobs`` (a dict per prompt token, ``[0]`` null) and no rows."""
    scores = [None] + [{str(1000 + i): {"logprob": -1.2345678, "rank": 1, "decoded_token": f"token_id:{1000 + i}"}}
                       for i in range(prompt - 1)]
    return msgspec.json.encode({"request_id": "r", "choices": [{"index": 0, "token_ids": [5], "logprobs": None,
                                                                 "finish_reason": "length", "routed_experts": None}],
                                "usage": {"prompt_tokens": prompt, "completion_tokens": 1}, "prompt_logprobs": scores})


@pytest.mark.parametrize("fmt, leg", [("sglang", logprob_prefill_leg), ("vllm", vllm_logprob_prefill_leg)])
def test_a_sessions_charge_for_its_absorbed_prefill_leg_covers_what_the_parsed_leg_holds(fmt, leg):
    """Body length (charged while buffered) plus ``retained_bytes`` against the parsed leg's own
    allocation (tracemalloc): never below it, and at most 3x it (the honest shapes parse to 6.1x /
    7.1x their JSON here). Charged at body length alone it was 1/6 of it; at a fixed 6x, 0.85x."""
    import tracemalloc

    body = leg()
    tracemalloc.start()
    parsed = msgspec.json.decode(body)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del parsed
    session = Catalog()(fmt).open_session()
    session.absorb_prefill([body])
    charged = len(body) + session.retained_bytes()
    assert held <= charged <= 3 * held, (charged, held)


def test_a_sessions_charge_covers_its_prefill_leg_after_a_join_republished_it():
    """The join copies prefill's prompt logprobs into decode's chunk and encodes it, which gives each
    wide token text a UTF-8 copy kept as long as the leg: a text of one astral character and 1 MB of
    ASCII held 4 MB parsed (charged 4 MB) and 5 MB after the first join."""
    import tracemalloc

    text = "\U0001F600" + "a" * 1_000_000
    prefill = msgspec.json.encode({"text": "a", "output_ids": [7], "meta_info": {
        "id": "p", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 2, "completion_tokens": 1,
        "input_token_logprobs": [[None, 1, None], [-1.0, 2, text]], "output_token_logprobs": [[-0.5, 7, None]]}})
    decode = msgspec.json.encode({"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "p", "finish_reason": None, "prompt_tokens": 2, "completion_tokens": 2,
        "output_token_logprobs": [[None, 7, None], [-0.7, 8, None]]}})
    session = Catalog()("sglang").open_session()
    tracemalloc.start()
    try:
        session.absorb_prefill([prefill])
        assert session.needs_prefill(decode, False)
        out, verdict = session.join(decode, False)
        assert verdict is Verdict.JOINED and text.encode() in out
        del out
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    charged = len(prefill) + session.retained_bytes()
    assert held <= charged, (held, charged)


def test_a_batch_prefill_legs_charge_covers_the_items_it_keeps():
    """A batch prefill leg is kept as its items re-encoded (``_prefill_items``), which was charged at
    the leg's length: ``1e15`` re-encodes as ``1000000000000000.0``, and msgspec's output keeps the
    slack of its buffer, so a leg of such numbers held 4.5x what it was charged."""
    import tracemalloc

    def item(i: int) -> dict:
        return {"text": "a", "output_ids": [1], "meta_info": {
            "id": f"p{i}", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 4,
            "completion_tokens": 1, "scores": [1e15] * 50_000}}

    body = msgspec.json.encode([item(0), item(1)]).replace(b"1000000000000000.0", b"1e15")
    Catalog()("sglang").open_session().absorb_prefill([body])  # msgspec's key cache is not the session's
    session = Catalog()("sglang").open_session()
    tracemalloc.start()
    try:
        session.absorb_prefill([body])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    charged = len(body) + session.retained_bytes()
    assert held <= charged + 4096, (held, charged)  # 4 KiB: CPython's free list of 100 floats, headers


def pathological_decode_chunk(prompt: int = 4096) -> bytes:
    """An sglang decode chunk that waits for its prefill leg (it has ``output_token_logprobs``) and
    carries ``{"<wide key>":{}}`` entries: ~45 KB of JSON that parses into ~30x its length."""
    meta = {"id": "d", "finish_reason": None, "prompt_tokens": prompt, "completion_tokens": 2,
            "output_token_logprobs": [[None, 7, None]], "hidden": [{chr(0x4E00 + i): {}} for i in range(prompt)]}
    return msgspec.json.encode({"text": "ab", "output_ids": [7, 8], "meta_info": meta})


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(180)
async def test_a_flood_of_decode_chunks_waiting_for_their_prefill_leg_stays_within_the_budget(nats_url, streamproc_run):
    """A decode chunk that needs the prefill leg is parsed on arrival (``needs_prefill``) and kept
    parsed (the session's ``_last``) while it waits for the leg, charged at its body length: 1,000
    such chunks of ~45 KB that parse to ~30x (43 MiB charged, under the 96 MiB default) with no
    prefill leg. Bound: VmHWM under 300 MiB; a later honest request is answered."""
    chunk = pathological_decode_chunk()
    answered, _, hwm = await flooded(streamproc_run, nats_url, [(f"leg{i}", "decode", chunk) for i in range(1_000)])
    print(f"VmHWM {hwm / MiB:.0f} MiB")
    assert answered["honest"] == HONEST
    assert hwm < 300 * MiB, hwm / MiB
