"""Hostile input to the command line, found by attacking it with real subprocesses: values that are
not UTF-8 (a flag or variable from a shell in another locale, a secret file holding binary), a
"secret" or key file that is huge or endless (a path pointing at the wrong file or a device), a
limit nats-server cannot store. Each must end in one ``streamproc <command>: error:`` line and exit
2 (bad configuration), never a traceback, a hang or unbounded memory."""

from __future__ import annotations

import os
import resource
import subprocess

import pytest
from conftest import CLI
from helpers import clean_env

pytestmark = [pytest.mark.timeout(120)]

NOT_UTF8 = os.fsdecode(b"a\xffb")  # what Python makes of the bytes a\xffb in argv or the environment
ADDRESS_SPACE = 2 << 30  # enough for any command; far less than reading an endless file needs


def run(*args: str, env: dict[str, str] | None = None, limit_memory: bool = False,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run([*CLI, *args], capture_output=True, text=True, errors="replace", timeout=timeout,
                          env=clean_env(env), stdin=subprocess.DEVNULL,
                          preexec_fn=limited if limit_memory else None)


def one_clean_error(proc: subprocess.CompletedProcess[str], code: int, command: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"streamproc {command}: error: "), proc.stderr
    return errors[0]


@pytest.mark.parametrize("where", ["flag", "env"])
@pytest.mark.parametrize("setting", ["prefix", "nats-user", "prefill-timeout", "format-option"])
def test_a_value_that_is_not_utf8_is_bad_configuration_in_one_line(setting, where, tmp_path):
    password = tmp_path / "password"
    password.write_text("pw-not-utf8-test\n")
    extra = ["--nats-password-file", str(password)] if setting == "nats-user" else []
    if where == "flag":
        proc = run("run", "--print-config", *extra, f"--{setting}", NOT_UTF8)
    else:
        proc = run("run", "--print-config", *extra,
                   env={"STREAMPROC_" + setting.upper().replace("-", "_"): NOT_UTF8})
    line = one_clean_error(proc, 2, "run")
    assert "UTF-8" in line and setting in line.lower().replace("_", "-"), line


@pytest.mark.parametrize("command", ["edge", "simulate", "token"])
def test_every_command_refuses_a_value_that_is_not_utf8(command, tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 40)
    args = {"edge": ["--insecure-demo", "--prefix", NOT_UTF8],
            "simulate": ["--prefix", NOT_UTF8],
            "token": ["--key-file", str(key), "--subject", NOT_UTF8, "--operator"]}[command]
    line = one_clean_error(run(command, "--print-config", *args), 2, command)
    assert "UTF-8" in line, line


@pytest.mark.parametrize("setting", ["nats-password-file", "nats-token-file", "nats-nkey-seed-file"])
def test_a_secret_file_that_is_not_utf8_is_bad_configuration_without_showing_it(setting, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SUsecret-\xff\xfe-tail\n")
    extra = ["--nats-user", "app"] if setting == "nats-password-file" else []
    line = one_clean_error(run("run", "--print-config", *extra, f"--{setting}", str(secret)), 2, "run")
    assert setting in line and "UTF-8" in line, line
    assert "secret-" not in line and "tail" not in line


@pytest.mark.parametrize("command, args", [
    ("run", ["--nats-token-file"]),
    ("run", ["--nats-user", "app", "--nats-password-file"]),
    ("run", ["--nats-nkey-seed-file"]),
    ("run", ["--nats-creds-file"]),
    ("edge", ["--auth-key-file"]),
    ("token", ["--operator", "--key-file"]),
])
def test_an_endless_secret_or_key_file_is_refused_without_reading_it_all(command, args):
    """/dev/zero stands for a path pointing at the wrong thing (a log, a disk): before, the whole of it
    was read into memory (VmHWM past 3 GiB within 8 s for /dev/zero, then killed)."""
    proc = run(command, "--print-config", *args, "/dev/zero", limit_memory=True)
    line = one_clean_error(proc, 2, command)
    assert "/dev/zero" in line and "larger than" in line, line


def test_a_secret_file_just_under_the_limit_is_still_read(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 100_000 + "\n")  # long, but a token all the same
    proc = run("run", "--print-config", "--nats-token-file", str(token))
    assert proc.returncode == 0, proc.stderr


def test_a_chunk_stream_byte_limit_nats_server_cannot_store_is_bad_configuration():
    """nats-server stores max_bytes as int64; a larger value was found only by the stream create
    (exit 1, 'cannot unmarshal number ... into ... int64'), and --print-config passed it."""
    line = one_clean_error(run("run", "--print-config", "--chunks-max-bytes", str(2**63)), 2, "run")
    assert "--chunks-max-bytes" in line
    assert run("run", "--print-config", "--chunks-max-bytes", str(2**63 - 1)).returncode == 0


def test_the_demo_verifies_thousands_of_requests():
    """Every leg of every request used to be interleaved at random: at 1,000 requests some prefill
    legs came seconds after their decode legs and met the demo's 1 s prefill timeout (7 of 1000 and
    164 of 2000 requests 'wrong', exit 1, on a healthy machine)."""
    proc = run("demo", "--requests", "2000", "--timeout", "200", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verified OK: all 2000 requests" in proc.stdout


def test_simulated_requests_keep_their_legs_close_however_many_there_are():
    from streamproc.sim import traffic

    plans = traffic.plan("sglang", requests=3000, mode="pd", seed=3, id_prefix="near")
    for shuffle in (False, True):
        messages = traffic.schedule(plans, seed=3, shuffle=shuffle, duplicates=0.5)
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, m in enumerate(messages):
            first.setdefault(m.request_id, i)
            last[m.request_id] = i
        span = max(last[r] - first[r] for r in first)
        assert span < 64 * 40, span  # a window of requests, whatever the total


# ------------------------------------------------------------------ --format-option mistakes


@pytest.mark.parametrize("option, says", [
    # A typo: the sglang codec went on assuming incremental streams (SGLang's default is cumulative).
    ("streming=cumulative", "'streming' is read by no installed codec"),
    ("STREAMING=cumulative", "'STREAMING' is read by no installed codec"),
    # A key given twice: the last one won, silently.
    ("streaming=cumulative,streaming=incremental", "'streaming' is given twice"),
    # A value the --format codec refuses: exit 1 ("runtime") before, though it is configuration.
    ("streaming=sideways", "streaming='sideways': expected incremental or cumulative"),
])
def test_a_format_option_mistake_is_bad_configuration_in_one_line(option, says):
    for where in ("flag", "env"):
        if where == "flag":
            proc = run("run", "--print-config", "--format", "sglang", "--format-option", option)
        else:
            proc = run("run", "--print-config", "--format", "sglang", env={"STREAMPROC_FORMAT_OPTION": option})
        line = one_clean_error(proc, 2, "run")
        assert says in line, line


def test_a_format_option_another_installed_codec_reads_is_accepted():
    """Chunks name their own format: ``zstd_level`` is sglang-zstd's, read when a chunk names it."""
    proc = run("run", "--print-config", "--format", "sglang",
               "--format-option", "streaming=cumulative,zstd_level=6,stream_routed_experts=no")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr


def test_an_edge_on_a_busy_port_says_why_in_one_error_line(nats_url):
    """Uvicorn logs the bind error and calls sys.exit(1): the edge exited 1 with no
    ``streamproc edge: error:`` line (found by a newcomer's walk through the README)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run("edge", "--insecure-demo", "--nats-url", nats_url, "--host", "127.0.0.1", "--port", str(port))
    line = one_clean_error(proc, 1, "edge")
    assert f"cannot serve on 127.0.0.1:{port}" in line and "address already in use" in line, line
