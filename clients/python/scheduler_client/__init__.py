"""Client of scheduler-grpc: generated stubs in `scheduler_client.v1`.

`SchedulerClient` (an asyncio client over grpc.aio) and its errors are importable from here; they
load on first use, so importing only the stubs (`scheduler_client.v1`) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from scheduler_client.client import Page, SchedulerClient
    from scheduler_client.errors import SchedulerClientError

__all__ = ["Page", "SchedulerClient", "SchedulerClientError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in {"SchedulerClient", "Page"}:
        from scheduler_client import client

        return getattr(client, name)
    if name == "SchedulerClientError":
        from scheduler_client import errors

        return errors.SchedulerClientError
    raise AttributeError(f"module 'scheduler_client' has no attribute {name!r}")
