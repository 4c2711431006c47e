"""Time-series charts with axes, as shapes for server-rendered SVG (`_timecharts.html`).

A `TimeChart` has a plot area inside margins, x ticks (times) and y ticks (values, with a unit), and
either stacked bars (counts per bucket) or lines and dots (values over time). No script, no library:
the template writes `<rect>`, `<polyline>`, `<circle>` and `<text>` elements, autoescaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final

from scheduler_grpc.console.charts import STACKED, Bar
from scheduler_grpc.console.humane import duration
from scheduler_grpc.executions import Execution

WIDTH: Final = 720
HEIGHT: Final = 170
LEFT: Final = 56.0
RIGHT: Final = 8.0
TOP: Final = 8.0
BOTTOM: Final = 22.0
_TIME_STEPS: Final = (
    timedelta(seconds=10), timedelta(seconds=30), timedelta(minutes=1), timedelta(minutes=5),
    timedelta(minutes=10), timedelta(minutes=15), timedelta(minutes=30), timedelta(hours=1), timedelta(hours=3),
    timedelta(hours=6), timedelta(hours=12), timedelta(days=1), timedelta(days=7), timedelta(days=30),
)  # fmt: skip


@dataclass(frozen=True)
class Tick:
    at: float
    label: str


@dataclass(frozen=True)
class Line:
    points: str
    css: str
    title: str


@dataclass(frozen=True)
class Dot:
    x: float
    y: float
    css: str
    title: str


@dataclass
class TimeChart:
    """One chart: its size, plot area, ticks and shapes (empty when there is nothing to draw)."""

    label: str
    width: int = WIDTH
    height: int = HEIGHT
    left: float = LEFT
    top: float = TOP
    right: float = WIDTH - RIGHT
    bottom: float = HEIGHT - BOTTOM
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    dots: list[Dot] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.bars or self.lines or self.dots)


def nice_step(top: float, ticks: int = 4) -> float:
    """A round step (1, 2 or 5 times a power of ten) dividing [0, top] into about `ticks` parts."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return float(factor * power)
    return float(10 * power)


def _time_step(span: timedelta, ticks: int = 6) -> timedelta:
    for step in _TIME_STEPS:
        if span / step <= ticks:
            return step
    return _TIME_STEPS[-1]


def _x_ticks(chart: TimeChart, start: datetime, end: datetime) -> None:
    span = end - start
    step = _time_step(span)
    first = datetime.fromtimestamp(math.ceil(start.timestamp() / step.total_seconds()) * step.total_seconds(), UTC)
    label = "%m-%d" if step >= timedelta(days=1) else "%H:%M" if span <= timedelta(days=1) else "%m-%d %H:%M"
    moment = first
    while moment <= end:
        chart.x_ticks.append(Tick(_x(chart, moment, start, end), moment.strftime(label)))
        moment += step


def _x(chart: TimeChart, moment: datetime, start: datetime, end: datetime) -> float:
    span = (end - start).total_seconds() or 1.0
    return chart.left + (chart.right - chart.left) * (moment - start).total_seconds() / span


def _y_axis(chart: TimeChart, top: float, label: Callable[[float], str]) -> Callable[[float], float]:
    step = nice_step(top)
    ceiling = step * math.ceil(top / step) if top > 0 else step
    value = 0.0
    while value <= ceiling + step / 2:
        chart.y_ticks.append(Tick(chart.bottom - (chart.bottom - chart.top) * value / ceiling, label(value)))
        value += step
    return lambda v: chart.bottom - (chart.bottom - chart.top) * v / ceiling


def _count(value: float) -> str:
    return f"{value:g}"


def outcomes(
    rows: Sequence[tuple[datetime, str, int]], start: datetime, end: datetime, bucket: timedelta, label: str
) -> TimeChart:
    """Stacked bars of attempts finished per bucket and outcome."""
    chart = TimeChart(label)
    _x_ticks(chart, start, end)
    slots: dict[datetime, dict[str, int]] = {}
    for moment, status, count in rows:
        key = status if status in STACKED else "other"
        slot = slots.setdefault(moment, {})
        slot[key] = slot.get(key, 0) + count
    tallest = max((sum(slot.values()) for slot in slots.values()), default=0)
    if tallest == 0:
        return chart
    y = _y_axis(chart, float(tallest), _count)
    width = max((chart.right - chart.left) * bucket.total_seconds() / (end - start).total_seconds() - 1, 1.0)
    for moment, slot in sorted(slots.items()):
        x = _x(chart, moment, start, end)
        level = 0
        for status in (*STACKED, "other"):
            count = slot.get(status, 0)
            if count:
                bar_top = y(level + count)
                chart.bars.append(
                    Bar(x, bar_top, width, y(level) - bar_top, f"s-{status}", f"{moment:%H:%M} {status}: {count}")
                )
                level += count
    chart.legend = [(f"s-{s}", s) for s in STACKED]
    return chart


def lines(
    series: Sequence[tuple[str, str, Sequence[tuple[datetime, float]]]],
    start: datetime,
    end: datetime,
    label: str,
    *,
    seconds: bool = False,
) -> TimeChart:
    """One polyline per (name, css class, points); `seconds`: values are durations (the y labels say so)."""
    chart = TimeChart(label)
    _x_ticks(chart, start, end)
    tallest = max((value for _, _, points in series for _, value in points), default=0.0)
    if not any(points for _, _, points in series):
        return chart
    y = _y_axis(chart, tallest, duration if seconds else _count)
    for name, css, points in series:
        text = " ".join(f"{_x(chart, m, start, end):.1f},{y(v):.1f}" for m, v in points)
        chart.lines.append(Line(text, css, name))
        if len(points) <= 120:  # dots carry the exact value on hover; too many would be clutter
            chart.dots += [
                Dot(_x(chart, m, start, end), y(v), css, f"{m:%Y-%m-%d %H:%M} {name}: "
                    + (duration(v) if seconds else f"{v:g}"))
                for m, v in points
            ]  # fmt: skip
        chart.legend.append((css, name))
    return chart


def run_times(executions: Sequence[Execution], label: str = "run time per attempt") -> TimeChart:
    """The job page's run times: one dot per finished attempt at its start time, y its duration."""
    finished = [e for e in executions if e.started_at and e.finished_at]
    chart = TimeChart(label)
    if not finished:
        return chart
    starts = [e.started_at for e in finished if e.started_at]
    start, end = min(starts), max(starts)
    if end - start < timedelta(minutes=1):  # a single run (or a burst) still gets a readable axis
        start, end = start - timedelta(seconds=30), end + timedelta(seconds=30)
    _x_ticks(chart, start, end)
    values = [(e, (e.finished_at - e.started_at).total_seconds()) for e in finished if e.started_at and e.finished_at]
    y = _y_axis(chart, max(v for _, v in values), duration)
    ordered = sorted(values, key=lambda pair: pair[0].started_at or start)
    chart.lines.append(
        Line(
            " ".join(f"{_x(chart, e.started_at, start, end):.1f},{y(v):.1f}" for e, v in ordered if e.started_at),
            "run-line",
            label,
        )
    )
    chart.dots = [
        Dot(
            _x(chart, e.started_at, start, end),
            y(v),
            f"s-{e.status.value}",
            f"{e.started_at:%Y-%m-%d %H:%M:%S} attempt {e.attempt}: {duration(v)} ({e.status.value})",
        )
        for e, v in ordered
        if e.started_at
    ]
    return chart
