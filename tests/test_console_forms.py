"""The job form and the DAG layout as pure code: an unchanged form gives back the stored job exactly
(whatever the form cannot show losslessly), a changed field changes only itself, the schedule kind
follows what was filled, and a laid-out DAG draws every edge left to right without overlaps."""

from __future__ import annotations

import uuid
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_grpc.console import dag, forms
from scheduler_grpc.control_flows import NodeView
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.flows import Node, TriggerRule
from scheduler_grpc.jobs import ConcurrencyPolicy, Job, JobSpec, RetryPolicy, ScheduleKind

UPSTREAMS = {str(uuid.UUID(int=i + 1)): f"up-{i}" for i in range(3)}
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_micros = st.integers(1, 24 * 3600 * 10**6).map(lambda us: timedelta(microseconds=us))


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    kind = draw(st.sampled_from(ScheduleKind))
    upstreams = tuple(draw(st.lists(st.sampled_from(sorted(UPSTREAMS)), unique=True, max_size=3)))
    payload = draw(st.dictionaries(st.text(min_size=1, max_size=6), _json, max_size=4))
    if upstreams:
        payload["in"] = {"$from": f"{UPSTREAMS[upstreams[0]]}.result.rows"}
    initial = draw(_micros.filter(lambda d: d <= timedelta(hours=1)))
    return Job(
        id=str(uuid.uuid4()),
        name=draw(st.from_regex(r"[a-z][a-z0-9_.:-]{0,20}", fullmatch=True)),
        handler="test.echo",
        payload=payload,
        schedule_kind=kind,
        cron="*/7 * * * *" if kind is ScheduleKind.CRON else None,
        run_at=datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC) if kind is ScheduleKind.ONCE else None,
        time_zone=draw(st.sampled_from(["UTC", "Europe/Paris"])),
        priority=draw(st.integers(-1000, 1000)),
        retry=RetryPolicy(
            max_retries=draw(st.integers(0, 100)),
            initial_backoff=initial,
            max_backoff=initial + draw(_micros),
            jitter=draw(st.booleans()),
        ),
        timeout=draw(_micros),
        concurrency_policy=draw(st.sampled_from(ConcurrencyPolicy)),
        depends_on=upstreams,
        trigger_rule=draw(st.sampled_from(TriggerRule)),
    )


def _spec(job: Job) -> JobSpec:
    return JobSpec(**{f.name: getattr(job, f.name) for f in fields(JobSpec)})


def _submitted(job: Job) -> dict[str, str]:
    """What a browser submits of the edit form as shown (a textarea's line breaks as CRLF)."""
    shown = forms.form_values(job, UPSTREAMS)
    shown["payload"] = shown["payload"].replace("\n", "\r\n")
    return {key: value for key, value in shown.items() if not (key == "retry_policy.jitter" and value == "")}


@settings(max_examples=200, deadline=None)
@given(jobs())
def test_an_unchanged_form_gives_back_the_stored_job_exactly(job: Job) -> None:
    assert forms.changed_fields(job, _submitted(job), UPSTREAMS) == []
    assert forms.merged_spec(job, _submitted(job), UPSTREAMS) == _spec(job)


@settings(max_examples=100, deadline=None)
@given(jobs(), st.integers(-1000, 1000), st.sampled_from(TriggerRule))
def test_a_changed_field_changes_only_itself(job: Job, priority: int, rule: TriggerRule) -> None:
    form = {**_submitted(job), "priority": str(priority), "trigger_rule": rule.value}
    merged = forms.merged_spec(job, form, UPSTREAMS)
    assert merged == replace(_spec(job), priority=priority, trigger_rule=rule)


def test_changed_upstreams_are_taken_by_name_and_a_retry_field_alone() -> None:
    retry = RetryPolicy(initial_backoff=timedelta(microseconds=1500), max_backoff=timedelta(seconds=3))
    job = Job(id="j", name="load", handler="test.echo", depends_on=(sorted(UPSTREAMS)[0],), retry=retry)
    form = {**_submitted(job), "depends_on": "up-1,\r\nup-2", "retry_policy.max_retries": "9"}
    merged = forms.merged_spec(job, form, UPSTREAMS)
    assert merged.depends_on == ("up-1", "up-2")
    assert merged.retry == replace(job.retry, max_retries=9)  # the 1.5 ms backoff kept exactly


@pytest.mark.parametrize(
    ("form", "kind"),
    [({"cron": "* * * * *"}, ScheduleKind.CRON), ({"run_at": "2031-01-01T00:00:00Z"}, ScheduleKind.ONCE),
     ({}, ScheduleKind.MANUAL), ({"schedule_kind": "auto", "cron": " 0 9 * * * "}, ScheduleKind.CRON)],
)  # fmt: skip
def test_under_auto_the_kind_follows_what_was_filled(form: dict[str, str], kind: ScheduleKind) -> None:
    assert forms.job_spec({"name": "x", "handler": "h", **form}).schedule_kind is kind


@pytest.mark.parametrize(
    ("form", "field"),
    [({"schedule_kind": "manual", "cron": "* * * * *"}, "cron"),
     ({"schedule_kind": "manual", "run_at": "2031-01-01T00:00:00Z"}, "run_at"),
     ({"schedule_kind": "cron", "cron": "* * * * *", "run_at": "2031-01-01T00:00:00Z"}, "run_at"),
     ({"cron": "* * * * *", "run_at": "2031-01-01T00:00:00Z"}, "schedule_kind")],
)  # fmt: skip
def test_a_filled_field_the_kind_cannot_use_is_refused_on_it(form: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        forms.job_spec({"name": "x", "handler": "h", **form})
    assert refused.value.field == field


@st.composite
def dags(draw: st.DrawFn) -> list[NodeView]:
    size = draw(st.integers(1, 40))
    ids = [str(uuid.UUID(int=i + 1)) for i in range(size)]
    views = []
    for index, job in enumerate(ids):
        ups = tuple(draw(st.lists(st.sampled_from(ids[:index]), unique=True, max_size=3))) if index else ()
        node = Node(job, f"job-{index}", ups, TriggerRule.ALL_SUCCEEDED, status=draw(st.sampled_from([None, "dead"])))
        views.append(NodeView(node, 1, None, None, ""))
    return views


@settings(max_examples=200, deadline=None)
@given(dags())
def test_a_laid_out_dag_points_every_edge_forward_without_overlaps(views: list[NodeView]) -> None:
    graph = dag.layout(views, datetime.now(UTC))
    boxes = {box.job_id: box for box in graph.boxes}
    assert len(boxes) == len(views)
    for view in views:
        for up in view.node.upstream_ids:
            assert boxes[up].x + graph.node_width < boxes[view.node.job_id].x
    places = [(box.x, box.y) for box in graph.boxes]
    assert len(set(places)) == len(places)
    assert all(
        box.x + graph.node_width <= graph.width and box.y + graph.node_height <= graph.height for box in boxes.values()
    )
    assert len(graph.edges) == sum(len(view.node.upstream_ids) for view in views)
    assert str(dag.svg(graph, lambda s: f"{s}s")).count('class="node ') == len(views)
