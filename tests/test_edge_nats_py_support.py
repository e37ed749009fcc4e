"""The edge reads a subscription's pending messages through nats-py internals (edge/pending.py): it
starts only on a nats-py in ``SUPPORTED_NATS_PY`` that has each of them, and elsewhere (or with
``STOCK_NATS_PY`` set) refuses in one line, as nats-py's public API cannot keep its held-bytes bound."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any, Callable

import pytest
from edge_harness import EDGE, EdgeProcess, running_edge
from helpers import clean_env, free_port
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_py_version
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from streamproc.edge import pending
from streamproc.nats import fast_client

PUSH, JSI = JetStreamContext.PushSubscription, JetStreamContext._JSI


def _without(cls: type, name: str) -> Callable[..., None]:
    """``cls.__init__`` whose instances lack ``name`` (as a release that renamed it)."""
    init = cls.__init__

    def changed(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        delattr(self, name)

    return changed


def _replaced(*args: Any, **kwargs: Any) -> None:
    """A method body that no longer does what pending.py mirrors."""


# (what changed, the class patched, its attribute, the new value, the check that must name it)
CHANGES = [
    ("Subscription._pending_queue", Subscription, "__init__", _without(Subscription, "_pending_queue")),
    ("Subscription._pending_size", Subscription, "__init__", _without(Subscription, "_pending_size")),
    ("Subscription._pending_next_msgs_calls", Subscription, "__init__",
     _without(Subscription, "_pending_next_msgs_calls")),
    ("Subscription._conn", Subscription, "__init__", _without(Subscription, "_conn")),
    ("PushSubscription._sub", PUSH, "__init__", _without(PUSH, "_sub")),
    ("PushSubscription._pending_queue", PUSH, "__init__", _without(PUSH, "_pending_queue")),
    ("_JSI._fcr", JSI, "__init__", _without(JSI, "_fcr")),
    ("_JSI._fciseq", JSI, "__init__", _without(JSI, "_fciseq")),
    ("_JSI._active", JSI, "__init__", _without(JSI, "_active")),
    ("asyncio.Queue._getters", asyncio.Queue, "__init__", _without(asyncio.Queue, "_getters")),
    ("asyncio.Queue._queue", asyncio.Queue, "__init__", _without(asyncio.Queue, "_queue")),
    ("Client.is_closed", Client, "is_closed", _replaced),
    ("Client._process_msg", Client, "_process_msg", _replaced),
    ("Client._close", Client, "_close", _replaced),
    ("Subscription.next_msg", Subscription, "next_msg", _replaced),
    ("PushSubscription.next_msg", PUSH, "next_msg", _replaced),
    ("_JSI.get_js_delivered", JSI, "get_js_delivered", _replaced),
    ("_JSI.schedule_flow_control_response", JSI, "schedule_flow_control_response", _replaced),
    ("asyncio.Queue.put_nowait", asyncio.Queue, "put_nowait", _replaced),
    ("asyncio.Queue.get_nowait", asyncio.Queue, "get_nowait", _replaced),
    ("asyncio.Queue._wakeup_next", asyncio.Queue, "_wakeup_next", None),
]


@pytest.fixture
def supported_env(monkeypatch):
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV, raising=False)


def test_the_installed_nats_py_has_every_internal_the_edge_reads(supported_env):
    assert pending.pending_support() == (True, f"nats-py {nats_py_version}")


@pytest.mark.parametrize(("name", "cls", "attr", "value"), CHANGES, ids=[c[0] for c in CHANGES])
def test_the_check_fails_naming_each_internal_the_edge_reads_once_it_changes(supported_env, monkeypatch,
                                                                              name, cls, attr, value):
    monkeypatch.setattr(cls, attr, value)
    usable, reason = pending.pending_support()
    assert not usable and "internals differ" in reason
    assert name in reason.split(": ", 1)[1], reason


@pytest.mark.parametrize("version", ["2.15.9", "2.17.0", "3.0.0"])
def test_a_release_outside_the_supported_range_fails_the_check(supported_env, version):
    usable, reason = pending.pending_support(version)
    assert not usable and reason == f"nats-py {version} is outside the supported range 2.16 <= v < 2.17"


def test_the_supported_range_has_one_home():
    """The edge's check and the processor's fast path read one range, through one check."""
    assert pending.outside_supported_range is fast_client.outside_supported_range
    assert fast_client.supported_range() == "2.16 <= v < 2.17"
    assert fast_client.fast_path_support("2.17.0") == (False, pending.pending_support("2.17.0")[1])


def test_stock_nats_py_fails_the_check_and_the_client_only_variable_does_not(monkeypatch):
    monkeypatch.setenv(fast_client.STOCK_CLIENT_ENV, "1")
    assert pending.pending_support() == (False, "STOCK_NATS_PY is set")
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV)
    monkeypatch.setenv(fast_client.STOCK_CLIENT_ONLY_ENV, "1")
    assert pending.pending_support()[0]
    assert fast_client.fast_path_support() == (False, "STOCK_NATS_CLIENT is set")


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_the_edge_refuses_to_start_in_one_line_when_the_check_fails(nats_url):
    """``STOCK_NATS_PY`` runs the edge as on a release outside the range: exit 1, one line naming the
    installed version and the supported range, no traceback, nothing served."""
    port = free_port()
    done = subprocess.run([*EDGE, "--nats-url", nats_url, "--port", str(port), "--insecure-demo"],
                          env=clean_env({fast_client.STOCK_CLIENT_ENV: "1"}), stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"streamproc edge: error: installed nats-py {nats_py_version} cannot run the edge "
                          "(STOCK_NATS_PY is set); it needs nats-py 2.16 <= v < 2.17"), err
    assert done.stdout == b""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_the_edge_logs_the_pending_path_it_starts_on(nats_url):
    with running_edge(nats_url) as edge:
        log = edge.log()
    assert "nats_pending_path" in log and "path=internals" in log and f"nats-py {nats_py_version}" in log, log


# streamproc edge with pending_support counted, the count printed at exit.
COUNTED = """
import atexit, sys
from streamproc.edge import pending
calls = []
check = pending.pending_support
def counted(*args, **kwargs):
    calls.append(1)
    return check(*args, **kwargs)
pending.pending_support = counted
atexit.register(lambda: print(f"nats-py internals checks: {len(calls)}", flush=True))
from streamproc.edge.command import main
sys.exit(main())
"""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_streamproc_edge_checks_the_nats_py_internals_once_per_start(nats_url):
    """The CLI checks before it sets up its server and hands the reason to ResultSource.start, which
    checked again on every start: two checks per start-up."""
    port = free_port()
    edge = EdgeProcess(nats_url, port=port, command=[sys.executable, "-c", COUNTED, "--nats-url", nats_url,
                                                     "--port", str(port), "--insecure-demo"])
    try:
        edge.start()
        code = edge.stop()
        log = edge.log()
    finally:
        edge.close()
    assert code == 0, log
    assert "nats_pending_path" in log and f"nats-py {nats_py_version}" in log, log
    assert "nats-py internals checks: 1\n" in log, log
