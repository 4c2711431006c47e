"""Bulk actions from the console: on the executions, jobs and dead-letter pages, by selection or by
the page's filter, always after a confirmation page that says how many.

The first POST (no `confirm`) counts what the selection or filter matches (`validate_only`) and shows
that count with a Confirm button; a filter is pinned there to the moment of the count (`until`), so
runs created afterwards are not swept up. The confirmed POST acts through `control_bulk` (batches of
500, at most 10,000 items) and returns to the list with a flash message saying what was done.
Roles are the API's: each route stands for a Batch* RPC, and deleting jobs needs BatchDeleteJobs'.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode

from aiohttp import web
from multidict import MultiDict, MultiDictProxy

from scheduler_grpc.auth import PermissionDenied
from scheduler_grpc.console import flash, security
from scheduler_grpc.console.context import CONSOLE, render
from scheduler_grpc.console.security import PRINCIPAL, allows, rpc
from scheduler_grpc.control_bulk import ExecutionAction, JobAction, JobFilter, Search
from scheduler_grpc.errors import InvalidArgument

_V: Final = "/scheduler.v1."
_EXECUTION_VERBS: Final = {
    ExecutionAction.CANCEL: ("Cancel", "cancelled", "Cancel the runs of"),
    ExecutionAction.RETRY: ("Retry", "retried", "Retry the runs of"),
    ExecutionAction.REQUEUE: ("Requeue", "requeued from the dead-letter queue", "Requeue the dead runs of"),
}
_JOB_VERBS: Final = {
    JobAction.PAUSE: ("Pause", "paused"),
    JobAction.RESUME: ("Resume", "resumed"),
    JobAction.DELETE: ("Delete", "deleted"),
}
# The list pages' own query keys that are not filters (paging, the live cursor).
_NOT_FILTERS: Final = frozenset({"before", "after", "token", "cursor", "done"})


def instant(value: str, field: str) -> datetime:
    """An ISO 8601 time from a form or query (UTC when it names no offset).

    Raises:
        InvalidArgument: not an ISO 8601 time, naming `field`.
    """
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidArgument(field, "must be an ISO 8601 time such as 2030-01-01T09:00:00Z") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def search_of(query: Mapping[str, str] | MultiDictProxy[str] | MultiDict[str]) -> Search:
    """The executions search a list page's query string describes (job, job_name, state, handler,
    queue, since, until, error)."""
    states = query.getall("state", []) if isinstance(query, MultiDict | MultiDictProxy) else [query.get("state", "")]
    return Search(
        job_id=query.get("job") or None,
        job_name=(query.get("job_name") or "").strip() or None,
        states=tuple(s for s in states if s),
        handler=query.get("handler") or None,
        queue=query.get("queue") or None,
        since=instant(query["since"], "since") if query.get("since") else None,
        until=instant(query["until"], "until") if query.get("until") else None,
        error=(query.get("error") or "").strip() or None,
    )


def describe(search: Search) -> str:
    """A filter in words, for the confirmation ("job name contains 'x', state queued")."""
    parts = []
    if search.job_id:
        parts.append(f"job {search.job_id}")
    if search.job_name:
        parts.append(f"job name contains {search.job_name!r}")
    if search.states:
        parts.append("state " + " or ".join(search.states))
    if search.handler:
        parts.append(f"handler {search.handler}")
    if search.queue:
        parts.append(f"queue {search.queue}")
    if search.since:
        parts.append(f"created from {search.since:%Y-%m-%d %H:%M:%S}")
    if search.until:
        parts.append(f"created before {search.until:%Y-%m-%d %H:%M:%S} UTC")
    if search.error:
        parts.append(f"error contains {search.error!r}")
    return ", ".join(parts) or "every execution"


def _filter_query(text: str) -> MultiDict[str]:
    return MultiDict((k, v) for k, v in parse_qsl(text, keep_blank_values=False) if k not in _NOT_FILTERS)


def _ids(form: MultiDictProxy[str | Any]) -> list[str]:
    return [value for value in form.getall("id", []) if isinstance(value, str) and value]


def _back_to(target: str, default: str) -> str:
    """A same-origin path to return to (anything else: `default`; the rule of `security.safe_next`)."""
    return security.safe_next(target, default)


@rpc(_V + "ExecutionService/BatchCancelExecutions")
async def executions_bulk(request: web.Request) -> web.StreamResponse:
    """Cancel, retry or requeue the runs of the selected executions, or of all the filter matches."""
    form = await request.post()
    try:
        action = ExecutionAction(str(form.get("action", "")))
    except ValueError:
        raise InvalidArgument("action", "must be cancel, retry or requeue") from None
    back = _back_to(str(form.get("back", "")), "/executions")
    scope = str(form.get("scope", "selected"))
    ids = _ids(form) if scope == "selected" else []
    query = _filter_query(str(form.get("filter", ""))) if scope == "filter" else MultiDict[str]()
    if scope == "filter" and action is ExecutionAction.REQUEUE:
        query["state"] = "dead"  # requeue is for dead runs: the filter says so
    if scope == "filter" and not query.get("until"):
        # Pinned to the count: what is created after the confirmation page is not part of it.
        query["until"] = datetime.now(UTC).isoformat()
    search = search_of(query) if scope == "filter" else None
    if scope == "selected" and not ids:
        raise InvalidArgument("ids", "select at least one execution (or act on everything the filter matches)")
    bulk = request.app[CONSOLE].api.control.bulk
    verb, done_word, question = _EXECUTION_VERBS[action]
    if form.get("confirm") != "1":
        counted = await bulk.executions(
            action, ids=ids, search=search, validate_only=True, reader=request[PRINCIPAL].role
        )
        what = f"{counted.matched} selected run{'s' if counted.matched != 1 else ''}"
        if search is not None:
            what = f"{counted.matched} execution{'s' if counted.matched != 1 else ''} matching {describe(search)}"
        return await render(
            request,
            "bulk_confirm.html",
            {
                "question": f"{question} {what}?",
                "count": counted.matched,
                "verb": verb,
                "target": "/executions/bulk",
                "fields": [
                    ("action", action.value),
                    ("scope", scope),
                    ("filter", urlencode(list(query.items()))),
                    ("back", back),
                    *(("id", i) for i in ids),
                ],
                "back": back,
            },
        )
    outcome = await bulk.executions(action, ids=ids, search=search, reader=request[PRINCIPAL].role)
    skipped = outcome.matched - len(outcome.done)
    note = f" ({skipped} left as they were)" if skipped > 0 else ""
    plural = "s" if len(outcome.done) != 1 else ""
    raise flash.redirect(request, back, f"{len(outcome.done)} run{plural} {done_word}{note}")


def job_filter_of(query: Mapping[str, str] | MultiDict[str]) -> JobFilter:
    """The jobs filter of the jobs page's query string (q, state, handler, queue)."""
    return JobFilter(
        name=(query.get("q") or "").strip() or None,
        state=query.get("state") or None,
        handler=query.get("handler") or None,
        queue=query.get("queue") or None,
    )


def _describe_jobs(selected: JobFilter) -> str:
    parts = []
    if selected.name:
        parts.append(f"name contains {selected.name!r}")
    if selected.state:
        parts.append(f"state {selected.state}")
    if selected.handler:
        parts.append(f"handler {selected.handler}")
    if selected.queue:
        parts.append(f"queue {selected.queue}")
    return ", ".join(parts) or "every job"


@rpc(_V + "JobService/BatchPauseJobs")
async def jobs_bulk(request: web.Request) -> web.StreamResponse:
    """Pause, resume or delete the selected jobs, or every job the filter matches."""
    form = await request.post()
    try:
        action = JobAction(str(form.get("action", "")))
    except ValueError:
        raise InvalidArgument("action", "must be pause, resume or delete") from None
    if action is JobAction.DELETE and not allows(request[PRINCIPAL], _V + "JobService/BatchDeleteJobs"):
        raise PermissionDenied(f"BatchDeleteJobs needs a higher role (you are {request[PRINCIPAL].role.value})")
    back = _back_to(str(form.get("back", "")), "/jobs")
    scope = str(form.get("scope", "selected"))
    ids = _ids(form) if scope == "selected" else []
    query = _filter_query(str(form.get("filter", ""))) if scope == "filter" else MultiDict[str]()
    search = job_filter_of(query) if scope == "filter" else None
    if scope == "selected" and not ids:
        raise InvalidArgument("ids", "select at least one job (or act on everything the filter matches)")
    bulk = request.app[CONSOLE].api.control.bulk
    verb, done_word = _JOB_VERBS[action]
    detach = form.get("detach_dependents") == "1"
    if form.get("confirm") != "1":
        counted = await bulk.jobs(action, ids=ids, search=search, validate_only=True)
        plural = "s" if counted.matched != 1 else ""
        what = f"the {counted.matched} selected job{plural}"
        if search is not None:
            what = f"{counted.matched} job{plural} matching {_describe_jobs(search)}"
        return await render(
            request,
            "bulk_confirm.html",
            {
                "question": f"{verb} {what}?" + (" Their history goes too." if action is JobAction.DELETE else ""),
                "count": counted.matched,
                "verb": verb,
                "target": "/jobs/bulk",
                "fields": [
                    ("action", action.value),
                    ("scope", scope),
                    ("filter", urlencode(list(query.items()))),
                    ("back", back),
                    ("detach_dependents", "1" if detach else ""),
                    *(("id", i) for i in ids),
                ],
                "back": back,
            },
        )
    outcome = await bulk.jobs(action, ids=ids, search=search, detach_dependents=detach)
    note = ""
    if outcome.kept:
        note = f"; {len(outcome.kept)} kept because other jobs depend on them"
    elif outcome.matched > len(outcome.done):
        note = f" ({outcome.matched - len(outcome.done)} already were)"
    plural = "s" if len(outcome.done) != 1 else ""
    raise flash.redirect(request, back, f"{len(outcome.done)} job{plural} {done_word}{note}")
