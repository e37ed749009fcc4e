"""Attacks against a real nats-server and a `streamproc run` subprocess (core mode).

Each test mixes one attack into legitimate traffic and asserts two things: every legitimate request
is answered in full (every seq, the final one included, byte for byte), and the processor's peak
RSS (``VmHWM`` in /proc/<pid>/status) stays under a stated bound.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import anyio
import nats
import pytest
from conftest import processor_subprocess
from helpers import (NON_UTF8_HEADERS, broken_codec_site, expert_pd_legs, free_port, inflating_pd_legs,
                     logprob_pd_legs, peak_rss, publish_repeated_joins, raw_hpub, raw_protocol,
                     scrape, wait_until)

from streamproc.core.wire import ERROR, FINAL, SEQ, Subjects, chunk_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
MiB = 1 << 20


class Results:
    """Every result on P.results.>, by request id: {seq: (body, headers)}."""

    def __init__(self) -> None:
        self.by_request: dict[str, dict[int, tuple[bytes, dict[str, str]]]] = {}
        self.changed = anyio.Event()

    async def on_message(self, msg) -> None:
        rid = SUBJECTS.request_id_of_result(msg.subject)
        headers = msg.headers or {}
        self.by_request.setdefault(rid, {})[int(headers[SEQ])] = (msg.data, headers)
        self.changed.set()

    def complete(self, rid: str, chunks: int) -> bool:
        got = self.by_request.get(rid, {})
        return len(got) == chunks and got.get(chunks - 1, (b"", {}))[1].get(FINAL) == "true"

    def final(self, rid: str) -> dict[str, str] | None:
        for _, headers in self.by_request.get(rid, {}).values():
            if headers.get(FINAL) == "true":
                return headers
        return None

    async def wait_for(self, done: Callable[[], bool], timeout: float) -> None:
        with anyio.move_on_after(timeout):
            while not done():
                self.changed = anyio.Event()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def worker_and_reader(url: str) -> AsyncIterator[tuple[nats.aio.client.Client, Results]]:
    """A plain nats-py connection (the legitimate worker and reader) subscribed to every result."""
    nc = await nats.connect(url)
    results = Results()
    try:
        await nc.subscribe(SUBJECTS.all_results, cb=results.on_message, pending_msgs_limit=1_000_000)
        await nc.flush()
        yield nc, results
    finally:
        await nc.close()


def legit_body(rid: str, seq: int) -> bytes:
    return f'{{"text":"{rid}:{seq}","meta_info":{{"id":"{rid}"}}}}'.encode()


async def publish_legit(nc, rid: str, chunks: int) -> None:
    for seq in range(chunks):
        await nc.publish(SUBJECTS.chunk(rid, "agg"), legit_body(rid, seq),
                         headers=chunk_headers(rid, "agg", seq, final=seq == chunks - 1))


async def run_mixed(url: str, pid: int, attack: Callable[..., Awaitable[None]], *, requests: int,
                    chunks: int = 3, every: int = 50, timeout: float = 30, log_path: Path | None = None,
                    attacked: Callable[[Results], bool] | None = None) -> Results:
    """``requests`` legitimate streamed requests, ``attack(nc, i, ping)`` before every ``every``-th; all must
    finish. ``attacked(results)``: what must also have arrived (the attackers' answers) before the reader
    disconnects."""
    async with worker_and_reader(url) as (nc, results):
        pings = 0

        async def ping() -> None:
            """One unary request through the processor and back: paces a bulk attack so it measures the
            processor's budgets, not nats-server's slow-consumer cut-off (64 MB pending per connection)
            on a loaded 2-core machine."""
            nonlocal pings
            rid = f"ping-{pings}"
            pings += 1
            await publish_legit(nc, rid, 1)
            await results.wait_for(lambda: results.complete(rid, 1), 30)
            assert results.complete(rid, 1), f"{rid} unanswered\n" + (log_path.read_text()[-3000:] if log_path else "")

        for i in range(requests):
            if i % every == 0:
                await attack(nc, i, ping)
            await publish_legit(nc, f"ok-{i}", chunks)
        await nc.flush()
        legit = [f"ok-{i}" for i in range(requests)]
        await results.wait_for(lambda: all(results.complete(r, chunks) for r in legit), timeout)
        missing = [r for r in legit if not results.complete(r, chunks)]
        log_tail = log_path.read_text(errors="replace")[-3000:] if log_path else ""
        assert not missing, (f"{len(missing)} of {requests} legitimate requests not answered in full: {missing[:5]}"
                             f"\n{log_tail}")
        for rid in legit[:: max(1, requests // 50)]:
            assert [results.by_request[rid][s][0] for s in range(chunks)] == [legit_body(rid, s) for s in range(chunks)]
        assert all(ERROR not in h for r in legit for _, h in results.by_request[r].values())
        if attacked is not None:
            await results.wait_for(lambda: attacked(results), timeout)
        return results


async def test_poison_seqs_end_their_request_with_invalid_chunk_and_legitimate_traffic_is_answered(
        nats_url, streamproc_run):
    poison = ["²", "٠", "１", "-1", "1e3", "0x1"]

    async def attack(nc, i: int, ping) -> None:
        rid = f"bad-{i}"
        headers = chunk_headers(rid, "agg", 0)
        headers[SEQ] = poison[(i // 50) % len(poison)]
        await nc.publish(SUBJECTS.chunk(rid, "agg"), b"{}", headers=headers)

    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, log_path=log_path,
                                  attacked=lambda res: all(res.final(f"bad-{i}") for i in range(0, 1000, 50)))
        for i in range(0, 1000, 50):
            final = results.final(f"bad-{i}")
            assert final is not None and final[ERROR] == "invalid_chunk", (i, final)
        assert peak_rss(proc.pid) < 150 * MiB
        assert proc.poll() is None
        assert "event=nats_error" not in log_path.read_text()


@pytest.mark.parametrize("separator", ["\x0b", "\x0c"])
async def test_ids_with_bytes_nats_py_splits_on_never_cost_other_requests_their_results(
        nats_url, streamproc_run, separator):
    """nats-server delivers a subject token holding VT/FF; stock nats-py drops its connection on it."""

    async def attack(nc, i: int, ping) -> None:
        rid = f"evil{separator}{i}"
        # Published raw: the helper (ChunkPublisher) refuses such ids.
        await nc.publish(f"{SUBJECTS.chunk('', 'agg')[:-len('.agg')]}{rid}.agg", b"{}",
                         headers=chunk_headers("x", "agg", 0, final=True))

    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=2000, log_path=log_path)
        assert not any(rid.startswith("evil") for rid in results.by_request)  # never answered
        text = log_path.read_text()
        assert "event=disconnected" not in text and "ProtocolError" not in text, text[-2000:]
        assert "event=unreadable_message" in text
        assert peak_rss(proc.pid) < 150 * MiB


async def test_a_reorder_backlog_behind_a_withheld_seq_is_cut_at_the_per_request_byte_cap(
        nats_url, streamproc_run):
    """300 chunks of ~1 MB behind a withheld seq 0 held 333 MiB until --request-timeout; now the request
    ends at --max-buffered-bytes (32 MiB) with invalid_chunk, and the rest are late chunks."""
    payload = bytes(1_000_000)

    async def attack(nc, i: int, ping) -> None:
        if i:
            return
        for seq in range(1, 301):
            await nc.publish(SUBJECTS.chunk("hoarder", "agg"), payload, headers=chunk_headers("hoarder", "agg", seq))
            if seq % 10 == 0:
                await ping()

    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, timeout=60, log_path=log_path,
                                  attacked=lambda res: res.final("hoarder") is not None)
        final = results.final("hoarder")
        assert final is not None and final[ERROR] == "invalid_chunk"
        assert list(results.by_request["hoarder"]) == [0]  # nothing of the backlog was published
        assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        assert proc.poll() is None


async def test_many_requests_each_under_the_per_request_cap_are_stopped_by_the_global_budget(
        nats_url, streamproc_run):
    """20 requests x 20 MB of backlog (400 MB in all, each under the 32 MiB cap): past the 96 MiB global
    budget the biggest holders end as overloaded at once; legitimate traffic beside them is answered in full."""
    payload = bytes(1_000_000)

    async def attack(nc, i: int, ping) -> None:
        rid = f"hog{i // 50}"
        for seq in range(1, 21):
            await nc.publish(SUBJECTS.chunk(rid, "agg"), payload, headers=chunk_headers(rid, "agg", seq))
            if seq % 10 == 0:
                await ping()

    with streamproc_run("--mode", "core") as (proc, log_path):
        hogs = [f"hog{k}" for k in range(20)]
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, timeout=60, log_path=log_path,
                                  attacked=lambda res: sum(res.final(h) is not None for h in hogs) >= 15)
        ended = {h: results.final(h)[ERROR] for h in hogs if results.final(h) is not None}
        # 5 x 20 MB fit in 96 MiB; each later hog's first chunk ends the biggest (idle longest among
        # equals) earlier hog, so the last five stay, holding 100 MB until --request-timeout.
        assert ended == {f"hog{k}": "overloaded" for k in range(15)}, ended
        assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB


async def test_decoded_prefill_rows_of_held_requests_are_charged_to_the_global_budget(nats_url, streamproc_run):
    """16 P/D requests whose prefill rows inflate to 64 MiB each, held open by a decode chunk that
    carries rows but is not final: 1,066 MiB before; now the ones past --max-total-bytes are overloaded."""
    prefill, decode = inflating_pd_legs()

    async def attack(nc, i: int, ping) -> None:
        rid = f"inflate{i // 50}"
        await nc.publish(SUBJECTS.chunk(rid, "prefill"), prefill,
                         headers=chunk_headers(rid, "prefill", 0, final=True, format="sglang-zstd"))
        await nc.publish(SUBJECTS.chunk(rid, "decode"), decode,
                         headers=chunk_headers(rid, "decode", 0, format="sglang-zstd"))  # never final

    with streamproc_run("--mode", "core", "--format", "sglang-zstd") as (proc, log_path):
        attackers = [f"inflate{k}" for k in range(16)]
        results = await run_mixed(nats_url, proc.pid, attack, requests=800, timeout=90, log_path=log_path,
                                  attacked=lambda res: all(0 in res.by_request.get(r, {}) for r in attackers))
        unanswered = [r for r in attackers if 0 not in results.by_request.get(r, {})]
        assert not unanswered, f"{unanswered}\n{log_path.read_text()[-3000:]}"
        outcomes = []
        for rid in attackers:
            body, headers = results.by_request[rid][0]
            outcomes.append(headers.get(ERROR) or headers.get("Streamproc-Join"))
            if headers.get("Streamproc-Join") == "omitted":
                assert b'"routed_experts_unavailable_reason":"too_large"' in body
        # Every decode past the budget is refused before it allocates: omitted, never joined from 64 MiB.
        print("attack outcomes:", outcomes)
        assert set(outcomes) <= {"omitted", "overloaded"} and "joined" not in outcomes, outcomes
        assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB


async def round_trips(nc, results: Results, tag: str, n: int) -> list[float]:
    """Seconds from publish to result of ``n`` unary aggregated requests, one after another."""
    import time

    out = []
    for k in range(n):
        rid = f"{tag}-{k}"
        start = time.perf_counter()
        await publish_legit(nc, rid, 1)
        await results.wait_for(lambda: results.complete(rid, 1), 10)
        assert results.complete(rid, 1), rid
        out.append(time.perf_counter() - start)
        await anyio.sleep(0.005)
    return out


async def test_joins_that_inflate_run_off_the_event_loop_so_passthrough_latency_stays_low(
        nats_url, streamproc_run):
    """20 P/D requests whose joins each decode 2 x 32 MiB of expert rows and splice them (about 1.6 s of
    event-loop time before): passthrough round trips measured while they run stay close to idle ones."""
    prefill, decode = inflating_pd_legs(prompt=2048)
    with streamproc_run("--mode", "core", "--format", "sglang-zstd") as (proc, log_path):
        async with worker_and_reader(nats_url) as (nc, results):
            p90_over_idle = []
            for attempt in range(2):  # a second paired round only when the first one's p90 misses (below)
                idle = await round_trips(nc, results, f"idle{attempt}", 40)
                heavy = [f"heavy{attempt}-{k}" for k in range(20)]
                for rid in heavy:
                    for role, body in (("prefill", prefill), ("decode", decode)):
                        await nc.publish(SUBJECTS.chunk(rid, role), body,
                                         headers=chunk_headers(rid, role, 0, final=True, format="sglang-zstd"))
                await nc.flush()
                busy = await round_trips(nc, results, f"busy{attempt}", 40)
                await results.wait_for(lambda: all(results.final(r) for r in heavy), 60)
                verdicts = {results.final(r).get("Streamproc-Join") for r in heavy if results.final(r)}
                busy.sort()
                idle.sort()
                print(f"round {attempt}: passthrough round trip idle p50 {idle[20] * 1e3:.1f} ms p90 "
                      f"{idle[36] * 1e3:.1f} ms max {idle[-1] * 1e3:.1f} ms; during joins p50 "
                      f"{busy[20] * 1e3:.1f} ms p90 {busy[36] * 1e3:.1f} ms max {busy[-1] * 1e3:.1f} ms")
                assert verdicts == {"joined"}, verdicts  # the heavy requests are served, not refused
                # Every round measured keeps the max and p50 checks; the max's reasons are below.
                assert busy[-1] < 0.200 and busy[20] < idle[20] + 0.010, (idle, busy)
                p90_over_idle.append(busy[36] - idle[36])
                if p90_over_idle[-1] <= 0.011:
                    break
        # Paired: the bystander's round trips during the joins against its idle ones in the same run.
        # The p90 catches a join step that holds the GIL (the old bytes.join row splice: +6.3 to +16.7 ms).
        # "A few ms" (issue 10) is not what 2 shared cores give reliably: with the joins' thread at nice
        # +10 and prefill's rows freed in it, p90 -1.0 to +10.4 ms over idle in 20 runs (median +1.9;
        # 3 above +5 ms), main's code -0.6 to +35.4 (median +5.3; 5 above +8 ms), interleaved, load
        # average 4.4-11.4 (2026-12-01, docs/operations.md). Bound: the tightest that held in all 20.
        # One of two paired rounds must hold it: with correct code a round missed it 1 of 3 times under
        # load (+16.9 ms, 2026-12-07), a miss that load makes, not the code, and that a second round's
        # independent scheduling does not repeat but at that rate squared (~1 in 9). The price is that
        # the old splice, which missed only about half its rounds (main's code passed idle + 12 ms in 5
        # of 9 runs), is now caught here less often: tests/test_join_gil_hold.py catches it directly
        # (its GIL hold, median of 9 rounds, 10-15.5 ms against this code's 2-4.6 ms under load).
        # With the joins inline (offload_joins off, checked once) p90 stays ~1 ms, since only the round
        # trip that arrives behind the joins waits for all of them (max 2.9 s): the max (200 ms) catches
        # that. The max off the loop (24-165 ms in those 20 runs; main's up to 606 ms) was, in the 3
        # runs that printed them in order, the first round trip: queued behind the 40 heavy chunks the
        # loop reads (and absorbs) just before it.
        assert min(p90_over_idle) <= 0.011, p90_over_idle
        assert peak_rss(proc.pid) < 300 * MiB


# ------------------------------------------------------------- reviewer's missing core-mode attacks
# Durable versions in tests/test_durable_hostile.py; each here runs against `streamproc run --mode core`.


async def pd_attack_ends_as_invalid_chunk(nats_url, streamproc_run, bodies: dict[str, bytes], says: bytes) -> int:
    """Every 50th of 500 mixed requests gets the P/D legs ``bodies`` (one final chunk each, core
    mode): each ends with one ``invalid_chunk`` error result whose body ``says`` why, every other
    request is answered (run_mixed), the processor lives. Returns its peak RSS."""
    async def attack(nc, i: int, ping) -> None:
        rid = f"attacked{i}"
        for role, body in bodies.items():
            await nc.publish(SUBJECTS.chunk(rid, role), body, headers=chunk_headers(rid, role, 0, final=True))

    attacked = [f"attacked{i}" for i in range(0, 500, 50)]
    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=500, log_path=log_path,
                                  attacked=lambda res: all(res.final(r) for r in attacked))
        for r in attacked:
            [(body, headers)] = results.by_request[r].values()
            assert headers.get(FINAL) == "true" and headers.get(ERROR) == "invalid_chunk", (r, headers)
            assert says in body, body
        assert proc.poll() is None
        return peak_rss(proc.pid)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_deeply_nested_json_on_a_pd_leg_ends_as_invalid_chunk_in_core_mode(nats_url, streamproc_run, leg):
    """100k-deep nested JSON on one leg made the codec's parser raise RecursionError (`internal`); now
    its request ends as invalid_chunk naming why, and the requests beside it are answered."""
    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    worker = worker_for("sglang")
    truth = make_truth(0, prompt_len=8, output_len=2)
    bodies = {"prefill": worker.prefill(truth, stream=False)[0], "decode": worker.decode(truth, stream=False)[-1]}
    bodies[leg] = b'{"a":' * 100_000 + b"1" + b"}" * 100_000

    peak = await pd_attack_ends_as_invalid_chunk(nats_url, streamproc_run, bodies, b"nested too deeply to parse")
    assert peak < 150 * MiB


async def test_a_decode_batch_of_too_many_items_ends_as_invalid_chunk_and_others_are_answered(nats_url,
                                                                                               streamproc_run):
    """A batch body (a JSON list) is joined item by item, a join session each; a list of thousands of
    tiny items would cost a decode leg's worker nothing and the processor ~0.3 s of CPU per MiB.
    Past MAX_BATCH_ITEMS the codec refuses it: invalid_chunk, naming why."""
    from streamproc_sglang.join import MAX_BATCH_ITEMS

    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    worker = worker_for("sglang")
    truth = make_truth(0, prompt_len=8, output_len=2)
    prefill = worker.prefill(truth, stream=False)[0]
    batch = b"[" + b",".join([b'{"meta_info":{}}'] * (MAX_BATCH_ITEMS + 1)) + b"]"

    await pd_attack_ends_as_invalid_chunk(nats_url, streamproc_run, {"prefill": prefill, "decode": batch},
                                          b"at most %d are joined" % MAX_BATCH_ITEMS)


async def test_a_message_whose_handling_raises_ends_its_request_as_internal_in_core_mode(nats_url, tmp_path):
    """A decode chunk naming a codec whose join raises and whose error_body then raises too
    (helpers.BrokenCodec: the correlator cannot end the request itself): the exception escaped the core input (no result,
    `event=nats_error`). Now the request ends with one internal error result naming the cause, its later
    chunk is late (nothing more published), and the processor goes on answering everyone else."""
    site = broken_codec_site(tmp_path)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()

    async def attack(nc, i: int, ping) -> None:
        rid = f"victim{i}"
        for seq in range(2):
            await nc.publish(SUBJECTS.chunk(rid, "decode"), b"{}",
                             headers=chunk_headers(rid, "decode", seq, final=seq == 1, format="broken"))

    victims = [f"victim{i}" for i in range(0, 500, 50)]
    with processor_subprocess(nats_url, "--mode", "core", "--http-port", str(port), env=env) as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=500, log_path=log_path,
                                  attacked=lambda res: all(res.final(r) for r in victims))
        for r in victims:
            [(body, headers)] = results.by_request[r].values()  # one result: the later chunk published nothing
            assert headers.get(SEQ) == "0" and headers.get(ERROR) == "internal", (r, headers)
            assert b"broken codec: every call raises" in body, body
        metrics = scrape(port)
        assert metrics["streamproc_internal_errors_total"] == len(victims)
        assert metrics['streamproc_error_results_total{kind="internal"}'] == len(victims)
        text = log_path.read_text()
        assert "event=message_failed" in text and "event=nats_error" not in text
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_a_request_whose_joins_pass_the_decode_time_budget_ends_overloaded_in_core_mode(
        nats_url, streamproc_run):
    """CPU amplification: a streamed P/D request whose 20 decode chunks each inflate 2 x 32 MiB of rows
    (~60 ms of CPU per join). With --max-decode-cpu 0.2 it is ended after a few joins, overloaded,
    instead of costing 1.2 s of CPU; the requests beside it are answered."""
    prefill, decode = inflating_pd_legs(prompt=2048)
    port = free_port()

    async def attack(nc, i: int, ping) -> None:
        if i:
            return
        await publish_repeated_joins(nc.publish, "heavy", prefill, decode, 20)

    with streamproc_run("--mode", "core", "--format", "sglang-zstd", "--max-decode-cpu", "0.2",
                        "--http-port", str(port)) as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=200, timeout=60, log_path=log_path,
                                  attacked=lambda res: res.final("heavy") is not None)
        got = results.by_request["heavy"]
        seqs = sorted(got)
        assert seqs == list(range(len(seqs))), seqs
        *joined, last = [got[s][1] for s in seqs]
        print(f"{len(joined)} joins published before the budget ended the request")
        assert 1 <= len(joined) < 19, [(h.get("Streamproc-Join"), h.get(ERROR)) for _, h in got.values()]
        assert all(h.get("Streamproc-Join") == "joined" for h in joined)
        assert last.get(FINAL) == "true" and last.get(ERROR) == "overloaded", last
        body = got[seqs[-1]][0]
        assert b"decode time budget exhausted" in body and b"max_decode_cpu 0.2 s" in body, body
        assert scrape(port)["streamproc_over_cpu_total"] == 1
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 300 * MiB  # as the core-mode join test


async def test_the_decode_time_budget_counts_the_codecs_compression_threads(nats_url, streamproc_run):
    """A P/D request whose 12 decode chunks each carry DeepSeek-V3-shaped rows, joined at zstd level 6
    on 2 compression threads: ~8 ms of CPU per join in the join thread, ~75 ms in the process (zstd's
    workers recompress the rows). ``time.thread_time`` charged the first: 12 joins came to ~0.1 s and
    the request was answered in full past a 0.3 s budget. Charged with the workers, it ends overloaded
    after a few joins; the requests beside it are answered. The budget is 0.15 s: on a fast machine
    (2026-12-05 15:30, relay factor 0.88) a join took ~25 ms in the process, and 0.3 s let 11 of the
    12 through, while the join thread's own share of 12 stays under 0.1 s."""
    prefill, decode = expert_pd_legs(prompt=700)
    port = free_port()

    async def attack(nc, i: int, ping) -> None:
        if i:
            return
        await publish_repeated_joins(nc.publish, "burn", prefill, decode, 12)

    with streamproc_run("--mode", "core", "--format", "sglang-zstd", "--format-option", "zstd_level=6,zstd_threads=2",
                        "--max-decode-cpu", "0.15", "--http-port", str(port)) as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=100, timeout=60, log_path=log_path,
                                  attacked=lambda res: res.final("burn") is not None)
        got = results.by_request["burn"]
        seqs = sorted(got)
        assert seqs == list(range(len(seqs))), seqs
        *joined, last = [got[s][1] for s in seqs]
        print(f"{len(joined)} joins published before the budget ended the request")
        assert len(joined) < 11, [(h.get("Streamproc-Join"), h.get(ERROR)) for _, h in got.values()]
        assert all(h.get("Streamproc-Join") == "joined" for h in joined)
        assert last.get(FINAL) == "true" and last.get(ERROR) == "overloaded", last
        assert b"decode time budget exhausted" in got[seqs[-1]][0]
        assert scrape(port)["streamproc_over_cpu_total"] == 1
        assert proc.poll() is None


async def test_joins_that_decode_no_sequence_data_are_not_charged_to_the_decode_time_budget(
        nats_url, streamproc_run):
    """A cheap P/D request that asked for a 4,096-token prompt's logprobs and no expert rows, streamed
    in 40 chunks: each decode chunk's join copies prefill's prompt logprobs in (~0.3-0.5 ms) and
    decodes nothing. The budget bounds inflation, so these joins are not charged: with
    --max-decode-cpu 0.005 the request is answered in full (all 40 charged came to ~15-20 ms and
    ended it overloaded)."""
    legs, bodies = logprob_pd_legs(prompt=4096, chunks=40)
    port = free_port()

    async def attack(nc, i: int, ping) -> None:
        if i:
            return
        for seq, body in enumerate(legs):
            await nc.publish(SUBJECTS.chunk("logprobs", "prefill"), body,
                             headers=chunk_headers("logprobs", "prefill", seq, final=seq == len(legs) - 1))
        for seq, body in enumerate(bodies):
            await nc.publish(SUBJECTS.chunk("logprobs", "decode"), body,
                             headers=chunk_headers("logprobs", "decode", seq, final=seq == len(bodies) - 1))

    with streamproc_run("--mode", "core", "--max-decode-cpu", "0.005", "--http-port", str(port)) as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=100, timeout=60, log_path=log_path,
                                  attacked=lambda res: res.final("logprobs") is not None)
        got = results.by_request["logprobs"]
        assert sorted(got) == list(range(len(bodies))), sorted(got)
        headers = [got[s][1] for s in range(len(bodies))]
        assert [h.get(ERROR) for h in headers] == [None] * len(bodies), headers[-1]
        assert {h.get("Streamproc-Join") for h in headers} == {"joined"}
        assert b"input_token_logprobs" in got[0][0]
        metrics = scrape(port)
        assert metrics["streamproc_over_cpu_total"] == 0
        assert metrics["streamproc_join_seconds_count"] == len(bodies)  # they ran off the loop, timed
        assert proc.poll() is None


# A wildcard in the id token (``P.chunks.abc.*`` is request ``abc`` with a bad role: an invalid_chunk answer).
WILDCARD_SUBJECTS = ["streamproc.chunks.*.prefill", "streamproc.chunks.*.agg", "streamproc.chunks.>.decode",
                     "streamproc.chunks.>.*", "streamproc.chunks.*.*"]


async def test_chunks_with_a_wildcard_token_are_counted_unreadable_and_never_answered_in_core_mode(
        nats_url, streamproc_run):
    """A core publish to ``P.chunks.*.agg`` is delivered to the processor's ``P.chunks.>`` subscription
    (nats-server does not refuse wildcards in a published subject unless pedantic). Such an id can
    never be answered (its result subject would be a wildcard): each is counted unreadable, logged,
    nothing is published for it, and the requests beside them are answered."""
    port = free_port()
    strays = 0

    async def attack(nc, i: int, ping) -> None:
        nonlocal strays
        subject = WILDCARD_SUBJECTS[(i // 50) % len(WILDCARD_SUBJECTS)]
        await nc.publish(subject, b'{"text":"stray"}', headers=chunk_headers(f"stray{i}", "agg", 0, final=True))
        strays += 1

    with streamproc_run("--mode", "core", "--http-port", str(port)) as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, log_path=log_path)
        await wait_until(lambda: scrape(port).get("streamproc_unreadable_total") == strays, 10,
                         f"every wildcard chunk counted unreadable: {scrape(port).get('streamproc_unreadable_total')}"
                         f"\n{log_path.read_text()[-3000:]}")
        assert strays == 20
        assert set(results.by_request) == {f"ok-{i}" for i in range(1000)}  # nothing answered for a stray
        text = log_path.read_text()
        assert text.count("event=unreadable_message") == 20, text[-3000:]  # LogLimiter's burst: 20 per 10 s
        assert "subject=streamproc.chunks.>.decode" in text
        assert "event=nats_error" not in text and "event=disconnected" not in text
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_a_flood_of_overloaded_results_logs_a_bounded_number_of_lines_with_a_suppressed_count(
        nats_url, streamproc_run):
    """40,000 requests refused as overloaded wrote 40,000 WARNING lines. Now LogLimiter writes 20 per
    event per 10 s interval and one ``event=log_suppressed`` count of the rest. With --max-inflight 10,
    nine legitimate requests are opened first and a holder takes the last slot; the flood is then
    refused (every attacker gets its overloaded result) and the nine finish, answered in full. (The nine
    wait idle through the flood: --shed-min-idle is raised so the flood is refused, not let in by
    ending them; that trade-off is pinned by the max-inflight tests.)"""
    flood = 40_000
    legit = [f"ok-{k}" for k in range(9)]
    with streamproc_run("--mode", "core", "--max-inflight", "10", "--shed-min-idle", "3600") as (proc, log_path):
        async with worker_and_reader(nats_url) as (nc, results):
            for r in legit:  # seq 0 of 3: in flight
                await nc.publish(SUBJECTS.chunk(r, "agg"), legit_body(r, 0), headers=chunk_headers(r, "agg", 0))
            await nc.publish(SUBJECTS.chunk("holder", "agg"), b"{}", headers=chunk_headers("holder", "agg", 0))
            await nc.flush()
            await results.wait_for(lambda: all(0 in results.by_request.get(r, {}) for r in [*legit, "holder"]), 30)
            started = anyio.current_time()
            for k in range(flood):
                # seq 0 of a streamed request (a unary one, final at seq 0, passes through without a slot)
                await nc.publish(SUBJECTS.chunk(f"flood{k}", "agg"), b"{}", headers=chunk_headers(f"flood{k}", "agg", 0))
                if k % 2000 == 1999:  # paced: measures the processor, not nats-server's slow-consumer cut-off
                    await results.wait_for(lambda: results.final(f"flood{k}") is not None, 30)
            await results.wait_for(lambda: sum(f"flood{k}" in results.by_request for k in range(flood)) == flood, 60)
            took = anyio.current_time() - started
            for r in legit:
                for seq in (1, 2):
                    await nc.publish(SUBJECTS.chunk(r, "agg"), legit_body(r, seq),
                                     headers=chunk_headers(r, "agg", seq, final=seq == 2))
            await results.wait_for(lambda: all(results.complete(r, 3) for r in legit), 30)
            for r in legit:
                assert results.complete(r, 3), (r, results.by_request.get(r))
                assert [results.by_request[r][s][0] for s in range(3)] == [legit_body(r, s) for s in range(3)]
            refused = [results.final(f"flood{k}") for k in range(flood)]
            answered = [(k, h and h.get(ERROR)) for k, h in enumerate(refused) if h is None or h.get(ERROR) != "overloaded"]
            assert not answered, (len(answered), answered[:5])
            # The suppressed count of an interval is reported by the next limited line or, once a flood
            # stopped, by the processor's timer: it wakes at least every min(prefill_timeout,
            # request_timeout, finished_grace) = 30 s at the defaults, so up to ~40 s after the flood's
            # last interval began. A flood longer than one interval has several counts: wait for all.

            def counted() -> tuple[int, int]:
                text = log_path.read_text()
                return text.count(" event=overloaded "), sum(
                    int(line.rsplit("count=", 1)[1].split()[0]) for line in text.splitlines()
                    if "event=log_suppressed" in line and "suppressed_event=overloaded" in line)

            await wait_until(lambda: sum(counted()) >= flood, 50, "every refusal logged or counted")
        text = log_path.read_text()
        lines, suppressed = counted()
        intervals = int(took // 10) + 2  # the flood's intervals of 10 s, and a partial one at each end
        print(f"{flood} overloaded results in {took:.1f} s: {lines} lines, {suppressed} suppressed")
        assert lines <= 20 * intervals, (lines, took)
        assert lines + suppressed == flood, (lines, suppressed)  # every refusal counted, once
        assert len(text.splitlines()) < 200, len(text.splitlines())
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_non_utf8_subjects_and_header_bytes_never_cost_the_processor_its_connection(
        nats_url, streamproc_run):
    """A subject or a header block that is not UTF-8 (sent over a raw socket: `PUB`/`HPUB` with
    ``\\xff\\xfe``) made stock nats-py's read loop raise and stop reading for good. The processor's
    client reads them: a non-UTF-8 subject is counted unreadable (no request id to answer), a chunk
    whose headers do not decode ends its request with invalid_chunk; the connection never drops and
    every legitimate request beside them is answered in full."""
    port = free_port()
    strays = 0

    async def attack(nc, i: int, ping) -> None:
        nonlocal strays
        k = i // 50
        strays += 1
        await raw_protocol(nats_url, [
            b"PUB streamproc.chunks.bad\xff\xfe%d.agg 2\r\n{}\r\n" % k,
            raw_hpub(b"streamproc.chunks.hdr%d.agg" % k, NON_UTF8_HEADERS[k % len(NON_UTF8_HEADERS)][0], b"{}"),
        ])

    with streamproc_run("--mode", "core", "--http-port", str(port)) as (proc, log_path):
        victims = [f"hdr{k}" for k in range(20)]
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, log_path=log_path,
                                  attacked=lambda res: all(res.final(v) for v in victims))
        for k, v in enumerate(victims):  # each answered once, as its header block allows
            [(body, headers)] = results.by_request[v].values()
            expected = NON_UTF8_HEADERS[k % len(NON_UTF8_HEADERS)][1]
            assert headers.get(FINAL) == "true", (v, headers)
            if expected is None:
                assert headers.get(ERROR) is None and body == b"{}", (v, headers, body)
            else:
                assert headers.get(ERROR) == "invalid_chunk" and expected in body, (v, headers, body)
        assert not any(r.startswith("bad") for r in results.by_request)  # nobody to answer
        await wait_until(lambda: scrape(port).get("streamproc_unreadable_total") == strays, 10,
                         "every non-UTF-8 subject counted unreadable")
        text = log_path.read_text(errors="replace")
        assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
        assert proc.poll() is None
        assert peak_rss(proc.pid) < 150 * MiB


async def test_a_requests_buffered_joins_take_turns_with_another_requests_join(nats_url, streamproc_run):
    """One streamed P/D request with 20 decode chunks whose joins each decode 2 x 32 MiB of rows, then a
    small P/D request: joins run one at a time, and the heavy request used to keep the join thread
    for all 20 (measured at the base commit: the small join was answered after all 20, 1.5-2.0 s). Now
    a finished join's request queues behind the joins waiting (round robin): the small request is
    answered after the heavy join that was running when it arrived (84-185 ms measured)."""
    import time

    prefill, decode = inflating_pd_legs(prompt=2048)
    small_prefill, small_decode = inflating_pd_legs(prompt=16)  # a join too, of 0.3 MiB of rows
    with streamproc_run("--mode", "core", "--format", "sglang-zstd") as (proc, log_path):
        async with worker_and_reader(nats_url) as (nc, results):
            arrivals: list[tuple[str, int]] = []

            async def note(msg) -> None:
                arrivals.append((SUBJECTS.request_id_of_result(msg.subject), int(msg.headers[SEQ])))

            await nc.subscribe(SUBJECTS.all_results, cb=note)
            await nc.flush()
            await publish_repeated_joins(nc.publish, "heavy", prefill, decode, 20)
            await nc.publish(SUBJECTS.chunk("light", "prefill"), small_prefill,
                             headers=chunk_headers("light", "prefill", 0, final=True, format="sglang-zstd"))
            await nc.flush()
            start = time.perf_counter()
            await nc.publish(SUBJECTS.chunk("light", "decode"), small_decode,
                             headers=chunk_headers("light", "decode", 0, final=True, format="sglang-zstd"))
            await results.wait_for(lambda: results.complete("light", 1), 30)
            light = time.perf_counter() - start
            await results.wait_for(lambda: results.complete("heavy", 20), 60)
            heavy_before = arrivals.index(("light", 0))
            print(f"small join answered {light * 1e3:.0f} ms after its decode chunk, after {heavy_before} of the "
                  f"heavy request's 20 joins")
            assert results.complete("heavy", 20) and results.final("light").get("Streamproc-Join") == "joined"
            assert [s for r, s in arrivals if r == "heavy"] == list(range(20))
            assert heavy_before <= 3, arrivals  # before: all 20 (the heavy joins kept the thread)
            assert proc.poll() is None


# --- progress-budget branch: the codec's migration progress state is charged to the byte budgets ---


def output_ids_body(start: int, size: int = 1_000_000) -> bytes:
    """A streamed sglang body of ~``size`` bytes that is all output token ids (7 bytes a token)."""
    count = size // 7
    ids = ",".join(str(t) for t in range(100_000 + start, 100_000 + start + count))
    return f'{{"text":"","output_ids":[{ids}],"meta_info":{{"id":"endless"}}}}'.encode()


async def test_a_never_ending_stream_of_output_ids_is_ended_at_the_byte_budget_not_held_forever(
        nats_url, streamproc_run):
    """120 in-order chunks of ~1 MB of output_ids for one request that never ends: each is progress, so
    --request-timeout never ended it, and past --max-retained-bytes the codec folded them into its
    progress state (8 bytes a token id) outside every budget (135 MiB traced, growing linearly). Now
    the state is charged: the request ends as overloaded once it passes --max-buffered-bytes (32 MiB,
    ~4.2 million ids, reached within the 31st chunk) and legitimate traffic beside it is answered."""
    bodies = [output_ids_body(seq * 142_857) for seq in range(4)]  # reused: the ids' values do not matter

    async def attack(nc, i: int, ping) -> None:
        if i:
            return
        for seq in range(120):
            await nc.publish(SUBJECTS.chunk("endless", "agg"), bodies[seq % 4],
                             headers=chunk_headers("endless", "agg", seq))
            if seq % 5 == 4:
                await ping()

    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, timeout=60, log_path=log_path,
                                  attacked=lambda res: res.final("endless") is not None)
        final = results.final("endless")
        assert final is not None and final[ERROR] == "overloaded", log_path.read_text()[-2000:]
        seqs = sorted(results.by_request["endless"])
        assert seqs == list(range(len(seqs))) and 20 <= len(seqs) <= 32, seqs  # published in order, then cut
        assert b"progress state" in results.by_request["endless"][seqs[-1]][0]
        assert peak_rss(proc.pid) < 150 * MiB, peak_rss(proc.pid) / MiB
        assert proc.poll() is None


async def publish_legit_needing_buffers(nc, tag: str, n: int, prefill_pad: int = 0) -> list[tuple[str, int]]:
    """Legitimate requests that the processor must buffer: ``n`` streamed ones whose seq 1 (2 KB) comes
    before seq 0, and ``n`` P/D ones whose prefill leg (padded to ``prefill_pad`` bytes) waits for the
    decode leg; ``n`` in-order ones beside them. Returns (request id, chunks) for each."""
    out = []
    for i in range(n):
        rid = f"{tag}-ooo{i}"
        await nc.publish(SUBJECTS.chunk(rid, "agg"), legit_body(rid, 1) + b" " * 2000,
                         headers=chunk_headers(rid, "agg", 1, final=True))
        await nc.publish(SUBJECTS.chunk(rid, "agg"), legit_body(rid, 0), headers=chunk_headers(rid, "agg", 0))
        out.append((rid, 2))
        rid = f"{tag}-pd{i}"
        pre = f'{{"text":"","meta_info":{{"id":"{rid}","pad":"{"x" * prefill_pad}"}}}}'.encode()
        await nc.publish(SUBJECTS.chunk(rid, "prefill"), pre, headers=chunk_headers(rid, "prefill", 0, final=True))
        await nc.publish(SUBJECTS.chunk(rid, "decode"), legit_body(rid, 0),
                         headers=chunk_headers(rid, "decode", 0, final=True))
        out.append((rid, 1))
        rid = f"{tag}-ok{i}"
        await publish_legit(nc, rid, 3)
        out.append((rid, 3))
    await nc.flush()
    return out


def assert_answered_without_error(results: Results, legit: list[tuple[str, int]], log_path: Path) -> None:
    missing = [r for r, n in legit if not results.complete(r, n)]
    assert not missing, f"{len(missing)} of {len(legit)} unanswered: {missing[:5]}\n{log_path.read_text()[-3000:]}"
    failed = [(r, h[ERROR]) for r, _ in legit for _, h in results.by_request[r].values() if ERROR in h]
    assert not failed, failed[:5]


async def test_backlogs_holding_the_global_budget_are_ended_to_make_room_for_requests_that_need_buffering(
        nats_url, streamproc_run):
    """Four 25 MB backlogs behind a withheld seq 0 (each under the 32 MiB per-request cap) held the 96 MiB
    budget, and every legitimate request that needed a buffer (a 200 KB prefill leg waiting for its
    decode leg, an out-of-order chunk) was refused overloaded. Now the biggest holder is ended to make
    room: the legitimate requests are answered in full, the ended backlogs get overloaded."""
    payload = bytes(1_000_000)
    hogs = [f"hog{k}" for k in range(4)]
    with streamproc_run("--mode", "core") as (proc, log_path):
        async with worker_and_reader(nats_url) as (nc, results):
            for hog in hogs:
                for seq in range(1, 26):
                    await nc.publish(SUBJECTS.chunk(hog, "agg"), payload, headers=chunk_headers(hog, "agg", seq))
                    if seq % 5 == 0:  # paced: the processor's budget is measured, not nats-server's cut-off
                        await nc.flush()
                        await anyio.sleep(0.05)
            await publish_legit(nc, "ping", 1)
            await results.wait_for(lambda: results.complete("ping", 1), 30)
            assert not any(results.final(h) for h in hogs)  # 100 MB fit: nobody ended yet
            legit = []
            for rnd in range(4):
                legit += await publish_legit_needing_buffers(nc, f"r{rnd}", 10, prefill_pad=200_000)
            await results.wait_for(lambda: all(results.complete(r, n) for r, n in legit), 60)
            assert_answered_without_error(results, legit, log_path)
            ended = {h: results.final(h) for h in hogs if results.final(h) is not None}
            assert ended and all(h[ERROR] == "overloaded" for h in ended.values()), ended
            for hog in ended:
                body = results.by_request[hog][0][0]
                assert b"held the most" in body and b"ended to make room" in body, body
        assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        assert proc.poll() is None


async def test_requests_held_idle_at_max_inflight_are_ended_to_admit_new_ones(nats_url, streamproc_run):
    """300 held requests (seq 1 sent, seq 0 never) filled --max-inflight 300 and every new streamed or P/D
    request was refused overloaded until --request-timeout. Now, once they have been idle --shed-min-idle
    (1 s), the one idle longest is ended (overloaded) for each newcomer: legitimate requests that
    need buffering are answered in full while the attacker keeps opening held requests beside them."""
    def held(k: int) -> str:
        return f"held{k:05d}" + "z" * 247  # 256-character ids

    with streamproc_run("--mode", "core", "--max-inflight", "300") as (proc, log_path):
        async with worker_and_reader(nats_url) as (nc, results):
            attackers = 0

            async def hold(n: int) -> None:
                nonlocal attackers
                for _ in range(n):
                    rid = held(attackers)
                    attackers += 1
                    await nc.publish(SUBJECTS.chunk(rid, "agg"), b"x", headers=chunk_headers(rid, "agg", 1, final=True))
                await nc.flush()

            await hold(300)
            await anyio.sleep(1.5)
            legit = []
            for rnd in range(5):
                legit += await publish_legit_needing_buffers(nc, f"r{rnd}", 10)
                await hold(30)  # new held requests beside them: refused or admitted, never in the way
            await results.wait_for(lambda: all(results.complete(r, n) for r, n in legit), 60)
            assert_answered_without_error(results, legit, log_path)
            ended = [held(k) for k in range(attackers) if results.final(held(k)) is not None]
            assert len(ended) >= 100, len(ended)  # one per legitimate newcomer (at least the 100 that buffer)
            assert all(results.final(r)[ERROR] == "overloaded" for r in ended)
            evicted = [r for r in ended if b"made no progress" in results.by_request[r][0][0]]
            assert evicted, ended[:3]
        assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        assert proc.poll() is None


async def test_finished_ids_of_a_flood_of_long_ids_stay_within_their_byte_bound(nats_url, streamproc_run):
    """200,000 one-chunk requests with 256-character ids: the finished-id table (remembered for
    --finished-grace so late duplicates get no new result) was in no budget and grew ~78 MiB (VmHWM
    ~130 MiB at main's code). Now it is bounded by --max-finished-bytes (32 MiB), oldest forgotten first."""
    published = 0

    def long_id(k: int) -> str:
        return f"long{k:07d}" + "z" * 245

    async def attack(nc, i: int, ping) -> None:
        nonlocal published
        for _ in range(2000):
            r = long_id(published)
            published += 1
            await nc.publish(SUBJECTS.chunk(r, "agg"), b"{}", headers=chunk_headers(r, "agg", 0, final=True))
        await ping()

    with streamproc_run("--mode", "core") as (proc, log_path):
        results = await run_mixed(nats_url, proc.pid, attack, requests=1000, every=10, timeout=60, log_path=log_path,
                                  attacked=lambda res: long_id(published - 1) in res.by_request)
        assert published == 200_000
        async with worker_and_reader(nats_url) as (nc, late):  # a late duplicate of a recent id: no new result
            recent = long_id(published - 1)
            await nc.publish(SUBJECTS.chunk(recent, "agg"), b"{}", headers=chunk_headers(recent, "agg", 0, final=True))
            await publish_legit(nc, "after", 1)
            await late.wait_for(lambda: late.complete("after", 1), 30)
            assert late.complete("after", 1) and recent not in late.by_request
        assert len(results.by_request[recent]) == 1
        assert peak_rss(proc.pid) < 110 * MiB, peak_rss(proc.pid) / MiB
        assert proc.poll() is None
