"""What every bench script shares: the servers it measures on, the role processes' environment
and where their logs go.

Imported by the scripts in this folder as `from benchlib import ...` (a script's own folder is on
`sys.path` when it runs).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler_grpc.embedded import EmbeddedValkeyCluster, ServerUrls, embedded_servers  # noqa: E402


@contextmanager
def servers(data: Path | None = None) -> Iterator[ServerUrls]:
    """The servers of `REDIS_URL` / `DATABASE_URL`, or throwaway embedded ones under `data`
    (default `.data/`) for those unset; `bench/run.py` passes its own pair down to every script."""
    with embedded_servers(
        data or ROOT / ".data",
        redis_url=os.environ.get("REDIS_URL") or None,
        database_url=os.environ.get("DATABASE_URL") or None,
        throwaway=True,
    ) as urls:
        yield urls


@contextmanager
def valkey_cluster(replicas: int = 1) -> Iterator[str]:
    """The `redis+cluster://` URL of BENCH_CLUSTER_URL (a cluster the bench may flush), or of a
    throwaway embedded cluster of 3 masters with `replicas` replicas each under `.data/`."""
    if url := os.environ.get("BENCH_CLUSTER_URL"):
        yield url
        return
    (ROOT / ".data").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-", dir=ROOT / ".data") as tmp:
        embedded = EmbeddedValkeyCluster(Path(tmp), replicas=replicas)
        try:
            yield embedded.start()
        finally:
            embedded.stop()


def role_env(redis_url: str, database_url: str, **settings: str) -> dict[str, str]:
    """The environment of a role process the bench starts: this one's without any SCHEDULER_*
    setting (the bench decides them), the servers, no metrics port, logs at BENCH_LOG_LEVEL
    (WARNING), then `settings` (SCHEDULER_X=value)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
            "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_METRICS_PORT": "0",
            "SCHEDULER_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"), **settings}  # fmt: skip


@contextmanager
def log_dir() -> Iterator[Path]:
    """Where the role processes' logs go: BENCH_LOG_DIR (`bench/run.py` sets it; kept), else a
    temporary folder removed at the end."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(os.environ.get("BENCH_LOG_DIR") or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        yield logs
