"""Valkey Cluster as a deployment (issue 24): the embedded 3-master, 3-replica cluster on loopback."""

from __future__ import annotations

from urllib.parse import urlsplit

import redis.asyncio as aioredis


def seeds(cluster_url: str) -> list[tuple[str, int]]:
    netloc = urlsplit(cluster_url).netloc
    return [(host, int(port)) for host, port in (seed.rsplit(":", 1) for seed in netloc.split(","))]


async def test_the_embedded_cluster_has_three_masters_each_with_a_replica_and_every_slot(cluster_url: str) -> None:
    assert urlsplit(cluster_url).scheme == "redis+cluster"
    host, port = seeds(cluster_url)[0]
    client = aioredis.Redis(host=host, port=port, decode_responses=True)
    try:
        info = await client.execute_command("CLUSTER", "INFO")
        nodes = (await client.execute_command("CLUSTER", "NODES")).splitlines()
    finally:
        await client.aclose()
    assert "cluster_state:ok" in info
    rows = [line.split() for line in nodes]
    masters = {row[0]: row for row in rows if "master" in row[2].split(",")}
    replicas = [row for row in rows if "slave" in row[2].split(",")]
    assert len(masters) == 3
    assert len(replicas) == 3
    assert sorted(row[3] for row in replicas) == sorted(masters), "each master has exactly one replica"
    covered: set[int] = set()
    for row in masters.values():
        for span in row[8:]:
            first, _, last = span.partition("-")
            covered.update(range(int(first), int(last or first) + 1))
    assert covered == set(range(16384))
    assert {(host, int(row[1].split("@")[0].rsplit(":", 1)[1])) for row in rows} == set(seeds(cluster_url))
