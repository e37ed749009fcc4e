"""NATS authentication and TLS for every command that connects out, against real nats-servers.

Each mechanism gets a server that requires it; `streamproc run`, `streamproc edge` and
`streamproc simulate --verify` connect with the credentials and a request goes through end to end.
A wrong credential stops each command at once (well before --connect-timeout) with one error line
and exit code 1; an unreadable credential file is a configuration error (exit 2).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import nkeys
import pytest

from conftest import processor_subprocess, run_cli_process
from edge_harness import demo_flag, running_edge
from nats_auth import Certificates, Operator, new_keypair
from streamproc.sim.embedded import EmbeddedNats

pytestmark = pytest.mark.nats

PASSWORD = "pw-Q7h2-never-printed"
TOKEN = "tok-Z9x4-never-printed"


class Case(msgspec.Struct):
    """A server that requires one mechanism, and the settings that pass it or fail it."""

    config: str
    good: list[str]
    bad: list[str]
    env: dict[str, str] = {}
    bad_env: dict[str, str] = {}
    secrets: list[str] = []


def _write(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    return str(path)


def user_password(tmp: Path) -> Case:
    return Case(f'authorization {{ users = [ {{ user: app, password: "{PASSWORD}" }} ] }}\n',
                good=["--nats-user", "app"], bad=["--nats-user", "app"],
                env={"STREAMPROC_NATS_PASSWORD": PASSWORD}, bad_env={"STREAMPROC_NATS_PASSWORD": "wrong"},
                secrets=[PASSWORD])


def token(tmp: Path) -> Case:
    return Case(f'authorization {{ token: "{TOKEN}" }}\n',
                good=["--nats-token-file", _write(tmp / "token", TOKEN)],
                bad=["--nats-token-file", _write(tmp / "bad-token", "tok-wrong")], secrets=[TOKEN])


def nkey(tmp: Path) -> Case:
    seed, public = new_keypair(nkeys.PREFIX_BYTE_USER)
    other, _ = new_keypair(nkeys.PREFIX_BYTE_USER)
    return Case(f"authorization {{ users = [ {{ nkey: {public} }} ] }}\n",
                good=["--nats-nkey-seed-file", _write(tmp / "user.nk", seed)],
                bad=["--nats-nkey-seed-file", _write(tmp / "other.nk", other)], secrets=[seed])


def creds(tmp: Path) -> Case:
    operator = Operator()
    stranger, _ = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # an account the operator never signed
    good = operator.creds(tmp / "user.creds")
    return Case(operator.server_config(), good=["--nats-creds-file", str(good)],
                bad=["--nats-creds-file", str(operator.creds(tmp / "bad.creds", account_seed=stranger))],
                secrets=[good.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]])


def tls(tmp: Path) -> Case:
    certs = Certificates(tmp, "ca")
    other = Certificates(tmp, "other-ca")
    return Case(certs.tls_block(verify=False), good=["--nats-tls-ca-file", str(certs.ca)],
                bad=["--nats-tls-ca-file", str(other.ca)])


def mutual_tls(tmp: Path) -> Case:
    certs = Certificates(tmp, "ca")
    other = Certificates(tmp, "other-ca")  # a client certificate the server's CA never signed
    return Case(certs.tls_block(verify=True),
                good=["--nats-tls-ca-file", str(certs.ca), "--nats-tls-cert-file", str(certs.client),
                      "--nats-tls-key-file", str(certs.client_key)],
                bad=["--nats-tls-ca-file", str(certs.ca), "--nats-tls-cert-file", str(other.client),
                     "--nats-tls-key-file", str(other.client_key)])


MECHANISMS: dict[str, Callable[[Path], Case]] = {
    "user-password": user_password, "token": token, "nkey": nkey, "creds": creds, "tls": tls,
    "mutual-tls": mutual_tls,
}


@pytest.fixture(params=list(MECHANISMS))
def case(request, tmp_path: Path) -> Iterator[tuple[Case, EmbeddedNats]]:
    case = MECHANISMS[request.param](tmp_path)
    with EmbeddedNats(jetstream=False, config=case.config) as server:
        yield case, server


def test_every_command_connects_with_each_mechanism_and_a_request_goes_through(case):
    case, server = case
    flags = ["--format", "sglang", *case.good]
    with processor_subprocess(server.url, *flags, env=case.env) as (_, log_path):
        with running_edge(server.url, *case.good, env=case.env) as edge:
            proc = run_cli_process("simulate", "--nats-url", server.url, *flags, "--requests", "4", "--verify",
                                   "--timeout", "20", env=case.env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "4/4" in proc.stdout or "4 requests" in proc.stdout or "ok" in proc.stdout.lower(), proc.stdout
            assert edge.metrics()["streamproc_edge_nats_connected"] == 1
        assert "event=started" in log_path.read_text()


@pytest.mark.parametrize("command", ["run", "simulate", "edge"])
def test_a_wrong_credential_fails_at_once_with_one_line_and_exit_1(case, command):
    case, server = case
    started = time.monotonic()
    args = [command, "--nats-url", server.url, "--connect-timeout", "60", *case.bad]
    if command == "edge":
        args += ["--port", "0", "--insecure-demo"]
    proc = run_cli_process(*args, env=case.bad_env, timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert elapsed < 15, f"took {elapsed:.1f}s: the refusal was retried instead of reported"
    errors = [line for line in proc.stderr.splitlines() if "cannot connect to NATS" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert any(word in errors[0] for word in ("Authorization", "refused", "SSL", "certificate")), errors[0]


@pytest.mark.parametrize("flag", ["--nats-password-file", "--nats-token-file", "--nats-nkey-seed-file",
                                  "--nats-creds-file", "--nats-tls-ca-file"])
@pytest.mark.parametrize("command", ["run", "simulate", "edge"])
def test_an_unreadable_credential_file_is_a_configuration_error(tmp_path, command, flag):
    extra = ["--nats-user", "app"] if flag == "--nats-password-file" else []
    proc = run_cli_process(command, "--nats-url", "nats://127.0.0.1:1", *extra, flag, str(tmp_path / "missing"),
                           *demo_flag(command),
                           timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--nats-user", "app"], "needs a password"),
    (["--nats-token-file", "/x", "--nats-creds-file", "/y"], "one NATS authentication mechanism"),
    (["--nats-tls-cert-file", "/x"], "go together"),
])
def test_contradictory_credential_settings_are_refused(args, message):
    proc = run_cli_process("run", "--print-config", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["run", "simulate", "edge"])
@pytest.mark.parametrize("flag", ["--nats-password", "--nats-token"])
def test_a_secret_on_the_command_line_is_refused_naming_the_variable(command, flag):
    proc = run_cli_process(command, flag, "hunter2-on-the-command-line")
    assert proc.returncode == 2, proc.stderr
    assert "STREAMPROC_" + flag[2:].replace("-", "_").upper() in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stderr


# ----------------------------------------------------------------- .creds files nats-py cannot use
# Found by an attack on the command line (2026-12-05). nats-py 2.16 reads a .creds file at every
# connect, after the server's INFO (which carries a nonce only under nkey or JWT authentication):
# ``Client._read_creds_user_nkey`` returns None without a seed line (TypeError in nkeys, exit 1
# with "object of type 'NoneType' has no len()"), and ``Client._read_creds_user_jwt`` loops on
# ``readline()`` at end of file for ever without a JWT line, on the event loop: the command spun a
# core, ignored --connect-timeout and SIGTERM, and said nothing.

def _creds_parts(path: Path) -> tuple[str, str]:
    text = path.read_text()
    jwt = text.split("-----BEGIN NATS USER JWT-----\n")[1].split("\n")[0]
    seed = text.split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
    return jwt, seed


BROKEN_CREDS: dict[str, Callable[[str, str], str]] = {
    # an nkey seed file given as the creds file (the seed and nothing else): the endless read
    "seed-alone": lambda jwt, seed: seed + "\n",
    "no-jwt-block": lambda jwt, seed: f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n",
    "no-seed-block": lambda jwt, seed: f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n",
    "jwt-marker-last": lambda jwt, seed: (f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
                                          "-----BEGIN NATS USER JWT-----"),
    "seed-not-a-seed": lambda jwt, seed: (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n"
                                          f"-----BEGIN USER NKEY SEED-----\nSU{seed[2:20]}\n"),
    "empty": lambda jwt, seed: "",
}


@pytest.fixture(scope="module")
def operator_server() -> Iterator[tuple[Operator, EmbeddedNats]]:
    operator = Operator()
    with EmbeddedNats(jetstream=False, config=operator.server_config()) as server:
        yield operator, server


@pytest.mark.parametrize("broken", list(BROKEN_CREDS))
def test_a_creds_file_nats_py_cannot_use_is_a_configuration_error_not_a_hang(operator_server, tmp_path, broken):
    operator, server = operator_server
    jwt, seed = _creds_parts(operator.creds(tmp_path / "good.creds"))
    path = tmp_path / "broken.creds"
    path.write_text(BROKEN_CREDS[broken](jwt, seed))
    for command in ("run", "simulate", "edge"):
        started = time.monotonic()
        try:
            proc = run_cli_process(command, "--nats-url", server.url, "--nats-creds-file", str(path),
                                   "--connect-timeout", "3", *demo_flag(command), timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"streamproc {command} with a {broken} creds file still ran 20 s into a 3 s connect "
                        "timeout (killed)")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out, (command, proc.returncode, out[-2000:])
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and "--nats-creds-file" in errors[0] and str(path) in errors[0], out[-2000:]
        assert seed[2:] not in out and jwt not in out, out
        assert time.monotonic() - started < 15


@pytest.mark.parametrize("broken", ["seed-alone", "no-jwt-block"])
def test_a_creds_file_broken_while_running_is_reported_at_each_reconnect_and_its_repair_is_taken(
        operator_server, tmp_path, broken):
    """nats-py reads the file again at every reconnect (so a rotated file is used): broken meanwhile,
    the reconnect hung the running processor for good (the endless read) or, with no seed, raised a
    TypeError out of nats-py's reconnect task, which then never tried again."""
    operator, server = operator_server
    path = operator.creds(tmp_path / "rotated.creds")
    good = path.read_text()
    jwt, seed = _creds_parts(path)
    with processor_subprocess(server.url, "--mode", "core", "--nats-creds-file", str(path)) as (proc, log_path):
        path.write_text(BROKEN_CREDS[broken](jwt, seed))  # a rotation gone wrong
        server.restart()  # the processor must reconnect, reading the file again
        deadline = time.monotonic() + 15
        while "holds no user JWT" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = log_path.read_text()
        assert "holds no user JWT" in log and str(path) in log, log[-3000:]
        assert seed[2:] not in log and jwt not in log
        path.write_text(good)  # repaired: the next reconnect attempt succeeds
        deadline = time.monotonic() + 15
        while "event=reconnected" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "event=reconnected" in log_path.read_text(), log_path.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, log_path.read_text()[-3000:]


@pytest.mark.parametrize("broken", ["cut", "not-base32", "two-seeds"])
def test_an_nkey_seed_file_nkeys_cannot_read_is_a_configuration_error(tmp_path, broken):
    """A seed cut short, with a character outside base32, or two on one line passed the ``SU`` prefix
    check and failed in nats-py's connect: exit 1 with
    ``cannot connect to NATS at ...: ErrInvalidSeed: nkeys: invalid seed``, as if the server had
    refused it (found by an attack on the command line)."""
    seed, public = new_keypair(nkeys.PREFIX_BYTE_USER)
    text = {"cut": seed[:30], "not-base32": seed[:20] + "!" + seed[21:], "two-seeds": seed + seed}[broken]
    path = _write(tmp_path / "user.nk", text)
    with EmbeddedNats(jetstream=False, config=f"authorization {{ users = [ {{ nkey: {public} }} ] }}\n") as server:
        proc = run_cli_process("run", "--nats-url", server.url, "--nats-nkey-seed-file", path, "--connect-timeout", "3",
                               timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "--nats-nkey-seed-file" in errors[0] and "nkey seed" in errors[0], proc.stderr
    assert seed[2:12] not in proc.stderr + proc.stdout
