"""How the console writes times and durations, one way everywhere.

* A duration: `duration` ("340 ms", "4.2 s", "3 min 12 s", "2 h 5 min", "3 d 4 h").
* A moment in a list: `relative` ("3 min ago", "in 20 s"), as a `<time>` element whose title is the
  exact UTC time (shown on hover) and whose `datetime` attribute is machine-readable.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from markupsafe import Markup, escape


def duration(value: timedelta | float | None) -> str:
    """A duration (a timedelta or seconds) in the console's one format; "—" for None."""
    if value is None:
        return "—"
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 1:
        return f"{sign}{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{sign}{seconds:.2f} s"
    if seconds < 60:
        return f"{sign}{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        minutes, rest = divmod(whole, 60)
        return f"{sign}{minutes} min" + (f" {rest} s" if rest else "")
    if whole < 86400:
        hours, rest = divmod(whole, 3600)
        return f"{sign}{hours} h" + (f" {rest // 60} min" if rest // 60 else "")
    days, rest = divmod(whole, 86400)
    return f"{sign}{days} d" + (f" {rest // 3600} h" if rest // 3600 else "")


def _coarse(seconds: float) -> str:
    """A distance in time as people say it: the largest unit only ("3 min", "2 h", "5 d")."""
    if seconds < 1:
        return "now"
    if seconds < 60:
        return f"{int(seconds)} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} d"


def exact(moment: datetime | None) -> str:
    """The exact UTC time ("2026-05-01 09:00:00 UTC"); "—" for None."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "—"


def relative_text(moment: datetime, now: datetime) -> str:
    """ "3 min ago", "in 20 s", or "now"."""
    seconds = (now - moment).total_seconds()
    distance = _coarse(abs(seconds))
    if distance == "now":
        return "now"
    return f"{distance} ago" if seconds > 0 else f"in {distance}"


def relative(moment: datetime | None, now: datetime | None = None) -> Markup:
    """A `<time>` element: the relative time, the exact one on hover; "—" for None."""
    if moment is None:
        return Markup("—")
    text = relative_text(moment, now or datetime.now(UTC))
    iso = moment.astimezone(UTC).isoformat()
    return Markup('<time datetime="{}" title="{}">{}</time>').format(escape(iso), exact(moment), text)
