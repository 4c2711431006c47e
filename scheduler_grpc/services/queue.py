"""QueueService: queue depths and the dead-letter queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

import grpc
from scheduler_client.v1 import queue_pb2, queue_pb2_grpc

from scheduler_grpc import redaction
from scheduler_grpc.application import Api
from scheduler_grpc.auth import current_principal
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.services import convert

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

    async def GetQueueStats(
        self, request: queue_pb2.GetQueueStatsRequest, context: Context
    ) -> queue_pb2.GetQueueStatsResponse:
        queue = request.queue or "default"
        stats = await self._control.queue_stats(queue)
        return queue_pb2.GetQueueStatsResponse(
            queue=queue, ready=stats.ready, processing=stats.processing, delayed=stats.delayed, dead=stats.dead
        )

    async def ListDeadLetters(
        self, request: queue_pb2.ListDeadLettersRequest, context: Context
    ) -> queue_pb2.ListDeadLettersResponse:
        page = await self._control.list_dead_letters(
            request.queue, convert.page_size(request.page_size), request.page_token or None
        )
        role = current_principal().role
        return queue_pb2.ListDeadLettersResponse(
            # The reason is the run's last error: credentials in it redacted below admin, as everywhere.
            dead_letters=[
                convert.dead_letter(replace(item, reason=redaction.error_for(role, item.reason))) for item in page.items
            ],
            next_page_token=page.next_page_token or "",
        )

    async def RequeueDeadLetters(
        self, request: queue_pb2.RequeueDeadLettersRequest, context: Context
    ) -> queue_pb2.RequeueDeadLettersResponse:
        runs = await self._control.requeue_dead_runs(request.queue, _selection(request.run_ids, request.all))
        requeued = [run.run_id for run in runs]
        return queue_pb2.RequeueDeadLettersResponse(run_ids=requeued)

    async def PurgeDeadLetters(
        self, request: queue_pb2.PurgeDeadLettersRequest, context: Context
    ) -> queue_pb2.PurgeDeadLettersResponse:
        purged = await self._control.purge_dead_runs(request.queue, _selection(request.run_ids, request.all))
        return queue_pb2.PurgeDeadLettersResponse(run_ids=purged)

    async def GetQueueShards(
        self, request: queue_pb2.GetQueueShardsRequest, context: Context
    ) -> queue_pb2.GetQueueShardsResponse:
        shards = convert.queue_shards(await self._control.queue_shards(request.queue))
        return queue_pb2.GetQueueShardsResponse(
            queue=shards.queue, shards=shards.shards, served_shards=shards.served_shards, changes=shards.changes
        )

    async def ListQueueShards(
        self, request: queue_pb2.ListQueueShardsRequest, context: Context
    ) -> queue_pb2.ListQueueShardsResponse:
        page = await self._control.list_queue_shards(
            page_size=convert.page_size(request.page_size), page_token=request.page_token
        )
        # A page ends before 1 MiB (a queue's history has a row per change made).
        queues, cut = convert.fill_page(page.histories, convert.queue_shards)
        token = page.token_after(page.histories[len(queues) - 1]) if cut else page.next_page_token
        return queue_pb2.ListQueueShardsResponse(queues=queues, next_page_token=token)

    async def SetQueueShards(
        self, request: queue_pb2.SetQueueShardsRequest, context: Context
    ) -> queue_pb2.SetQueueShardsResponse:
        change = await self._control.set_queue_shards(request.queue, request.shards)
        return queue_pb2.SetQueueShardsResponse(change=convert.shard_change(change))
