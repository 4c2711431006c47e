"""Settings: flags beat the environment beat defaults; bad values name the setting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from scheduler_grpc import config
from scheduler_grpc.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults() -> None:
    settings = config.load({}, {})
    assert settings.env == "dev"
    assert settings.leader_ttl == timedelta(milliseconds=2500)
    assert settings.redis_url is None
    assert settings.shell_enabled is False


def test_flag_beats_environment_beats_default() -> None:
    environ = {"SCHEDULER_LEADER_TTL": "3s", "SCHEDULER_WORKER_CONCURRENCY": "7"}
    settings = config.load(environ, {"leader_ttl": "1500ms"})
    assert settings.leader_ttl == timedelta(milliseconds=1500)
    assert settings.worker_concurrency == 7


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"SCHEDULER_LEADER_TTL": "soon"}, "SCHEDULER_LEADER_TTL"),
        ({"SCHEDULER_LEADER_TTL": "100ms"}, "SCHEDULER_LEADER_TTL"),
        ({"SCHEDULER_WORKER_CONCURRENCY": "0"}, "SCHEDULER_WORKER_CONCURRENCY"),
        ({"SCHEDULER_SHELL_ENABLED": "maybe"}, "SCHEDULER_SHELL_ENABLED"),
        ({"SCHEDULER_ENV": "staging"}, "SCHEDULER_ENV"),
        ({"REDIS_URL": "http://x"}, "REDIS_URL"),
        ({"DATABASE_URL": "mysql://secret@x/db"}, "DATABASE_URL"),
        ({"SCHEDULER_ENV": "production"}, "REDIS_URL and DATABASE_URL"),
    ],
)
def test_bad_values_name_the_setting(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as caught:
        config.load(environ, {})
    assert "secret" not in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("250ms", timedelta(milliseconds=250)), ("10s", timedelta(seconds=10)), ("5m", timedelta(minutes=5)),
     ("1h", timedelta(hours=1)), ("2.5", timedelta(seconds=2.5))],
)  # fmt: skip
def test_durations(text: str, expected: timedelta) -> None:
    assert config.parse_duration(text) == expected
    assert config.parse_duration(config.format_duration(expected)) == expected


def test_the_configuration_page_shows_the_generated_settings_table() -> None:
    page = (ROOT / "docs" / "operations" / "configuration.md").read_text()
    assert "<!-- generated: settings -->" in page  # filled by scripts/docs_gen.py at build time


def test_a_cluster_url_names_its_seed_nodes() -> None:
    settings = config.load({"REDIS_URL": "redis+cluster://10.0.0.1:7000,[::1]:7001,valkey-2:7002"}, {})
    assert settings.redis_url is not None
    cluster = config.cluster_url(settings.redis_url)
    assert cluster == config.ClusterUrl((("10.0.0.1", 7000), ("::1", 7001), ("valkey-2", 7002)), False, None, None)
    secure = config.cluster_url("rediss+cluster://app:p%40ss@valkey-0:6380/")
    assert secure == config.ClusterUrl((("valkey-0", 6380),), True, "app", "p@ss")
    assert config.cluster_url("redis://localhost:6379/0") is None


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://host",
        "redis+cluster://host:port",
        "redis+cluster://a:7000,b",
        "redis+cluster://a:7000/1",
        "redis+cluster://a:7000?protocol=3",
        "redis+cluster://a:70000",
    ],
)
def test_a_bad_cluster_url_names_redis_url(url: str) -> None:
    with pytest.raises(ConfigError, match="REDIS_URL"):
        config.load({"REDIS_URL": url}, {})
