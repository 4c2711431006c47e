"""The embedded servers' start when the port chosen for them is taken before they bind it (another
test process, or any client's outgoing connection, can take a port between its choice and the bind)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scheduler_grpc.embedded import EmbeddedPostgres, EmbeddedRedis, EmbeddedValkeyCluster, free_port
from scheduler_grpc.errors import ConfigError


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """Hold `port` as another process would: bound and listening on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield


def test_a_valkey_whose_chosen_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedRedis(tmp_path / "valkey", port=port, movable=True)
    with taken(port):
        url = server.start()
        try:
            assert server.port != port
            assert redis.Redis.from_url(url).ping()
        finally:
            server.stop()


def test_a_valkey_on_a_fixed_port_that_is_taken_fails_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedRedis(tmp_path / "valkey", port=port)  # a restart on the same port must keep it
    with taken(port), pytest.raises(ConfigError, match="Address already in use"):
        server.start()


def test_a_postgresql_whose_chosen_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedPostgres(tmp_path / "postgres", fast=True, port=port, movable=True)
    with taken(port):
        url = server.start()
        try:
            assert server.port != port
            assert url.endswith(f":{server.port}/postgres")
        finally:
            server.stop()


def test_a_cluster_whose_node_port_was_taken_forms_on_another(tmp_path: Path) -> None:
    cluster = EmbeddedValkeyCluster(tmp_path / "cluster", replicas=0)
    port = cluster.nodes[1].port
    with taken(port):
        url = cluster.start()
        try:
            assert cluster.nodes[1].port != port
            assert f"127.0.0.1:{cluster.nodes[1].port}" in url
            assert cluster._ready()
        finally:
            cluster.stop()
