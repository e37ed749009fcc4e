"""The live page in a real browser: headless Chromium (Debian ``chromium`` + ``chromium-driver``)
driven by Selenium. The page follows a request with the browser's own ``EventSource``; the test
reads what the browser's SSE parser delivered (``window.streamprocPage.received``) and compares it
with the bytes the worker published. Screenshots go to ``artifacts/`` (gitignored).

The routed-experts view, the charts and the error states are tested against a real processor
(``sglang-zstd``, joined P/D traffic from ``streamproc.sim``): the heat map's ids must be the
simulation's ground truth, decoded by the edge from the body the browser received.

Needs ``apt-get install -y chromium chromium-driver``: ``scripts/install-system-deps`` (run by
``make test`` and ``.ci/run``) installs them where it can; without them the module is skipped with
a notice that says why, repeated in pytest's terminal summary (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import anyio
import httpx
import nats
import pytest
from edge_harness import publish_result, publish_results, running_edge, sse_view
from helpers import free_port, rid, status_kib
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from streamproc import ChunkPublisher
from streamproc.catalog import Catalog, worker_for
from streamproc.codec import ErrorKind
from streamproc.sim import traffic
from streamproc.simulation import make_truth
from streamproc.wire import Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SUBJECTS = Subjects("streamproc")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


BROWSER_SKIP_NOTICE = (
    "BROWSER TEST SKIPPED: no {missing} on PATH, so the live page was not tested in a browser. "
    "Install them with `scripts/install-system-deps` (as root, with apt-get; `make test` runs it) "
    "or `apt-get install -y chromium chromium-driver`"
)


def _binary(*names: str) -> str | None:
    return next((found for found in map(shutil.which, names) if found), None)


CHROMIUM = _binary("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _binary("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    _missing = " and ".join(name for name, found in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER))
                            if found is None)
    pytest.skip(BROWSER_SKIP_NOTICE.format(missing=_missing), allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = CHROMIUM, CHROMEDRIVER
    with tempfile.TemporaryDirectory(prefix="streamproc-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # for js_errors()
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        driver.set_script_timeout(10)
        try:
            yield driver
        finally:
            driver.quit()


def page_state(driver) -> dict:
    return driver.execute_script(
        "const p = window.streamprocPage;"
        "return {state: p.state, received: p.received, meta: p.meta, verdict: p.verdict,"
        " requestId: p.requestId};"
    )


async def wait_for(driver, predicate, timeout: float = 10.0) -> dict:
    with anyio.fail_after(timeout):
        while True:
            state = page_state(driver)
            if predicate(state):
                return state
            await anyio.sleep(0.05)


def is_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def js_errors(driver) -> list[str]:
    """Script errors logged since the last call (refused HTTP requests are logged too; left out)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and "Failed to load resource" not in entry["message"]]


def renderer_rss_kib() -> int:
    """Resident memory of every Chromium renderer process (the page's tab), KiB."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"--type=renderer" in Path(f"/proc/{pid}/cmdline").read_bytes():
                total += status_kib(int(pid), "VmRSS")
        except (OSError, ValueError):
            pass  # gone meanwhile
    return total


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


async def test_the_pages_eventsource_sees_exactly_the_bytes_the_worker_published(browser, edge, server):
    request_id = rid("page-agg")
    worker = worker_for("sglang")
    truth = make_truth(31, request_id=request_id, output_len=12)
    bodies = (
        worker.agg(truth, stream=True)
        + worker.opaque_agg(truth, stream=True, rng=random.Random(2))[:3]
        + [
            '{"text":" naïve ☃ \u2028 😀","meta_info":{"routed_experts":"%%%"}}'.encode(),
            b' {"text":" data: [DONE]","note":"leading space, framing words inside"}',
        ]
    )
    browser.get(f"{edge.url}/?id={request_id}")
    await wait_for(browser, lambda s: s["state"] == "open")

    async with await nats.connect(server.url) as nc:
        for seq, body in enumerate(bodies):  # live, one at a time, as a worker streams
            await publish_result(nc, SUBJECTS, request_id, seq, body, final=seq == len(bodies) - 1)
            await nc.flush()
            await anyio.sleep(0.02)

    state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    json_bodies = [b for b in bodies if is_json(b)]
    assert len(json_bodies) >= len(bodies) - 3  # the worker's opaque bodies may include raw binary ones
    for seen, body in zip(state["received"], bodies):
        if is_json(body):
            assert seen == body.decode()  # exactly the worker's bytes
        else:
            assert seen == sse_view(body)  # what the SSE standard makes of non-UTF-8 bytes
    assert state["received"][len(bodies) :] == ["[DONE]"]
    assert state["state"] == "done"
    assert [m["seq"] for m in state["meta"]] == list(range(len(bodies)))
    assert browser.find_element(By.ID, "verdict").text == "passthrough"
    shown = browser.find_element(By.ID, "tokens").get_attribute("textContent")
    assert shown.startswith(json.loads(Catalog()("sglang").fold(worker.agg(truth, stream=True)))["text"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chunks tr")) == len(bodies)
    assert screenshot(browser, "edge-page-aggregated.png").stat().st_size > 0


async def test_a_long_request_keeps_the_last_rows_an_exact_count_and_all_its_text(browser, edge, server):
    """A row per result without a bound (and the text rewritten whole per result) made a tab following
    a long request ever slower: the table keeps the last MAX_ROWS (1,000) rows, the count and the text
    stay whole, and ``received`` keeps every body."""
    request_id = rid("page-long")
    total = 2500
    bodies = [json.dumps({"text": f"<{seq}>", "meta_info": {"id": request_id}}).encode() for seq in range(total)]
    browser.get(f"{edge.url}/?id={request_id}")
    await wait_for(browser, lambda s: s["state"] == "open")
    async with await nats.connect(server.url) as nc:
        for seq, body in enumerate(bodies):
            await publish_result(nc, SUBJECTS, request_id, seq, body, final=seq == total - 1)
        await nc.flush()
    state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"], timeout=60)
    assert state["received"] == [b.decode() for b in bodies] + ["[DONE]"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#chunks tr")
    assert len(rows) == 1000
    assert rows[0].find_element(By.CSS_SELECTOR, "td").text == str(total - 1000)  # the oldest kept row
    assert browser.find_element(By.ID, "count").text == f"{total} results (the last 1000 shown)"
    assert browser.find_element(By.ID, "tokens").get_attribute("textContent") == "".join(
        f"<{seq}>" for seq in range(total))
    assert js_errors(browser) == []


async def test_the_page_shows_join_verdicts_and_omission_reasons(browser, edge, server):
    request_id = rid("page-pd")
    worker = worker_for("sglang")
    truth = make_truth(32, request_id=request_id, output_len=8)
    bodies = worker.decode(truth, stream=True)
    last = json.loads(bodies[-1])
    last["meta_info"].pop("routed_experts", None)
    last["meta_info"]["routed_experts_unavailable_reason"] = "prefill_timeout"
    bodies[-1] = json.dumps(last, separators=(",", ":")).encode()
    browser.get(f"{edge.url}/?id={request_id}")
    await wait_for(browser, lambda s: s["state"] == "open")

    async with await nats.connect(server.url) as nc:
        for seq, body in enumerate(bodies):
            final = seq == len(bodies) - 1
            await publish_result(
                nc,
                SUBJECTS,
                request_id,
                seq,
                body,
                final=final,
                verdict=Verdict.OMITTED if final else Verdict.JOINED,
            )
        await nc.flush()

    state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    assert state["received"] == [body.decode() for body in bodies] + ["[DONE]"]
    assert [m["verdict"] for m in state["meta"]] == ["joined"] * (len(bodies) - 1) + ["omitted"]
    assert browser.find_element(By.ID, "verdict").text == "omitted"
    assert "routed_experts: prefill_timeout" in browser.find_element(By.ID, "reasons").text
    screenshot(browser, "edge-page-omitted.png")


async def test_omission_reasons_a_body_chose_are_shown_as_plain_text_never_looked_up_through_a_prototype(
        browser, edge, server):
    """An aggregated body passes through byte for byte, so its ``<field>_unavailable_reason`` values are
    the worker's. The experts panel explained a reason through an object literal: ``constructor``
    showed ``(function Object() { [native code] })``; the summary line showed a non-string reason as
    ``[object Object]`` (found by a reviewer). Known reasons keep their meaning; others are named as
    unknown, non-strings as JSON, long ones cut to 64 characters and their length."""
    request_id = rid("page-reasons")
    long_reason = "r" * 500
    body = json.dumps({"text": "x", "meta_info": {
        "routed_experts_unavailable_reason": "constructor",
        "input_token_logprobs_unavailable_reason": {"toString": 1},
        "hidden_states_unavailable_reason": "prefill_timeout",
        "output_token_logprobs_unavailable_reason": long_reason,
        "__proto___unavailable_reason": "hasOwnProperty",
    }}, separators=(",", ":")).encode()
    browser.get(f"{edge.url}/?id={request_id}")
    await wait_for(browser, lambda s: s["state"] == "open")
    async with await nats.connect(server.url) as nc:
        await publish_result(nc, SUBJECTS, request_id, 0, body, final=True, verdict=Verdict.PASSTHROUGH)
        await nc.flush()
    await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    await wait_js(browser, experts_state, lambda s: s["state"] == "omitted")
    cut = "r" * 64 + "... (500 characters)"
    assert browser.find_element(By.ID, "reasons").text == (
        'omitted routed_experts: constructor, input_token_logprobs: {"toString":1}, hidden_states: prefill_timeout, '
        f"output_token_logprobs: {cut}, __proto__: hasOwnProperty")
    unknown = "(a reason this page does not know)"
    assert [item.text for item in browser.find_elements(By.CSS_SELECTOR, "#experts-omitted li")] == [
        f"omitted routed_experts: constructor {unknown}",
        f'omitted input_token_logprobs: {{"toString":1}} {unknown}',
        "omitted hidden_states: prefill_timeout (the prefill leg did not complete within --prefill-timeout)",
        f"omitted output_token_logprobs: {cut} {unknown}",
        f"omitted __proto__: hasOwnProperty {unknown}",
    ]
    assert browser.find_element(By.ID, "experts-summary").text.startswith(
        "no routed_experts in this request's results: omitted, see why below")
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "native code" not in text and "[object Object]" not in text, [
        line for line in text.splitlines() if "native code" in line or "[object Object]" in line]
    assert js_errors(browser) == []


async def test_a_result_whose_body_is_done_does_not_end_the_pages_stream(browser, edge, server):
    """A passthrough body is its worker's bytes, and ``[DONE]`` is a body like any other: the edge
    frames it with its ``id:`` (seq), its own end marker has none. The page took any ``[DONE]`` for
    the end and closed the stream after it, losing the results after it (found by a reviewer)."""
    request_id = rid("page-forged-done")
    bodies = [b'{"text":"a"}', b"[DONE]", b'{"text":"b"}']
    browser.get(f"{edge.url}/?id={request_id}")
    await wait_for(browser, lambda s: s["state"] == "open")
    async with await nats.connect(server.url) as nc:
        for seq, body in enumerate(bodies):
            await publish_result(nc, SUBJECTS, request_id, seq, body, final=seq == len(bodies) - 1)
            await nc.flush()
            await anyio.sleep(0.1)  # live, one at a time: the page has handled each before the next
    await wait_for(browser, lambda s: s["state"] == "done")
    await anyio.sleep(0.3)
    state = page_state(browser)
    assert state["received"] == ['{"text":"a"}', "[DONE]", '{"text":"b"}', "[DONE]"], state["received"]
    assert state["state"] == "done"
    assert [m["seq"] for m in state["meta"]] == [0, 1, 2]
    assert browser.find_element(By.ID, "count").text == "3 results"
    assert [row.find_element(By.CSS_SELECTOR, "td").text for row in
            browser.find_elements(By.CSS_SELECTOR, "#chunks tr")] == ["0", "1", "2"]
    assert browser.find_element(By.ID, "tokens").get_attribute("textContent") == "ab"
    assert js_errors(browser) == []


async def test_a_recent_request_can_be_picked_from_the_list_or_typed_in(browser, edge, server):
    picked, typed = rid("page-recent"), rid("page-typed")
    async with await nats.connect(server.url) as nc:
        await publish_results(nc, SUBJECTS, picked, [b'{"text":" one"}', b'{"text":" two"}'])
        await publish_results(nc, SUBJECTS, typed, [b'{"text":" typed"}'], verdict=Verdict.JOINED)
    browser.get(f"{edge.url}/")

    button = None
    with anyio.fail_after(10):  # the list refreshes every 2 s from GET /v1/recent
        while button is None:
            found = browser.find_elements(By.CSS_SELECTOR, f'#recent button[data-request-id="{picked}"]')
            button = found[0] if found else None
            await anyio.sleep(0.1)
    button.click()
    state = await wait_for(browser, lambda s: s["requestId"] == picked and s["received"][-1:] == ["[DONE]"])
    assert state["received"] == ['{"text":" one"}', '{"text":" two"}', "[DONE]"]
    assert browser.find_element(By.ID, "tokens").get_attribute("textContent") == " one two"

    field = browser.find_element(By.ID, "request-id")
    field.clear()
    field.send_keys(typed)
    browser.find_element(By.ID, "follow").click()
    state = await wait_for(browser, lambda s: s["requestId"] == typed and s["received"][-1:] == ["[DONE]"])
    assert state["received"] == ['{"text":" typed"}', "[DONE]"]
    assert state["verdict"] == "joined"
    assert browser.current_url.endswith(f"?id={typed}")
    screenshot(browser, "edge-page-recent.png")


async def test_a_request_id_with_a_slash_is_followed_from_the_recent_list(browser, edge, server):
    """The wire rule allows ``/`` in a request id; the page sends it as ``%2F``, which the edge
    answered with 404 (the page said "refused (HTTP 404)") until it read the id from the raw path."""
    slashed = f"tenant/{rid('page-slash')}"
    async with await nats.connect(server.url) as nc:
        await publish_results(nc, SUBJECTS, slashed, [b'{"text":" sl"}', b'{"text":"ash"}'])
    browser.get(f"{edge.url}/")
    button = None
    with anyio.fail_after(10):
        while button is None:
            found = browser.find_elements(By.CSS_SELECTOR, f'#recent button[data-request-id="{slashed}"]')
            button = found[0] if found else None
            await anyio.sleep(0.1)
    button.click()
    state = await wait_for(browser, lambda s: s["requestId"] == slashed and s["state"] in ("done", "refused", "failed"))
    assert state["received"] == ['{"text":" sl"}', '{"text":"ash"}', "[DONE]"], browser.find_element(By.ID, "notice").text
    assert state["state"] == "done"
    assert browser.find_element(By.ID, "tokens").get_attribute("textContent") == " slash"


async def test_the_insecure_demo_page_says_so_on_screen(browser, edge):
    browser.get(f"{edge.url}/")
    with anyio.fail_after(10):
        while not browser.find_element(By.ID, "auth-banner").is_displayed():
            await anyio.sleep(0.05)
    assert "Insecure demo" in browser.find_element(By.ID, "auth-banner").text


async def test_with_an_operator_token_in_the_fragment_the_page_follows_a_request_on_an_authenticated_edge(
        browser, server, tmp_path):
    from edge_harness import running_edge

    from streamproc.client.capability import mint_capability

    secret = b"page-test-secret-0123456789abcdef-0123"
    (tmp_path / "edge.key").write_bytes(secret)
    request_id = rid("page-auth")
    bodies = [b'{"text":"a"}', b'{"text":"ab"}']
    with running_edge(server.url, "--auth-key-file", str(tmp_path / "edge.key"), "--ensure-results-stream") as edge:
        async with await nats.connect(server.url) as nc:
            await publish_results(nc, SUBJECTS, request_id, bodies)  # the page attaches late: JetStream replays
        browser.get(f"{edge.url}/?id={request_id}")  # no token: the page asks for one, the API refuses
        with anyio.fail_after(10):
            while not browser.find_element(By.ID, "auth-banner").is_displayed():
                await anyio.sleep(0.05)
        assert "operator capability" in browser.find_element(By.ID, "auth-banner").text
        token = mint_capability(secret, operator=True, ttl=120)
        browser.get(f"{edge.url}/?id={request_id}#access_token={token}")
        browser.refresh()  # only the fragment changed: a same-document navigation, no reload
        state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
        assert state["received"] == [b.decode() for b in bodies] + ["[DONE]"]
        with anyio.fail_after(10):  # the recent list (operator data) loads too
            while request_id not in browser.find_element(By.ID, "recent").text:
                await anyio.sleep(0.1)
        assert not browser.find_element(By.ID, "auth-banner").is_displayed()
        # The token left the address (no history entry, bookmark or copied link holds it), and the
        # tab keeps it: a reload follows the request again, authenticated.
        assert token not in browser.current_url and "access_token" not in browser.current_url
        browser.back()  # the entry before: the page opened without a token; the token's own was replaced
        assert token not in browser.current_url
        browser.forward()
        browser.refresh()
        state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
        assert state["received"] == [b.decode() for b in bodies] + ["[DONE]"]
        assert not browser.find_element(By.ID, "auth-banner").is_displayed()
        assert token not in edge.log()
        browser.get(f"{edge.url}/?id={request_id}#access_token=")  # an empty one forgets it
        browser.refresh()
        with anyio.fail_after(10):
            while not browser.find_element(By.ID, "auth-banner").is_displayed():
                await anyio.sleep(0.05)


# ---------------------------------------------------------------- experts view, charts, states

def experts_state(driver) -> dict:
    return driver.execute_script(
        "const e = window.streamprocExperts, p = window.streamprocPage;"
        "return {state: e.state, view: e.view, layout: e.layout, pd: e.pd, page: p.state,"
        " done: p.received[p.received.length - 1] === '[DONE]', notice: document.getElementById('notice').textContent};"
    )


async def wait_js(driver, read, predicate, timeout: float = 15.0) -> dict:
    with anyio.fail_after(timeout):
        while True:
            state = read(driver)
            if predicate(state):
                return state
            await anyio.sleep(0.05)


def pixel(driver, canvas_id: str, x: int, y: int) -> list[int]:
    return driver.execute_script(
        "const c = document.getElementById(arguments[0]);"
        "return Array.from(c.getContext('2d').getImageData(arguments[1], arguments[2], 1, 1).data);",
        canvas_id, x, y,
    )


def rgb(hex_colour: str) -> list[int]:
    return [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)] + [255]


PREFILL, DECODE, SPLICE, AGG = rgb("#3d5afe"), rgb("#ff9100"), rgb("#d50000"), rgb("#90a4ae")
LEFT, HEAD = 34, 14  # experts.js geometry: cells start LEFT px from the left, the leg band HEAD px down


@pytest.fixture
def zstd_pipeline(nats_server):
    """An edge (sglang-zstd, results stream, reading the processor's /metrics) on a fresh server;
    the processor is started by the test on ``http_port``."""
    http_port = free_port()
    with running_edge(nats_server.url, "--format", "sglang-zstd", "--ensure-results-stream",
                      "--processor-metrics-url", f"http://127.0.0.1:{http_port}/metrics") as edge:
        yield edge, http_port


async def test_the_heat_map_shows_a_joined_requests_expert_ids_with_the_splice_marked(
    browser, zstd_pipeline, nats_server, start_processor
):
    edge, http_port = zstd_pipeline
    worker = worker_for("sglang-zstd")
    base = rid("page-experts")
    # 40 prompt rows from prefill, 29 generated rows from decode; 12 layers x top-2.
    truth = make_truth(71, request_id=f"{base}-pd", prompt_len=40, output_len=30, num_layers=12, top_k=2)
    missing = make_truth(72, request_id=f"{base}-missing", prompt_len=12, output_len=5, num_layers=12, top_k=2)
    agg = make_truth(73, request_id=f"{base}-agg", prompt_len=9, output_len=7, num_layers=12, top_k=2)
    plans = [
        traffic.PlannedRequest(truth.request_id, "pd", True, truth, prefill=worker.prefill(truth, stream=True),
                               decode=worker.decode(truth, stream=True)),
        traffic.PlannedRequest(missing.request_id, "pd", True, missing, decode=worker.decode(missing, stream=True),
                               fault="missing_prefill"),
        traffic.PlannedRequest(agg.request_id, "agg", True, agg, agg=worker.agg(agg, stream=True)),
    ]
    async with start_processor("in-process", format="sglang-zstd", prefill_timeout=1, http_port=http_port):
        browser.get(f"{edge.url}/?id={truth.request_id}&topk=2")  # before the traffic: the charts see it
        await wait_for(browser, lambda s: s["state"] in ("open", "waiting"))
        async with await nats.connect(nats_server.url) as nc:
            await traffic.publish(nc, SUBJECTS, traffic.schedule(plans, seed=3))
        shown = await wait_js(browser, experts_state, lambda s: s["state"] == "shown")

        view, layout = shown["view"], shown["layout"]
        assert shown["pd"] and shown["page"] == "done"
        assert (view["positions"], view["row_ids"], view["splice"]) == (truth.rows, 24, 40)
        assert view["spans"] == [{"source": "prefill", "start": 0, "stop": 40},  # the page posted the verdict
                                 {"source": "decode", "start": 40, "stop": truth.rows}]
        assert (view["prompt_tokens"], view["completion_tokens"], view["dtype"]) == (40, 30, "int32")
        assert view["ids"] == list(memoryview(truth.experts).cast("i"))  # the ground truth, not stale rows
        assert (layout["layers"], layout["topK"], layout["splice"]) == (12, 2, 40)
        summary = browser.find_element(By.ID, "experts-summary").text
        assert "69 positions [0, 69) × 12 layers × top-2" in summary
        assert "0–39 from prefill, 40–68 from decode; splice at position 40" in summary
        cw, band_y = layout["cw"], HEAD + 2
        assert pixel(browser, "experts-map", LEFT + 39 * cw + cw // 2, band_y) == PREFILL
        assert pixel(browser, "experts-map", LEFT + 41 * cw + cw // 2, band_y) == DECODE
        assert pixel(browser, "experts-map", LEFT + 40 * cw, layout["top"] + 3) == SPLICE
        assert pixel(browser, "experts-map", LEFT + 5 * cw + 1, layout["top"] + 1) not in (PREFILL, DECODE, SPLICE,
                                                                                          [255, 255, 255, 255])

        browser.execute_script("document.getElementById('experts-panel').scrollIntoView()")
        # Hovering a cell names it: position 45 (a decode row), layer 3, slot 1.
        canvas = browser.find_element(By.ID, "experts-map")
        size = canvas.size
        x = LEFT + 45 * cw + cw // 2 - size["width"] // 2
        y = layout["top"] + 3 * layout["lh"] + layout["sh"] + layout["sh"] // 2 - size["height"] // 2
        ActionChains(browser).move_to_element_with_offset(canvas, x, y).perform()
        expert = memoryview(truth.experts).cast("i")[45 * 24 + 3 * 2 + 1]
        assert browser.find_element(By.ID, "experts-hover").text == \
            f"position 45 (decode) · layer 3 · slot 1 · expert {expert}"
        screenshot(browser, "edge-page-experts-joined.png")

        # The final body is long; a click shows all of it, wrapped, nothing hidden.
        rows = browser.find_elements(By.CSS_SELECTOR, "#chunks tr td.body")
        final_cell = rows[-1]
        final_body = browser.execute_script("return window.streamprocPage.received.at(-2)")
        assert len(final_body) > 2000 and final_cell.get_attribute("textContent") == final_body
        assert browser.execute_script("return arguments[0].scrollWidth > arguments[0].clientWidth", final_cell)
        final_cell.click()
        assert "expanded" in final_cell.get_attribute("class")
        assert browser.execute_script(
            "const c = arguments[0]; return getComputedStyle(c).whiteSpace === 'pre-wrap'"
            " && c.scrollWidth <= c.clientWidth && c.getBoundingClientRect().height > 100", final_cell)
        browser.execute_script("arguments[0].scrollIntoView()", final_cell)
        screenshot(browser, "edge-page-full-body.png")
        final_cell.click()

        # Charts: results/s from the edge's subscription, join wait from the processor's histogram
        # (the missing prefill leg waited its 1 s prefill timeout).
        charts = await wait_js(
            browser, lambda d: d.execute_script("return window.streamprocCharts"),
            # one result waited ~1000 ms among at most ~20 in its interval
            lambda c: any(r > 0 for r in c["rates"]) and any(j[0] is not None and j[0] >= 50 for j in c["joins"])
            and c["samples"] >= 6,
        )
        # the joins' own CPU time beside the wait (streamproc_join_seconds), in the interval the joins were in
        assert any(ms is not None and ms > 0 for ms in charts["computes"]), charts
        assert " · cpu " in browser.find_element(By.ID, "join-value").text
        assert charts["note"] == "from 1 processor(s)"
        assert browser.find_element(By.ID, "rate-value").text.endswith("/s")
        browser.execute_script("window.scrollTo(0, 0)")
        screenshot(browser, "edge-page-charts.png")

        # The request whose prefill never came: routed experts omitted, and why.
        browser.get(f"{edge.url}/?id={missing.request_id}")
        omitted = await wait_js(browser, experts_state, lambda s: s["state"] == "omitted")
        assert omitted["page"] == "done"
        assert browser.find_element(By.ID, "verdict").text == "omitted"
        reasons = browser.find_element(By.ID, "experts-omitted").text
        assert "omitted routed_experts: prefill_timeout (the prefill leg did not complete within --prefill-timeout)" \
            in reasons
        assert "omitted input_logprobs: prefill_timeout" in reasons
        assert not browser.find_element(By.ID, "experts-map").is_displayed()  # no heat map without rows
        screenshot(browser, "edge-page-experts-omitted.png")

        # An aggregated request: one worker's rows, no splice.
        browser.get(f"{edge.url}/?id={agg.request_id}&topk=2")
        aggregated = await wait_js(browser, experts_state, lambda s: s["state"] == "shown")
        assert not aggregated["pd"] and aggregated["layout"]["splice"] is None
        assert aggregated["view"]["spans"] == [{"source": "worker", "start": 0, "stop": agg.rows}]
        assert aggregated["view"]["ids"] == list(memoryview(agg.experts).cast("i"))
        assert "aggregated: every row from one worker, no splice" in browser.find_element(By.ID, "experts-summary").text
        assert pixel(browser, "experts-map", LEFT + 1, HEAD + 2) == AGG
        assert js_errors(browser) == []


async def test_the_page_says_it_is_waiting_for_a_request_that_has_not_started(browser, edge, server):
    request_id = rid("page-waiting")
    browser.get(f"{edge.url}/?id={request_id}")
    state = await wait_for(browser, lambda s: s["state"] == "waiting")
    notice = browser.find_element(By.ID, "notice")
    assert notice.is_displayed()
    assert notice.text.startswith(f"waiting for request {request_id}: no result yet. It has not started")
    assert state["received"] == []
    screenshot(browser, "edge-page-waiting.png")

    async with await nats.connect(server.url) as nc:
        await publish_results(nc, SUBJECTS, request_id, [b'{"text":" late"}'])
    state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    assert state["state"] == "done"
    assert not browser.find_element(By.ID, "notice").is_displayed()


async def test_a_finished_request_an_edge_without_results_stream_cannot_replay_is_named(browser, nats_server):
    request_id = rid("page-gone")
    with running_edge(nats_server.url) as edge:  # no --ensure-results-stream: core NATS, live results only
        async with await nats.connect(nats_server.url) as nc:
            await publish_results(nc, SUBJECTS, request_id, [b'{"text":" a"}', b'{"text":" b"}'])
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            with anyio.fail_after(10):
                while not any(e["request_id"] == request_id for e in (await client.get("/v1/recent")).json()):
                    await anyio.sleep(0.05)
        browser.get(f"{edge.url}/?id={request_id}")
        await wait_for(browser, lambda s: s["state"] == "waiting")
        notice = await wait_js(browser, lambda d: d.find_element(By.ID, "notice").text,
                               lambda text: "already finished" in text)
    assert notice == (f"request {request_id} already finished (2 results), but this edge cannot replay it: it has "
                      "no JetStream results stream (start it with --ensure-results-stream)")


@pytest.mark.parametrize("bad_id", ["has.dot", "x" * 257])
async def test_an_invalid_id_shows_the_edges_400(browser, edge, bad_id):
    browser.get(f"{edge.url}/?id={bad_id}")
    await wait_for(browser, lambda s: s["state"] == "invalid")
    refusal = browser.execute_script("return window.streamprocPage.refusal")
    assert refusal["status"] == 400
    notice = browser.find_element(By.ID, "notice")
    assert notice.is_displayed()
    assert notice.text == "invalid request id (the edge answered 400): " + refusal["message"]
    assert "request id" in refusal["message"]
    assert browser.find_element(By.ID, "state").text == "invalid"
    if "." in bad_id:
        screenshot(browser, "edge-page-invalid-id.png")


async def test_an_error_result_from_the_processor_is_shown_as_an_error(browser, nats_server, start_processor):
    """A contract violation (a prefill chunk on an aggregated request) ends in an invalid_chunk
    error result, published by a real processor."""
    worker = worker_for("sglang-zstd")
    truth = make_truth(74, request_id=rid("page-error"), prompt_len=6, output_len=8)
    plan = traffic.PlannedRequest(truth.request_id, "agg", True, truth, agg=worker.agg(truth, stream=True),
                                  prefill=worker.prefill(truth, stream=False), fault="contract")
    with running_edge(nats_server.url, "--format", "sglang-zstd", "--ensure-results-stream") as edge:
        async with start_processor("in-process", format="sglang-zstd"):
            async with await nats.connect(nats_server.url) as nc:
                await traffic.publish(nc, SUBJECTS, traffic.schedule([plan]))
            browser.get(f"{edge.url}/?id={truth.request_id}")
            state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    assert state["state"] == "failed" and state["verdict"] == "error"
    assert state["meta"][-1]["error"] == ErrorKind.INVALID_CHUNK
    error = json.loads(state["received"][-2])["error"]
    notice = browser.find_element(By.ID, "notice")
    assert notice.is_displayed()
    assert notice.text == f"error result (invalid_chunk): {error['message']}"
    screenshot(browser, "edge-page-error.png")


async def test_the_edges_own_timeout_is_shown_as_an_error(browser, nats_server):
    request_id = rid("page-timeout")
    with running_edge(nats_server.url, "--result-timeout", "1") as edge:
        browser.get(f"{edge.url}/?id={request_id}")
        state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    assert state["state"] == "failed"
    assert browser.find_element(By.ID, "notice").text.startswith(
        f"the edge ended the stream (timeout): no result for request {request_id} within 1.0s")


async def test_a_stream_the_edge_refuses_with_503_is_shown_as_refused(browser, nats_server):
    held, refused = rid("page-held"), rid("page-refused")
    with running_edge(nats_server.url, "--max-streams", "1") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=20) as client:
            async with client.stream("GET", f"/v1/results/{held}") as holding:  # the one slot
                assert holding.status_code == 200
                browser.get(f"{edge.url}/?id={refused}")
                await wait_for(browser, lambda s: s["state"] == "refused")
                refusal = browser.execute_script("return window.streamprocPage.refusal")
                notice = browser.find_element(By.ID, "notice").text
                screenshot(browser, "edge-page-refused.png")
    assert refusal["status"] == 503
    assert notice == "the edge refused the stream (HTTP 503): " + refusal["message"]
    assert "too many concurrent result streams (limit 1)" in refusal["message"]


async def test_a_capture_larger_than_one_answer_is_paged(browser, edge, server):
    """1024 ids a row (64 layers x top-16): 256 rows an answer, so 400 positions take two pages.
    The worker sends uint8 ids (``SGLANG_ROUTED_EXPERTS_DTYPE``), which keeps the body under NATS'
    1 MiB payload limit and exercises the advertised dtype."""
    from streamproc_sglang import SGLangWorker
    from streamproc_sglang.upstream import Shape

    request_id = rid("page-paged")
    worker = SGLangWorker(shape=Shape(dtype="uint8", advertise_dtype=True))
    truth = make_truth(75, request_id=request_id, prompt_len=250, output_len=151, num_layers=64, top_k=16,
                       num_experts=256)
    bodies = worker.agg(truth, stream=False)
    async with await nats.connect(server.url) as nc:
        await publish_results(nc, SUBJECTS, request_id, bodies)
    browser.get(f"{edge.url}/?id={request_id}&topk=16")
    first = await wait_js(browser, experts_state, lambda s: s["state"] == "shown")
    ids = list(memoryview(truth.experts).cast("i"))
    assert (first["view"]["positions"], first["view"]["offset"], first["view"]["rows"]) == (400, 0, 256)
    assert first["view"]["ids"] == ids[:256 * 1024]
    assert (first["layout"]["layers"], first["layout"]["topK"], first["view"]["dtype"]) == (64, 16, "uint8")
    pager = browser.find_element(By.ID, "experts-pager")
    assert "rows 0–255 of 400" in pager.text
    previous, following = pager.find_elements(By.TAG_NAME, "button")
    assert not previous.is_enabled() and following.is_enabled()
    following.click()
    second = await wait_js(browser, experts_state, lambda s: s["view"]["offset"] == 256)
    assert second["view"]["rows"] == 144 and second["view"]["ids"] == ids[256 * 1024:]
    assert "rows 256–399 of 400" in browser.find_element(By.ID, "experts-pager").text
    browser.execute_script("document.getElementById('experts-panel').scrollIntoView()")
    screenshot(browser, "edge-page-experts-paged.png")
    assert js_errors(browser) == []


async def test_the_edges_own_timeout_after_a_result_is_shown_as_an_error(browser, nats_server):
    """An EventSource keeps the last ``id:`` it saw: the edge's own error frame (no ``id:``) after a
    result arrives with that result's ``lastEventId``, so it must still be told apart from a result."""
    request_id = rid("page-timeout-late")
    with running_edge(nats_server.url, "--result-timeout", "1") as edge:
        browser.get(f"{edge.url}/?id={request_id}")
        await wait_for(browser, lambda s: s["state"] == "open")
        async with await nats.connect(nats_server.url) as nc:
            await publish_result(nc, SUBJECTS, request_id, 0, b'{"text":"only one"}')  # not final
            await nc.flush()
        state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
    error = json.loads(state["received"][1])["error"]
    assert error["type"] == "timeout"
    assert state["state"] == "failed", state
    assert state["verdict"] == "error"
    assert browser.find_element(By.ID, "notice").text.startswith(
        f"the edge ended the stream (timeout): no result for request {request_id} within 1.0s")


async def test_the_page_runs_no_injected_inline_script_and_may_not_be_framed(browser, edge):
    """The page comes with a Content-Security-Policy: its own scripts only. A script element a bug
    or an injection put into the page does not run, and no other site may frame it."""
    response = httpx.get(f"{edge.url}/", timeout=10)
    assert response.status_code == 200
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY" and response.headers["referrer-policy"] == "no-referrer"
    assert httpx.get(f"{edge.url}/edge.js", timeout=10).headers["x-content-type-options"] == "nosniff"
    browser.get(f"{edge.url}/")
    with anyio.fail_after(10):  # the page's own scripts ran under the policy
        while not browser.execute_script("return window.streamprocPage !== undefined && document.readyState === 'complete'"):
            await anyio.sleep(0.05)
    assert not [line for line in js_errors(browser) if "Content Security Policy" in line]  # nothing of its own refused
    ran = browser.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.injected = 1';"
        "document.body.appendChild(s); return window.injected === 1;")
    assert ran is False
    refused = js_errors(browser)
    assert any("Content Security Policy" in line for line in refused), refused


async def test_a_worker_flooding_its_request_with_large_bodies_costs_the_tab_a_bounded_amount(
        browser, nats_server, start_processor):
    """A worker's aggregated chunks pass through byte for byte, up to NATS' 1 MiB each, as many as it
    likes. The page laid out every body whole in its row and all the generated text: 12 bodies of
    900 KB took the tab from ~370 MB to ~1.2 GB, and it fell so far behind that the edge ended the
    stream (`overloaded`). Now a row shows a body's start until clicked, the text its last 256 Ki
    characters and `received` the newest 16 Mi characters of bodies; the count and the last body stay
    exact, and the tab follows the next request as before."""
    flood, honest = rid("page-flood"), rid("page-after-flood")
    total, size = 60, 900_000
    bodies = [json.dumps({"text": chr(65 + seq % 26) * size} if seq % 2 else
                         {"text": "x", "meta_info": {"blob": chr(97 + seq % 26) * size}}).encode()
              for seq in range(total)]
    with running_edge(nats_server.url) as edge:
        async with start_processor("in-process"):
            browser.get(f"{edge.url}/?id={flood}")
            await wait_for(browser, lambda s: s["state"] in ("open", "waiting"))
            before = renderer_rss_kib()
            peak = before
            async with await nats.connect(nats_server.url) as nc:
                publisher = ChunkPublisher(nc, SUBJECTS)
                for seq, body in enumerate(bodies):
                    await publisher.publish(flood, "agg", seq, body, final=seq == total - 1)
                    await nc.flush()
                    await anyio.sleep(0.1)  # ~9 MB/s: a tab that keeps up with it is within the edge's buffer
                    peak = max(peak, renderer_rss_kib())
                await nc.flush()
                with anyio.fail_after(60):
                    while (state := browser.execute_script(
                            "const p = window.streamprocPage; return {state: p.state, results: p.results,"
                            " dropped: p.dropped, last: p.received.slice(-2), kept: p.received.length}"))["state"] \
                            not in ("done", "failed"):
                        peak = max(peak, renderer_rss_kib())
                        await anyio.sleep(0.2)
                peak = max(peak, renderer_rss_kib())
                assert state["state"] == "done", browser.find_element(By.ID, "notice").text
                assert state["results"] == total and state["last"] == [bodies[-1].decode(), "[DONE]"]
                assert state["dropped"] > 0 and (state["kept"] - 1) * size <= 16 * 1024 * 1024
                assert browser.find_element(By.ID, "count").text == f"{total} results"
                assert (peak - before) < 400 * 1024, (before, peak)  # was +830 MiB after 12 bodies
                text = browser.find_element(By.ID, "tokens").get_attribute("textContent")
                assert len(text) == 256 * 1024 and text == json.loads(bodies[-1])["text"][-len(text):]
                assert "characters are not shown" in browser.find_element(By.ID, "tokens-cut").text
                cells = browser.find_elements(By.CSS_SELECTOR, "#chunks tr td.body")
                assert len(cells) == total and all(len(c.get_attribute("textContent")) < 9000 for c in cells)
                cells[-1].click()  # the newest body, whole
                assert cells[-1].get_attribute("textContent") == bodies[-1].decode()
                cells[0].click()  # let go: said so
                assert "the page no longer holds the rest" in cells[0].get_attribute("textContent")
                assert js_errors(browser) == []

                browser.get(f"{edge.url}/?id={honest}")  # the same tab follows the next request
                await wait_for(browser, lambda s: s["state"] in ("open", "waiting"))
                await ChunkPublisher(nc, SUBJECTS).publish_leg(honest, "agg", [b'{"text":"fine"}'])
                state = await wait_for(browser, lambda s: s["received"][-1:] == ["[DONE]"])
                assert state["received"] == ['{"text":"fine"}', "[DONE]"] and state["state"] == "done"
