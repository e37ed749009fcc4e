"""``POST /v1/experts`` and ``GET /v1/stats``, the live page's two data endpoints, over real HTTP
against a real ``streamproc edge`` (``sglang-zstd``) on a real nats-server.

The view must be the ground truth's rows for a body the real join produced, paged within its
bound; hostile posts (a zstd bomb, an oversized body, not JSON) get a clear answer while the edge
keeps serving everyone else within a stated memory bound.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import struct
import threading
import urllib.parse
from typing import Iterator

import anyio
import httpx
import hypothesis
import nats
import prometheus_client
import pytest
from edge_harness import expected_sse, publish_results, running_edge
from helpers import peak_rss, rid, wait_until

from streamproc.catalog import Catalog, worker_for
from streamproc.edge.experts import MAX_BODY_BYTES, MAX_VIEW_IDS, build_view
from streamproc.edge.stats import MAX_SCRAPE_BYTES, SCRAPE_TIMEOUT
from streamproc.simulation import make_truth
from streamproc.testing.harness import leg, run_pipeline
from streamproc.wire import Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

MiB = 1 << 20
# How much the edge's resident peak may grow while it refuses a bomb, an oversized body and garbage:
# the oversized body is read up to its 32 MiB bound before the 413; a bomb inflated to the 64 MiB
# decode limit (or to its 2 GiB) would pass this.
HOSTILE_GROWTH_BOUND = 48 * MiB


@pytest.fixture(scope="module")
def zstd_edge(server):
    with running_edge(server.url, "--format", "sglang-zstd") as edge:
        yield edge


def joined_final_body(truth, fmt: str = "sglang-zstd", stream: bool = True) -> bytes:
    """The final result body the real join of ``fmt`` makes of the truth's P/D legs."""
    worker = worker_for(fmt)
    rid_ = truth.request_id
    run = run_pipeline([*leg(rid_, "prefill", worker.prefill(truth, stream=stream)),
                        *leg(rid_, "decode", worker.decode(truth, stream=stream))], format=fmt)
    final = run.of(rid_)[-1]
    assert final.final and final.verdict is Verdict.JOINED
    return final.body


def truth_ids(truth) -> list[int]:
    return list(struct.unpack(f"<{len(truth.experts) // 4}i", truth.experts))


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd", "vllm"])
def test_every_format_describes_its_joined_rows_split_at_the_prompt_and_its_aggregated_rows_as_one_workers(fmt):
    """The codec hook (``Codec.routed_experts``) is the edge's only source: the truth's rows, the
    prefill leg's up to the prompt and decode's after it, whatever the format's wire encoding."""
    truth = make_truth(83, prompt_len=30, output_len=20, num_layers=6, top_k=4)
    codec = Catalog()(fmt)
    # A vLLM stream's chunks carry no usage (serve_tokens_stream_generator, no stream_options), so its
    # final body does not say where the prompt ends: its rows are described as joined, unsplit. The
    # split is read from the unary body.
    stream = fmt != "vllm"
    if not stream:
        streamed = build_view(codec, joined_final_body(truth, fmt), verdict=Verdict.JOINED)
        assert (streamed.present, streamed.positions, streamed.splice) == (True, 49, None)
        assert streamed.ids == truth_ids(truth)
        assert [(s.source, s.start, s.stop) for s in streamed.spans] == [("joined", 0, 49)]
    joined = build_view(codec, joined_final_body(truth, fmt, stream), verdict=Verdict.JOINED)
    assert (joined.present, joined.problem, joined.omitted) == (True, None, {})
    assert (joined.positions, joined.row_ids, joined.splice) == (49, 24, 30)
    assert joined.ids == truth_ids(truth)
    assert [(s.source, s.start, s.stop) for s in joined.spans] == [("prefill", 0, 30), ("decode", 30, 49)]
    aggregated = build_view(codec, worker_for(fmt).agg(truth, stream=False)[-1], verdict=Verdict.PASSTHROUGH)
    assert aggregated.ids == truth_ids(truth)
    assert [(s.source, s.start, s.stop) for s in aggregated.spans] == [("worker", 0, 49)]
    body = joined_final_body(truth, fmt, stream)
    assert build_view(codec, body).spans == []  # no verdict: not attributed
    stitched = build_view(codec, body, verdict=Verdict.STITCHED)  # migrated: attempts not told apart
    assert [(s.source, s.start, s.stop) for s in stitched.spans] == [("resumed", 0, 49)]


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd", "vllm"])
def test_every_format_reports_omitted_experts_with_the_reason_and_no_matrix(fmt):
    truth = make_truth(85, prompt_len=8, output_len=4, num_layers=2, top_k=2)
    codec = Catalog()(fmt)
    session = codec.open_session()
    session.prefill_unavailable("prefill_timeout")
    body, verdict = session.join(worker_for(fmt).decode(truth, stream=False)[-1], True)
    assert verdict is Verdict.OMITTED
    view = build_view(codec, body, verdict=verdict)
    assert (view.present, view.ids, view.spans, view.problem) == (False, [], [], None)
    assert view.omitted["routed_experts"] == "prefill_timeout"


def test_a_format_without_routed_experts_says_so_without_reading_the_body():
    from toy_codec import ToyCodec

    view = build_view(ToyCodec(), b"\xff anything")
    assert (view.present, view.ids, view.problem) == (False, [], "format toy describes no routed experts")


async def test_a_joined_body_is_decoded_to_the_truths_rows_with_the_splice_at_the_prompt(zstd_edge):
    truth = make_truth(81, prompt_len=30, output_len=20, num_layers=6, top_k=4)
    body = joined_final_body(truth)
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=10) as client:
        answer = await client.post("/v1/experts", content=body)
    assert answer.status_code == 200
    view = answer.json()
    assert (view["positions"], view["row_ids"], view["splice"], view["start"]) == (49, 24, 30, 0)
    assert view["ids"] == list(struct.unpack(f"<{len(truth.experts) // 4}i", truth.experts))
    assert view["max_id"] == max(view["ids"]) and view["problem"] is None and view["omitted"] == {}


async def test_a_large_capture_is_paged_within_the_id_bound(zstd_edge):
    # 4096 ids a row (64 layers x top-64 of 4096 experts): 64 rows per answer, 1200 positions.
    truth = make_truth(82, prompt_len=700, output_len=501, num_layers=64, top_k=64, num_experts=4096)
    body = joined_final_body(truth)
    row = 64 * 64
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=30) as client:
        first = (await client.post("/v1/experts", content=body)).json()
        later = (await client.post("/v1/experts?offset=1190&rows=100", content=body)).json()
    assert (first["positions"], first["offset"], first["rows"]) == (1200, 0, MAX_VIEW_IDS // row)
    assert len(first["ids"]) == MAX_VIEW_IDS
    truth_ids = struct.unpack(f"<{len(truth.experts) // 4}i", truth.experts)
    assert first["ids"] == list(truth_ids[:MAX_VIEW_IDS])
    assert (later["offset"], later["rows"]) == (1190, 10)  # clipped at the end
    assert later["ids"] == list(truth_ids[1190 * row:])


async def test_the_verdict_attributes_rows_to_legs_and_an_unknown_verdict_is_refused(zstd_edge):
    truth = make_truth(84, prompt_len=12, output_len=6, num_layers=2, top_k=4)
    body = joined_final_body(truth)
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=10) as client:
        joined = await client.post("/v1/experts?verdict=joined", content=body)
        bad = await client.post("/v1/experts?verdict=spliced", content=body)
        info = (await client.get("/v1/info")).json()
    assert joined.json()["spans"] == [{"source": "prefill", "start": 0, "stop": 12},
                                      {"source": "decode", "start": 12, "stop": 17}]
    assert bad.status_code == 400 and "verdict must be one of" in bad.json()["error"]["message"]
    # The page names no format field: it finds the value to post, and the text it shows, by the codec's names.
    assert (info["experts_field"], info["text_field"]) == ("routed_experts", "text")


async def test_omission_markers_are_reported_without_a_matrix(zstd_edge):
    body = json.dumps({"text": "x", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                                  "routed_experts_unavailable_reason": "prefill_timeout",
                                                  "input_logprobs_unavailable_reason": "prefill_timeout"}})
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=10) as client:
        view = (await client.post("/v1/experts", content=body)).json()
    assert view["present"] is False and view["ids"] == []
    assert view["omitted"] == {"routed_experts": "prefill_timeout", "input_logprobs": "prefill_timeout"}


async def test_hostile_posts_get_a_clear_answer_and_the_edge_keeps_serving(server):
    """A zstd bomb (a few KiB that inflate to 2 GiB), a body over the bound, and a body that is not
    JSON: each poster gets a clear answer, a stream client is still served, the edge's peak stays bounded."""
    from streamproc_sglang_zstd.worker import zstd_bomb
    from streamproc.decompress import encode_base64

    bomb = json.dumps({"meta_info": {"prompt_tokens": 10, "completion_tokens": 5,
                                     "routed_experts": encode_base64(zstd_bomb(2 << 30, declare_size=False))}})
    bystander = rid("experts-bystander")
    with running_edge(server.url, "--format", "sglang-zstd") as edge:  # its own edge: its own peak
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            baseline = peak_rss(edge.proc.pid)
            answers = await hostile_posts(client, bomb)
            async with await nats.connect(server.url) as nc:
                async with client.stream("GET", f"/v1/results/{bystander}") as r:  # headers once subscribed
                    await publish_results(nc, Subjects(), bystander, [b'{"text":" still here"}'])
                    answered = (r.status_code, await r.aread())
        peak = peak_rss(edge.proc.pid)
    bombed, declared, chunked, garbage = answers

    assert bombed.status_code == 200
    assert bombed.json()["problem"].startswith("cannot decode: too_large")
    assert declared.status_code == 400  # a JSON string, not a result body object
    assert chunked.status_code == 413 and f"body over {MAX_BODY_BYTES} bytes" in chunked.json()["error"]["message"]
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request"
    assert answered == (200, expected_sse([b'{"text":" still here"}']))
    assert peak - baseline < HOSTILE_GROWTH_BOUND, (baseline, peak)


async def hostile_posts(client: httpx.AsyncClient, bomb: str) -> list[httpx.Response]:
    """The bomb; a bare JSON string; a chunked body past the bound; bytes that are not JSON."""
    from streamproc_sglang_zstd.worker import zstd_bomb
    from streamproc.decompress import encode_base64

    async def oversized():
        chunk = b"x" * MiB
        for _ in range(MAX_BODY_BYTES // MiB + 2):
            yield chunk

    return [
        await client.post("/v1/experts", content=bomb),
        await client.post("/v1/experts", content=json.dumps(encode_base64(zstd_bomb(2 << 30, declare_size=True)))),
        await client.post("/v1/experts", content=oversized()),  # no Content-Length: counted as it is read
        await client.post("/v1/experts", content=b"\xff not json"),
    ]


async def test_stats_count_every_result_seen_and_name_the_missing_processor_metrics(zstd_edge, server):
    request_id = rid("stats")
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=10) as client:
        before = (await client.get("/v1/stats")).json()
        async with await nats.connect(server.url) as nc:
            await publish_results(nc, Subjects(), request_id, [b'{"text":"a"}', b'{"text":"b"}', b'{"text":"c"}'])
            await nc.flush()
        for _ in range(100):
            after = (await client.get("/v1/stats")).json()
            if after["results_seen"] >= before["results_seen"] + 3:
                break
    assert after["results_seen"] == before["results_seen"] + 3
    assert after["time"] >= before["time"]
    assert (after["processors"], after["join_wait"], after["processor_results"]) == ([], None, None)


async def test_stats_report_a_processor_that_does_not_answer(server):
    """And with --recent 0 (no wildcard subscription) results seen are unknown, not zero."""
    with running_edge(server.url, "--processor-metrics-url", "http://127.0.0.1:9/metrics", "--recent", "0") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            stats = (await client.get("/v1/stats")).json()
    assert [(p["url"], p["ok"]) for p in stats["processors"]] == [("http://127.0.0.1:9/metrics", False)]
    assert stats["processors"][0]["error"]
    assert stats["join_wait"] is None
    assert stats["processor_results"] is None  # unknown, not 0: no processor answered
    assert stats["results_seen"] is None and stats["results_sent"] == 0


def test_a_processor_metrics_url_that_is_not_http_is_refused_at_start(run_cli):
    done = run_cli("edge", "--processor-metrics-url", "ftp://x/metrics", "--insecure-demo")
    assert done.returncode == 2
    assert "--processor-metrics-url" in done.stderr and "'ftp://x/metrics' is not an http:// or https:// URL" in done.stderr


@contextlib.contextmanager
def metrics_behind_a_token(token: str) -> Iterator[str]:
    """A ``/metrics`` endpoint (one join-wait observation) that answers only ``?token=<token>``, as a
    scrape endpoint behind a query-string credential does; yields its address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            allowed = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("token") == [token]
            body = (b"# TYPE streamproc_join_wait_seconds histogram\n"
                    b'streamproc_join_wait_seconds_bucket{le="+Inf"} 1.0\n'
                    b"streamproc_join_wait_seconds_sum 0.5\nstreamproc_join_wait_seconds_count 1.0\n")
            self.send_response(200 if allowed else 401)
            self.send_header("Content-Length", str(len(body) if allowed else 0))
            self.end_headers()
            if allowed:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def metrics_endpoints(*bodies: bytes | None) -> Iterator[tuple[list[str], list[int]]]:
    """One ``/metrics`` endpoint per body (None: one that accepts the connection and never answers);
    yields their URLs and how many requests each answered so far."""
    answered = [0] * len(bodies)

    def handler(n: int, body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                answered[n] += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass
        return Handler

    servers, silent, urls = [], [], []
    for n, body in enumerate(bodies):
        if body is None:
            sock = socket.create_server(("127.0.0.1", 0))  # listens, never accepts nor answers
            silent.append(sock)
            urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}/metrics")
            continue
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(n, body))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    try:
        yield urls, answered
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for sock in silent:
            sock.close()


def processor_metrics(bounds: tuple[float, ...], waits: list[float], joined: float) -> bytes:
    """A processor's ``/metrics`` as prometheus_client writes it (``generate_latest``, with its
    ``_created`` series): the join waits ``waits`` in a histogram of upper ``bounds``, ``joined`` results."""
    registry = prometheus_client.CollectorRegistry()
    wait = prometheus_client.Histogram("streamproc_join_wait_seconds", "join wait", buckets=bounds, registry=registry)
    for seconds in waits:
        wait.observe(seconds)
    prometheus_client.Counter("streamproc_results", "results", ["verdict"], registry=registry).labels("joined").inc(joined)
    return prometheus_client.generate_latest(registry)


async def test_stats_sum_every_processors_histogram_and_results_and_scrape_each_at_most_once_a_second(server):
    """The page charts the processors together: bucket by bucket (one processor's bucket that the
    other lacks in order among them), sums, counts and results summed; any number of /v1/stats within ``CACHE_SECONDS`` cost one scrape each."""
    one = processor_metrics((0.1, 1.0), [0.05, 0.5, 1.0], 4)
    two = processor_metrics((0.1, 0.5, 1.0), [0.05] * 10 + [0.25] * 10 + [0.75] * 10 + [2.0] * 10, 6)
    with metrics_endpoints(one, two) as (urls, answered):
        with running_edge(server.url, "--processor-metrics-url", ",".join(urls)) as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
                stats = [(await client.get("/v1/stats")).json() for _ in range(3)]
                scraped = list(answered)
                await anyio.sleep(1.2)  # past CACHE_SECONDS
                await client.get("/v1/stats")
    first = stats[0]
    assert [p["ok"] for p in first["processors"]] == [True, True], first
    assert first["join_wait"] == {"buckets": [[0.1, 11], [0.5, 20], [1.0, 33], [None, 43]], "sum": 1.55 + 30.5,
                                  "count": 43}, first["join_wait"]
    assert first["processor_results"] == 10
    assert scraped == [1, 1], scraped  # three /v1/stats, one scrape each
    assert answered == [2, 2], answered


async def test_stats_bound_a_processors_metrics_to_max_scrape_bytes_and_its_answer_to_the_scrape_timeout(server):
    """A scrape of exactly ``MAX_SCRAPE_BYTES`` is read; one byte more is a failed scrape that says
    so (its text never parsed); a processor that never answers is a failed scrape after
    ``SCRAPE_TIMEOUT``, and /v1/stats still answers."""
    body = processor_metrics((1.0,), [0.5], 1)
    exact = body + b"#" * (MAX_SCRAPE_BYTES - len(body) - 1) + b"\n"
    over = body + b"#" * (MAX_SCRAPE_BYTES - len(body)) + b"\n"
    with metrics_endpoints(exact, over, None) as (urls, _):
        with running_edge(server.url, "--processor-metrics-url", ",".join(urls)) as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=SCRAPE_TIMEOUT + 8) as client:
                started = anyio.current_time()
                answer = await client.get("/v1/stats")
                took = anyio.current_time() - started
    assert answer.status_code == 200, answer.text
    stats = answer.json()
    assert [p["ok"] for p in stats["processors"]] == [True, False, False], stats["processors"]
    assert stats["processors"][1]["error"] == f"more than {MAX_SCRAPE_BYTES} bytes", stats["processors"][1]
    assert "timed out" in stats["processors"][2]["error"], stats["processors"][2]
    assert stats["join_wait"]["count"] == 1 and stats["processor_results"] == 1  # the exact one alone
    assert SCRAPE_TIMEOUT <= took < SCRAPE_TIMEOUT + 4, took


async def test_a_processor_metrics_urls_query_is_sent_but_its_values_are_never_shown(server, run_cli):
    """A scrape endpoint may take its credential in the query (``?token=``): /v1/stats (and so the
    live page's chart note) and --print-config showed the URL whole, while a ``user:password@`` is
    refused at start (found by a reviewer). The scrape sends the URL as given; what the edge shows
    keeps each query parameter's name and says ``<redacted>`` for its value (and for a fragment), as
    the access log shows ``access_token=<redacted>`` and --print-config ``user:<redacted>@``."""
    secret = "S3cretQ"
    with metrics_behind_a_token(secret) as address:
        url = f"http://{address}/metrics?token={secret}&job=edge{secret}#{secret}"
        shown = f"http://{address}/metrics?token=<redacted>&job=<redacted>#<redacted>"
        spaced = f"http://{address}/metrics?token={secret} x"  # http.client's InvalidURL repeats path and query
        with running_edge(server.url, "--processor-metrics-url", f"{url},http://127.0.0.1:9/metrics,{spaced}") as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
                answer = await client.get("/v1/stats")
            log = edge.log()
    assert answer.status_code == 200, answer.text  # InvalidURL was not caught: every /v1/stats a 500
    stats = answer.json()
    assert [(p["url"], p["ok"]) for p in stats["processors"]] == [
        (shown, True), ("http://127.0.0.1:9/metrics", False), (f"http://{address}/metrics?token=<redacted>", False)]
    assert "can't contain control characters" in stats["processors"][2]["error"], stats
    assert stats["join_wait"]["count"] == 1  # the query reached the endpoint: it answered
    assert secret not in answer.text and secret not in log
    printed = run_cli("edge", "--processor-metrics-url", url, "--insecure-demo", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["processor_metrics_url"]["value"] == shown
    assert secret not in printed.stdout + printed.stderr
    refused = run_cli("edge", "--processor-metrics-url", f"ftp://{address}/metrics?token={secret}", "--insecure-demo")
    assert refused.returncode == 2 and "is not an http:// or https:// URL" in refused.stderr, refused.stderr
    assert secret not in refused.stdout + refused.stderr


@pytest.mark.parametrize("url", ["http://scraper:S3cretPW@127.0.0.1:9/metrics", "https://S3cretPW@proc:9090/metrics"])
@pytest.mark.parametrize("print_config", [False, True])
def test_a_processor_metrics_url_with_credentials_is_refused_without_showing_them(run_cli, url, print_config):
    """GET /v1/stats names every --processor-metrics-url and --print-config printed it: a password
    in one was shown whole, while the scrape (urllib) never sent it (it read ``user:pw@host`` as the
    host name, so such a URL never worked)."""
    done = run_cli("edge", "--processor-metrics-url", url, "--insecure-demo", *(["--print-config"] * print_config))
    assert done.returncode == 2
    assert "holds credentials (user:password@)" in done.stderr and "<redacted>@" in done.stderr
    assert "S3cretPW" not in done.stdout + done.stderr


@pytest.mark.parametrize("url", ["http://scraper:S3cret/PW@127.0.0.1:9/metrics", "http://scraper:9/S3cretPW@proc/metrics",
                                 "http://scraper:S3cret?PW@127.0.0.1:9/metrics",
                                 "http://scraper:S3cret#PW@127.0.0.1:9/metrics"])
@pytest.mark.parametrize("print_config", [False, True])
def test_a_processor_metrics_url_whose_password_holds_a_delimiter_is_refused_without_showing_it(
        run_cli, url, print_config):
    """A password holding "/", "?" or "#" ends urlsplit's netloc early, so no "@" was in it: the URL
    was accepted and --print-config (and GET /v1/stats) showed the password, whole with a "/"."""
    done = run_cli("edge", "--processor-metrics-url", url, "--insecure-demo", *(["--print-config"] * print_config))
    assert done.returncode == 2, done.stdout
    assert "processor-metrics-url" in done.stderr or "processor_metrics_url" in done.stderr
    assert "S3cret" not in done.stdout + done.stderr, done.stdout + done.stderr



@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(hypothesis.strategies.lists(
    hypothesis.strategies.tuples(hypothesis.strategies.sampled_from("abc"),
                                 hypothesis.strategies.integers(0, 40), hypothesis.strategies.integers(0, 40))))
def test_the_bodies_budget_never_holds_more_than_its_bounds_and_gives_back_exactly_what_it_took(posts):
    """Each post claims its declared length of its client's share, then holds what it reads."""
    from streamproc.edge.experts import BodyBudget

    budget = BodyBudget(total=64, per_client=32)
    admitted: list[tuple[str, int, int]] = []
    for client, declared, read in posts:
        mine = sum(c for who, c, _ in admitted if who == client)
        if not budget.claim(client, declared):
            assert mine + declared > 32  # refused only past the client's share
            continue
        held_before = budget.held
        if budget.hold(read):
            admitted.append((client, declared, read))
        else:
            assert held_before + read > 64  # refused only past the edge's bound
            budget.give(client, declared, 0)
        assert budget.held == sum(h for _, _, h in admitted) <= 64
        assert all(claimed <= 32 for claimed in budget.by_client.values())
    for client, declared, read in admitted:
        budget.give(client, declared, read)
    assert budget.held == 0 and budget.by_client == {}


@pytest.mark.parametrize("fmt", ["sglang-zstd", "vllm"])
async def test_a_body_nested_too_deeply_to_parse_is_a_400_not_a_500(server, fmt):
    """Parsers recurse per nesting level (msgspec raises RecursionError, not DecodeError): ~1 KiB of
    ``[`` from any capability holder was a 500 and an ERROR traceback in the edge's log per post."""
    with running_edge(server.url, "--format", fmt) as edge:
        answers = []
        for body in (b"[" * 2000, b'{"meta_info":' * 2000, b'{"text":"x"}'):  # a client each: a 500 reset its connection
            async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
                answers.append(await client.post("/v1/experts", content=body))
        deep, nested, served = answers
        log = edge.log()
    for answer in (deep, nested):
        assert answer.status_code == 400, (answer.status_code, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request"
    assert served.status_code == 200
    assert "Traceback" not in log and "RecursionError" not in log


@pytest.mark.parametrize("query", ["token=S3cretQ\tx", "token=S3cret\\Q x", "token=S3cretQ\x7f"])
async def test_a_scrape_error_never_shows_a_query_value_that_its_text_escapes(query):
    """http.client's ``InvalidURL`` repeats the path and query through ``repr()``: a tab, DEL or a
    backslash in a query value is escaped there (``\\t``, ``\\\\``), so the query as given was not
    found in the error text and /v1/stats (and the page's chart note) showed the value."""
    from streamproc.edge.metrics import EdgeMetrics
    from streamproc.edge.stats import StatsSource

    url = f"http://127.0.0.1:9/metrics?{query}"
    stats = await StatsSource(EdgeMetrics(), [url], sees_all_results=False).snapshot()
    [scrape] = stats.processors
    assert (scrape.url, scrape.ok) == ("http://127.0.0.1:9/metrics?token=<redacted>", False)
    assert "can't contain control characters" in scrape.error, scrape.error
    assert "S3cret" not in scrape.error, scrape.error


def post_and_leave(port: int, declared: int, sent: bytes, expect_continue: bool) -> bytes:
    """POST /v1/experts declaring ``declared`` bytes, send ``sent`` of them (after the ``100 Continue``
    when ``expect_continue``) and leave; what the edge answered before the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        expect = "Expect: 100-continue\r\n" if expect_continue else ""
        sock.sendall(f"POST /v1/experts HTTP/1.1\r\nHost: edge\r\nContent-Length: {declared}\r\n{expect}\r\n".encode())
        answer = b""
        if expect_continue:
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(65536)
        sock.sendall(sent)
    return answer


async def test_a_poster_that_leaves_before_its_body_ends_costs_no_traceback_and_gives_its_share_back(zstd_edge):
    """``request.stream()`` raises Starlette's ``ClientDisconnect`` when the client leaves mid-body, and
    ``POST /v1/experts`` let it out: Uvicorn logged ``Exception in ASGI application`` with a traceback,
    at error level, for every such post (any capability holder, any client of an --insecure-demo edge,
    chose how many; found by an attack with ``Expect: 100-continue``). The post is now over quietly,
    its share of the bodies' budget given back, and a whole post right after it is answered."""
    for i in range(12):
        answer = await anyio.to_thread.run_sync(post_and_leave, zstd_edge.port, 8 * MiB, b'{"meta_info":', i % 2 == 0)
        assert answer in (b"", b"HTTP/1.1 100 Continue\r\n\r\n"), answer
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=15) as client:
        whole = await client.post("/v1/experts", content=b'{"meta_info":{}}')
    assert whole.status_code == 200 and whole.json()["present"] is False, whole.text
    await anyio.sleep(0.5)
    log = zstd_edge.log()
    assert "Traceback" not in log and "ClientDisconnect" not in log and "level=error" not in log


async def test_posts_whose_client_left_mid_body_are_counted_in_the_metrics(zstd_edge):
    """A ``POST /v1/experts`` whose client left before its body ended was over quietly and counted
    nowhere (no answer, so no access-log status either): an operator could not see a client that
    opens such posts at will. Each is ``streamproc_edge_experts_bodies_abandoned_total`` now; a whole
    post is not."""
    before = zstd_edge.metrics()["streamproc_edge_experts_bodies_abandoned_total"]
    for i in range(3):
        await anyio.to_thread.run_sync(post_and_leave, zstd_edge.port, 4096, b'{"meta_info":', i == 0)
    await wait_until(lambda: zstd_edge.metrics()["streamproc_edge_experts_bodies_abandoned_total"] - before >= 3,
                     10, "three abandoned posts counted")
    async with httpx.AsyncClient(base_url=zstd_edge.url, timeout=15) as client:
        whole = await client.post("/v1/experts", content=b'{"meta_info":{}}')
    assert whole.status_code == 200, whole.text
    assert zstd_edge.metrics()["streamproc_edge_experts_bodies_abandoned_total"] - before == 3


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd"])
async def test_a_body_whose_experts_dtype_is_no_string_gets_a_problem_not_a_500(server, fmt):
    """The dtype name was looked up in a dict as the body gave it: a worker's result (or any poster)
    with ``"routed_experts_dtype": {}`` or ``[]`` raised ``TypeError: unhashable type``, a 500 and an
    ERROR traceback in the edge's log per post. It names no dtype SGLang ships: a view whose
    ``problem`` says so, as for ``"bogus"``."""
    rows = Catalog()(fmt).sequences["routed_experts"].encode(bytes(4 * 6))  # Base64, or Base64(zstd)
    with running_edge(server.url, "--format", fmt) as edge:
        answers = []
        for dtype in ({}, [], "bogus"):
            body = json.dumps({"text": "x", "output_ids": [1], "meta_info": {
                "prompt_tokens": 2, "completion_tokens": 2, "routed_experts": rows,
                "routed_experts_dtype": dtype}}).encode()
            async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:  # a 500 resets its connection
                answers.append(await client.post("/v1/experts", content=body))
        log = edge.log()
    for answer in answers:
        assert answer.status_code == 200, (answer.status_code, answer.text)
        view = answer.json()
        assert view["present"] and view["ids"] == [] and view["problem"].startswith("unknown routed_experts_dtype")
    assert "Traceback" not in log and "TypeError" not in log
