"""Cron schedules: validation traps, and DST behaviour under each policy."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.schedule import DstEffect, fire_times, instants, next_fire_time, parse_cron

NY = "America/New_York"


def take(expression: str, after: datetime, count: int, zone: str = NY, **policies: str) -> list[tuple[str, str]]:
    schedule = parse_cron(expression, zone, **policies)
    return [
        (fire.instant.strftime("%m-%d %H:%M"), fire.dst.value)
        for fire in itertools.islice(fire_times(schedule, after), count)
    ]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "must not be empty"),
        ("* * * *", "got 4"),
        ("0 0 0 1 1 * 2030", "got 7"),
        ("0 0 31 2 *", "never fires"),
        ("61 * * * *", "invalid cron"),
        ("* * * * * * ;rm", "got 7"),
        ("@sometimes", "unknown alias"),
        ("*" * 201, "at most 200"),
    ],
)
def test_invalid_expressions_are_refused_naming_the_field(expression: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        parse_cron(expression)
    assert caught.value.field == "cron"


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "../../etc/passwd", "UTC+5"])
def test_unknown_time_zone_names_the_field(zone: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_cron("* * * * *", zone)
    assert caught.value.field == "time_zone"


def test_policies_are_validated() -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_cron("* * * * *", "UTC", gap_policy="sometimes")
    assert caught.value.field == "dst_gap_policy"
    with pytest.raises(InvalidArgument) as caught:
        parse_cron("* * * * *", "UTC", fold_policy="twice")
    assert caught.value.field == "dst_fold_policy"


def test_six_fields_means_seconds_first() -> None:
    schedule = parse_cron("*/15 * * * * *", "UTC")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    fires = [fire.instant for fire in itertools.islice(fire_times(schedule, start), 3)]
    assert fires == [start + timedelta(seconds=15 * i) for i in (1, 2, 3)]


def test_fall_back_fires_once_by_default_although_croniter_fires_twice() -> None:
    after = datetime(2026, 10, 31, 12, tzinfo=UTC)
    assert take("30 1 * * *", after, 2) == [("11-01 05:30", "none"), ("11-02 06:30", "none")]
    # The trap this policy exists for: croniter alone fires both occurrences of 01:30.
    walker = croniter("30 1 * * *", after.astimezone(ZoneInfo(NY)))
    croniter_fires = {walker.get_next(datetime).astimezone(UTC) for _ in range(2)}
    assert len([t for t in croniter_fires if t.date() == datetime(2026, 11, 1).date()]) == 2


def test_fall_back_both_fires_each_occurrence_in_order() -> None:
    after = datetime(2026, 11, 1, 5, 10, tzinfo=UTC)  # 01:10 EDT, first pass of the repeated hour
    assert take("*/20 1-2 * * *", after, 6, fold_policy="both") == [
        ("11-01 05:20", "none"),
        ("11-01 05:40", "none"),
        ("11-01 06:00", "repeated"),
        ("11-01 06:20", "repeated"),
        ("11-01 06:40", "repeated"),
        ("11-01 07:00", "none"),
    ]


def test_fall_back_both_from_inside_the_second_pass() -> None:
    after = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)  # 01:10 EST, second pass
    assert take("*/20 1 * * *", after, 3, fold_policy="both")[:2] == [
        ("11-01 06:20", "repeated"),
        ("11-01 06:40", "repeated"),
    ]


def test_spring_forward_shift_collapses_skipped_slots_into_one_fire_at_the_gap_end() -> None:
    after = datetime(2026, 3, 8, 0, tzinfo=UTC)
    assert take("*/20 2 * * *", after, 2) == [("03-08 07:00", "shifted"), ("03-09 06:00", "none")]


def test_spring_forward_skip_drops_the_slot() -> None:
    after = datetime(2026, 3, 8, 0, tzinfo=UTC)
    assert take("30 2 * * *", after, 1, gap_policy="skip") == [("03-09 06:30", "none")]


def test_shifted_slot_and_the_real_slot_at_the_gap_end_fire_once() -> None:
    after = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)
    fires = take("0 2,3 * * *", after, 2)
    assert fires == [("03-08 07:00", "shifted"), ("03-09 06:00", "none")]


@settings(max_examples=60, deadline=None)
@given(
    start=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2035, 1, 1), timezones=st.just(UTC)),
    zone=st.sampled_from([NY, "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]),
    expression=st.sampled_from(["*/7 * * * *", "30 1 * * *", "0,30 0-3 * * *", "15 2 * * 0", "*/13 * * * * *"]),
    fold=st.sampled_from(["first", "both"]),
)
def test_fire_times_strictly_increase_and_first_fires_each_local_slot_once(
    start: datetime, zone: str, expression: str, fold: str
) -> None:
    schedule = parse_cron(expression, zone, fold_policy=fold)
    fires = list(itertools.islice(fire_times(schedule, start), 40))
    instants = [fire.instant for fire in fires]
    assert all(a < b for a, b in itertools.pairwise(instants))
    assert all(instant > start for instant in instants)
    if fold == "first":
        slots = [fire.local_slot for fire in fires if fire.dst is not DstEffect.SHIFTED]
        assert len(slots) == len(set(slots))
    if zone == "UTC":
        walker = croniter(expression, start, second_at_beginning=schedule.seconds)
        assert instants == [walker.get_next(datetime) for _ in range(40)]


@settings(max_examples=60, deadline=None)
@given(
    start=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2035, 1, 1), timezones=st.just(UTC)),
    zone=st.sampled_from([NY, "Europe/Berlin", "Australia/Lord_Howe", "UTC", "Etc/GMT-5"]),
    expression=st.sampled_from(
        ["*/7 * * * *", "30 1 * * *", "0,30 0-3 * * *", "* * * * * *", "*/15 * * * * *", "0 */2 * * *", "@hourly"]
    ),
    fold=st.sampled_from(["first", "both"]),
    gap=st.sampled_from(["shift", "skip"]),
)
def test_the_leaders_cached_and_arithmetic_next_slots_are_the_walked_fire_times(
    start: datetime, zone: str, expression: str, fold: str, gap: str
) -> None:
    # The leader plans with `instants` (arithmetic for fixed periods, one cached walk per slot
    # otherwise), previews with `fire_times`: they must agree slot for slot, DST nights included.
    schedule = parse_cron(expression, zone, fold_policy=fold, gap_policy=gap)
    walked = [fire.instant for fire in itertools.islice(fire_times(schedule, start), 30)]
    assert list(itertools.islice(instants(schedule, start), 30)) == walked
    assert list(itertools.islice(instants(schedule, start), 30)) == walked  # from the cache, too


@pytest.mark.parametrize(
    ("zone", "start"),
    [(NY, datetime(2026, 11, 1, 4, tzinfo=UTC)), (NY, datetime(2026, 3, 8, 5, tzinfo=UTC)),
     ("Europe/Berlin", datetime(2026, 10, 24, 23, tzinfo=UTC)),
     ("Australia/Lord_Howe", datetime(2026, 4, 4, 14, tzinfo=UTC))],
)  # fmt: skip
@pytest.mark.parametrize("expression", ["*/20 * * * *", "30 1 * * *", "*/30 * * * * *", "0,30 0-3 * * *"])
@pytest.mark.parametrize(("fold", "gap"), [("first", "shift"), ("both", "skip")])
def test_the_leaders_next_slots_agree_with_fire_times_across_dst_nights(
    zone: str, start: datetime, expression: str, fold: str, gap: str
) -> None:
    schedule = parse_cron(expression, zone, fold_policy=fold, gap_policy=gap)
    walked = [fire.instant for fire in itertools.islice(fire_times(schedule, start), 400)]
    assert list(itertools.islice(instants(schedule, start), 400)) == walked


def test_rare_schedules_find_their_next_slot() -> None:
    schedule = parse_cron("0 0 29 2 *", "UTC")
    fire = next_fire_time(schedule, datetime(2026, 1, 1, tzinfo=UTC))
    assert fire is not None
    assert fire.instant == datetime(2028, 2, 29, tzinfo=UTC)
