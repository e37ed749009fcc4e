"""What both compose tests share: the compose file as a user gets it, and the checks at the edge.

Not a test module. ``test_compose.py`` runs every service natively (the fast check);
``test_compose_real.py`` runs them in Docker with Compose v2. Both must see the same results
through the edge, so the checks live once, here.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from httpx_sse import connect_sse

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"

# `${NAME:-default}`: the only interpolation form the compose file uses, so that a plain
# `docker compose up` needs no variable set (docs/compose.md lists them). `$$` is a literal `$`.
VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*):-([^}]*)\}")


def compose_variables(text: str | None = None) -> dict[str, str]:
    """Every variable the compose file reads, with its default."""
    return dict(VARIABLE.findall(COMPOSE.read_text() if text is None else text))


def load_compose(overrides: dict[str, str] | None = None) -> dict:
    """The compose file after interpolation, as Compose resolves it with ``overrides`` set."""
    values = overrides or {}
    text = VARIABLE.sub(lambda m: values.get(m.group(1)) or m.group(2), COMPOSE.read_text())
    return yaml.safe_load(text.replace("$$", "$"))


def wait_for_results(
    edge: str, logs: Callable[[], str], timeout: float = 20.0, since: float | None = None
) -> list[dict]:
    """Recent requests from the edge until both aggregated and joined P/D ones have finished.

    ``since`` (a wall-clock time): only requests the edge last heard of after it count.
    """
    deadline = time.monotonic() + timeout
    entries: list[dict] = []
    while True:
        try:
            entries = httpx.get(f"{edge}/v1/recent", timeout=5).json()
        except httpx.HTTPError:
            entries = []
        finished = [e for e in entries if e["final"] and (since is None or e["last_seen"] > since)]
        kinds = {k for e in finished for k in e["verdicts"]}
        if {"passthrough", "joined"} <= kinds and len(finished) >= 6:
            assert not [e for e in finished if e["error"]], entries
            return finished
        if time.monotonic() > deadline:
            pytest.fail(f"results did not reach the edge in {timeout}s: {entries}\n{logs()}")
        time.sleep(0.3)


def check_one_of_each(edge: str, finished: list[dict], logs: Callable[[], str]) -> None:
    """Late attach through the results stream: every result, framed, with the expected verdicts."""
    aggregated = next(e for e in finished if set(e["verdicts"]) == {"passthrough"})
    joined = next(e for e in finished if "joined" in e["verdicts"])
    with httpx.Client(base_url=edge, timeout=10) as client:
        for entry, verdict in ((aggregated, "passthrough"), (joined, "joined")):
            with connect_sse(client, "GET", f"/v1/results/{entry['request_id']}?verdicts=1") as source:
                events = list(source.iter_sse())
            metas = [json.loads(e.data) for e in events if e.event == "meta"]
            data = [e.data for e in events if e.event == "message"]
            assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
            seqs = [m["seq"] for m in metas]
            assert seqs == list(range(len(metas))), (entry, seqs)
            assert len(data) - 1 == len(metas) == entry["results"], (entry, seqs, logs())
            assert {m["verdict"] for m in metas} == {verdict}, (entry, metas, logs())
            assert all(isinstance(json.loads(d), dict) for d in data[:-1])
            unary = client.get(f"/v1/results/{entry['request_id']}", headers={"Accept": "application/json"})
            assert unary.status_code == 200 and "text" in unary.json()


# Run inside the workers' environment (natively, or with `docker compose exec workers python -c`):
# with NO credentials the server refuses the connection; with the worker's own (the service's
# STREAMPROC_NATS_* variables and secret file) a forged result and a subscription to results are
# refused by the server's permissions (issue 11: anyone could forge `P.results.<id>`). Prints JSON.
FORGERY_SCRIPT = r"""
import asyncio, json, os
import nats

async def main():
    url = os.environ["STREAMPROC_NATS_URL"]
    out = {}
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)
        out["anonymous"] = "connected"
        await nc.close()
    except Exception as exc:
        out["anonymous"] = f"refused: {type(exc).__name__}: {exc}"
    errors = []
    async def on_error(exc):
        errors.append(str(exc))
    with open(os.environ["STREAMPROC_NATS_PASSWORD_FILE"]) as f:
        password = f.read().strip()
    nc = await nats.connect(url, user=os.environ["STREAMPROC_NATS_USER"], password=password,
                            error_cb=on_error, allow_reconnect=False)
    rid = os.environ["FORGED_ID"]
    await nc.subscribe("streamproc.results.>")
    await nc.publish(f"streamproc.results.{rid}", b'{"text": "forged"}',
                     headers={"Nats-Msg-Id": f"{rid}.0", "Streamproc-Seq": "0", "Streamproc-Final": "1"})
    await nc.flush()
    await asyncio.sleep(0.5)
    await nc.close()
    out["worker_errors"] = errors
    print(json.dumps(out))

asyncio.run(main())
"""


def check_forgery_refused(output: str, edge: str, forged_id: str, logs: Callable[[], str]) -> None:
    """What FORGERY_SCRIPT printed, and the edge never heard of the forged request."""
    seen = json.loads(output.strip().splitlines()[-1])
    assert seen["anonymous"].startswith("refused") and "authorization" in seen["anonymous"].lower(), seen
    errors = " | ".join(seen["worker_errors"]).lower()
    assert f'permissions violation for publish to "streamproc.results.{forged_id}"' in errors, seen
    assert 'permissions violation for subscription to "streamproc.results.>"' in errors, seen
    time.sleep(0.5)
    recent = httpx.get(f"{edge}/v1/recent", timeout=5).json()
    assert forged_id not in {e["request_id"] for e in recent}, (recent, logs())
