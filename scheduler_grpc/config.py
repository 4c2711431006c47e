"""Settings: one table, read from `SCHEDULER_*` environment variables and matching CLI flags.

Every setting is declared once in `SETTINGS`; the CLI flags, the environment lookup, the validation
and the README table (checked by a test) all come from it. A flag beats the environment, which beats
the default. A bad value raises `ConfigError` naming the setting, which the CLI prints as one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from scheduler_grpc.errors import ConfigError
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> timedelta:
    """Parse `250ms`, `10s`, `5m`, `1h` or a bare number of seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError("expected a duration such as 250ms, 10s, 5m or 1h")
    return timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def format_duration(value: timedelta) -> str:
    ms = round(value.total_seconds() * 1000)
    if ms % 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    if seconds and seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _parse_non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _parse_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number between 0 and 65535")
    return value


def _parse_ratio(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError("must be greater than 0 and at most 1")
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return text

    return parse


CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
"""The `REDIS_URL` schemes of a Redis/Valkey Cluster, and whether each is TLS."""


@dataclass(frozen=True)
class ClusterUrl:
    """A `redis+cluster://[user:password@]host:port[,host:port...]` URL: the seed nodes the client
    asks for the cluster's topology (one reachable seed is enough; give several)."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None
    password: str | None


def cluster_url(text: str) -> ClusterUrl | None:
    """The cluster `text` names, or None for a single server's URL.

    Raises:
        ValueError: a cluster URL without seeds, with a seed that is not host:port, or with a
            database number or query (a cluster has database 0 only).
    """
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        return None
    credentials, at, hosts = rest.rpartition("@")
    if "/" in hosts.rstrip("/") or "?" in hosts:
        raise ValueError("a cluster URL names no database or options: redis+cluster://host:port,host:port")
    seeds = []
    for seed in hosts.rstrip("/").split(","):
        host, colon, port = seed.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster seed {seed!r} is not host:port")
        seeds.append((host.strip("[]"), int(port)))
    username, colon, password = credentials.partition(":") if at else ("", "", "")
    return ClusterUrl(
        tuple(seeds),
        CLUSTER_SCHEMES[scheme],
        unquote(username) or None,
        unquote(password) if colon else None,
    )


def _redis_url(text: str) -> str:
    if cluster_url(text) is None and urlsplit(text).scheme not in {"redis", "rediss", "unix"}:
        raise ValueError(
            "expected redis://host:port/db, rediss://..., unix://path, "
            "or a cluster's redis+cluster://host:port,host:port (rediss+cluster:// for TLS)"
        )
    return text


def _database_url(text: str) -> str:
    if urlsplit(text).scheme not in {"postgres", "postgresql"}:
        raise ValueError("expected postgresql://user:password@host:port/database")
    return text


def _networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    try:
        return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"expected comma-separated CIDRs: {exc}") from None


def _parse_metrics_base(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError("must be a port number between 1 and 65535")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("expected a TCP port between 0 and 65535 (0: any free port)")
    return value


def _host(text: str) -> str:
    text = text.strip()
    if not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]{1,255}", text):
        raise ValueError("expected a host name or an IP address, e.g. 0.0.0.0 or 127.0.0.1")
    return text


def _host_names(text: str) -> tuple[str, ...]:
    names: list[str] = []
    for part in text.split(","):
        name = part.strip().lower().rstrip(".")
        if not name:
            continue
        if name != "*" and not re.fullmatch(r"\.?[a-z0-9_]([a-z0-9_.-]{0,252})?|\[[0-9a-f:.]+\]|[0-9a-f:.]+", name):
            raise ValueError(
                f"{part.strip()!r}: expected comma-separated host names without ports (e.g. console.example.com, "
                "a leading '.' for a domain and its subdomains, or * for any)"
            )
        names.append(name.strip("[]"))
    return tuple(names)


def _username(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", text):
        raise ValueError("expected 1-64 letters, digits, '_', '.', '@' or '-'")
    return text


def _existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError("no such file")
    return path


def _queue_name(text: str) -> str:
    if not is_queue_name(text):
        raise ValueError(QUEUE_NAME_RULE)
    return text


@dataclass(frozen=True)
class Setting:
    """One setting: its attribute, environment variable, flag, parser, default and meaning."""

    attr: str
    env: str
    parse: Callable[[str], Any]
    default: str | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.attr.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "redis_url",
        "REDIS_URL",
        _redis_url,
        None,
        "Redis/Valkey URL. A Valkey/Redis Cluster: `redis+cluster://host:port,host:port` (seed nodes; "
        "`rediss+cluster://` for TLS). Unset: an embedded Valkey is started (dev mode only).",
    ),
    Setting(
        "database_url",
        "DATABASE_URL",
        _database_url,
        None,
        "PostgreSQL URL. Unset: an embedded PostgreSQL is started (dev mode only).",
    ),
    Setting(
        "env",
        "SCHEDULER_ENV",
        _choice("dev", "production"),
        "dev",
        "`production` requires explicit URLs and real credentials; `dev` allows embedded servers.",
    ),
    Setting("data_dir", "SCHEDULER_DATA_DIR", Path, ".data", "Where embedded servers keep their data (dev and tests)."),
    Setting("log_level", "SCHEDULER_LOG_LEVEL", _choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "Log level."),
    Setting(
        "log_format",
        "SCHEDULER_LOG_FORMAT",
        _choice("auto", "json", "text"),
        "auto",
        "`json`: one object per line; `text`: for a terminal; `auto`: text when stderr is a terminal, else json.",
    ),
    Setting("queue", "SCHEDULER_QUEUE", _queue_name, "default", "Name of the Redis queue this process works on."),
    Setting(
        "connect_timeout",
        "SCHEDULER_CONNECT_TIMEOUT",
        parse_duration,
        "5s",
        "Time allowed to reach Redis and PostgreSQL at start-up and per call.",
    ),
    Setting(
        "db_pool_size",
        "SCHEDULER_DB_POOL_SIZE",
        _parse_positive_int,
        "10",
        "Maximum PostgreSQL connections per process.",
    ),
    Setting(
        "leader_ttl",
        "SCHEDULER_LEADER_TTL",
        parse_duration,
        "2500ms",
        "Leader lock lifetime; renewed every TTL/3, each renewal answered within TTL/6 or the leader steps "
        "down. A crashed leader is replaced within about TTL (the standby wakes when the lock expires); "
        "every leader write is fenced by its term, so a short TTL risks no double write.",
    ),
    Setting(
        "misfire_grace",
        "SCHEDULER_MISFIRE_GRACE",
        parse_duration,
        "60s",
        "A slot later than this (no leader ran) is a misfire and follows the job's misfire policy.",
    ),
    Setting(
        "reconcile_interval",
        "SCHEDULER_RECONCILE_INTERVAL",
        parse_duration,
        "10s",
        "How often the leader re-enqueues work PostgreSQL has queued but Redis lost.",
    ),
    Setting(
        "execution_retention_days",
        "SCHEDULER_EXECUTION_RETENTION_DAYS",
        _parse_non_negative_int,
        "0",
        "The leader drops whole day partitions of the execution history older than this many days (a day "
        "holding a queued or running run is kept); 0 keeps every day.",
    ),
    Setting(
        "execution_partitions_ahead",
        "SCHEDULER_EXECUTION_PARTITIONS_AHEAD",
        _parse_positive_int,
        "3",
        "The leader keeps a partition of the execution history for today and this many days ahead.",
    ),
    Setting(
        "scan_interval",
        "SCHEDULER_SCAN_INTERVAL",
        parse_duration,
        "1s",
        "Longest the leader sleeps between due-scans (it wakes earlier for the next due job or a change).",
    ),
    Setting(
        "fire_ahead",
        "SCHEDULER_FIRE_AHEAD",
        parse_duration,
        "1500ms",
        "The leader records and enqueues a slot of an `allow` job this long before it is due; the run waits, "
        "delayed, until its slot, so recording it is off the lateness path. Pausing, editing or deleting a job "
        "does not recall a slot already fired. `forbid` and `replace` jobs fire at the slot; `0` for all. "
        "At most 1m.",
    ),
    Setting(
        "visibility_timeout",
        "SCHEDULER_VISIBILITY_TIMEOUT",
        parse_duration,
        "30s",
        "Lease length of a dequeued item; extended while its job runs.",
    ),
    Setting(
        "queue_shard_lead",
        "SCHEDULER_QUEUE_SHARD_LEAD",
        parse_duration,
        "10s",
        "Sharded queues: a change of a queue's shard count applies to the runs made this long after it "
        "(`SetQueueShards`, `schedctl queues shards set`, `scheduler-grpc shards set`); every role reads "
        "the counts again within a quarter of it. Every role of a deployment must have the same value. "
        "At least 1s.",
    ),
    Setting(
        "max_stalls",
        "SCHEDULER_MAX_STALLS",
        _parse_positive_int,
        "3",
        "Expired leases after which a run's deliveries are solo (alone on an idle worker); it is dead-lettered "
        "as stalled at its second solo stall (so after this many plus one), and runs that only shared a dying "
        "worker are never parked for it (1: the first stall parks the run).",
    ),
    Setting(
        "solo_retry_delay",
        "SCHEDULER_SOLO_RETRY_DELAY",
        parse_duration,
        "30s",
        "How long a run whose solo delivery stalled waits before its last solo delivery: longer than a burst "
        "of outside kills (a rolling deploy), so only a run that kills its worker twice, that far apart, is parked.",
    ),
    Setting(
        "worker_concurrency",
        "SCHEDULER_WORKER_CONCURRENCY",
        _parse_positive_int,
        "10",
        "Jobs one worker process runs at once.",
    ),
    Setting(
        "shutdown_grace",
        "SCHEDULER_SHUTDOWN_GRACE",
        parse_duration,
        "30s",
        "On SIGTERM a worker lets running jobs finish this long, then hands the rest back to the queue.",
    ),
    Setting(
        "worker_reserve_ahead",
        "SCHEDULER_WORKER_RESERVE_AHEAD",
        parse_duration,
        "750ms",
        "A worker with free slots also takes (reserves) delayed runs due within this long and claims them "
        "ahead, so each starts at its due time without a claim on the way; a reserved run shows `running` "
        "with a future start until then. `0` turns reservations off. Below the visibility timeout.",
    ),
    Setting(
        "worker_reserve_max",
        "SCHEDULER_WORKER_RESERVE_MAX",
        _parse_non_negative_int,
        "10000",
        "Most reserved runs one worker holds (waiting for their due time; they take no slot until then).",
    ),
    Setting(
        "worker_reserve_grace",
        "SCHEDULER_WORKER_RESERVE_GRACE",
        parse_duration,
        "2s",
        "A reserved run that cannot start this long after its due time (all slots busy) is handed back to "
        "the queue, its attempt unspent.",
    ),
    Setting(
        "remote_ack_timeout",
        "SCHEDULER_REMOTE_ACK_TIMEOUT",
        parse_duration,
        "10s",
        "A remote worker (WorkerService.Connect) must acknowledge an assignment within this long, else the run "
        "goes back to the queue, its attempt unspent.",
    ),
    Setting(
        "remote_hello_timeout",
        "SCHEDULER_REMOTE_HELLO_TIMEOUT",
        parse_duration,
        "10s",
        "A remote worker's stream (WorkerService.Connect) must send its `hello` within this long after it "
        "opens, else it is ended with INVALID_ARGUMENT on `hello`.",
    ),
    Setting(
        "remote_ping_interval",
        "SCHEDULER_REMOTE_PING_INTERVAL",
        parse_duration,
        "10s",
        "The server pings each remote worker's stream this often; a stream without an answer to two pings "
        "in a row is ended (its acknowledged runs parked until their leases expire, for the worker to resume).",
    ),
    Setting(
        "remote_poll_wait",
        "SCHEDULER_REMOTE_POLL_WAIT",
        parse_duration,
        "20s",
        "The longest a unary remote worker's poll (WorkerService.PollWorkerSession) may wait for a message "
        "(at most 25s, under the server's 30 s bound of a unary call).",
    ),
    Setting(
        "remote_poll_timeout",
        "SCHEDULER_REMOTE_POLL_TIMEOUT",
        parse_duration,
        "20s",
        "A unary remote worker's session (WorkerService.OpenWorkerSession) with no poll in flight for this long "
        "is ended (its runs handed back, as at a stream's end).",
    ),
    Setting(
        "breaker_window",
        "SCHEDULER_BREAKER_WINDOW",
        _parse_positive_int,
        "10",
        "Calls a circuit breaker remembers (per handler and per webhook host).",
    ),
    Setting(
        "breaker_min_calls",
        "SCHEDULER_BREAKER_MIN_CALLS",
        _parse_positive_int,
        "5",
        "Fewer remembered calls than this never open a breaker.",
    ),
    Setting(
        "breaker_failure_ratio",
        "SCHEDULER_BREAKER_FAILURE_RATIO",
        _parse_ratio,
        "0.5",
        "A breaker opens when this share of its remembered calls failed.",
    ),
    Setting(
        "breaker_reset_timeout",
        "SCHEDULER_BREAKER_RESET_TIMEOUT",
        parse_duration,
        "30s",
        "How long an open breaker refuses work before letting trial calls through (half-open).",
    ),
    Setting(
        "metrics_port",
        "SCHEDULER_METRICS_PORT",
        _parse_port,
        None,
        "Port of this process's /metrics (0: any free port). Unset: server 9090, scheduler 9091, "
        "worker 9100; under `up`, from `SCHEDULER_METRICS_BASE`.",
    ),
    Setting(
        "metrics_base",
        "SCHEDULER_METRICS_BASE",
        _parse_metrics_base,
        "9090",
        "`up` only: /metrics port of its server; scheduler i listens on base+i, worker i on base+9+i "
        "(`SCHEDULER_METRICS_BASE=19090 make run` moves them all off 9090-9102).",
    ),
    Setting(
        "metrics_host",
        "SCHEDULER_METRICS_HOST",
        str,
        "127.0.0.1",
        "Address /metrics listens on (0.0.0.0 in containers).",
    ),
    Setting("shell_enabled", "SCHEDULER_SHELL_ENABLED", _parse_bool, "false", "Allow the `shell.command` handler."),
    Setting(
        "webhook_allowlist",
        "SCHEDULER_WEBHOOK_ALLOWLIST",
        _networks,
        "",
        "Comma-separated CIDRs (e.g. `10.0.0.0/8,127.0.0.1/32`) that `http.webhook` may reach "
        "although they are private, loopback or link-local.",
    ),
    Setting(
        "grpc_host",
        "SCHEDULER_GRPC_HOST",
        _host,
        None,
        "Address the gRPC server listens on. Unset: `127.0.0.1` in dev; production must set it (e.g. `0.0.0.0`).",
    ),
    Setting("grpc_port", "SCHEDULER_GRPC_PORT", _port, "50051", "Port of the gRPC server (0: any free port)."),
    Setting(
        "http_enabled",
        "SCHEDULER_HTTP_ENABLED",
        _parse_bool,
        "true",
        "Serve the web console from `server` (false: gRPC only).",
    ),
    Setting(
        "http_host",
        "SCHEDULER_HTTP_HOST",
        _host,
        None,
        "Address the web console listens on. Unset: `127.0.0.1` in dev; production must set it (or disable the "
        "console). Served over TLS with `SCHEDULER_TLS_CERT/KEY` when they are set.",
    ),
    Setting("http_port", "SCHEDULER_HTTP_PORT", _port, "8080", "Port of the web console (0: any free port)."),
    Setting(
        "http_allowed_hosts",
        "SCHEDULER_HTTP_ALLOWED_HOSTS",
        _host_names,
        "",
        "Comma-separated host names the web console answers to (its `Host` header; `.example.com`: that domain "
        "and its subdomains; `*`: any, only behind a proxy that checks it). Always accepted: `localhost`, "
        "`*.localhost`, IP addresses, and the name in `SCHEDULER_HTTP_HOST` (and this machine's names when that "
        "is a wildcard address). Any other name is refused with 421: a DNS-rebinding page cannot drive the "
        "console.",
    ),
    Setting(
        "http_max_connections",
        "SCHEDULER_HTTP_MAX_CONNECTIONS",
        _parse_positive_int,
        "1000",
        "Connections the web console holds open at once (at most a quarter of the process's file descriptor "
        "limit); beyond, a new one replaces the oldest connection waiting for a request, or is closed.",
    ),
    Setting(
        "http_header_timeout",
        "SCHEDULER_HTTP_HEADER_TIMEOUT",
        parse_duration,
        "10s",
        "Time a web console connection has to send a complete request head, from its opening or the end of "
        "its previous response (also the keep-alive idle limit, and the TLS handshake's limit); then it is "
        "closed.",
    ),
    Setting(
        "http_tls_proxy",
        "SCHEDULER_HTTP_TLS_PROXY",
        _parse_bool,
        "false",
        "The console is reached through a reverse proxy that terminates TLS: mark its session cookie `Secure`.",
    ),
    Setting(
        "admin_username",
        "SCHEDULER_ADMIN_USERNAME",
        _username,
        "admin",
        "The admin user the gRPC server creates (or updates) at start-up.",
    ),
    Setting(
        "admin_password",
        "SCHEDULER_ADMIN_PASSWORD",
        str,
        None,
        "Password of that admin. Production requires one of at least 12 characters (not the dev default); "
        "only in dev on a loopback address may it be unset (`admin123` is used, with a warning).",
    ),
    Setting(
        "session_ttl",
        "SCHEDULER_SESSION_TTL",
        parse_duration,
        "12h",
        "How long a session token from `Login` stays valid.",
    ),
    Setting(
        "max_concurrent_rpcs",
        "SCHEDULER_MAX_CONCURRENT_RPCS",
        _parse_positive_int,
        "10000",
        "Calls (streams included; health checks exempt) one gRPC server runs at once; beyond, calls fail with "
        "RESOURCE_EXHAUSTED (logged and counted).",
    ),
    Setting(
        "watch_buffer",
        "SCHEDULER_WATCH_BUFFER",
        _parse_positive_int,
        "1000",
        "Events buffered per `WatchExecutions` subscriber; a subscriber that falls further behind is ended "
        "with RESOURCE_EXHAUSTED and resumes from its cursor.",
    ),
    Setting(
        "tls_cert",
        "SCHEDULER_TLS_CERT",
        _existing_file,
        None,
        "PEM certificate chain of the gRPC server. Set with `SCHEDULER_TLS_KEY` to serve TLS.",
    ),
    Setting("tls_key", "SCHEDULER_TLS_KEY", _existing_file, None, "PEM private key of `SCHEDULER_TLS_CERT`."),
    Setting(
        "tls_client_ca",
        "SCHEDULER_TLS_CLIENT_CA",
        _existing_file,
        None,
        "PEM CA bundle: when set (with TLS), clients must present a certificate it signed (mutual TLS).",
    ),
)

_BY_ATTR = {setting.attr: setting for setting in SETTINGS}


@dataclass(frozen=True)
class Settings:
    """Validated settings of one process."""

    redis_url: str | None
    database_url: str | None
    env: str
    data_dir: Path
    log_level: str
    log_format: str
    queue: str
    connect_timeout: timedelta
    db_pool_size: int
    leader_ttl: timedelta
    misfire_grace: timedelta
    reconcile_interval: timedelta
    execution_retention_days: int
    execution_partitions_ahead: int
    scan_interval: timedelta
    fire_ahead: timedelta
    visibility_timeout: timedelta
    max_stalls: int
    solo_retry_delay: timedelta
    worker_concurrency: int
    shutdown_grace: timedelta
    worker_reserve_ahead: timedelta
    queue_shard_lead: timedelta
    worker_reserve_max: int
    worker_reserve_grace: timedelta
    remote_ack_timeout: timedelta
    remote_hello_timeout: timedelta
    remote_ping_interval: timedelta
    remote_poll_wait: timedelta
    remote_poll_timeout: timedelta
    breaker_window: int
    breaker_min_calls: int
    breaker_failure_ratio: float
    breaker_reset_timeout: timedelta
    metrics_port: int | None
    metrics_base: int
    metrics_host: str
    shell_enabled: bool
    grpc_host: str | None
    grpc_port: int
    http_enabled: bool
    http_host: str | None
    http_port: int
    http_allowed_hosts: tuple[str, ...]
    http_max_connections: int
    http_header_timeout: timedelta
    http_tls_proxy: bool
    admin_username: str
    admin_password: str | None
    session_ttl: timedelta
    max_concurrent_rpcs: int
    watch_buffer: int
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    webhook_allowlist: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @property
    def production(self) -> bool:
        return self.env == "production"

    def with_urls(self, redis_url: str, database_url: str) -> Settings:
        return dataclasses.replace(self, redis_url=redis_url, database_url=database_url)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one `--flag` per setting; values stay strings until `load` validates them."""
    group = parser.add_argument_group("settings (each also from its environment variable)")
    for setting in SETTINGS:
        group.add_argument(
            setting.flag,
            dest=setting.attr,
            default=None,
            metavar="VALUE",
            help=f"{setting.help} [{setting.env}, default {setting.default or 'unset'}]",
        )


def load(environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> Settings:
    """Build `Settings` from flags, then the environment, then defaults.

    Raises:
        ConfigError: naming the first invalid setting and what it expects.
    """
    environ = os.environ if environ is None else environ
    flags = flags or {}
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = flags.get(setting.attr)
        source = setting.flag
        if raw is None:
            raw = environ.get(setting.env) or None
            source = setting.env
        if raw is None:
            raw = setting.default
            source = f"default of {setting.env}"
        if raw is None:
            values[setting.attr] = None
            continue
        try:
            values[setting.attr] = setting.parse(str(raw))
        except ValueError as exc:
            # URLs may carry credentials and passwords are secrets: never echo them.
            shown = "<redacted>" if setting.attr.endswith(("_url", "_password")) else repr(raw)
            raise ConfigError(f"{source}={shown} is invalid: {exc}") from None
    settings = Settings(**values)
    _check(settings)
    return settings


def _check(settings: Settings) -> None:
    def name(attr: str) -> str:
        return f"{_BY_ATTR[attr].env} ({_BY_ATTR[attr].flag})"

    if settings.leader_ttl < timedelta(milliseconds=300):
        raise ConfigError(f"{name('leader_ttl')} must be at least 300ms (renewal runs at TTL/3)")
    if settings.visibility_timeout < timedelta(seconds=1):
        raise ConfigError(f"{name('visibility_timeout')} must be at least 1s")
    if settings.worker_reserve_ahead >= settings.visibility_timeout:
        # A reserved item's lease runs from its reservation: it must outlast the wait for its due time.
        raise ConfigError(
            f"{name('worker_reserve_ahead')} must be shorter than {name('visibility_timeout')} "
            f"({format_duration(settings.visibility_timeout)})"
        )
    if settings.queue_shard_lead < timedelta(seconds=1):
        raise ConfigError(f"{name('queue_shard_lead')} must be at least 1s")
    if settings.remote_ack_timeout <= timedelta(0):
        raise ConfigError(f"{name('remote_ack_timeout')} must be positive")
    if settings.remote_hello_timeout <= timedelta(0):
        raise ConfigError(f"{name('remote_hello_timeout')} must be positive")
    if settings.remote_ping_interval < timedelta(milliseconds=100):
        raise ConfigError(f"{name('remote_ping_interval')} must be at least 100ms")
    if not timedelta(0) < settings.remote_poll_wait <= timedelta(seconds=25):
        raise ConfigError(f"{name('remote_poll_wait')} must be positive and at most 25s")
    if settings.remote_poll_timeout < timedelta(milliseconds=100):
        raise ConfigError(f"{name('remote_poll_timeout')} must be at least 100ms")
    if settings.connect_timeout <= timedelta(0):
        raise ConfigError(f"{name('connect_timeout')} must be positive")
    if settings.fire_ahead > timedelta(minutes=1):
        # Slots fired ahead are not recalled by a pause or an edit: keep that window short.
        raise ConfigError(f"{name('fire_ahead')} must be at most 1m")
    if settings.production and not (settings.redis_url and settings.database_url):
        raise ConfigError("SCHEDULER_ENV=production needs REDIS_URL and DATABASE_URL: embedded servers are for dev")
    if not timedelta(seconds=1) <= settings.http_header_timeout <= timedelta(minutes=5):
        raise ConfigError(f"{name('http_header_timeout')} must be between 1s and 5m")
    if settings.session_ttl < timedelta(minutes=1):
        raise ConfigError(f"{name('session_ttl')} must be at least 1m")
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise ConfigError(f"{name('tls_cert')} and {name('tls_key')} must be set together")
    if settings.tls_client_ca is not None and settings.tls_cert is None:
        raise ConfigError(f"{name('tls_client_ca')} needs TLS: set {name('tls_cert')} and {name('tls_key')} too")


def readme_table() -> str:
    """The settings table for README.md (a test keeps the README in step with this)."""
    lines = ["| Environment variable | Flag | Default | Meaning |", "| --- | --- | --- | --- |"]
    for setting in SETTINGS:
        default = f"`{setting.default}`" if setting.default else "unset"
        lines.append(f"| `{setting.env}` | `{setting.flag}` | {default} | {setting.help} |")
    return "\n".join(lines)
