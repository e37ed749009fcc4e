"""The live page in a real browser: headless Chromium (Debian ``chromium`` + ``chromium-driver``)
driven by Selenium. The page follows a request with the browser's own ``EventSource``; the test
reads what the browser's SSE parser delivered (``window.streamprocPage.received``) and compares it
with the bytes the worker published. A screenshot goes to ``artifacts/`` (gitignored).

Needs ``apt-get install -y chromium chromium-driver``: ``scripts/install-system-deps`` (run by
``make test`` and ``.ci/run``) installs them where it can; without them the module is skipped with
a notice that says why, repeated in pytest's terminal summary (tests/conftest.py).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import anyio
import nats
import pytest
from edge_harness import publish_result, publish_results, sse_view
from helpers import rid
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from streamproc.catalog import Catalog, worker_for
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
        assert token in browser.current_url  # the fragment survives the page's own URL updates
        assert token not in edge.log()
