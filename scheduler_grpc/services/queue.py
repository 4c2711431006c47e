"""QueueService: queue depths and the dead-letter queue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import grpc
from scheduler_client.v1 import queue_pb2, queue_pb2_grpc

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.queue import Queue
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.services import Api, convert

Context = grpc.aio.ServicerContext[Any, Any]

MAX_RUN_IDS: Final = 10_000


def _selection(run_ids: Sequence[str], everything: bool) -> list[str] | None:
    """The run ids a requeue/purge names (None: every dead run of the queue).

    Raises:
        InvalidArgument: both or neither of `run_ids` and `all`, or a malformed id.
    """
    if everything and run_ids:
        raise InvalidArgument("all", "give run_ids or set all, not both")
    if everything:
        return None
    if not run_ids:
        raise InvalidArgument("run_ids", "required (or set all)")
    if len(run_ids) > MAX_RUN_IDS:
        raise InvalidArgument("run_ids", f"at most {MAX_RUN_IDS} per call")
    return list(dict.fromkeys(convert.resource_id(run_id, f"run_ids[{i}]") for i, run_id in enumerate(run_ids)))


class QueueService(queue_pb2_grpc.QueueServiceServicer):
    """Queue statistics and dead-letter handling (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._control = api.control

    def _queue(self, name: str) -> Queue:
        name = name or "default"
        if not is_queue_name(name):
            raise InvalidArgument("queue", QUEUE_NAME_RULE)
        return self._control.queues.get(name)

    async def GetQueueStats(
        self, request: queue_pb2.GetQueueStatsRequest, context: Context
    ) -> queue_pb2.GetQueueStatsResponse:
        queue = self._queue(request.queue)
        stats = await queue.stats()
        return queue_pb2.GetQueueStatsResponse(
            queue=queue.name, ready=stats.ready, processing=stats.processing, delayed=stats.delayed, dead=stats.dead
        )

    async def ListDeadLetters(
        self, request: queue_pb2.ListDeadLettersRequest, context: Context
    ) -> queue_pb2.ListDeadLettersResponse:
        queue = self._queue(request.queue)
        page = await queue.list_dead(convert.page_size(request.page_size), request.page_token or None)
        return queue_pb2.ListDeadLettersResponse(
            dead_letters=[convert.dead_letter(item) for item in page.items], next_page_token=page.next_page_token or ""
        )

    async def RequeueDeadLetters(
        self, request: queue_pb2.RequeueDeadLettersRequest, context: Context
    ) -> queue_pb2.RequeueDeadLettersResponse:
        queue = self._queue(request.queue)
        runs = await self._control.requeue_dead_runs(queue.name, _selection(request.run_ids, request.all))
        requeued = [run.run_id for run in runs]
        return queue_pb2.RequeueDeadLettersResponse(run_ids=requeued)

    async def PurgeDeadLetters(
        self, request: queue_pb2.PurgeDeadLettersRequest, context: Context
    ) -> queue_pb2.PurgeDeadLettersResponse:
        queue = self._queue(request.queue)
        purged = await self._control.purge_dead_runs(queue.name, _selection(request.run_ids, request.all))
        return queue_pb2.PurgeDeadLettersResponse(run_ids=purged)
