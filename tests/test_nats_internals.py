"""Every nats-py internal the edge and the processor's FastClient touch is in one list
(streamproc/nats/internals.py) and checked once: a release that renames one stops the edge in one line
(``pending_support``) and sends the processor to stock nats-py (``fast_path_support``), instead of
silently breaking the held-bytes bound or delivery. And every way of starting an edge runs the check."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import subprocess
import sys
import types
from typing import Any

import pytest
from helpers import clean_env, free_port
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_py_version
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from streamproc.core import errors
from streamproc.core.wire import Subjects
from streamproc.edge import pending
from streamproc.edge import settings as edge_settings
from streamproc.edge.app import create_app
from streamproc.nats import fast_client, internals

CLASSES: dict[str, type] = {"Client": Client, "Subscription": Subscription,
                            "PushSubscription": JetStreamContext.PushSubscription, "_JSI": JetStreamContext._JSI,
                            "JetStreamContext": JetStreamContext, "asyncio.Queue": asyncio.Queue}
EDGE_MODULES = ["streamproc.edge.pending", "streamproc.edge.fanout", "streamproc.edge.barrier",
                "streamproc.edge.source", "streamproc.edge.replay"]
FAST_MODULES = ["streamproc.nats.fast_client", "streamproc.nats.fast_parser", "streamproc.nats.eager_reads"]
STOCK_MODULES = ["streamproc.nats.robust", "streamproc.nats.subscription",
                 "streamproc.nats.durable.migrations"]


def _split(name: str) -> tuple[str, str]:
    owner, _, attribute = name.rpartition(".")
    return owner, attribute


def _code_names(module: types.ModuleType) -> set[str]:
    """Attribute and global names the module's own functions and methods (nested code included) use,
    and the names its classes define: a method that replaces a nats-py one (``FastClient._flusher``)
    is never called by name, and a release that renames the original leaves it silently unused."""
    todo: list[types.CodeType] = []
    found: set[str] = set()
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found.update(vars(obj))
        for member in (vars(obj).values() if inspect.isclass(obj) else [obj]):
            func = getattr(member, "fget", getattr(member, "__func__", member))
            if isinstance(getattr(func, "__code__", None), types.CodeType):
                todo.append(func.__code__)
    while todo:
        code = todo.pop()
        found.update(code.co_names)
        found.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())  # getattr(x, "_a")
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _private_names() -> set[str]:
    """The private names nats-py's objects (as it makes them) and asyncio.Queue have."""
    names: set[str] = set()
    for owner, obj in internals.owners().items():
        names |= {n for n in dir(CLASSES[owner]) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in vars(obj) if n.startswith("_") and not n.startswith("__")}
    return names


# Streamproc's own attributes that happen to share a nats-py private name (checked by reading the code).
OWN = {"_queue", "_JSI", "_js", "_get_metadata_fields"}  # own deque/_js cache; Msg.Metadata via ordered bookkeeping


@pytest.mark.parametrize(("modules", "listed", "own"), [
    (EDGE_MODULES, internals.EDGE_INTERNALS, OWN),
    (FAST_MODULES, internals.FAST_CLIENT_INTERNALS, OWN),
    (STOCK_MODULES, internals.STOCK_CLIENT_INTERNALS, OWN | {"_nc"}),  # migrations' own self._nc
], ids=["edge", "fast_client", "stock_client"])
def test_every_nats_py_internal_the_code_touches_is_listed(modules, listed, own):
    private = _private_names()
    attributes = {_split(name)[1] for name in listed}
    touched = set().union(*(_code_names(importlib.import_module(m)) for m in modules)) & private
    assert touched - attributes - own == set()


def test_the_installed_nats_py_has_every_listed_internal(monkeypatch):
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV, raising=False)
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ONLY_ENV, raising=False)
    assert internals.missing(internals.EDGE_INTERNALS) == []
    assert internals.missing(internals.FAST_CLIENT_INTERNALS) == []
    assert internals.missing(internals.STOCK_CLIENT_INTERNALS) == []
    assert pending.pending_support() == (True, f"nats-py {nats_py_version}")
    assert fast_client.fast_path_support() == (True, f"nats-py {nats_py_version}")


def _remove(monkeypatch, name: str) -> None:
    """Make nats-py (on a copy: monkeypatch undoes it) as a release that renamed ``name``."""
    owner, attribute = _split(name)
    cls = CLASSES[owner]
    obj = internals.owners()[owner]
    if attribute in vars(obj):  # set by its constructor
        init = cls.__init__

        def changed(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if attribute in vars(self):
                delattr(self, attribute)

        monkeypatch.setattr(cls, "__init__", changed)
    else:
        home = next(c for c in cls.__mro__ if attribute in vars(c))
        monkeypatch.delattr(home, attribute)
    assert name in internals.missing((name,))


@pytest.mark.parametrize("name", internals.EDGE_INTERNALS)
def test_the_edge_check_names_each_internal_once_it_changes(monkeypatch, name):
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV, raising=False)
    _remove(monkeypatch, name)
    usable, reason = pending.pending_support()
    assert not usable and "internals differ" in reason
    assert name in reason.split(": ", 1)[1].split(", "), reason


@pytest.mark.parametrize("name", internals.FAST_CLIENT_INTERNALS)
def test_the_fast_path_check_names_each_internal_once_it_changes(monkeypatch, name):
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV, raising=False)
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ONLY_ENV, raising=False)
    _remove(monkeypatch, name)
    usable, reason = fast_client.fast_path_support()
    assert not usable and "internals differ" in reason
    assert name in reason.split(": ", 1)[1].split(", "), reason


@pytest.mark.parametrize("name", internals.STOCK_CLIENT_INTERNALS)
def test_no_client_is_made_once_a_stock_path_internal_changes(monkeypatch, name):
    """Below the stock-path RobustClient there is nothing to fall back to: refused, in one line."""
    for env in (fast_client.STOCK_CLIENT_ENV, fast_client.STOCK_CLIENT_ONLY_ENV):
        monkeypatch.setenv(env, "1")  # the stock path itself (the fast path checks these too)
    monkeypatch.setattr(fast_client, "_support", None)
    monkeypatch.setattr(internals, "_stock_missing", None)
    _remove(monkeypatch, name)
    with pytest.raises(errors.NatsPyUnsupported) as raised:
        fast_client.new_client()
    text = str(raised.value)
    assert "\n" not in text and name in text.split("(", 1)[1].split(")", 1)[0].split(", "), text


# `streamproc run` on the stock path with a nats-py that renamed _is_control_message (RobustClient calls
# it for every empty JetStream message: the read loop would end at the first heartbeat).
RUN_RENAMED = """
import sys
from nats.aio.client import Client
Client._control_message = Client._is_control_message
del Client._is_control_message
from streamproc.cli import main
sys.exit(main())
"""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_the_processor_refuses_to_start_in_one_line_when_a_stock_internal_is_renamed(nats_url):
    done = subprocess.run([sys.executable, "-c", RUN_RENAMED, "run", "--nats-url", nats_url],
                          env=clean_env({fast_client.STOCK_CLIENT_ENV: "1"}), stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"streamproc run: error: installed nats-py {nats_py_version} lacks internals "
                               "streamproc's NATS client reads (Client._is_control_message)"), err


# `streamproc edge` on a nats-py whose Subscription no longer has _pending_bytes_limit (the fan-out
# sets it to 0): the same nats-py otherwise.
RENAMED = """
import sys
from nats.aio.subscription import Subscription
init = Subscription.__init__
def changed(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self._pending_bytes_max = self.__dict__.pop("_pending_bytes_limit")
Subscription.__init__ = changed
from streamproc.edge.command import main
sys.exit(main())
"""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_the_edge_refuses_to_start_in_one_line_when_an_internal_is_renamed(nats_url):
    done = subprocess.run([sys.executable, "-c", RENAMED, "--nats-url", nats_url, "--port", str(free_port()),
                           "--insecure-demo"], env=clean_env({}), stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"streamproc edge: error: installed nats-py {nats_py_version} cannot run the edge "
                          f"(nats-py {nats_py_version} internals differ: Subscription._pending_bytes_limit"), err
    assert done.stdout == b""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_an_edge_built_in_process_runs_the_same_check(nats_url, monkeypatch):
    """``create_app`` as ``streamproc demo`` and library users build it: its start refuses too."""
    monkeypatch.delenv(fast_client.STOCK_CLIENT_ENV, raising=False)
    _remove(monkeypatch, "Subscription._pending_bytes_limit")
    settings = edge_settings.load({}, {"nats_url": nats_url, "prefix": Subjects("streamproc").prefix,
                                       "insecure_demo": True, "host": "127.0.0.1", "port": 0})
    app = create_app(settings, tracing=None)

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(errors.NatsPyUnsupported, match=r"internals differ: Subscription\._pending_bytes_limit"):
        asyncio.run(start())


# robust.connect() (tests/helpers.py's connection, library users) on a nats-py that renamed
# _is_control_message, then on one outside SUPPORTED_NATS_PY: the one stock check refuses the first in one
# line, and the second gets the stock-path RobustClient, never the FastClient mirroring 2.16's internals.
ROBUST_CONNECT = """
import asyncio, sys
from nats.aio import client as _client
from streamproc.core.errors import NatsPyUnsupported
from streamproc.nats import fast_client, robust
if sys.argv[2] == "renamed":
    _client.Client._control_message = _client.Client._is_control_message
    del _client.Client._is_control_message
else:
    _client.__version__ = "2.99.0"
async def main():
    try:
        nc = await robust.connect(servers=[sys.argv[1]])
    except NatsPyUnsupported as exc:
        print("refused:", exc)
        return
    made = fast_client.new_client()
    print("connected:", type(nc).__name__, type(made).__name__, fast_client.fast_path_support()[1])
    await nc.close()
asyncio.run(main())
"""


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_robust_connect_runs_the_one_stock_check(nats_url):
    done = subprocess.run([sys.executable, "-c", ROBUST_CONNECT, nats_url, "renamed"], env=clean_env({}),
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == (f"refused: installed nats-py {nats_py_version} lacks internals streamproc's NATS "
                           "client reads (Client._is_control_message); use a nats-py release that has them "
                           "(docs/operations.md, Supported dependency versions)\n"), done.stdout


@pytest.mark.nats
@pytest.mark.timeout(60)
def test_robust_connect_outside_the_supported_range_is_the_stock_path(nats_url):
    env = {k: v for k, v in clean_env({}).items()
           if k not in (fast_client.STOCK_CLIENT_ENV, fast_client.STOCK_CLIENT_ONLY_ENV)}
    done = subprocess.run([sys.executable, "-c", ROBUST_CONNECT, nats_url, "outside"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ("connected: RobustClient RobustClient nats-py 2.99.0 is outside the supported "
                           f"range {fast_client.supported_range()}\n"), done.stdout
