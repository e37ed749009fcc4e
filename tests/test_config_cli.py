"""Configuration behaves the same for every command (`run`, `edge`, `simulate`), checked on real
subprocesses: --print-config shows each value's source and validates as start-up would, bad values
exit 2 with one line naming the flag or variable and the value, misspelt STREAMPROC_* variables
are reported, and start-up failures exit 1 without a traceback."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import run_cli_process
from edge_harness import demo_flag, free_port

pytestmark = [pytest.mark.timeout(60)]

COMMANDS = ["run", "edge", "simulate"]
EDGE_SCRIPT = [sys.executable, "-m", "streamproc.edge"]


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


@pytest.mark.parametrize("command", COMMANDS)
def test_misspelt_streamproc_variables_are_reported_with_a_suggestion(command):
    proc = run_cli_process(command, "--print-config", *demo_flag(command),
                           env={"STREAMPROC_PREFIL_TIMEOUT": "3", "STREAMPROC_EDGE_MAX_STREAMS": "5"})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == [f"streamproc {command}: warning: unknown environment variable STREAMPROC_PREFIL_TIMEOUT "
                        "(did you mean STREAMPROC_PREFILL_TIMEOUT?), ignored"]


def test_edge_start_up_failure_exits_1_in_one_line_without_a_traceback():
    proc = run_cli_process("edge", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1",
                           "--port", str(free_port()), "--insecure-demo")
    line = one_clean_error(proc, 1, "edge")
    assert "cannot connect to NATS" in line


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
    ("run", ["connection", "correlation", "limits", "durable", "logging"]),
    ("edge", ["connection", "correlation", "durable", "edge", "logging"]),
])
def test_help_groups_flags_by_topic_and_lists_choices(command, groups):
    proc = run_cli_process(command, "--help")
    assert proc.returncode == 0
    sections = _help_sections(proc.stdout)
    titles = [t for t in sections if t.endswith(" settings")]
    assert titles == [f"{g} settings" for g in groups]
    expect = {"connection": "--nats-url", "correlation": "--format", "logging": "--log-format",
              "durable": "--results-max-age", "limits": "--max-inflight", "edge": "--max-streams"}
    for group in groups:
        assert expect[group] in sections[f"{group} settings"]
    logging_help = " ".join(sections["logging settings"].split())
    assert "(one of: DEBUG, INFO, WARNING, ERROR, CRITICAL)" in logging_help
    assert "(one of: logfmt, json)" in logging_help
    if command == "run":
        assert "--mode {auto,core,durable}" in sections["correlation settings"]
        assert "--prefill-timeout" in sections["correlation settings"]
        assert "--partitions" in sections["durable settings"]
        assert "--http-port" in sections["logging settings"]


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
