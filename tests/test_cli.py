"""The `streamproc` command line as a user runs it: real subprocesses, real nats-server."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from conftest import SCRIPT
from helpers import chunks_published_by, clean_env, free_port

from streamproc import config
from streamproc.client.migration import Resumed
from streamproc.sim import traffic
from streamproc.sim.migration import DIE_AFTER, plan_migrations, verify_migration
from streamproc.catalog import worker_for
from streamproc.wire import ResultInfo, Verdict

pytestmark = [pytest.mark.nats, pytest.mark.timeout(30)]


def assert_clean_failure(proc, code: int) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


# -------------------------------------------------------------------------- codecs

def test_codecs_lists_sglang_and_vllm_with_distribution_and_description(run_cli):
    proc = run_cli("codecs", script=True)  # the installed console script, not just the module
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "DESCRIPTION"]
    rows = {line.split()[0]: line.split(maxsplit=2) for line in lines[1:]}
    assert {"sglang", "vllm"} <= set(rows)
    assert rows["sglang"][1] == "streamproc" and rows["sglang"][2].strip()
    assert rows["vllm"][1] == "streamproc" and rows["vllm"][2].strip()


# -------------------------------------------------------------------- settings

def test_print_config_merges_defaults_environment_and_flags(run_cli):
    proc = run_cli("run", "--print-config", "--max-inflight", "7", "--prefix", "flagged",
                   env={"STREAMPROC_PREFILL_TIMEOUT": "2.5", "STREAMPROC_PREFIX": "from-env",
                        "STREAMPROC_LOG_LEVEL": "debug"})
    assert proc.returncode == 0, proc.stderr
    explained = json.loads(proc.stdout)
    effective = {name: entry["value"] for name, entry in explained.items()}
    assert explained["prefill_timeout"]["source"] == "env STREAMPROC_PREFILL_TIMEOUT"
    assert explained["prefix"]["source"] == "flag --prefix"
    assert explained["request_timeout"]["source"] == "default"
    assert effective["prefill_timeout"] == 2.5  # environment over default
    assert effective["prefix"] == "flagged"  # flag over environment
    assert effective["max_inflight"] == 7
    assert effective["log_level"] == "DEBUG"
    assert effective["request_timeout"] == 300.0 and effective["format"] == "sglang"
    assert set(effective) == {f.name for f in config.fields()}


@pytest.mark.parametrize("args, env, named", [
    (["--prefill-timeout", "-1"], {}, "--prefill-timeout"),
    (["--max-inflight", "lots"], {}, "--max-inflight"),
    ([], {"STREAMPROC_REQUEST_TIMEOUT": "0"}, "STREAMPROC_REQUEST_TIMEOUT"),
    (["--log-level", "loud"], {}, "DEBUG, INFO"),
    (["--mode", "exactly-once"], {}, "--mode"),
    (["--partitions", "0"], {}, "--partitions"),
    ([], {"STREAMPROC_DUPLICATE_WINDOW": "7200"}, "--duplicate-window (environment variable "
                                                   "STREAMPROC_DUPLICATE_WINDOW='7200')"),
    (["--prefix", "a..b"], {}, "prefix"),
])
def test_invalid_settings_exit_2_naming_where_the_value_came_from(run_cli, args, env, named):
    proc = run_cli("run", "--print-config", *args, env=env)
    assert_clean_failure(proc, 2)
    assert named in proc.stderr


def test_settings_precedence_is_defaults_then_environment_then_flags():
    env = {"STREAMPROC_MAX_INFLIGHT": "5", "STREAMPROC_FORMAT": "vllm"}
    settings = config.load(env, {"max_inflight": "9", "format": None})
    assert (settings.max_inflight, settings.format, settings.finished_grace) == (9, "vllm", 60.0)
    with pytest.raises(config.ConfigError, match="STREAMPROC_MAX_INFLIGHT"):
        config.load({"STREAMPROC_MAX_INFLIGHT": "0"})


# ------------------------------------------------------------------ run failures

def test_run_with_unknown_format_exits_2_before_connecting_listing_installed_codecs(run_cli):
    started = time.monotonic()
    # A NATS url that would hang for connect_timeout proves the format is checked first.
    proc = run_cli("run", "--format", "no-such-codec", "--nats-url", f"nats://127.0.0.1:{free_port()}",
                   "--connect-timeout", "60")
    assert_clean_failure(proc, 2)  # bad configuration, like every command
    assert time.monotonic() - started < 15
    assert "unknown format 'no-such-codec'" in proc.stderr
    assert re.search(r"installed codecs: .*sglang.*vllm", proc.stderr), proc.stderr


def test_run_fails_cleanly_when_nats_is_unreachable(run_cli):
    started = time.monotonic()
    proc = run_cli("run", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1")
    assert_clean_failure(proc, 1)
    assert "cannot connect to NATS" in proc.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_stops_gracefully_on_signal(streamproc_run, signum):
    with streamproc_run("--format", "sglang") as (proc, log_path):
        proc.send_signal(signum)
        assert proc.wait(10) == 0
        text = log_path.read_text()
    assert f"event=signal signal={signum.name}" in text and "event=stopped" in text
    assert "Traceback" not in text


# ---------------------------------------------------------------------- simulate

def test_simulate_verify_against_streamproc_run_with_200_shuffled_requests(nats_url, run_cli, streamproc_run):
    with streamproc_run("--format", "sglang"):
        proc = run_cli("simulate", "--nats-url", nats_url, "--format", "sglang", "--requests", "200",
                       "--mode", "mixed", "--shuffle", "--duplicates", "0.1", "--verify", "--timeout", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified OK: all 200 requests" in proc.stdout


def test_simulate_publishes_the_announced_number_of_chunks(nats_url, run_cli):
    proc, received = chunks_published_by(
        nats_url, lambda: run_cli("simulate", "--nats-url", nats_url, "--requests", "12", "--mode", "pd", "--unary"),
        expect=r"published (\d+) chunks for 12 requests")
    assert proc.returncode == 0, proc.stderr
    assert "published 24 chunks for 12 requests" in proc.stdout  # unary P/D: one prefill, one decode chunk each
    assert len(received) == 24
    assert {s.rsplit(".", 1)[1] for s in received} == {"prefill", "decode"}


def test_simulate_verify_without_any_result_says_what_to_check(nats_url, run_cli):
    """No processor on the server (or a NATS user that may not read the results, as compose's
    ``worker``): not one result arrives, and the summary says what to look at, not only that the
    requests timed out."""
    proc = run_cli("simulate", "--nats-url", nats_url, "--prefix", "p9", "--requests", "3", "--verify",
                   "--timeout", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("no result arrived at all: is a processor (`streamproc run --prefix p9`) reading p9.chunks.> "
            "on this server, and may this NATS user subscribe to p9.results.>?") in proc.stdout, proc.stdout


def test_simulate_without_a_server_fails_cleanly(run_cli):
    proc = run_cli("simulate", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "2")
    assert_clean_failure(proc, 1)
    assert "cannot connect to NATS" in proc.stderr


# -------------------------------------------------------------------------- demo

def test_demo_exits_zero_with_a_verified_summary(run_cli):
    proc = run_cli("demo", script=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for row in ("aggregated stream", "aggregated unary", "P/D stream", "P/D unary", "total"):
        assert re.search(rf"^{re.escape(row)}\s+\d+", out, re.M), out
    assert re.search(r"^total\s+200\s+\d+", out, re.M), out
    assert "verified OK: all 200 requests" in out
    # the planned faults are visible: omissions (corrupt and missing prefill legs) and errors
    header, total = next(line for line in out.splitlines() if "passthrough" in line), \
        next(line for line in out.splitlines() if line.startswith("total"))
    columns = dict(zip(header.split(), map(int, total.split()[1:])))
    assert columns["omitted"] > 0 and columns["errors"] > 0, out
    # ... and the summary says they were planned and ended as they must, so a newcomer does not read
    # "errors 5" as a failure: 10 corrupt and 10 missing prefill legs in 100 P/D requests, a contract
    # violation in every 20 aggregated ones (traffic.planned)
    assert ("planned faults, 25 of 25 as expected: 10 corrupt prefill legs -> omitted with a reason; "
            "10 missing prefill legs -> omitted with a reason (prefill timeout); "
            "5 contract violations -> invalid_chunk error results") in out.splitlines(), out
    # a worker dies mid-decode in one aggregated and one P/D request: each migrates, and its client
    # sees one verified stream whose resumed part is stitched
    for row in ("aggregated stream, migrated", "P/D stream, migrated"):
        line = next(line for line in out.splitlines() if line.startswith(row))
        migrated = dict(zip(header.split(), map(int, line[len(row):].split())))
        assert migrated["requests"] == migrated["verified"] == 1 and migrated["stitched"] > 0, out
        assert migrated["results"] > migrated["stitched"], out  # results before the migration, too
    assert columns["stitched"] > 0, out
    assert "prefill_timeouts=10" in out
    assert re.search(r"^progress: \d+/200 requests finished", proc.stderr, re.M), proc.stderr
    assert "warning" not in proc.stderr


def test_demo_with_an_unknown_format_is_a_usage_error(run_cli):
    proc = run_cli("demo", "--format", "no-such-codec")
    assert_clean_failure(proc, 2)
    assert "no-such-codec" in proc.stderr


# ------------------------------------------------------- the verifier can fail

def _as_results(rid: str, bodies: list[bytes], verdict: Verdict) -> list[ResultInfo]:
    last = len(bodies) - 1
    return [ResultInfo(rid, i, i == last, verdict, None, b) for i, b in enumerate(bodies)]


def test_verify_flags_changed_bytes_missing_results_and_stale_rows():
    worker = worker_for("sglang")
    agg, pd = traffic.plan("sglang", requests=2, mode="mixed", stream=True, seed=3, worker=worker)
    good = _as_results(agg.request_id, agg.agg, Verdict.PASSTHROUGH)
    assert traffic.verify(agg, good, worker) == []
    tampered = list(agg.agg)
    tampered[0] = tampered[0][:-1] + b" "
    assert traffic.verify(agg, _as_results(agg.request_id, tampered, Verdict.PASSTHROUGH), worker)
    assert traffic.verify(agg, good[:-1], worker)
    # Decode's own bodies carry stale prompt rows: publishing them unjoined must be caught.
    assert any("expert rows" in p for p in traffic.verify(pd, _as_results(pd.request_id, pd.decode,
                                                                          Verdict.PASSTHROUGH), worker))


def test_verify_migration_demands_one_uninterrupted_stream_stitched_after_the_seal():
    worker = worker_for("sglang")
    agg, pd = plan_migrations(seed=3, id_prefix="t")
    expected = worker.agg(agg.truth, stream=True)
    sent = DIE_AFTER * 2
    resumed_body = msgspec.json.encode({"input_ids": agg.truth.prompt_ids + agg.truth.output_ids[:sent],
                                        "sampling_params": {"max_new_tokens": agg.truth.output_len - sent}})
    agg.resumed = Resumed(agg.request_id, 1, sent, DIE_AFTER, resumed_body)
    good = [ResultInfo(agg.request_id, i, i == len(expected) - 1,
                       Verdict.PASSTHROUGH if i < DIE_AFTER else Verdict.STITCHED, None, b)
            for i, b in enumerate(expected)]
    assert verify_migration(agg, good, worker) == []
    assert verify_migration(agg, good[:-1], worker)  # the final result missing
    unstitched = [msgspec.structs.replace(r, verdict=Verdict.PASSTHROUGH) for r in good]
    assert any("stitched" in p for p in verify_migration(agg, unstitched, worker))
    restarted = good[:DIE_AFTER] + [msgspec.structs.replace(r, body=expected[0]) for r in good[DIE_AFTER:]]
    assert any("bodies" in p for p in verify_migration(agg, restarted, worker))
    wrong_budget = msgspec.json.encode({"input_ids": agg.truth.prompt_ids + agg.truth.output_ids[:sent],
                                        "sampling_params": {"max_new_tokens": agg.truth.output_len}})
    agg.resumed = Resumed(agg.request_id, 1, sent, DIE_AFTER, wrong_budget)
    assert any("rebuilt request" in p for p in verify_migration(agg, good, worker))
    pd.error = "MigrationError: unknown_request"
    assert verify_migration(pd, good, worker) == ["the migration failed: MigrationError: unknown_request"]


def test_verify_demands_omissions_for_broken_prefill_and_an_error_for_a_contract_violation():
    worker = worker_for("sglang")
    plans = traffic.plan("sglang", requests=80, mode="mixed", seed=3, worker=worker, faults=True)
    by_fault = {}
    for p in plans:
        by_fault.setdefault(p.fault, p)
    assert {"corrupt_prefill", "missing_prefill", "contract"} <= set(by_fault)
    missing = by_fault["missing_prefill"]
    assert missing.prefill == [] and missing.truth.return_experts
    # Claiming a clean join (or publishing decode's own stale rows) for a broken prefill leg is caught.
    for fault in ("corrupt_prefill", "missing_prefill"):
        p = by_fault[fault]
        assert traffic.verify(p, _as_results(p.request_id, p.decode, Verdict.JOINED), worker)
    contract = by_fault["contract"]
    assert traffic.verify(contract, _as_results(contract.request_id, contract.agg, Verdict.PASSTHROUGH), worker)
    error = ResultInfo(contract.request_id, 0, True, None, "invalid_chunk", b"{}")
    assert traffic.verify(contract, [error], worker) == []
    assert all(m.final is False for m in traffic.schedule([contract]) if m.role == "agg")


def test_configuration_doc_lists_every_setting_with_its_flag_and_variable():
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    # Secrets have no flag (environment only): their row starts with a dash.
    missing = [f.name for f in config.fields()
               if (f"| — | `{f.env}`" if f.secret else f"`{f.flag}` | `{f.env}`") not in doc]
    assert missing == []


def demo_serving(requests: int, *, soft_nofile: int | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``streamproc demo --requests N --serve 0`` started, and its output up to its ``live page:`` line
    (within 60 s); the caller stops it (SIGTERM). ``soft_nofile``: the soft open-file limit it starts with
    (the hard one kept)."""
    import resource

    from conftest import CLI

    def lower_limit() -> None:
        if soft_nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft_nofile, hard))

    proc = subprocess.Popen([*CLI, "demo", "--requests", str(requests), "--serve", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=clean_env(),
                            preexec_fn=lower_limit)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while not lines or not lines[-1].startswith("live page: "):
        if time.monotonic() >= deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError("".join(lines) + proc.stderr.read())
        lines.append(proc.stdout.readline())
    return proc, lines


def test_demo_serve_keeps_the_edge_up_with_the_live_page_and_stops_on_sigterm():
    import urllib.request

    proc, lines = demo_serving(40)
    try:
        assert "verified OK: all 40 requests" in "".join(lines)
        page = lines[-1].split()[2]
        base, example = page.split("/?id=")
        with urllib.request.urlopen(page, timeout=5) as response:
            assert response.status == 200 and b"<html" in response.read().lower()
        # the example is a request whose prefill leg was corrupt: replayed from the results stream
        request = urllib.request.Request(f"{base}/v1/results/{example}?stream=false")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Streamproc-Join"] == "omitted"
            json.loads(response.read())
        # the page's join-latency chart: the edge scrapes the demo processor's /metrics
        with urllib.request.urlopen(f"{base}/v1/stats", timeout=10) as response:
            stats = json.loads(response.read())
        assert [p["ok"] for p in stats["processors"]] == [True], stats
        assert stats["join_wait"] and stats["join_wait"]["count"] > 0, stats
        # the page's list of recent requests holds the demo's (it said "none seen yet": the edge
        # started after the traffic and its ring reads new results only)
        with urllib.request.urlopen(f"{base}/v1/recent", timeout=10) as response:
            recent = {entry["request_id"] for entry in json.loads(response.read())}
        assert example in recent and len(recent) >= 38, sorted(recent)  # 38 planned, 2 migrated
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    assert code == 0, proc.stderr.read()


def test_demo_serve_runs_the_edge_with_its_connection_bounds():
    """``demo --serve``'s edge is the edge's own server (edge/server.py), not a stock Uvicorn: a
    request head past ``--max-head-bytes`` (64 KiB) gets 431 and the connection is closed, as on
    ``streamproc edge``. (A stock Uvicorn on httptools read a 200 KiB head whole and answered it.)"""
    import socket

    proc, lines = demo_serving(4)
    try:
        port = int(lines[-1].split()[2].split("/?id=")[0].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            head = b"GET /healthz HTTP/1.1\r\nHost: demo\r\nX-Pad: " + b"a" * (200 * 1024) + b"\r\n\r\n"
            try:
                sock.sendall(head)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed once the bound was passed: the answer is already on the wire
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        # and the edge still answers everyone else
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    assert code == 0, proc.stderr.read()


def open_file_limits(pid: int) -> tuple[int | None, int | None]:
    """The soft and hard ``Max open files`` of a process (``/proc/<pid>/limits``; None: unlimited)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return (None if soft == "unlimited" else int(soft)), (None if hard == "unlimited" else int(hard))
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


def test_demo_serve_raises_its_open_file_limit_as_the_edge_does():
    """``streamproc edge`` raises the soft RLIMIT_NOFILE to ``--max-connections`` + the reserve (up to the
    hard limit); ``demo --serve`` runs the same edge and kept a soft limit of 1024, under which its edge
    fails to accept before it refuses past 2048 connections."""
    import resource

    from streamproc.edge.connections import DESCRIPTOR_RESERVE
    from streamproc.edge.settings import load

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    needed = load({}, {"insecure_demo": True}).max_connections + DESCRIPTOR_RESERVE  # the demo edge's
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"a hard open-file limit of {hard} leaves nothing to raise")
    proc, _ = demo_serving(4, soft_nofile=1024)
    try:
        soft, child_hard = open_file_limits(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    assert soft == (needed if child_hard is None else min(needed, child_hard)), (soft, child_hard, needed)
    assert code == 0, proc.stderr.read()


def test_demo_serve_on_a_busy_port_fails_in_one_line(run_cli):
    """The live page's port taken: exit 1 with ``cannot serve the live page`` (docs/configuration.md:
    never a traceback), not an ExceptionGroup traceback from the edge's task group."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("demo", "--requests", "4", "--serve", str(port), timeout=60)
    assert_clean_failure(proc, 1)
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert errors == [f"streamproc demo: error: cannot serve the live page on 127.0.0.1:{port}"], proc.stderr


def test_token_refuses_a_request_id_no_request_can_have(tmp_path):
    from conftest import run_cli_process

    key = tmp_path / "edge.key"
    key.write_bytes(b"k" * 40)
    for flag, value in (("--rid", "a b"), ("--rid", "has.dot"), ("--rid-prefix", "tenant>")):
        proc = run_cli_process("token", "--key-file", str(key), flag, value)
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"streamproc token: error: {flag} {value!r}: invalid request id"), line
    ok = run_cli_process("token", "--key-file", str(key), "--rid", "good-id")
    assert ok.returncode == 0 and ok.stdout.count(".") == 2, ok.stderr


@pytest.mark.parametrize("command", ["codecs", "token", "run"])
def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(command, tmp_path):
    """``streamproc codecs | head -1``: the reader has gone, so the command stops with exit 1 and
    nothing on stderr, as ``head`` users expect, not a BrokenPipeError traceback."""
    import os

    key = tmp_path / "edge.key"
    key.write_bytes(b"k" * 40)
    args = {"codecs": ["codecs"], "token": ["token", "--key-file", str(key), "--operator"],
            "run": ["run", "--print-config"]}[command]
    read, write = os.pipe()
    os.close(read)  # no reader: the command's first write to stdout meets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "streamproc", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60, env=clean_env(), stdin=subprocess.DEVNULL)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr


def test_python_dash_m_streamproc_is_the_streamproc_command():
    """``python -m streamproc`` (no ``__main__`` before: "No module named streamproc.__main__")."""
    by_module = subprocess.run([sys.executable, "-m", "streamproc", "--version"], capture_output=True, text=True,
                               timeout=60, env=clean_env(), stdin=subprocess.DEVNULL)
    by_script = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=60,
                               env=clean_env(), stdin=subprocess.DEVNULL)
    assert by_module.returncode == 0 and by_script.returncode == 0, by_module.stderr
    assert by_module.stdout == by_script.stdout and by_module.stdout.strip()
