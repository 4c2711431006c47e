"""Charts as data for inline SVG in the templates (no chart library, no script, nothing to vendor).

Each function returns plain shapes (rectangles with a class and a tooltip); the templates write them
out as `<rect>` elements, autoescaped like every other value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler_grpc.executions import Execution

WIDTH = 720
HEIGHT = 120
# Stacking order (bottom first) of the per-minute chart; other statuses are drawn as "other".
STACKED = ("succeeded", "failed", "timed_out", "dead", "cancelled")


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


def per_minute(rows: Sequence[tuple[datetime, str, int]], now: datetime, minutes: int = 60) -> tuple[list[Bar], int]:
    """Stacked bars of attempts finished per minute by status over the last `minutes`; and the tallest total."""
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
    counts: dict[int, dict[str, int]] = {}
    for minute, status, count in rows:
        index = int((minute - start).total_seconds() // 60)
        if 0 <= index < minutes:
            key = status if status in STACKED else "other"
            slot = counts.setdefault(index, {})
            slot[key] = slot.get(key, 0) + count
    tallest = max((sum(slot.values()) for slot in counts.values()), default=0)
    bars: list[Bar] = []
    if tallest == 0:
        return bars, 0
    step = WIDTH / minutes
    for index, slot in sorted(counts.items()):
        y = float(HEIGHT)
        for status in (*STACKED, "other"):
            count = slot.get(status, 0)
            if not count:
                continue
            height = HEIGHT * count / tallest
            y -= height
            label = (start + timedelta(minutes=index)).strftime("%H:%M")
            bars.append(Bar(index * step + 1, y, step - 2, height, f"s-{status}", f"{label} {status}: {count}"))
    return bars, tallest


def timeline(executions: Sequence[Execution]) -> list[Bar]:
    """One square per attempt, oldest on the left, coloured by status (the job page's slot timeline)."""
    size = 14.0
    ordered = list(reversed(executions))
    return [
        Bar(
            i * (size + 2),
            0,
            size,
            size,
            f"s-{e.status.value}",
            f"{e.scheduled_for:%Y-%m-%d %H:%M:%S} attempt {e.attempt} ({e.trigger.value}): {e.status.value}",
        )
        for i, e in enumerate(ordered)
    ]


def durations(executions: Sequence[Execution]) -> tuple[list[Bar], float]:
    """Bars of run time per finished attempt, oldest on the left; and the longest, in seconds."""
    finished = [e for e in reversed(executions) if e.started_at and e.finished_at]
    seconds = [(e, (e.finished_at - e.started_at).total_seconds()) for e in finished if e.finished_at and e.started_at]
    longest = max((s for _, s in seconds), default=0.0)
    if longest <= 0:
        return [], 0.0
    step = WIDTH / max(len(seconds), 1)
    return [
        Bar(
            i * step + 1,
            HEIGHT - HEIGHT * s / longest,
            max(step - 2, 1),
            HEIGHT * s / longest,
            f"s-{e.status.value}",
            f"{e.scheduled_for:%Y-%m-%d %H:%M:%S}: {s:.3f}s",
        )
        for i, (e, s) in enumerate(seconds)
    ], longest
