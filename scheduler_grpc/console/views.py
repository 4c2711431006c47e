"""The console's pages and actions.

Each handler is marked with the RPC it corresponds to (`security.rpc`): the middleware in `app`
refuses it to a role the API's table would refuse that RPC to. Actions call the same `Control`,
`Authenticator` and `ClusterView` methods as the servicers, so the rules are the API's.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from urllib.parse import urlencode

import orjson
from aiohttp import web

from scheduler_grpc import redaction, statuses
from scheduler_grpc.auth import ResourceExhausted, Role, Unauthenticated
from scheduler_grpc.console import charts, forms, live, search, security, sse, timecharts
from scheduler_grpc.console.context import CONSOLE, Console, render
from scheduler_grpc.console.security import (
    PRINCIPAL,
    clear_session_cookie,
    rpc,
    set_session_cookie,
    visible,
)
from scheduler_grpc.control import preview_fire_times
from scheduler_grpc.errors import InvalidArgument, NotFound
from scheduler_grpc.events import EventFilter, ExecutionEvent
from scheduler_grpc.executions import Execution, ExecutionStatus
from scheduler_grpc.jobs import JobStatus
from scheduler_grpc.schedule import parse_cron

PAGE_SIZE: Final = 50
PREVIEW_COUNT: Final = 10
SLOTS_SHOWN: Final = 60
_V: Final = "/scheduler.v1."


def _uuid(value: str, field: str = "id") -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidArgument(field, "must be a UUID") from None


def _status(exc: Exception) -> int:
    """The HTTP status of an error the page answers itself (the API's mapping, `statuses`)."""
    return statuses.HTTP_STATUS[statuses.status_of(exc)[0]]


def _console(request: web.Request) -> Console:
    return request.app[CONSOLE]


async def _form(request: web.Request) -> dict[str, str]:
    data = await request.post()
    return {key: value for key, value in data.items() if isinstance(value, str)}


def _back(request: web.Request, default: str) -> web.HTTPSeeOther:
    """A redirect to the page the action came from (same origin only), else `default`."""
    return web.HTTPSeeOther(security.safe_next(request.query.get("next", ""), default))


# -- login / logout ------------------------------------------------------------------------------


async def _login_form(request: web.Request, error: str | None, username: str, status: int = 200) -> web.Response:
    """The login form, with the browser's pre-session token (in a cookie and in the form)."""
    token = security.login_token(request)
    response = await render(
        request, "login.html", {"error": error, "username": username, "login_token": token}, status=status
    )
    security.set_login_cookie(response, token, secure=_console(request).secure)
    return response


async def login_page(request: web.Request) -> web.StreamResponse:
    return await _login_form(request, None, "")


async def login(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    form = await _form(request)
    username = form.get("username", "")
    if not security.login_token_ok(request, form.get(security.LOGIN_FIELD)):
        # Login CSRF: only a form this console served to this browser logs it in.
        return await _login_form(
            request, "the login form expired or did not come from this console; log in again", username, 403
        )
    remote = request.remote or "unknown"
    # The same peer spelling gRPC uses, so the same address is throttled the same way on both.
    peer = f"ipv6:[{remote}]:0" if ":" in remote else f"ipv4:{remote}:0"
    try:
        session = await console.api.auth.login(username, form.get("password", ""), peer)
    except (Unauthenticated, ResourceExhausted, InvalidArgument) as exc:
        if isinstance(exc, Unauthenticated):
            console.api.metrics.login_failed()
        return await _login_form(request, str(exc), username, _status(exc))
    response = web.Response(status=303, headers={"Location": "/"})
    max_age = max(1, int((session.expire_time - datetime.now(UTC)).total_seconds()))
    set_session_cookie(response, session.token, secure=console.secure, max_age=max_age)
    return response


@rpc(_V + "AuthService/Logout")
async def logout(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    await console.api.auth.logout(request[PRINCIPAL])
    response = web.Response(status=303, headers={"Location": "/login"})
    clear_session_cookie(response, secure=console.secure)
    return response


# -- overview ------------------------------------------------------------------------------------


async def _stores_down_safe(coro: Any) -> Any:
    """The value of `coro`, or None if a store failed (the page shows the outage, not zeros)."""
    try:
        return await coro
    except Exception as exc:
        if statuses.status_of(exc)[0] is not statuses.Code.UNAVAILABLE:
            raise  # a bug is a bug: a 500 with its traceback logged, not an "unknown" figure
        return None


@rpc(_V + "ClusterService/GetSchedulerStatus")
async def overview(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    api = console.api
    now = datetime.now(UTC)
    leader, electors, workers, stats, queues = await asyncio.gather(
        _stores_down_safe(api.cluster.leader()),
        _stores_down_safe(api.cluster.electors()),
        _stores_down_safe(api.cluster.workers()),
        _stores_down_safe(api.control.overview(now)),
        _stores_down_safe(api.control.handlers_and_queues()),
    )
    if stats is not None:  # the failures' errors as the caller may read them
        role = request[PRINCIPAL].role
        failures = [replace(row, execution=redaction.execution_for(role, row.execution)) for row in stats.failures]
        stats = replace(stats, failures=failures)
    names = sorted({"default", *(queues[1] if queues else [])})
    stats_of = await asyncio.gather(*(_stores_down_safe(api.control.queue_stats(name)) for name in names))
    depths = list(zip(names, stats_of, strict=True))
    bars, tallest = charts.per_minute(stats.per_minute if stats else [], now)
    breakers = [
        (worker.id, key, state)
        for worker in workers or []
        for key, state in sorted(worker.breakers.items())
        if state != "closed"
    ]
    return await render(
        request,
        "overview.html",
        {
            "leader": leader,
            # Electors are the leader and its standbys (each subscribed to the release channel).
            "standbys": None if electors is None or leader is None else max(0, electors - (1 if leader.holder else 0)),
            "workers": workers,
            "stats": stats,
            "depths": depths,
            "bars": bars,
            "tallest": tallest,
            "breakers": breakers,
            "chart": {"width": charts.WIDTH, "height": charts.HEIGHT},
        },
    )


# -- jobs ----------------------------------------------------------------------------------------


@rpc(_V + "JobService/ListJobs")
async def jobs(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    query = request.query
    status = query.get("state") or None
    if status is not None and status not in (JobStatus.ACTIVE.value, JobStatus.PAUSED.value):
        raise InvalidArgument("state", "must be active or paused")
    rows = await console.api.control.search_jobs(
        search=query.get("q") or None,
        status=status,
        handler=query.get("handler") or None,
        queue=query.get("queue") or None,
        after=query.get("after") or None,
        limit=PAGE_SIZE + 1,
    )
    handlers, queues = await console.api.control.handlers_and_queues()
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    next_query = None
    if more:
        next_query = {**{k: v for k, v in query.items() if k != "after"}, "after": rows[-1].job.name}
    return await render(
        request,
        "jobs.html",
        {
            "rows": rows,
            "handlers": handlers,
            "queues": queues,
            "query": query,
            "next_query": next_query,
            "filter_query": urlencode([(k, v) for k, v in query.items() if k != "after" and v]),
        },
    )


@dataclass(frozen=True)
class RemoteHandler:
    """A handler live remote workers serve (their heartbeats), for the job form's choices.

    Attributes:
        name: The handler's name, as a job names it.
        queues: The queues those workers take runs from (a job of it must be on one of them).
        workers: How many live remote workers serve it.
    """

    name: str
    queues: tuple[str, ...]
    workers: int


@dataclass(frozen=True)
class HandlerChoices:
    """What the job form offers for its handler: this server's enabled handlers (name and
    description) and the handlers live remote workers serve (None: unknown, Redis did not answer).
    The field stays free text: a job may name a remote handler no worker serves yet."""

    builtin: list[tuple[str, str]]
    remote: list[RemoteHandler] | None

    @property
    def queues(self) -> list[str]:
        """The queues remote workers serve now (the queue field's suggestions)."""
        return sorted({queue for handler in self.remote or [] for queue in handler.queues})


async def _handler_choices(console: Console) -> HandlerChoices:
    builtin = [
        (str(entry["name"]), str(entry.get("description") or ""))
        for entry in console.api.handlers.describe()
        if entry.get("enabled")
    ]
    workers = await _stores_down_safe(console.api.cluster.workers())
    if workers is None:
        return HandlerChoices(builtin, None)
    served: dict[str, list[str]] = {}
    for worker in workers:
        if worker.remote:
            for name in worker.handlers:
                served.setdefault(name, []).append(worker.queue)
    remote = [
        RemoteHandler(name, tuple(sorted(set(queues))), len(queues))
        for name, queues in sorted(served.items())
        if name not in console.api.handlers  # a hello naming a built-in handler is refused anyway
    ]
    return HandlerChoices(builtin, remote)


def _field_errors(exc: InvalidArgument) -> dict[str, str]:
    """The form field an error belongs to: its own, or the form field it is part of (a handler's
    payload field errors go on the payload box, `depends_on[2]` on the upstreams), named in the
    message. An error of no form field keeps its name: the form's summary shows every error."""
    if exc.field in forms.FIELDS:
        return {exc.field: exc.message}
    for field in forms.FIELDS:
        if exc.field.startswith((f"{field}.", f"{field}[")):
            return {field: f"{exc.field}: {exc.message}"}
    return {exc.field: exc.message}


async def _job_form(
    request: web.Request, job_id: str | None, values: dict[str, str], errors: dict[str, str], status: int = 200
) -> web.StreamResponse:
    console = _console(request)
    choices = await _handler_choices(console)
    in_process_queue = console.api.control.in_process_queue
    return await render(
        request,
        "job_form.html",
        {
            "job_id": job_id,
            "values": values,
            "errors": errors,
            "choices": forms.CHOICES,
            # Suggestions only: the handler field is free text, so a job's own handler (disabled
            # here, or a remote one nobody serves now) is shown as it is and never switched.
            "handler_choices": choices,
            "in_process_queue": in_process_queue,
            "queue_choices": sorted({*([in_process_queue] if in_process_queue else []), *choices.queues}),
            "version": values.get("version", ""),
        },
        status=status,
    )


@rpc(_V + "JobService/CreateJob")
async def new_job(request: web.Request) -> web.StreamResponse:
    return await _job_form(request, None, forms.form_values(None), {})


@rpc(_V + "JobService/CreateJob")
async def create_job(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    form = await _form(request)
    try:
        spec = forms.job_spec(form)
        job = await console.api.control.create_job(spec, request_id=form.get("request_id") or None)
    except InvalidArgument as exc:
        return await _job_form(request, None, form, _field_errors(exc), status=_status(exc))
    raise web.HTTPSeeOther(f"/jobs/{job.id}")


@rpc(_V + "JobService/UpdateJob")
async def edit_job(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    job = await console.api.control.get_job(_uuid(request.match_info["id"]))
    values = forms.form_values(job, await console.api.control.flow_reads.job_names(job.depends_on))
    values["version"] = str(job.version)
    return await _job_form(request, job.id, values, {})


@rpc(_V + "JobService/UpdateJob")
async def update_job(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    control = console.api.control
    job_id = _uuid(request.match_info["id"])
    form = await _form(request)
    version = form.get("version", "")
    try:
        current = await control.get_job(job_id)
        names = await control.flow_reads.job_names(current.depends_on)
        # Only the fields the form changed (compared with what it showed) replace stored values;
        # the version the form was read at keeps an edit made meanwhile from being overwritten.
        await control.merge_job(
            job_id,
            lambda job: forms.merged_spec(job, form, names),
            expected_version=int(version) if version.isdigit() else None,
        )
    except InvalidArgument as exc:
        return await _job_form(request, job_id, form, _field_errors(exc), status=_status(exc))
    raise web.HTTPSeeOther(f"/jobs/{job_id}")


@rpc(_V + "JobService/GetJob")
async def job_detail(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    role = request[PRINCIPAL].role
    job = redaction.job_for(role, await console.api.control.get_job(_uuid(request.match_info["id"])))
    slots = await console.api.control.job_slots(job.id, SLOTS_SHOWN)
    finished = [
        e for e in slots if e.status.finished and e.status not in (ExecutionStatus.SKIPPED, ExecutionStatus.MISSED)
    ]
    succeeded = sum(1 for e in finished if e.status is ExecutionStatus.SUCCEEDED)
    rate = (100.0 * succeeded / len(finished)) if finished else None
    duration_bars, longest = charts.durations(slots)
    upstreams, downstreams = await console.api.control.flow_reads.job_relations(job.id)
    (served,) = await console.api.handlers_served([job])
    return await render(
        request,
        "job_detail.html",
        {
            "job": job,
            "handler_served": served,
            "upstreams": upstreams,
            "downstreams": downstreams,
            "payload": orjson.dumps(job.payload, option=orjson.OPT_INDENT_2).decode(),
            "slots": slots,
            "timeline": charts.timeline(slots),
            "rate": rate,
            "duration_bars": duration_bars,
            "run_times": timecharts.run_times(slots),
            "longest": longest,
            "chart": {"width": charts.WIDTH, "height": charts.HEIGHT},
        },
    )


@rpc(_V + "JobService/PauseJob")
async def pause_job(request: web.Request) -> web.StreamResponse:
    job_id = _uuid(request.match_info["id"])
    await _console(request).api.control.pause_job(job_id)
    raise _back(request, f"/jobs/{job_id}")


@rpc(_V + "JobService/ResumeJob")
async def resume_job(request: web.Request) -> web.StreamResponse:
    job_id = _uuid(request.match_info["id"])
    await _console(request).api.control.resume_job(job_id)
    raise _back(request, f"/jobs/{job_id}")


@rpc(_V + "JobService/TriggerJob")
async def trigger_job(request: web.Request) -> web.StreamResponse:
    job_id = _uuid(request.match_info["id"])
    form = await _form(request)
    await _console(request).api.control.trigger_execution(job_id, request_id=form.get("request_id") or None)
    raise web.HTTPSeeOther(f"/executions?job={job_id}")


@rpc(_V + "JobService/DeleteJob")
async def delete_job(request: web.Request) -> web.StreamResponse:
    await _console(request).api.control.delete_job(_uuid(request.match_info["id"]))
    raise web.HTTPSeeOther("/jobs")


def _instant(value: str, field: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidArgument(field, "must be an ISO 8601 time such as 2030-01-01T09:00:00Z") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@rpc(_V + "JobService/BackfillJob")
async def backfill_job(request: web.Request) -> web.StreamResponse:
    job_id = _uuid(request.match_info["id"])
    form = await _form(request)
    start = _instant(form.get("start_time", ""), "start_time")
    end = _instant(form.get("end_time", ""), "end_time")
    await _console(request).api.control.backfill_range(job_id, start, end)
    raise web.HTTPSeeOther(f"/executions?job={job_id}")


@rpc(_V + "JobService/PreviewSchedule")
async def preview(request: web.Request) -> web.StreamResponse:
    """JSON: the next fire times of the cron expression being typed (the same code as PreviewSchedule)."""
    query = request.query
    try:
        schedule = parse_cron(
            query.get("cron", ""),
            query.get("time_zone") or "UTC",
            query.get("dst_gap_policy") or "shift",
            query.get("dst_fold_policy") or "first",
        )
        fires = await preview_fire_times(schedule, datetime.now(UTC), PREVIEW_COUNT)
    except InvalidArgument as exc:
        return web.json_response({"field": exc.field, "error": exc.message}, status=_status(exc))
    return web.json_response(
        {
            "fire_times": [
                {"instant": fire.instant.isoformat(), "local": fire.local_slot.isoformat(), "dst": fire.dst.value}
                for fire in fires
            ]
        }
    )


# -- executions ----------------------------------------------------------------------------------


@rpc(_V + "ExecutionService/ListExecutions")
async def executions(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    query = request.query
    job_id = await console.api.control.flow_reads.resolve_job(query["job"]) if query.get("job") else None
    states = [s for s in query.getall("state", []) if s]
    for state in states:
        if state not in ExecutionStatus.__members__.values():
            raise InvalidArgument("state", f"unknown state {state!r}")
    since = _instant(query["since"], "since") if query.get("since") else None
    until = _instant(query["until"], "until") if query.get("until") else None
    before = None
    if query.get("before"):
        time_text, _, before_id = query["before"].partition("_")
        before = (_instant(time_text, "before"), _uuid(before_id, "before"))
    # Where the live stream starts: the fan-out's position before the list is read, so no event
    # between the read and the subscription is lost (the page applies each one it already shows).
    cursor = console.api.fanout.position
    job_ids, error = await search.execution_extras(console, query)
    rows = await console.api.control.search_executions(
        job_ids=job_ids,
        error=error,
        job_id=job_id,
        statuses=states,
        handler=query.get("handler") or None,
        since=since,
        until=until,
        before=before,
        limit=PAGE_SIZE + 1,
    )
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    next_query = None
    if more:
        last = rows[-1].execution
        next_query = {
            **{k: v for k, v in query.items() if k != "before"},
            "before": f"{last.created_at.isoformat()}_{last.id}",
        }
    if error is not None:  # paged by what the store found; shown by what the caller may read
        role = request[PRINCIPAL].role
        rows = [row for row in rows if redaction.error_matches(role, row.execution.error or "", error)]
    handlers, _ = await console.api.control.handlers_and_queues()
    return await render(
        request,
        "executions.html",
        {
            "rows": rows,
            # A queued run due later (fired ahead of its slot, a retry's backoff) says when it is due.
            "now": datetime.now(UTC),
            "query": query,
            "states": [s.value for s in ExecutionStatus],
            "selected_states": states,
            "handlers": handlers,
            "next_query": next_query,
            "live": before is None and until is None and job_ids is None and error is None,
            "cursor": cursor if cursor != "0-0" else "",
            "job_id": job_id or "",
            "filter_query": urlencode([(k, v) for k, v in query.items() if k != "before" and v]),
        },
    )


@rpc(_V + "ExecutionService/GetExecution")
async def execution_detail(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    role = request[PRINCIPAL].role
    execution = redaction.execution_for(role, await console.api.control.get_execution(_uuid(request.match_info["id"])))
    attempts = [
        redaction.execution_for(role, attempt) for attempt in await console.api.control.run_attempts(execution.run_id)
    ]
    job = None
    with contextlib.suppress(NotFound):  # deleted meanwhile (its history goes with it)
        job = await console.api.control.get_job(execution.job_id)
    return await render(
        request,
        "execution.html",
        {
            "execution": execution,
            "attempts": attempts,
            "job": job,
            "flow_run_id": execution.flow_run_id,
            "result": lambda e: (
                orjson.dumps(e.result, option=orjson.OPT_INDENT_2).decode() if e.result is not None else ""
            ),
        },
    )


def _result_text(execution: Execution) -> str:
    if execution.result is None:
        return ""
    return orjson.dumps(execution.result, option=orjson.OPT_INDENT_2).decode()


@rpc(_V + "ExecutionService/CancelExecution")
async def cancel_execution(request: web.Request) -> web.StreamResponse:
    execution_id = _uuid(request.match_info["id"])
    await _console(request).api.control.cancel_execution(execution_id)
    raise web.HTTPSeeOther(f"/executions/{execution_id}")


@rpc(_V + "ExecutionService/WatchExecutions")
async def events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: execution events from the shared fan-out (WatchExecutions' source), each
    a JSON row for the executions page (`sse.relay`)."""
    job = request.query.get("job")
    event_filter = EventFilter(
        job_ids=frozenset({_uuid(job, "job")}) if job else frozenset(), handler=request.query.get("handler", "")
    )
    labels = request.app[live.LABELS]
    role = request[PRINCIPAL].role

    async def encode(event: ExecutionEvent) -> bytes:
        # A row shows the job's name and the trigger, not an id fragment (live.Labels).
        label = await labels.of(event.execution_id)
        return orjson.dumps(
            {
                "type": event.type.value,
                "execution_id": event.execution_id,
                "run_id": event.run_id,
                "job_id": event.job_id,
                "job_name": visible(label.job_name) if label else "",
                "trigger": label.trigger if label else "",
                "attempt": event.attempt,
                # Shown by the page as text: bidi controls made visible here too; credentials in
                # an error redacted as on every page.
                "handler": visible(event.handler),
                "worker_id": visible(event.worker_id),
                "error": visible(redaction.error_for(role, event.error)),
                "time": event.time.isoformat() if event.time else "",
            }
        )

    return await sse.relay(request, event_filter, encode)


# -- workers, dead letters, API keys -------------------------------------------------------------


@rpc(_V + "ClusterService/ListWorkers")
async def workers(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    found = await console.api.cluster.workers()
    now = datetime.now(UTC)
    return await render(request, "workers.html", {"workers": found, "now": now})


def _dead_selection(form: Any) -> tuple[str, list[str] | None]:
    queue = form.get("queue") or "default"
    if form.get("all") == "1":
        return queue, None
    ids = [_uuid(value, "run_ids") for value in form.getall("run_id", []) if isinstance(value, str)]
    if not ids:
        raise InvalidArgument("run_ids", "select at least one dead letter (or use the 'all' button)")
    return queue, ids


@rpc(_V + "QueueService/RequeueDeadLetters")
async def requeue_dead(request: web.Request) -> web.StreamResponse:
    queue, ids = _dead_selection(await request.post())
    runs = await _console(request).api.control.requeue_dead_runs(queue, ids)
    raise web.HTTPSeeOther(f"/dead-letters?queue={queue}&done=requeued+{len(runs)}")


@rpc(_V + "QueueService/PurgeDeadLetters")
async def purge_dead(request: web.Request) -> web.StreamResponse:
    queue, ids = _dead_selection(await request.post())
    purged = await _console(request).api.control.purge_dead_runs(queue, ids)
    raise web.HTTPSeeOther(f"/dead-letters?queue={queue}&done=purged+{len(purged)}")


@rpc(_V + "AuthService/ListApiKeys")
async def api_keys(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    page = await console.api.auth.list_api_keys(100, request.query.get("token", ""))
    return await render(request, "api_keys.html", {"page": page, "created": None, "roles": [r.value for r in Role]})


@rpc(_V + "AuthService/CreateApiKey")
async def create_api_key(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    form = await _form(request)
    try:
        role = Role(form.get("role", ""))
    except ValueError:
        raise InvalidArgument("role", "must be viewer, operator or admin") from None
    expires = None
    if form.get("expires_in", "").strip():
        try:
            expires = datetime.now(UTC) + timedelta(days=float(form["expires_in"]))
        except (ValueError, OverflowError):
            raise InvalidArgument("expire_time", "give a number of days") from None
    created = await console.api.auth.create_api_key(request[PRINCIPAL], form.get("display_name", ""), role, expires)
    page = await console.api.auth.list_api_keys(100, "")
    # The secret is in this response only (it is stored hashed): shown once, never again.
    return await render(request, "api_keys.html", {"page": page, "created": created, "roles": [r.value for r in Role]})


@rpc(_V + "AuthService/RevokeApiKey")
async def revoke_api_key(request: web.Request) -> web.StreamResponse:
    await _console(request).api.auth.revoke_api_key(_uuid(request.match_info["id"]))
    raise web.HTTPSeeOther("/api-keys")
