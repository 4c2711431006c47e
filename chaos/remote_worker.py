"""A remote worker process for the fault suite (issue 23): the Python SDK's `Worker`, serving the
handler `chaos.remote` on one queue, with one JSON line on stdout per thing the suite reads back.

    CHAOS_WORKER_KEY=<worker key> python -m chaos.remote_worker --target HOST:PORT --mode work|hold
        --queue QUEUE --slots N [--ack-first N] [--reconnect-max SECONDS]

* `work`: the handler sleeps `payload["seconds"]` (default 0) and returns.
* `hold`: the handler never returns (`held <execution id>`): the process holds every run it gets
  until it is killed. With `--ack-first N`, only the first N acknowledgements reach the server:
  every later one is withheld on the wire (`withheld <execution id>`) while the SDK believes it
  acknowledged, so the server holds those assignments unacknowledged (until its ack timeout, or
  the stream's end) -- a worker whose acks were lost in flight.

Lines (`{"message": ..., ...}`, as the service's JSON logs, so `RoleProcess.logged` counts them):
`connected` (worker_id, connects) on every welcome, `held` / `withheld` (execution_id), `served`
(execution_id, worker_id), and the SDK's own log records. SIGTERM stops the worker (no new work,
running handlers finish); a worker still busy 10 s later exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, Final, TypeVar, cast

import grpc
from scheduler_client.v1 import workers_pb2
from scheduler_client.worker import ExecutionContext, Worker

HANDLER: Final = "chaos.remote"
KEY_ENV: Final = "CHAOS_WORKER_KEY"
STOP_GRACE_S: Final = 10.0
TRequest = TypeVar("TRequest")
TResponse = TypeVar("TResponse")


def emit(message: str, **fields: Any) -> None:
    """One JSON line on stdout (the role's log)."""
    print(json.dumps({"message": message, "at": datetime.now(UTC).isoformat(), **fields}), flush=True)


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"message": record.getMessage(), "level": record.levelname, "logger": record.name})


class AckFilter(grpc.aio.StreamStreamClientInterceptor):
    """Lets the first `let_through` acknowledgements of the process reach the server and withholds
    every later one (alone or in a `RequestBatch`); everything else passes untouched."""

    def __init__(self, let_through: int) -> None:
        self.let_through = let_through
        self.passed = 0

    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[TRequest] | Iterable[TRequest]],
            Awaitable[grpc.aio.StreamStreamCall[TRequest, TResponse]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[TRequest] | Iterable[TRequest],
    ) -> AsyncIterator[TResponse] | grpc.aio.StreamStreamCall[TRequest, TResponse]:
        # Only the SDK's Connect stream goes through this channel: its requests are ConnectRequests.
        requests = cast(AsyncIterable[workers_pb2.ConnectRequest], request_iterator)
        return await continuation(client_call_details, cast(AsyncIterable[TRequest], self._filter(requests)))

    def _keep(self, ack: workers_pb2.Ack) -> bool:
        if self.passed < self.let_through:
            self.passed += 1
            return True
        emit("withheld", execution_id=ack.execution_id)
        return False

    async def _filter(
        self, requests: AsyncIterable[workers_pb2.ConnectRequest]
    ) -> AsyncIterator[workers_pb2.ConnectRequest]:
        async for request in requests:
            kind = request.WhichOneof("message")
            if kind == "ack" and not self._keep(request.ack):
                continue
            if kind == "batch" and request.batch.acks:
                kept = [ack for ack in request.batch.acks if self._keep(ack)]
                del request.batch.acks[:]
                request.batch.acks.extend(kept)
                if not (kept or request.batch.outcomes or request.batch.credit):
                    continue
            yield request


def _filtered_channels(acks: AckFilter) -> None:
    """Make every plaintext channel of this process go through `acks` (the SDK opens its own)."""
    plain = grpc.aio.insecure_channel

    def insecure_channel(
        target: str, options: Any = None, compression: Any = None, interceptors: Any = None
    ) -> grpc.aio.Channel:
        return plain(target, options, compression, [*(interceptors or ()), acks])

    grpc.aio.insecure_channel = insecure_channel


async def _report_connections(worker: Worker) -> None:
    """A `connected` line for every welcome (a new stream: a new worker id)."""
    seen = 0
    while True:
        await worker.connected.wait()
        if worker.stats.connects != seen:
            seen = worker.stats.connects
            emit("connected", worker_id=worker.worker_id, connects=seen)
        await asyncio.sleep(0.05)


async def main(args: argparse.Namespace) -> int:
    worker = Worker(
        args.target, os.environ[KEY_ENV], slots=args.slots, queue=args.queue, reconnect_max=args.reconnect_max
    )
    hold = args.mode == "hold"

    @worker.handler(HANDLER, description="the fault suite's remote handler")
    async def run(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        if hold:
            emit("held", execution_id=ctx.execution_id, attempt=ctx.attempt)
            await asyncio.Event().wait()
        await asyncio.sleep(float(payload.get("seconds") or 0))
        emit("served", execution_id=ctx.execution_id, worker_id=worker.worker_id)
        return {"attempt": ctx.attempt}

    loop = asyncio.get_running_loop()

    def stop() -> None:
        worker.stop()
        loop.call_later(STOP_GRACE_S, give_up)

    def give_up() -> None:
        emit("still busy after SIGTERM; exiting", running=worker.stats.assigned - worker.stats.succeeded)
        os._exit(3)

    loop.add_signal_handler(signal.SIGTERM, stop)
    reporter = asyncio.create_task(_report_connections(worker))
    try:
        await worker.run()
    except grpc.aio.AioRpcError as exc:
        emit("failed", code=exc.code().name, details=exc.details())
        return 1
    finally:
        reporter.cancel()
    emit("stopped", connects=worker.stats.connects, succeeded=worker.stats.succeeded)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos.remote_worker", description=__doc__)
    parser.add_argument("--target", required=True, help="host:port of a server (or of a proxy in front of it)")
    parser.add_argument("--mode", choices=("work", "hold"), default="work")
    parser.add_argument("--queue", required=True)
    parser.add_argument("--slots", type=int, default=10)
    parser.add_argument("--ack-first", type=int, default=None, help="hold: acks after this many are withheld")
    parser.add_argument("--reconnect-max", type=float, default=2.0, help="the SDK's longest reconnect wait (s)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_JsonLines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if arguments.ack_first is not None:
        _filtered_channels(AckFilter(arguments.ack_first))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main(arguments)))
