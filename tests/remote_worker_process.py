"""A remote worker in a process of its own, for tests that kill it (`kill -9`): prints one line
per assignment it holds (`held <execution id>`) and keeps it until killed.

`python -m tests.remote_worker_process sdk|raw TARGET KEY QUEUE SLOTS`

* `sdk`: the Python SDK's `Worker`, whose handler acknowledges (the SDK does) and blocks;
* `raw`: a raw stream that grants SLOTS credit and acknowledges nothing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
from scheduler_client.v1 import workers_pb2
from scheduler_client.worker import ExecutionContext, Worker


async def sdk(target: str, key: str, queue: str, slots: int) -> None:
    worker = Worker(target, key, slots=slots, queue=queue)

    @worker.handler("remote.noop")
    async def hold(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        print(f"held {ctx.execution_id}", flush=True)
        await asyncio.Event().wait()

    await worker.run()


async def raw(target: str, key: str, queue: str, slots: int) -> None:
    async def requests() -> AsyncIterator[workers_pb2.ConnectRequest]:
        yield workers_pb2.ConnectRequest(hello=workers_pb2.Hello(
            handlers=[workers_pb2.HandlerInfo(name="remote.noop")], slots=slots, sdk="raw", queue=queue
        ))  # fmt: skip
        yield workers_pb2.ConnectRequest(credit=workers_pb2.Credit(grant=slots))
        await asyncio.Event().wait()

    async with grpc.aio.insecure_channel(target) as channel:
        connect = channel.stream_stream(
            "/scheduler.v1.WorkerService/Connect",
            request_serializer=workers_pb2.ConnectRequest.SerializeToString,
            response_deserializer=workers_pb2.ConnectResponse.FromString,
        )
        async for response in connect(requests(), metadata=(("authorization", f"Bearer {key}"),)):
            kind = response.WhichOneof("message")
            if kind == "assignment":
                print(f"held {response.assignment.execution_id}", flush=True)
            elif kind == "assignments":
                for assignment in response.assignments.assignments:
                    print(f"held {assignment.execution_id}", flush=True)


if __name__ == "__main__":
    mode, target, key, queue, slots = sys.argv[1:6]
    asyncio.run((sdk if mode == "sdk" else raw)(target, key, queue, int(slots)))
