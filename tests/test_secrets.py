"""Secrets never reach stdout or stderr: not in --print-config, logs (DEBUG included) or errors.

Every command runs with real secrets (a password in the environment, a token file, credentials in
the URL) against a real nats-server that requires them, succeeding and failing; the secret strings
must appear nowhere in what the command printed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from conftest import CLI, run_cli_process
from helpers import clean_env
from edge_harness import EdgeProcess, demo_flag
from streamproc.sim.embedded import EmbeddedNats

pytestmark = pytest.mark.nats

PASSWORD = "pw-S3cr3t-4f9a"
URL_PASSWORD = "urlpw-8c1e-hidden"
TOKEN = "tok-77b2-hidden"


@pytest.fixture(scope="module")
def server():
    config = (f'authorization {{ users = [ {{ user: app, password: "{PASSWORD}" }},'
              f' {{ user: url, password: "{URL_PASSWORD}" }} ] }}\n')
    with EmbeddedNats(jetstream=False, config=config) as srv:
        yield srv


def assert_hidden(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text, f"secret {secret!r} printed:\n{text}"


def url_with_password(server: EmbeddedNats, password: str = URL_PASSWORD) -> str:
    return server.url.replace("nats://", f"nats://url:{password}@")


def test_print_config_redacts_the_password_the_token_and_url_credentials(server, tmp_path):
    proc = run_cli_process("run", "--print-config", "--nats-url", url_with_password(server),
                           env={"STREAMPROC_NATS_PASSWORD": PASSWORD, "STREAMPROC_NATS_USER": "app"})
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["nats_password"] == {"value": "<redacted>", "source": "env STREAMPROC_NATS_PASSWORD"}
    assert "url:<redacted>@" in printed["nats_url"]["value"]
    assert_hidden(proc.stdout + proc.stderr, PASSWORD, URL_PASSWORD)
    for command in ("run", "edge", "simulate"):
        proc = run_cli_process(command, "--print-config", *demo_flag(command), env={"STREAMPROC_NATS_TOKEN": TOKEN})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["nats_token"]["value"] == "<redacted>"
        assert_hidden(proc.stdout + proc.stderr, TOKEN)


def test_token_print_config_shows_the_key_file_never_the_key(tmp_path):
    """`streamproc token --print-config` reads the key and signs with it as a real run would, but
    prints only the file's path, and no error about the key prints the key."""
    signing_key = "hmac-7d41-never-printed-" + "k" * 24
    key_file = tmp_path / "edge.key"
    key_file.write_text(signing_key + "\n")
    proc = run_cli_process("token", "--print-config", "--key-file", str(key_file), "--operator")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["key_file"] == {"value": str(key_file), "source": "flag --key-file"}
    assert "eyJ" not in proc.stdout  # the configuration, not a token (a JWT starts with base64 of '{"')
    assert_hidden(proc.stdout + proc.stderr, signing_key)
    for algorithm in ("RS256", "ES256", "EdDSA"):  # the secret is no PEM key: refused without echoing it
        proc = run_cli_process("token", "--print-config", "--key-file", str(key_file), "--operator",
                               "--algorithm", algorithm)
        assert proc.returncode == 2 and "cannot sign with --key-file" in proc.stderr, proc.stderr
        assert_hidden(proc.stdout + proc.stderr, signing_key)


def test_a_bad_setting_next_to_a_secret_does_not_print_the_secret():
    proc = run_cli_process("run", "--prefill-timeout", "-1", "--nats-url", f"nats://u:{URL_PASSWORD}@127.0.0.1:1",
                           env={"STREAMPROC_NATS_TOKEN": TOKEN})
    assert proc.returncode == 2
    assert_hidden(proc.stdout + proc.stderr, TOKEN, URL_PASSWORD)
    proc = run_cli_process("run", "--print-config", env={"STREAMPROC_NATS_URL": f"nats://u:{URL_PASSWORD}@h:1",
                                                         "STREAMPROC_NATS_PASSWORD": PASSWORD})
    assert proc.returncode == 2  # a password without a user, and one in the URL
    assert_hidden(proc.stdout + proc.stderr, PASSWORD, URL_PASSWORD)


@pytest.mark.parametrize("password", [PASSWORD, "wrong-pw-1d3f"])
def test_run_logs_at_debug_and_its_errors_hold_no_secret(server, password):
    env = {"STREAMPROC_NATS_PASSWORD": password, "STREAMPROC_NATS_USER": "app"}
    proc = subprocess.Popen([*CLI, "run", "--nats-url", server.url, "--log-level", "DEBUG", "--connect-timeout",
                             "10"], env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    if password == PASSWORD:
        time.sleep(2.5)
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    text = out.decode()
    assert ("event=started" in text) == (password == PASSWORD), text
    assert_hidden(text, password)
    # The URL form: user and password in --nats-url, wrong and right.
    for pw in (URL_PASSWORD, "wrong-url-pw-55aa"):
        result = run_cli_process("run", "--nats-url", url_with_password(server, pw), "--log-level", "DEBUG",
                                 "--connect-timeout", "3", "--format", "nonexistent-format")
        assert_hidden(result.stdout + result.stderr, pw)
        result = run_cli_process("simulate", "--nats-url", url_with_password(server, pw), "--log-level", "DEBUG",
                                 "--requests", "2")
        assert_hidden(result.stdout + result.stderr, pw)
        assert ("published" in result.stdout) == (pw == URL_PASSWORD), result.stdout + result.stderr


@pytest.mark.parametrize("url_password", [URL_PASSWORD, "wrong-edge-pw-9e0c"])
def test_the_edge_prints_no_secret_running_or_refused(server, url_password, tmp_path):
    edge = EdgeProcess(url_with_password(server, url_password), "--log-level", "DEBUG")
    if url_password == URL_PASSWORD:
        edge.start()
        assert edge.metrics()["streamproc_edge_nats_connected"] == 1
        edge.stop()
    else:
        with open(edge.log_path, "wb") as log_file:
            code = subprocess.run(edge.argv, env=edge.env, stdout=log_file, stderr=log_file, timeout=30).returncode
        assert code == 1
    assert_hidden(edge.log(), url_password)
    edge.close()


def schemeless_url(server: EmbeddedNats, password: str = URL_PASSWORD) -> str:
    """``url:<password>@127.0.0.1:<port>``: no scheme, the form check_nats_url accepts and nats-py
    reads as ``nats://`` (its _parse_server_uri)."""
    return f"url:{password}@" + server.url.removeprefix("nats://")


def test_print_config_redacts_credentials_in_a_schemeless_url_and_in_every_server_of_a_list(server):
    listed = f"nats://a:list-pw-1a2b@h1:4222,b:list-pw-3c4d@h2:4222, tok-in-list-5e6f@h3,{schemeless_url(server)}"
    for url, secrets, redacted in ((schemeless_url(server), [URL_PASSWORD], 1),
                                   (listed, ["list-pw-1a2b", "list-pw-3c4d", "tok-in-list-5e6f", URL_PASSWORD], 4),
                                   ("u:p@ss-w0rd-at@h:4222", ["p@ss-w0rd-at", "ss-w0rd-at"], 1)):
        for command in ("run", "edge", "simulate"):
            proc = run_cli_process(command, "--print-config", "--nats-url", url, *demo_flag(command))
            assert proc.returncode == 0, proc.stderr
            shown = json.loads(proc.stdout)["nats_url"]["value"]
            assert shown.count("<redacted>@") == redacted, shown
            assert_hidden(proc.stdout + proc.stderr, *secrets)
        proc = run_cli_process("run", "--print-config", env={"STREAMPROC_NATS_URL": url})
        assert proc.returncode == 0, proc.stderr
        assert_hidden(proc.stdout + proc.stderr, *secrets)


def test_the_started_line_shows_a_schemeless_url_with_its_password_redacted(server):
    proc = subprocess.Popen([*CLI, "run", "--nats-url", schemeless_url(server), "--log-level", "DEBUG",
                             "--connect-timeout", "10", "--mode", "core"], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        lines: list[str] = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            lines.append(line)
            if "event=started" in line or not line:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out.decode()
    started = next((line for line in lines if "event=started" in line), "")
    assert "url:<redacted>@127.0.0.1" in started, text
    assert_hidden(text, URL_PASSWORD)


def test_connection_errors_name_a_schemeless_url_without_its_password(server):
    # refused credentials (the server answers) and nothing listening (the timeout), for run and simulate
    wrong = "wrong-bare-pw-7a7a"
    for url in (schemeless_url(server, wrong), f"u:{wrong}@127.0.0.1:1", f"nats://x:y@h:1,u:{wrong}@127.0.0.1:1"):
        for command in ("run", "simulate"):
            proc = run_cli_process(command, "--nats-url", url, "--connect-timeout", "2", "--log-level", "DEBUG")
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "cannot connect to NATS at" in proc.stderr and ":<redacted>@127.0.0.1" in proc.stderr, proc.stderr
            assert_hidden(proc.stdout + proc.stderr, wrong)
