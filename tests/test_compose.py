"""docker-compose.yml and the Dockerfile, proven without a Docker engine.

1. The compose file validates against the Compose Specification's JSON schema (the copy vendored
   by the ``check-jsonschema`` package, ``vendor.compose-spec``), and its wiring is what the
   README promises (health-gated ``depends_on``, port 8080, STREAMPROC_* settings that exist).
2. Every service's command runs natively, with the service's own environment, against a
   nats-server started from the compose ``nats`` command: health checks are executed (``wget``
   emulated, ``python`` run as is), services start in ``depends_on`` order, and the results of
   the looping simulated workers must reach the edge over HTTP, joined and passed through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from compose_checks import (
    COMPOSE,
    ROOT,
    VARIABLE,
    check_one_of_each,
    compose_variables,
    load_compose,
    wait_for_results,
)
from helpers import clean_env, free_port, wait_ready

from streamproc import config
from streamproc.edge import settings as edge_settings
from streamproc.sim.embedded import find_binary

DOCKERFILE = ROOT / "Dockerfile"
STREAMPROC_SERVICES = ("processor", "edge", "workers")


def compose_schema() -> dict:
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(vendored.read_text())


def schema_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


# ------------------------------------------------------------------------ the file itself


def test_compose_file_validates_against_the_compose_specification():
    assert schema_errors(load_compose()) == []


def test_the_schema_check_rejects_a_broken_compose_file():
    broken = load_compose()
    broken["services"]["workers"]["depends_on"]["edge"]["condition"] = "service_helthy"
    broken["services"]["edge"]["heathcheck"] = broken["services"]["edge"].pop("healthcheck")
    broken["services"]["edge"]["ports"] = {"8080": 8080}
    assert len(schema_errors(broken)) >= 3


def test_check_jsonschema_accepts_the_compose_file():
    cli = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run(
        [str(cli), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_services_are_wired_as_the_readme_says():
    services = load_compose()["services"]
    assert set(services) == {"nats", *STREAMPROC_SERVICES}

    nats = services["nats"]
    assert nats["image"].startswith("nats:2.") and nats["image"].endswith(
        "-alpine"
    )  # wget for the healthcheck
    assert "-js" in nats["command"] and nats["command"][nats["command"].index("-m") + 1] == "8222"
    assert "http://127.0.0.1:8222/healthz?js-enabled-only=true" in nats["healthcheck"]["test"]

    for name in STREAMPROC_SERVICES:
        service = services[name]
        build = service["build"]
        assert build["context"] == "." and (ROOT / build["context"] / "Dockerfile").is_file()
        assert build["args"] == {"BASE_IMAGE": "python:3.11-slim"} and build["secrets"] == ["ca_bundle"]
        assert service["image"] == "streamproc:local"
        assert service["environment"]["STREAMPROC_NATS_URL"] == "nats://nats:4222"
        assert service["environment"]["STREAMPROC_FORMAT"] == "sglang-zstd"
        for dependency, rule in service["depends_on"].items():
            assert rule["condition"] == "service_healthy", (name, dependency)
            assert "healthcheck" in services[dependency], (
                f"{name} waits for {dependency}, which has no healthcheck"
            )

    edge = services["edge"]
    assert edge["command"] == ["streamproc", "edge"]
    assert "8080:8080" in edge["ports"] and edge["environment"]["STREAMPROC_EDGE_PORT"] == "8080"
    assert edge["environment"]["STREAMPROC_EDGE_HOST"] == "0.0.0.0"
    assert edge["environment"]["STREAMPROC_EDGE_ENSURE_RESULTS_STREAM"] == "true"
    assert services["processor"]["command"] == ["streamproc", "run"]
    assert "streamproc simulate" in services["workers"]["command"][-1]
    assert "--mode mixed" in services["workers"]["command"][-1]


def test_every_compose_variable_has_todays_default_and_the_ports_can_move():
    """A plain `docker compose up` needs no variable; the real test moves images, ports and the tag."""
    assert compose_variables() == {
        "NATS_IMAGE": "nats:2.11-alpine",
        "PYTHON_IMAGE": "python:3.11-slim",
        "LOCAL_IMAGE": "streamproc:local",
        "NATS_HOST_PORT": "4222",
        "NATS_MONITOR_HOST_PORT": "8222",
        "EDGE_HOST_PORT": "8080",
        "BUILD_CA_BUNDLE": "/dev/null",
    }
    bare = VARIABLE.sub("", COMPOSE.read_text()).replace("$$", "")
    assert "$" not in bare, "only ${NAME:-default} interpolation (and $$ for a literal $) is used"
    moved = load_compose({"EDGE_HOST_PORT": "127.0.0.1:18080", "NATS_IMAGE": "streamproc-standin/nats:2.11"})
    assert moved["services"]["edge"]["ports"] == ["127.0.0.1:18080:8080"]
    assert moved["services"]["nats"]["image"] == "streamproc-standin/nats:2.11"
    assert moved["secrets"]["ca_bundle"] == {"file": "/dev/null"}
    assert schema_errors(moved) == []


def test_every_streamproc_variable_is_a_setting_its_command_reads():
    """An unknown STREAMPROC_* variable is silently ignored at run time; catch typos here."""
    known = {
        "edge": edge_settings.env_names(),
        "run": {f.env for f in config.fields()},
        "simulate": {f.env for f in config.fields()},
    }
    for name in STREAMPROC_SERVICES:
        service = load_compose()["services"][name]
        command = " ".join(service["command"])
        sub = next(c for c in known if f"streamproc {c}" in command)
        unknown = {k for k in service["environment"] if k.startswith("STREAMPROC_")} - known[sub]
        assert not unknown, f"{name}: `streamproc {sub}` reads no {sorted(unknown)}"


def test_dockerfile_builds_every_service_from_python_slim_with_the_external_codec():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert instructions[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]
    copied = [part for line in instructions if line.startswith("COPY ") for part in line.split()[1:-1]]
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    run = " ".join(instructions[instructions.index(next(i for i in instructions if i.startswith("RUN "))) :])
    assert "pip install . ./codecs/sglang-zstd" in run
    # The optional CA bundle is a BuildKit secret (never stored in a layer), used only when non-empty.
    assert run.startswith("RUN --mount=type=secret,id=ca_bundle ")
    assert "if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi" in run
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "artifacts"} <= set(ignored)


def test_the_image_gets_the_edge_package_and_its_page():
    """``pip install .`` (the Dockerfile) ships only what pyproject lists; editable installs get it all."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "streamproc.edge" in setuptools["packages"]
    data = setuptools.get("package-data", {})
    edge = ROOT / "streamproc" / "edge"
    # declared either as data of streamproc.edge ("page/*.html") or as the package streamproc.edge.page
    shipped = [*data.get("streamproc.edge", []),
               *(f"page/{p}" for p in data.get("streamproc.edge.page", [])
                 if "streamproc.edge.page" in setuptools["packages"])]
    for asset in (edge / "page").iterdir():
        assert any(asset.relative_to(edge).match(pattern) for pattern in shipped), (
            f"{asset.name} is not shipped"
        )


# --------------------------------------------------------------------- running it natively


class NativeCompose:
    """Runs compose services as local processes, mapping container addresses to local ports."""

    def __init__(self, compose: dict, workdir: Path) -> None:
        self.services = compose["services"]
        self.workdir = workdir
        self.nats_port, self.monitor_port, self.edge_port = free_port(), free_port(), free_port()
        self.addresses = {
            "nats://nats:4222": f"nats://127.0.0.1:{self.nats_port}",
            "http://nats:8222": f"http://127.0.0.1:{self.monitor_port}",
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def native(self, text: str, service: str) -> str:
        local = dict(self.addresses)
        local["http://127.0.0.1:8222"] = f"http://127.0.0.1:{self.monitor_port}"
        local["http://127.0.0.1:8080"] = f"http://127.0.0.1:{self.edge_port}"
        for container, here in local.items():
            text = text.replace(container, here)
        return text

    def environment(self, name: str) -> dict[str, str]:
        env = {
            k: self.native(str(v), name) for k, v in (self.services[name].get("environment") or {}).items()
        }
        if "STREAMPROC_EDGE_PORT" in env:
            env["STREAMPROC_EDGE_PORT"] = str(self.edge_port)
        if env.get("STREAMPROC_EDGE_HOST") == "0.0.0.0":
            env["STREAMPROC_EDGE_HOST"] = "127.0.0.1"  # same code path; no listening beyond loopback here
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return clean_env({**env, "PATH": path})

    def command(self, name: str) -> list[str]:
        service = self.services[name]
        if name == "nats":  # the official image's entrypoint is nats-server; -sd and ports become local
            args = list(service["command"])
            args[args.index("-sd") + 1] = str(self.workdir / "jetstream")
            args[args.index("-m") + 1] = str(self.monitor_port)
            return [str(find_binary()), *args, "-a", "127.0.0.1", "-p", str(self.nats_port)]
        return [self.native(part, name) for part in service["command"]]

    def order(self) -> list[str]:
        done: list[str] = []
        while len(done) < len(self.services):
            for name, service in self.services.items():
                if name not in done and all(d in done for d in service.get("depends_on", {})):
                    done.append(name)
        return done

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"----- {name}\n{self.log(name)}" for name in self.processes)

    def start(self, name: str) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                self.command(name),
                env=self.environment(name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.workdir,
                start_new_session=True,
            )

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        program, *args = [self.native(part, name) for part in test[1:]]
        if program == "wget":  # busybox wget in the alpine image: success means an HTTP 2xx
            url = next(a for a in args if a.startswith("http"))
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    return 200 <= response.status < 300
            except (urllib.error.URLError, OSError):
                return False
        assert program == "python", test
        done = subprocess.run(
            [sys.executable, *args], env=self.environment(name), capture_output=True, timeout=10
        )
        return done.returncode == 0

    def wait_healthy(self, name: str, timeout: float = 20.0) -> None:
        wait_ready(lambda: self.healthy(name), self.processes[name], name, timeout, self.logs, every=0.2)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the service's own session: shell loop and children
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.mark.nats
def test_every_service_runs_natively_and_results_reach_the_edge():
    with tempfile.TemporaryDirectory(prefix="streamproc-compose-") as tmp:
        stack = NativeCompose(load_compose(), Path(tmp))
        try:
            for name in stack.order():
                stack.start(name)
                if "healthcheck" in stack.services[name]:
                    stack.wait_healthy(name)
            edge = f"http://127.0.0.1:{stack.edge_port}"
            finished = wait_for_results(edge, stack.logs)
            check_one_of_each(edge, finished, stack.logs)
            assert stack.processes["workers"].poll() is None, "the workers loop must keep running"
        finally:
            stack.stop()


def test_the_docker_test_is_left_out_of_make_test_and_run_by_make_test_compose_and_ci():
    """`make test` must not need an engine; `make test-compose` and CI must still run the real test."""

    def collected(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        return done.stdout

    real = "tests/test_compose_real.py"
    assert "3 deselected" in collected(real)  # pyproject's addopts: -m 'not docker'
    assert "3 tests collected" in collected("-m", "docker", real)
    makefile = (ROOT / "Makefile").read_text()
    assert f"$(BIN)/python -m pytest -m docker {real}" in makefile
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make test-compose")
