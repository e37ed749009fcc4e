"""Credentials a NATS URL cannot carry are refused at start-up, not sent to DNS as a host name.

Found by an attack (2026-12-06): nats-py reads a server with ``urllib.parse.urlparse``, whose host
part ends at the first ``/``, ``?`` or ``#``, and sends the userinfo as it is (no percent-decoding).
So ``nats://<token>@host`` with a token holding ``/`` (base64 tokens do) made nats-py connect to the
token's start as a host name: a DNS lookup of the secret, again at every retry, for
``--connect-timeout`` (for ever with 0), ending in ``gaierror`` and exit 1; a password holding one
was ``invalid connect url option``. Such a URL is now refused (exit 2) naming the setting that can
carry the secret; the secret itself works from there, and ``@`` in a password still works in the URL.
"""

from __future__ import annotations

import json
import subprocess
import time

import nkeys
import pytest

from conftest import CLI, run_cli_process
from edge_harness import demo_flag
from helpers import clean_env, wait_ready
from nats_auth import authenticated_cluster, new_keypair
from streamproc.nats.connection import url_credentials
from streamproc.sim.embedded import EmbeddedNats, stop_process

pytestmark = pytest.mark.nats

TOKEN = "tokPart1/tokPart2+secret=="  # as base64 (openssl rand -base64) writes them
PASSWORD = "pwPart1#pwPart2"
AT_PASSWORD = "atPart1@atPart2"


@pytest.fixture(scope="module")
def servers():
    token_config = f'authorization {{ token: "{TOKEN}" }}\n'
    user_config = (f'authorization {{ users = [ {{ user: app, password: "{PASSWORD}" }},'
                   f' {{ user: at, password: "{AT_PASSWORD}" }} ] }}\n')
    with EmbeddedNats(jetstream=False, config=token_config) as token_server, \
            EmbeddedNats(jetstream=False, config=user_config) as user_server:
        yield token_server, user_server


def host(server: EmbeddedNats) -> str:
    return server.url.removeprefix("nats://")


def unusable_urls(token_server: EmbeddedNats, user_server: EmbeddedNats) -> list[str]:
    return [f"nats://{TOKEN}@{host(token_server)}",
            f"{TOKEN}@{host(token_server)}",  # no scheme: nats-py prefixes nats://
            f"nats://app:{PASSWORD}@{host(user_server)}",
            f"nats://app:pwPart1?pwPart2@{host(user_server)}",
            f"nats://127.0.0.1:1,{TOKEN}@{host(token_server)}"]


@pytest.mark.parametrize("command", ["run", "edge", "simulate"])
def test_credentials_holding_a_url_delimiter_are_refused_at_once_without_showing_them(servers, command):
    for url in unusable_urls(*servers):
        started = time.monotonic()
        proc = run_cli_process(command, *demo_flag(command), "--nats-url", url, "--connect-timeout", "20",
                               "--requests", "1") if command == "simulate" else \
            run_cli_process(command, *demo_flag(command), "--nats-url", url, "--connect-timeout", "20")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, f"{url}: exit {proc.returncode}\n{out}"
        # Refused, not retried until the connect timeout (20 s): the CLI's own start took up to 2.7 s
        # beside two CPU burners (45 runs), against a bound of 5 s that was also the timeout (1.85x).
        assert time.monotonic() - started < 10, out
        password_setting = "STREAMPROC_NATS_TOKEN" if "tokPart" in url else "STREAMPROC_NATS_PASSWORD"
        assert password_setting in proc.stderr, proc.stderr
        for part in ("tokPart1", "tokPart2", "pwPart1", "pwPart2"):
            assert part not in out, f"{part!r} printed:\n{out}"


def test_the_same_secrets_connect_from_their_own_settings_and_an_at_sign_still_works_in_the_url(servers):
    token_server, user_server = servers
    proc = run_cli_process("simulate", "--nats-url", token_server.url, "--requests", "1",
                           env={"STREAMPROC_NATS_TOKEN": TOKEN})
    assert proc.returncode == 0 and "published" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli_process("simulate", "--nats-url", user_server.url, "--requests", "1",
                           env={"STREAMPROC_NATS_USER": "app", "STREAMPROC_NATS_PASSWORD": PASSWORD})
    assert proc.returncode == 0 and "published" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli_process("simulate", "--nats-url", f"nats://at:{AT_PASSWORD}@{host(user_server)}", "--requests", "1")
    assert proc.returncode == 0 and "published" in proc.stdout, proc.stdout + proc.stderr
    assert "atPart" not in proc.stdout + proc.stderr
    proc = run_cli_process("run", "--print-config", "--nats-url", f"nats://at:{AT_PASSWORD}@{host(user_server)}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nats_url"]["value"] == f"nats://at:<redacted>@{host(user_server)}"


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8080/nats@edge", "wss://127.0.0.1/nats?user=ops@example.com"])
def test_an_at_sign_in_a_websocket_path_or_query_is_refused_saying_how_to_write_it(url):
    """A websocket URL's path and query are sent (nats-py ``ws_connect(uri.geturl())``) and may
    hold ``@``, which the URL check (the userinfo runs to the last ``@``) reads as credentials
    holding ``/`` or ``?``: the refusal says to write it ``%40``, and that form is taken as it is."""
    proc = run_cli_process("run", "--print-config", "--nats-url", url)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "%40" in proc.stderr, proc.stderr
    written = url.replace("@", "%40")
    proc = run_cli_process("run", "--print-config", "--nats-url", written)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nats_url"]["value"] == written


CLUSTER_PASSWORD = "clusterPw-5e1c"
READY = {"run": "event=started", "edge": "event=connected"}
PORT = {"run": ["--http-port", "0"], "edge": ["--port", "0"]}


@pytest.mark.parametrize("command", ["run", "edge"])
def test_url_credentials_reach_the_servers_the_cluster_names_when_the_url_s_server_goes_away(command, tmp_path):
    """nats-py adds the servers a cluster's INFO names (``connect_urls``) without credentials and
    sends a URL's userinfo only to the server written with it: with ``nats://user:pw@n0``, losing n0
    made every reconnect to n1 and n2 an ``Authorization Violation``, for as long as n0 was down (the
    same password from STREAMPROC_NATS_PASSWORD failed over at once). Found by the deploy attack."""
    config = f'authorization {{ users = [ {{ user: app, password: "{CLUSTER_PASSWORD}" }} ] }}\n'
    with authenticated_cluster(config) as nodes:
        log = tmp_path / "out.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*CLI, command, *demo_flag(command), *PORT[command], "--nats-url",
                                     f"nats://app:{CLUSTER_PASSWORD}@{host(nodes[0])}", "--connect-timeout", "10"],
                                    stdout=out, stderr=subprocess.STDOUT, env=clean_env())
        try:
            wait_ready(lambda: READY[command] in log.read_text(), proc, command, 20, log.read_text)
            nodes[0].kill()
            wait_ready(lambda: "event=reconnected" in log.read_text(), proc, "a reconnect to n1 or n2", 15,
                       log.read_text)
        finally:
            stop_process(proc, 10)
        assert CLUSTER_PASSWORD not in log.read_text()


@pytest.mark.parametrize("urls, options, want", [
    (["nats://app:pw@h1:4222", "h2:4222"], {}, (["nats://h1:4222", "h2:4222"], {"user": "app", "password": "pw"})),
    (["tok@h1", "tls://tok@h2"], {}, (["h1", "tls://h2"], {"token": "tok"})),
    (["nats://app:p%40w@h1"], {}, (["nats://h1"], {"user": "app", "password": "p%40w"})),  # undecoded, as nats-py
    (["nats://a:1@h1", "nats://b:2@h2"], {}, (["nats://a:1@h1", "nats://b:2@h2"], {})),  # which one? as written
    (["ws://app:pw@h1"], {}, (["ws://app:pw@h1"], {})),  # aiohttp sends a websocket URL's userinfo itself
    (["nats://app:pw@h1"], {"token": "t"}, (["nats://h1"], {})),  # nats-py sent the settings' only
    # with a signature, nats-py sent the URL's where the server asks for none (no nonce): as written
    (["nats://app:pw@h1"], {"nkeys_seed_str": "SU"}, (["nats://app:pw@h1"], {})),
    (["nats://app:pw@h1"], {"user_jwt_cb": None}, (["nats://app:pw@h1"], {})),
    (["nats://h1", "h2"], {}, (["nats://h1", "h2"], {})),
])
def test_url_credentials_become_options_nats_py_sends_to_every_server(urls, options, want):
    assert url_credentials(urls, options) == want


@pytest.mark.parametrize("flag", ["--nats-nkey-seed-file", "--nats-creds-file"])
def test_url_credentials_still_reach_a_server_that_asks_for_no_signature_beside_an_nkey_or_creds_file(flag, tmp_path):
    """nats-py signs with an nkey seed or .creds file only where the server's INFO carries a nonce
    (nkey or JWT users); elsewhere it sent the URL's user and password. 58f292d dropped a URL's
    credentials whenever any credential setting was given, so a password server reached with
    ``nats://app:pw@host`` and a seed or creds file set (a shared deployment default) refused the
    connect: ``Authorization Violation``, exit 1, where it had connected."""
    seed, _ = new_keypair(nkeys.PREFIX_BYTE_USER)
    if flag == "--nats-nkey-seed-file":
        (tmp_path / "user.nk").write_text(seed + "\n")
        path = tmp_path / "user.nk"
    else:
        jwt = "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2ln"  # never sent: the server asks no nonce
        path = tmp_path / "user.creds"
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
    config = f'authorization {{ users = [ {{ user: app, password: "{CLUSTER_PASSWORD}" }} ] }}\n'
    with EmbeddedNats(jetstream=False, config=config) as server:
        proc = run_cli_process("simulate", "--nats-url", f"nats://app:{CLUSTER_PASSWORD}@{host(server)}",
                               flag, str(path), "--requests", "1", "--connect-timeout", "5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "published" in proc.stdout, out
    assert CLUSTER_PASSWORD not in out and seed not in out
