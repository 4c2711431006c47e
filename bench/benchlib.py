"""What every bench script shares: the servers it measures on.

Imported by the scripts in this folder as `from benchlib import ...` (a script's own folder is on
`sys.path` when it runs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler_grpc.embedded import ServerUrls, embedded_servers  # noqa: E402


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
