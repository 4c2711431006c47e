"""The console's searches and charts: executions by job name and error text (for the executions
page), dead letters with their job, handler, error and age, and the charts page (executions per
bucket by outcome, queue depth and start lateness over the last hour or day, per queue)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Final

from aiohttp import web

from scheduler_grpc import redaction
from scheduler_grpc.console import timecharts
from scheduler_grpc.console.context import CONSOLE, Console, render
from scheduler_grpc.console.security import PRINCIPAL, rpc
from scheduler_grpc.control import DeadLetter, Series
from scheduler_grpc.errors import InvalidArgument

_V: Final = "/scheduler.v1."
PAGE_SIZE: Final = 50
WINDOWS: Final = {"hour": (timedelta(hours=1), timedelta(minutes=1)), "day": (timedelta(days=1), timedelta(minutes=15))}
# How long the charts' PostgreSQL aggregates are reused: a day's (15-minute buckets, ~0.2 s to read
# on a million rows) for a minute, an hour's (1-minute buckets) for 10 s.
SERIES_TTL: Final = {"hour": 10.0, "day": 60.0}
SERIES_CACHE_SIZE: Final = 128
_series_cache: dict[tuple[int, str, str], tuple[float, Series]] = {}


async def _series(console: Console, window: str, queue: str | None, start: datetime, bucket: timedelta) -> Series:
    """The window's aggregates, from the cache while fresh (one entry per window and queue)."""
    key = (id(console), window, queue or "")
    cached = _series_cache.get(key)
    if cached is not None and time.monotonic() < cached[0]:
        return cached[1]
    series = await console.api.control.chart_series(since=start, bucket=bucket, queue=queue)
    if len(_series_cache) >= SERIES_CACHE_SIZE:
        _series_cache.pop(min(_series_cache, key=lambda k: _series_cache[k][0]))
    _series_cache[key] = (time.monotonic() + SERIES_TTL[window], series)
    return series


async def execution_extras(console: Console, query: Mapping[str, str]) -> tuple[list[str] | None, str | None]:
    """The executions page's name and error searches: the ids of the jobs `job_name` names (None: no
    name search) and the error text to look for.

    Raises:
        InvalidArgument: a name matching more than `MAX_NAME_MATCHES` jobs (`job_name`).
    """
    name = (query.get("job_name") or "").strip()
    error = (query.get("error") or "").strip() or None
    if not name:
        return None, error
    return await console.api.control.bulk.job_ids_named(name), error


@rpc(_V + "QueueService/ListDeadLetters")
async def dead_letters(request: web.Request) -> web.StreamResponse:
    """The dead-letter queue of a queue: its Redis page, or a search by job name, handler and error
    (PostgreSQL, the record the queue is rebuilt from), each with job, handler, error and age."""
    console: Console = request.app[CONSOLE]
    query = request.query
    names = sorted({"default", *(await console.api.control.queue_names())})
    queue = query.get("queue") or "default"
    if queue not in names:
        names.append(queue)
    control = console.api.control
    job_name = (query.get("job_name") or "").strip()
    handler = query.get("handler") or None
    error = (query.get("error") or "").strip() or None
    searching = bool(job_name or handler or error)
    next_query: dict[str, str] | None = None
    if searching:
        job_ids, _ = await execution_extras(console, {"job_name": job_name})
        before = None
        if query.get("before"):
            moment, _, run_id = query["before"].partition("_")
            try:
                before = (datetime.fromisoformat(moment), str(uuid.UUID(run_id)))
            except ValueError:
                raise InvalidArgument("before", "is not a position this page gave") from None
        found = await control.search_dead_letters(
            queue=queue, job_ids=job_ids, handler=handler, error=error, before=before, limit=PAGE_SIZE + 1
        )
        items = found[:PAGE_SIZE]
        if len(found) > PAGE_SIZE and items[-1].died_at is not None:
            next_query = {**query, "before": f"{items[-1].died_at.isoformat()}_{items[-1].run_id}"}
        # Paged by what the store found; shown by what the caller may read (no secret oracle).
        rows: list[tuple[str, DeadLetter | None, datetime | None, str]] = [
            (item.run_id, item, item.died_at, item.error)
            for item in items
            if error is None or redaction.error_matches(request[PRINCIPAL].role, item.error, error)
        ]
    else:
        page = await control.list_dead_letters(queue, PAGE_SIZE, query.get("token") or None)
        details = await control.dead_letter_details([item.id for item in page.items if _is_uuid(item.id)])
        rows = [(item.id, details.get(item.id), item.parked_at, item.reason) for item in page.items]
        if page.next_page_token:
            next_query = {"queue": queue, "token": page.next_page_token}
    role = request[PRINCIPAL].role
    # Errors (the reasons) as the caller may read them: credentials redacted below admin.
    rows = [(run_id, item, died, redaction.error_for(role, reason)) for run_id, item, died, reason in rows]
    handlers = sorted({*(await control.handlers_and_queues())[0]})
    filter_query = {k: v for k, v in query.items() if k in ("job_name", "handler", "error") and v}
    return await render(
        request,
        "dead_letters.html",
        {
            "queues": names,
            "queue": queue,
            "rows": rows,
            "searching": searching,
            "query": query,
            "handlers": handlers,
            "next_query": next_query,
            "filter_query": {"queue": queue, **filter_query},
            "now": datetime.now(UTC),
            "message": query.get("done"),
        },
    )


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


@rpc(_V + "QueueService/GetQueueStats")
async def charts(request: web.Request) -> web.StreamResponse:
    """Executions per bucket by outcome, queue depth and start lateness p50/p99, over the last hour
    (per minute) or day (per 15 minutes), for one queue or all."""
    console: Console = request.app[CONSOLE]
    window = request.query.get("window") or "hour"
    if window not in WINDOWS:
        raise InvalidArgument("window", "must be hour or day")
    span, bucket = WINDOWS[window]
    queue = request.query.get("queue") or None
    names = sorted({"default", *(await console.api.control.queue_names())})
    if queue is not None and queue not in names:
        raise InvalidArgument("queue", f"no job uses queue {queue!r}")
    end = datetime.now(UTC)
    start = end - span
    series, samples = await asyncio.gather(
        _series(console, window, queue, start, bucket),
        asyncio.gather(*(console.api.control.queue_depth(name, start) for name in ([queue] if queue else names))),
    )
    # Depth of all queues: the samples of each minute added up (each queue sampled the same minute).
    totals: dict[datetime, list[int]] = {}
    for queue_samples in samples:
        for sample in queue_samples:
            slot = totals.setdefault(sample.time.replace(second=0, microsecond=0), [0, 0, 0])
            slot[0] += sample.ready
            slot[1] += sample.delayed
            slot[2] += sample.processing
    ordered = sorted(totals.items())
    where = f"queue {queue}" if queue else "all queues"
    outcome_chart = timecharts.outcomes(
        series.outcomes, start, end, bucket, f"attempts finished per {_bucket_name(bucket)}, by outcome ({where})"
    )
    depth_chart = timecharts.lines(
        [
            ("ready", "q-ready", [(t, float(v[0])) for t, v in ordered]),
            ("delayed", "q-delayed", [(t, float(v[1])) for t, v in ordered]),
            ("running", "q-running", [(t, float(v[2])) for t, v in ordered]),
        ],
        start,
        end,
        f"queue depth, sampled each minute ({where})",
    )
    lateness_chart = timecharts.lines(
        [
            ("p50", "l-p50", [(t, p50) for t, p50, _ in series.lateness]),
            ("p99", "l-p99", [(t, p99) for t, _, p99 in series.lateness]),
        ],
        start,
        end,
        f"start lateness of scheduled runs per {_bucket_name(bucket)} ({where})",
        seconds=True,
    )
    return await render(
        request,
        "charts.html",
        {
            "window": window,
            "queue": queue or "",
            "queues": names,
            "charts": [("outcomes", outcome_chart), ("depth", depth_chart), ("lateness", lateness_chart)],
        },
    )


def _bucket_name(bucket: timedelta) -> str:
    return "minute" if bucket == timedelta(minutes=1) else f"{int(bucket.total_seconds() // 60)} minutes"
