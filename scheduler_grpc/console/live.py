"""What live rows show besides the event itself: the job's name and the run's trigger.

An execution event carries ids (`events.ExecutionEvent`); a person reads names. The console's event
stream adds `job_name` and `trigger` to each event, looked up once per execution
(`Control.flow_reads.execution_labels`) and remembered in a bounded cache shared by every stream of the
process (a trigger never changes; a renamed job shows its new name on the next execution).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Final

from aiohttp import web

from scheduler_grpc import stores
from scheduler_grpc.control import Control
from scheduler_grpc.control_flows import ExecutionLabel

log = logging.getLogger(__name__)

CACHE_SIZE: Final = 8192


class Labels:
    """Execution id -> (job name, trigger), at most CACHE_SIZE remembered (least recently used goes)."""

    def __init__(self, control: Control, size: int = CACHE_SIZE) -> None:
        self._control = control
        self._size = size
        self._cache: OrderedDict[str, ExecutionLabel] = OrderedDict()
        self._warned = False

    async def of(self, execution_id: str) -> ExecutionLabel | None:
        """The label of an execution; None if it is not (or no longer) stored, or PostgreSQL does
        not answer (the row then shows the ids it has: a live stream never stops for a label)."""
        label = self._cache.get(execution_id)
        if label is not None:
            self._cache.move_to_end(execution_id)
            return label
        try:
            found = await self._control.flow_reads.execution_labels([execution_id])
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            if not self._warned:
                self._warned = True
                log.warning("console: execution labels unavailable", extra={"error": repr(exc)})
            return None
        self._warned = False
        label = found.get(execution_id)
        if label is not None:
            self._cache[execution_id] = label
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return label


LABELS: Final = web.AppKey("labels", Labels)
