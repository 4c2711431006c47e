"""`scheduler-grpc server`: the gRPC control plane.

One process serves the eight `scheduler.v1` services, `grpc.health.v1.Health` and server reflection,
on grpc.aio (on uvloop under the CLI). Everything is created inside the running loop. Around it:

* health: a background task pings Redis and PostgreSQL about every second (each ping bounded);
  while either does not answer, every service reports NOT_SERVING, and SERVING again once both do
  (the console's outage banner shows the same answers, `Api.health`);
* one reader of the execution event stream shared by every WatchExecutions call (`EventFanout`);
* interceptors: request log and metrics, error mapping, authentication and the role table;
* limits: `SCHEDULER_MAX_CONCURRENT_RPCS` concurrent calls (beyond: RESOURCE_EXHAUSTED; gRPC core's
  queue of calls not yet picked up is sized above it, so a burst is never silently CANCELLED),
  message sizes, keepalive; optional TLS and mutual TLS;
* shutdown (SIGTERM): watch streams end with UNAVAILABLE and their resume cursor, health turns
  NOT_SERVING, then `server.stop(grace)` lets in-flight calls finish within SCHEDULER_SHUTDOWN_GRACE.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, cast

import grpc
from argon2 import PasswordHasher
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer
from redis.asyncio import Redis

from scheduler_grpc import metrics
from scheduler_grpc.application import Api, StoreHealth
from scheduler_grpc.auth import DEV_ADMIN_PASSWORD, Authenticator, admin_password
from scheduler_grpc.cluster import ClusterView
from scheduler_grpc.config import Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.control import Control
from scheduler_grpc.control_users import UserAdmin
from scheduler_grpc.db.api_keys import ApiKeyRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.pool import Pool, ping
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.db.users import UserRepository
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.events import EventFanout
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.interceptors import ApiInterceptor
from scheduler_grpc.remote import RemoteWorkers
from scheduler_grpc.services import add_services
from scheduler_grpc.services.decode import GenericOnly
from scheduler_grpc.sharding import ShardMap

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT: Final = 9090
# The cyclic collector's thresholds once serving: a BatchTriggerJobs call of 1,000 items allocates
# tens of thousands of container objects that live until its answer. At the default 700 collections
# took ~25 % of the server's CPU under 10 such callers (perf), at 5,000 (the worker's) ~7 % (what
# lives through a call was promoted and walked again), at 50,000 ~1.4 %.
SERVER_GC_THRESHOLD: Final = (50_000, 20, 20)
DEV_HOST: Final = "127.0.0.1"
HEALTH_INTERVAL: Final = timedelta(seconds=1)
# A ping slower than this counts as down: long enough not to flap under load, short enough that a
# load balancer hears of an outage within a few seconds.
HEALTH_TIMEOUT: Final = timedelta(seconds=2)
CALL_TIMEOUT: Final = timedelta(seconds=30)
MAX_RECEIVE_MESSAGE_BYTES: Final = 4 * 1024 * 1024
MAX_SEND_MESSAGE_BYTES: Final = 16 * 1024 * 1024
SERVER_OPTIONS: Final[Sequence[tuple[str, int]]] = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
    # Ping idle connections so dead peers (and the streams they held) are noticed and freed.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Clients may ping every 10 s (e.g. to keep a WatchExecutions stream alive through proxies).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    # Refuse to share a port with another process: a second server must fail, not split traffic.
    ("grpc.so_reuseport", 0),
)


# gRPC core queues calls that arrived before the Python server asked for them ("pending requests")
# and, past grpc.server.max_pending_requests (default 1,000), cancels a growing share of new ones
# at random up to grpc.server.max_pending_requests_hard_limit (default 3,000), where it cancels all:
# the client sees CANCELLED and the server never sees (logs or counts) the call. A burst of a few
# thousand calls fills that queue faster than one event loop drains it, so both limits are raised
# well above SCHEDULER_MAX_CONCURRENT_RPCS: every call of a burst then reaches the server, which
# answers it or refuses it with RESOURCE_EXHAUSTED (interceptors.ApiInterceptor: logged and counted). The
# queue stays bounded (each waiting call holds memory in gRPC core); only a burst beyond it is
# still cancelled by core.
MIN_PENDING_REQUESTS: Final = 20_000


def server_options(max_concurrent_rpcs: int) -> list[tuple[str, int]]:
    """SERVER_OPTIONS plus the pending-call limits sized for `max_concurrent_rpcs`."""
    pending = max(MIN_PENDING_REQUESTS, 2 * max_concurrent_rpcs)
    return [
        *SERVER_OPTIONS,
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
    ]


@dataclass(frozen=True)
class RunningServer:
    """A started server (what `serve` yields).

    Attributes:
        address: `host:port` it listens on.
        port: The bound port (useful with SCHEDULER_GRPC_PORT=0).
        api: The servicers' dependencies (tests reach the fan-out and the authenticator through it).
        health: The health servicer.
        console_url: The web console's URL (None: SCHEDULER_HTTP_ENABLED=false).
    """

    address: str
    port: int
    api: Api
    health: HealthServicer
    console_url: str | None = None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen_host(settings: Settings) -> str:
    if settings.grpc_host:
        return settings.grpc_host
    if settings.production:
        raise ConfigError("SCHEDULER_GRPC_HOST must be set in production (e.g. 0.0.0.0)")
    return DEV_HOST


def _credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    try:
        chain = settings.tls_cert.read_bytes()
        key = settings.tls_key.read_bytes()
        client_ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca else None
    except OSError as exc:
        raise ConfigError(f"SCHEDULER_TLS_CERT/KEY/CLIENT_CA cannot be read: {exc.strerror}") from None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class HealthMonitor:
    """Flips every service between SERVING and NOT_SERVING as Redis and PostgreSQL come and go.

    Args:
        health: The health servicer to update.
        services: The service names to report on ("" is the whole server and is always included).
        redis: Pinged with PING.
        pool: Pinged with `db.pool.ping`.
        metrics: Records which backend answered.
        stores: Where the last answers are kept for the console (`Api.health`).
    """

    def __init__(
        self,
        health: HealthServicer,
        services: Sequence[str],
        redis: Redis,
        pool: Pool,
        metrics_: metrics.Metrics,
        *,
        stores: StoreHealth | None = None,
    ) -> None:
        self._health = health
        self.stores = stores or StoreHealth()
        self._services = ["", *services]
        self._redis = redis
        self._pool = pool
        self._metrics = metrics_
        self.serving: bool | None = None

    async def _answers(self, store: str, ping: Callable[[], Awaitable[object]]) -> bool:
        """Whether `ping` of `store` succeeds within HEALTH_TIMEOUT (a failure is a store error)."""
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT.total_seconds()):
                await ping()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._metrics.store_error(exc, store)
            return False
        return True

    async def check(self) -> bool:
        """Ping both once and publish the result; returns whether the server is serving."""
        redis_up, postgres_up = await asyncio.gather(
            self._answers("redis", self._redis.ping), self._answers("postgres", lambda: ping(self._pool))
        )
        self._metrics.backend_up("redis", redis_up)
        self._metrics.backend_up("postgres", postgres_up)
        self.stores.redis_up, self.stores.postgres_up = redis_up, postgres_up
        serving = redis_up and postgres_up
        if serving != self.serving:
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in self._services:
                await self._health.set(service, status)
            if self.serving is not None or not serving:
                level = logging.INFO if serving else logging.WARNING
                log.log(level, "health: %s", "SERVING" if serving else "NOT_SERVING",
                        extra={"redis_up": redis_up, "postgres_up": postgres_up})  # fmt: skip
            self.serving = serving
        return serving

    async def run(self) -> None:
        """Check every HEALTH_INTERVAL until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(HEALTH_INTERVAL.total_seconds())


class _ReflectionPool:
    """The default descriptor pool, but also finding the file of a method symbol.

    Reflection answers `file_containing_symbol` with `FindFileContainingSymbol`, which in the
    protobuf runtime knows services, messages, enums and fields but not methods, so
    `grpcurl describe scheduler.v1.JobService.TriggerJob` answered "Symbol not found". A method's
    file is its service's file.
    """

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:  # the pool's API, its spelling
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service_name, _, method = symbol.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                raise KeyError(symbol) from None
            if method not in service.methods_by_name:
                raise KeyError(symbol) from None
            return service.file


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """The pool server reflection reads (the default pool, with method symbols resolved)."""
    # Duck-typed: the reflection servicer only calls the pool's Find* methods.
    return cast(descriptor_pool.DescriptorPool, _ReflectionPool(descriptor_pool.Default()))


def preflight(settings: Settings) -> tuple[str, str]:
    """The listen host and the admin password, or ConfigError before anything is opened.

    Raises:
        ConfigError: no SCHEDULER_GRPC_HOST in production, an admin password unfit for where
            the server listens, or no SCHEDULER_HTTP_HOST in production with the console enabled.
    """
    host = _listen_host(settings)
    exposed = [] if _is_loopback(host) else ["SCHEDULER_GRPC_HOST"]
    console_error: ConfigError | None = None
    if settings.http_enabled:
        from scheduler_grpc.console.app import listen_host

        try:
            console_host = listen_host(settings)
        except ConfigError as exc:  # production without SCHEDULER_HTTP_HOST: said after the password
            console_error = exc
        else:
            # The console logs the same admin in: the dev password must not reach the network through it.
            if not _is_loopback(console_host):
                exposed.append("SCHEDULER_HTTP_HOST")
    password = admin_password(
        settings.admin_password, production=settings.production, loopback=not exposed, exposed_by=exposed
    )
    if console_error is not None:
        raise console_error
    return host, password


@contextlib.asynccontextmanager
async def serve(
    settings: Settings,
    redis: Redis,
    pool: Pool,
    *,
    hasher: PasswordHasher | None = None,
    metrics_: metrics.Metrics | None = None,
) -> AsyncIterator[RunningServer]:
    """Build, start and (on exit) gracefully stop the gRPC server on open connections.

    Args:
        settings: Process settings (host, port, TLS, admin, limits, grace).
        redis: An open Redis client.
        pool: An open, migrated PostgreSQL pool.
        hasher: The argon2id hasher (tests pass cheap parameters).
        metrics_: Where calls are recorded (default: the process's Prometheus registry).

    Raises:
        ConfigError: a setting that cannot work (host in production, admin password, TLS files, port).
    """
    host, password = preflight(settings)
    if password == DEV_ADMIN_PASSWORD and not settings.admin_password:
        log.warning(
            "SCHEDULER_ADMIN_PASSWORD is unset: admin %r has the dev password %r (loopback only; never in production)",
            settings.admin_username,
            DEV_ADMIN_PASSWORD,
        )
    credentials = _credentials(settings)
    if credentials is None and not _is_loopback(host):
        log.warning("the gRPC server listens beyond loopback without TLS (set SCHEDULER_TLS_CERT/KEY)")
    recorder = metrics_ or metrics.Metrics()
    timeout = settings.connect_timeout
    registry = default_registry(HandlerSettings.from_settings(settings))
    try:
        users = UserRepository(pool, timeout=timeout)
        authenticator = Authenticator(
            redis,
            users,
            ApiKeyRepository(pool, timeout=timeout),
            session_ttl=settings.session_ttl,
            timeout=timeout,
            hasher=hasher,
        )
        await authenticator.ensure_admin(settings.admin_username, password)
        fanout = EventFanout(redis, buffer=settings.watch_buffer, timeout=timeout)
        shard_map = ShardMap(QueueShardRepository(pool, timeout=timeout).histories, lead=settings.queue_shard_lead)
        remote = RemoteWorkers(
            redis, RunRepository(pool), HistoryRepository(pool), settings, registry.names(), shard_map=shard_map
        )
        api = Api(
            control=Control(
                redis,
                pool,
                registry,
                misfire_grace=settings.misfire_grace,
                read_timeout=timeout,
                users=UserAdmin(users, authenticator),
                in_process_queue=settings.queue,
                shard_map=shard_map,
            ),
            auth=authenticator,
            fanout=fanout,
            cluster=ClusterView(redis, LeadershipRepository(pool, timeout=timeout), timeout=timeout),
            handlers=registry,
            metrics=recorder,
            health=StoreHealth(),
            remote=remote,
        )
        server = grpc.aio.server(
            interceptors=[
                ApiInterceptor(recorder, authenticator, call_timeout=CALL_TIMEOUT, limit=settings.max_concurrent_rpcs)
            ],
            options=server_options(settings.max_concurrent_rpcs),
            # Not grpc.aio's maximum_concurrent_rpcs: its refusals bypass the interceptors, so they
            # were never logged or counted; ApiInterceptor enforces the same limit where they are.
        )
        services = add_services(server, api)
        health = HealthServicer()
        generic = cast(grpc.aio.Server, GenericOnly(server))  # generated code, generic handlers only
        health_pb2_grpc.add_HealthServicer_to_server(health, generic)
        # What reflection.enable_server_reflection does for an aio server (it picks the servicer
        # by the server's type, which GenericOnly is not).
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]  # untyped generated code
            ReflectionServicer(
                [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                pool=reflection_pool(),
            ),
            generic,
        )
        monitor = HealthMonitor(health, services, redis, pool, recorder, stores=api.health)
        await monitor.check()  # the first answer is a real one, not the library's default SERVING
        bind = (
            f"[{host}]:{settings.grpc_port}"
            if ":" in host and not host.startswith("[")
            else f"{host}:{settings.grpc_port}"
        )
        try:
            port = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise ConfigError(f"SCHEDULER_GRPC_HOST/PORT: cannot listen on {bind}: {exc}") from None
        if port == 0:
            raise ConfigError(f"SCHEDULER_GRPC_HOST/PORT: cannot listen on {bind} (in use?)")
        await server.start()
        address = f"{bind.rsplit(':', 1)[0]}:{port}"
        log.info("gRPC server listening", extra={"address": address, "tls": credentials is not None,
                                                  "mutual_tls": settings.tls_client_ca is not None})  # fmt: skip
        try:
            async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(monitor.run(), name="health-monitor"),
                    group.create_task(fanout.run(), name="event-fanout"),
                ]
                console_url = None
                if settings.http_enabled:
                    from scheduler_grpc.console.app import serve_console  # aiohttp.web and Jinja2 only when served

                    console = await stack.enter_async_context(serve_console(settings, api))
                    console_url = console.url
                try:
                    yield RunningServer(address=address, port=port, api=api, health=health, console_url=console_url)
                finally:
                    # Streams first (WatchExecutions and the console's live pages): they would
                    # otherwise hold the grace period open to its end.
                    fanout.close()
                    await health.enter_graceful_shutdown()
                    # Remote workers are told to drain; their outcomes in flight are recorded.
                    await remote.drain(settings.shutdown_grace)
                    await server.stop(settings.shutdown_grace.total_seconds())
                    for task in tasks:
                        task.cancel()
        finally:
            await server.stop(None)  # no-op after a graceful stop; immediate after a failed start
    finally:
        await registry.aclose()


async def run_server(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """`scheduler-grpc server`: serve the gRPC API (and /metrics) until SIGTERM/SIGINT."""
    preflight(settings)  # a bad setting is one line at once, before connecting anywhere
    port = settings.metrics_port if settings.metrics_port is not None else DEFAULT_METRICS_PORT
    async with (
        # No session reset on release (one round trip saved per statement): nothing the API runs
        # leaves session state on a pooled connection. It never LISTENs (the leader's JobChanges
        # does, on the scheduler's pool; events come from Redis), takes no session advisory lock
        # (the migration's is released, and its connections closed, before serving), SETs only
        # LOCAL inside transactions, opens no cursor outside one; an open transaction is still
        # rolled back by asyncpg on release.
        connect(settings, session_reset=False) as conns,
        metrics.serve(settings.metrics_host, port),
        serve(settings, conns.redis, conns.pool) as running,
    ):
        # What start-up made (modules, descriptors, pools) lives as long as the process: out of the
        # collector's sight, so a full collection (1,000 streams opening trigger some) does not walk
        # it again; that took ~0.2 s, a pause every stream's events waited out (bench/watch_bench.py).
        gc.freeze()
        gc.set_threshold(*SERVER_GC_THRESHOLD)
        await stop.wait()
        log.info("stopping the gRPC server", extra={"address": running.address})
    return 0
