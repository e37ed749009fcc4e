"""Configuration behaves the same for every command (`run`, `edge`, `simulate`, `demo`, `token`,
`codecs`), checked on real subprocesses: --print-config shows each value's source and validates as
start-up would, bad values exit 2 with one line naming the flag or variable and the value, misspelt
STREAMPROC_* variables are reported, and start-up failures exit 1 without a traceback."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import run_cli_process
from edge_harness import demo_flag, free_port

from streamproc.cli import build_parser

pytestmark = [pytest.mark.timeout(60)]

COMMANDS = ["run", "edge", "simulate"]
EDGE_SCRIPT = [sys.executable, "-m", "streamproc.edge"]


def every_command() -> list[str]:
    """The sub-commands ``streamproc --help`` lists (a new one is covered by the tests below at once)."""
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


EVERY_COMMAND = every_command()
DEAD_NATS = ["--nats-url", "nats://127.0.0.1:1", "--connect-timeout", "30"]


def needed(command: str, key_file: Path) -> list[str]:
    """What a command cannot start without (the edge its auth choice, a token its key and grant)."""
    return {"edge": ["--insecure-demo"], "token": ["--key-file", str(key_file), "--operator"]}.get(command, [])


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "edge.key"
    path.write_text("hmac-secret-5a1f-not-for-printing-0123456789\n")
    return path


# A value each command refuses, and what the one error line must name.
BAD_VALUE = {
    "run": (["--prefill-timeout", "-1", *DEAD_NATS], "--prefill-timeout='-1'"),
    "edge": (["--port", "70000", *DEAD_NATS], "--port='70000'"),
    "simulate": (["--duplicates", "2", *DEAD_NATS], "--duplicates='2'"),
    "demo": (["--requests", "0"], "--requests='0'"),
    "token": (["--ttl", "0"], "--ttl='0'"),
    "codecs": (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
}


def test_every_command_has_a_bad_value_case():
    assert sorted(BAD_VALUE) == EVERY_COMMAND


@pytest.mark.parametrize("command", EVERY_COMMAND)
@pytest.mark.parametrize("print_config", [False, True])
def test_a_bad_value_exits_2_in_one_line_for_every_command(command, print_config, key_file):
    args, named = BAD_VALUE[command]
    extra = ["--print-config"] if print_config and command != "codecs" else []
    proc = run_cli_process(command, *needed(command, key_file), *args, *extra)
    line = one_clean_error(proc, 2, command)
    assert named in line
    assert proc.stdout == ""


@pytest.mark.parametrize("command", EVERY_COMMAND)
def test_every_command_prints_its_config_with_the_source_of_each_value(command, key_file):
    proc = run_cli_process(command, "--print-config", *needed(command, key_file))
    assert proc.returncode == 0, proc.stderr
    explained = json.loads(proc.stdout)
    assert isinstance(explained, dict)
    for name, entry in explained.items():
        assert set(entry) == {"value", "source"}, (name, entry)
        assert re.fullmatch(r"default|env STREAMPROC_[A-Z_]+|flag --[a-z-]+", entry["source"]), (name, entry)
    if command == "codecs":
        assert explained == {}  # it has no settings
    else:
        assert explained, "a command with settings printed none"


def test_demo_token_and_simulate_print_their_own_options(key_file):
    demo = json.loads(run_cli_process("demo", "--print-config", "--requests", "5", "--serve").stdout)
    assert demo["requests"] == {"value": 5, "source": "flag --requests"}
    assert demo["serve"] == {"value": 8080, "source": "flag --serve"}  # --serve alone: 8080
    assert demo["format"]["source"] == "default" and demo["format"]["value"] in ("sglang", "sglang-zstd")
    token = json.loads(run_cli_process("token", "--print-config", "--key-file", str(key_file), "--rid", "a-1",
                                       "--rid", "b-2", "--ttl", "60").stdout)
    assert token["rid"] == {"value": ["a-1", "b-2"], "source": "flag --rid"}
    assert token["ttl"] == {"value": 60.0, "source": "flag --ttl"}
    assert token["operator"] == {"value": False, "source": "default"}
    assert token["key_file"] == {"value": str(key_file), "source": "flag --key-file"}
    sim = json.loads(run_cli_process("simulate", "--print-config", "--requests", "3", "--unary",
                                     "--prefix", "p1").stdout)
    assert sim["requests"] == {"value": 3, "source": "flag --requests"}
    assert sim["stream"] == {"value": False, "source": "flag --stream"}
    assert sim["prefix"] == {"value": "p1", "source": "flag --prefix"}
    assert "partitions" not in sim  # only the processor settings simulate takes


@pytest.mark.parametrize("command, args, named", [
    ("demo", ["--serve", "70000"], "--serve (flag --serve='70000'): a port is 0..65535"),
    ("demo", ["--format", "no-such-codec"], "no-such-codec"),
    ("token", ["--algorithm", "RS256"], "cannot sign with --key-file"),  # an HMAC secret is no RSA key
    ("token", ["--rid", "a b"], "--rid 'a b': invalid request id"),
    ("simulate", ["--requests", "0", *DEAD_NATS], "--requests='0'"),
    ("simulate", ["--nats-token-file", "/nonexistent/token", *DEAD_NATS],
     "cannot read --nats-token-file (STREAMPROC_NATS_TOKEN_FILE) '/nonexistent/token'"),
    ("run", ["--max-migrate-rate", "0.001", *DEAD_NATS], "--max-migrate-rate (flag --max-migrate-rate='0.001') must be 0"),
    ("run", ["--nats-creds-file", "/nonexistent/x.creds", *DEAD_NATS],
     "cannot read --nats-creds-file (STREAMPROC_NATS_CREDS_FILE) '/nonexistent/x.creds'"),
])
def test_print_config_refuses_what_start_up_refuses(command, args, named, key_file):
    for extra in ([], ["--print-config"]):
        proc = run_cli_process(command, *needed(command, key_file), *args, *extra)
        line = one_clean_error(proc, 2, command)
        assert named in line and proc.stdout == ""


def test_token_print_config_needs_a_readable_key_and_a_grant(key_file):
    line = one_clean_error(run_cli_process("token", "--print-config", "--key-file", str(key_file)), 2, "token")
    assert "name what the token grants" in line
    missing = str(key_file.parent / "missing.key")
    line = one_clean_error(run_cli_process("token", "--print-config", "--key-file", missing, "--operator"), 2,
                           "token")
    assert f"cannot read --key-file {missing!r}" in line


@pytest.mark.parametrize("algorithm", ["ES256", "RS256", "EdDSA"])
def test_token_refuses_the_public_half_of_a_key_in_one_line(algorithm, tmp_path):
    """The edge gets the public key, the minter the private one (docs/security.md names both files):
    handed the public one, ``token`` says so (exit 2), never an AttributeError traceback from PyJWT."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    private = {"ES256": lambda: ec.generate_private_key(ec.SECP256R1()),
               "RS256": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
               "EdDSA": ed25519.Ed25519PrivateKey.generate}[algorithm]()
    public = tmp_path / "edge.pub"
    public.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    for extra in ([], ["--print-config"]):
        proc = run_cli_process("token", "--key-file", str(public), "--algorithm", algorithm, "--operator", *extra)
        line = one_clean_error(proc, 2, "token")
        assert f"cannot sign with --key-file {str(public)!r} as {algorithm}: " in line and "public key" in line, line
        assert proc.stdout == ""


def test_run_print_config_checks_the_otel_variables_as_start_up_does():
    proc = run_cli_process("run", "--print-config", env={"OTEL_TRACES_EXPORTER": "no-such-exporter"})
    line = one_clean_error(proc, 2, "run")
    assert "OTEL_TRACES_EXPORTER='no-such-exporter'" in line


@pytest.mark.parametrize("value", ["*", "proxy.internal", "10.0.0.0/33", "10.0.0.1,,10.0.0.300"])
def test_edge_forwarded_allow_ips_names_addresses_or_networks_only(value):
    """Uvicorn takes ``*`` for every peer (any client then names its own address) and keeps a value that
    is no address or network as a literal nothing matches, silently: both are refused at start."""
    proc = run_cli_process("edge", "--print-config", "--insecure-demo", "--forwarded-allow-ips", value)
    line = one_clean_error(proc, 2, "edge")
    assert "--forwarded-allow-ips" in line and "not an IP address or network" in line, line


@pytest.mark.parametrize("value", ["0.0.0.0/0", "::/0", "10.0.0.5,0.0.0.0/0.0.0.0"])
def test_edge_forwarded_allow_ips_refuses_a_network_of_every_address_as_it_refuses_a_star(value):
    """``0.0.0.0/0`` (or ``::/0``) is a network Uvicorn trusts as given: every peer of its family, the
    same as ``*``, so any client names its own address for --max-streams-per-client and the access
    log. ``*`` is refused for that; so is its spelling as a network."""
    proc = run_cli_process("edge", "--print-config", "--insecure-demo", "--forwarded-allow-ips", value)
    line = one_clean_error(proc, 2, "edge")
    assert "--forwarded-allow-ips" in line and "every address" in line, line


def one_clean_error(proc, code: int, command: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"streamproc {command}: error: "), proc.stderr
    return errors[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_print_config_names_the_source_of_every_value(command):
    proc = run_cli_process(command, "--print-config", "--prefix", "flagged", *demo_flag(command),
                           env={"STREAMPROC_LOG_LEVEL": "debug", "STREAMPROC_CONNECT_TIMEOUT": "4"})
    assert proc.returncode == 0, proc.stderr
    explained = json.loads(proc.stdout)
    assert explained["prefix"] == {"value": "flagged", "source": "flag --prefix"}
    assert explained["log_level"] == {"value": "DEBUG", "source": "env STREAMPROC_LOG_LEVEL"}
    assert explained["connect_timeout"] == {"value": 4.0, "source": "env STREAMPROC_CONNECT_TIMEOUT"}
    assert explained["log_format"] == {"value": "logfmt", "source": "default"}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("print_config", [True, False])
def test_unknown_format_exits_2_naming_the_flag_and_value(command, print_config):
    extra = ["--print-config"] if print_config else []
    proc = run_cli_process(command, "--format", "no-such-codec", "--nats-url", "nats://127.0.0.1:1",
                           "--connect-timeout", "30", *extra, *demo_flag(command))
    line = one_clean_error(proc, 2, command)
    assert "--format='no-such-codec'" in line and "installed codecs:" in line
    assert proc.stdout == ""


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1:4222", "unsupported scheme 'http://'"),
    ("not a url", "is not a server address"),
    ("nats://127.0.0.1:4222,ftp://x", "unsupported scheme 'ftp://'"),
    ("nats://host:70000", "is not a server address"),
    ("NATS://127.0.0.1:4222", "unsupported scheme 'NATS://'"),  # nats-py made it nats://NATS://...
])
def test_nats_url_scheme_and_shape_are_checked_before_connecting(command, url, reason):
    proc = run_cli_process(command, "--nats-url", url, "--connect-timeout", "30")
    line = one_clean_error(proc, 2, command)
    assert f"--nats-url (flag --nats-url={url!r})" in line and reason in line


def test_nats_url_from_the_environment_is_named_as_such():
    proc = run_cli_process("run", "--print-config", env={"STREAMPROC_NATS_URL": "http://x"})
    line = one_clean_error(proc, 2, "run")
    assert "environment variable STREAMPROC_NATS_URL='http://x'" in line


@pytest.mark.parametrize("command", ["run", "edge"])
def test_cross_field_errors_name_both_flags_and_values(command):
    proc = run_cli_process(command, "--print-config", "--results-max-age", "60")
    line = one_clean_error(proc, 2, command)
    assert "--duplicate-window (default 120.0) must not exceed --results-max-age (flag --results-max-age='60')" in line


@pytest.mark.parametrize("command", EVERY_COMMAND)
def test_misspelt_streamproc_variables_are_reported_with_a_suggestion(command, key_file):
    proc = run_cli_process(command, "--print-config", *needed(command, key_file),
                           env={"STREAMPROC_PREFIL_TIMEOUT": "3", "STREAMPROC_EDGE_MAX_STREAMS": "5"})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == [f"streamproc {command}: warning: unknown environment variable STREAMPROC_PREFIL_TIMEOUT "
                        "(did you mean STREAMPROC_PREFILL_TIMEOUT?), ignored"]


def test_a_setting_named_without_the_edges_prefix_is_suggested_with_it():
    """``STREAMPROC_PORT`` for the edge: its variable is ``STREAMPROC_EDGE_PORT`` (README), and the
    warning offered ``STREAMPROC_FORMAT`` (found by a newcomer walk)."""
    proc = run_cli_process("edge", "--print-config", "--insecure-demo", env={"STREAMPROC_PORT": "18081"})
    assert proc.returncode == 0, proc.stderr
    assert ("warning: unknown environment variable STREAMPROC_PORT (did you mean STREAMPROC_EDGE_PORT?), ignored"
            in proc.stderr), proc.stderr


def test_edge_start_up_failure_exits_1_in_one_line_without_a_traceback():
    proc = run_cli_process("edge", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1",
                           "--port", str(free_port()), "--insecure-demo")
    line = one_clean_error(proc, 1, "edge")
    assert "cannot connect to NATS" in line


@pytest.mark.parametrize("command", ["run", "edge"])
def test_a_first_connect_that_fails_logs_no_lost_connection(command):
    """``event=disconnected`` means "the NATS connection was lost; the client reconnects"
    (docs/operations.md): a start-up that never connected and gives up logged it anyway, right
    before ``cannot connect to NATS``, and counted it in ``disconnects`` (found by a newcomer)."""
    proc = run_cli_process(command, "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1",
                           *needed(command, Path()), *(["--port", str(free_port())] if command == "edge" else []))
    assert "cannot connect to NATS" in one_clean_error(proc, 1, command)
    assert "event=disconnected" not in proc.stderr, proc.stderr


def test_edge_with_a_busy_port_exits_1():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli_process("edge", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1",
                               "--port", str(port), "--insecure-demo")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_exit_codes_are_documented_once_for_every_command():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = doc.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\d)` \| (.+) \|$", section, re.M)
    assert [code for code, _ in rows] == ["0", "1", "2"]
    listed = re.search(r"The same for every command \(([^)]*)", section).group(1)
    assert sorted(re.findall(r"`(\w+)`", listed)) == EVERY_COMMAND
    per_command = re.findall(r"^\| `(\w+)` \| .+ \| .+ \|$", section, re.MULTILINE)
    assert sorted(per_command) == EVERY_COMMAND


def _help_sections(text: str) -> dict[str, str]:
    """``--help`` split at its group headings (lines ending in ':' at column 0)."""
    sections, current = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = ""
        elif current:
            sections[current] += line + "\n"
    return sections


@pytest.mark.parametrize("command, groups", [
    ("run", ["connection", "correlation", "limits", "durable", "logging", "observability"]),
    ("edge", ["connection", "correlation", "durable", "edge", "logging"]),
])
def test_help_groups_flags_by_topic_and_lists_choices(command, groups):
    proc = run_cli_process(command, "--help")
    assert proc.returncode == 0
    sections = _help_sections(proc.stdout)
    titles = [t for t in sections if t.endswith(" settings")]
    assert titles == [f"{g} settings" for g in groups]
    expect = {"connection": "--nats-url", "correlation": "--format", "logging": "--log-format",
              "durable": "--results-max-age", "limits": "--max-inflight", "edge": "--max-streams",
              "observability": "--http-port"}
    for group in groups:
        assert expect[group] in sections[f"{group} settings"]
    logging_help = " ".join(sections["logging settings"].split())
    assert "(one of: DEBUG, INFO, WARNING, ERROR, CRITICAL)" in logging_help
    assert "(one of: logfmt, json)" in logging_help
    if command == "run":
        assert "--mode {auto,core,durable}" in sections["correlation settings"]
        assert "--prefill-timeout" in sections["correlation settings"]
        assert "--partitions" in sections["durable settings"]
        for flag in ("--http-port", "--http-host"):  # the status server, not a logging setting
            assert flag in sections["observability settings"] and flag not in sections["logging settings"]


@pytest.mark.parametrize("command", ["run", "edge", "simulate"])
def test_help_names_every_flags_value_after_the_flag_not_an_internal_name(command):
    """The refused secret flags (``--nats-password``, ``--nats-token``) showed argparse's default
    metavar, built from the internal dest: ``--nats-password SETTING_NATS_PASSWORD``."""
    proc = run_cli_process(command, "--help")
    assert proc.returncode == 0
    assert "SETTING_" not in proc.stdout, proc.stdout
    assert "--nats-password NATS_PASSWORD" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--chunks-max-bytes", "0"], ("--chunks-max-bytes (flag --chunks-max-bytes='0') must be -1 (unlimited) or a "
                                   "byte count: nats-server takes 0 for unlimited")),
    (["--max-ack-pending", "1"], "invalid flag --max-ack-pending='1': Expected `int` >= 2"),
])
def test_nonsensical_durable_stream_limits_exit_2_naming_the_flag_and_value(flags, message):
    """Limits nats-server or the processor cannot honour are refused before connecting (the one that
    depends on the server's max_payload is checked at start-up: tests/test_durable_hostile.py)."""
    proc = run_cli_process("run", "--print-config", "--mode", "durable", *flags)
    line = one_clean_error(proc, 2, "run")
    assert message in line, line


def test_the_edge_does_not_take_the_processors_control_reply_prefix():
    """Only the processor answers migrates; the edge accepted --control-reply-prefix and ignored it."""
    from streamproc.config import Settings
    from streamproc.edge.settings import EdgeSettings

    assert "control_reply_prefix" in Settings.__struct_fields__
    assert "control_reply_prefix" not in EdgeSettings.__struct_fields__
