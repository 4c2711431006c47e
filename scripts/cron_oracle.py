"""Regenerate tests/data/cron_oracle.json: cron fire times on which two independent implementations agree.

The oracles are Python's `cronsim` (Debian/Vixie cron's reading) and Node's `cron-parser`; neither is a
dependency of the project. For every expression, zone and start (the first of January 2026, and two
hours before each daylight-saving transition of 2026-2027 in the zone), both compute the next
`COUNT` fire times; a case enters the fixture only if they agree on every one of them, and the
cases they disagree on are counted in the fixture's `disagreements` (by expression and zone, or the oracle refusing it).
tests/test_cron_oracle.py checks that `scheduler_grpc.schedule` reproduces every fire time.

Run it (about a minute):

    pip install cronsim                                   # into any venv, not the project's deps
    npm install --prefix /tmp/cronoracle cron-parser@5    # outside the repository
    NODE_PATH=/tmp/cronoracle/node_modules python scripts/cron_oracle.py

Generated with cronsim 2.8 and cron-parser 5.10.6. Fire times are stored compactly: the start and
the fires as seconds since the epoch, the fires as differences from the previous one, a run of
equal differences as [difference, times].
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from cronsim import CronSim  # type: ignore[import-not-found, unused-ignore]

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "cron_oracle.json"
COUNT = 24
ZONES = ["UTC", "Asia/Kolkata", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
         "Pacific/Chatham", "America/Santiago"]  # fmt: skip
EXPRESSIONS = [
    # The reported cases: an equal range is its one value; the day of the week reaches 7 (Sunday).
    "0 3-3 * * *", "5-5 * * * *", "0 0 * * MON-MON", "0 0 * * 7/1", "0 0 * * 1/2", "0 0 * * 3/2",
    "0 0 * * 0/3", "0 0 10-10 * *", "0 0 1 MAR-MAR *", "0 2-2 * * *", "0 0 3-3 * * *", "5-5 * * * * *",
    "0 0 0 * * 7/1",
    # The day of the week: 0 and 7, names, ranges through 7, steps.
    "0 0 * * 7", "0 0 * * 0,7", "0 0 * * 5-7", "0 0 * * 1-7/3", "0 0 * * */2", "0 0 * * */7",
    "0 0 * * 0-7/2", "0 0 * * SUN-SAT", "0 0 * * MON,WED,FRI", "0 0 * * mon-fri", "0 6 * * SAT,SUN",
    # Ranges, lists and steps in the other fields.
    "0 9-17 * * 1-5", "*/20 2-3 * * *", "30 1-3 * * *", "0 0-6/2 * * *", "10-50/20 * * * *",
    "0 12 1-7 * *", "0 0 1 1-12/3 *", "0 0 1 JAN,JUL *", "0 8 * JUN-AUG MON-FRI", "0,15,30,45 * * * *",
    "5,10 1,2,3 * * *", "0 0 1,15 * *", "*/7 * * * *", "*/13 * * * *", "0 */5 * * *", "0 */7 * * *",
    "*/45 * * * *", "5/15 * * * *", "0 0 */10 * *", "0 0 5/10 * *", "0 3/6 * * *", "0 0 1 jan *",
    "0 0 31 * *", "0 0 29 2 *", "* * * * *", "0 * * * *", "30 * * * *",
    # Both day fields restricted: either matches (Vixie cron).
    "0 0 1,15 * MON", "0 0 13 * FRI", "0 0 1 * 1#1",
    # L and # (as croniter accepted them before).
    "0 0 L * *", "0 0 1,L * *", "0 0 L 2 *", "0 0 * * 1#1", "0 0 * * 5#3", "0 0 * * 1#5", "0 0 * * 7#2",
    "0 12 * * 2#1,4#3", "0 0 L * 1",
    # Aliases.
    "@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually",
    # Seconds first.
    "*/15 * * * * *", "0 */20 * * * *", "30 30 1 * * *", "*/30 0 2 * * *", "10,20 * 2 * * *",
    # Slots inside the 2026 DST transitions.
    "0 2 * * *", "30 2 * * *", "15 2 * * *", "0 1 * * *", "30 1 * * *", "0 0 * * *", "30 0 * * *",
    "0 2 8 3 *", "30 2 29 3 *", "*/30 1-3 * * *", "0 0 1 * *",
]  # fmt: skip
# cronsim reads no aliases; cron-parser reads them as these.
ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@weekly": "0 0 * * 0",
           "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *"}  # fmt: skip

NODE = """
const { CronExpressionParser } = require('cron-parser');
const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));
process.stdout.write(JSON.stringify(cases.map(([expr, tz, start, count]) => {
  try {
    const it = CronExpressionParser.parse(expr, { currentDate: new Date(start * 1000), tz });
    const fires = [];
    for (let i = 0; i < count; i++) fires.push(it.next().getTime() / 1000);
    return fires;
  } catch (e) { return String(e.message || e); }
})));
"""


def transitions(zone: str) -> list[datetime]:
    """The UTC instants in 2026-2027 at which `zone`'s offset changes."""
    tz, found = ZoneInfo(zone), []
    moment, end = datetime(2026, 1, 1, tzinfo=UTC), datetime(2028, 1, 1, tzinfo=UTC)
    while moment < end:
        following = moment + timedelta(hours=1)
        if moment.astimezone(tz).utcoffset() != following.astimezone(tz).utcoffset():
            low, high = moment, following
            while high - low > timedelta(seconds=1):
                middle = low + (high - low) / 2
                if middle.astimezone(tz).utcoffset() == low.astimezone(tz).utcoffset():
                    low = middle
                else:
                    high = middle
            found.append(high.replace(microsecond=0))
        moment = following
    return found


def cronsim_fires(expression: str, zone: str, start: int) -> list[int] | str:
    try:
        walker = CronSim(ALIASES.get(expression, expression), datetime.fromtimestamp(start, ZoneInfo(zone)))
        return [int(next(walker).timestamp()) for _ in range(COUNT)]
    except Exception as exc:  # an oracle refusing an expression is data here
        return f"{type(exc).__name__}: {exc}"


def compact(start: int, fires: list[int]) -> list[Any]:
    """Differences from the previous fire time (the first from `start`), runs as [difference, times]."""
    out: list[Any] = []
    previous = start
    for fire in fires:
        difference, previous = fire - previous, fire
        if out and isinstance(out[-1], list) and out[-1][0] == difference:
            out[-1][1] += 1
        elif out and out[-1] == difference:
            out[-1] = [difference, 2]
        else:
            out.append(difference)
    return out


def main() -> None:
    cases = []
    for zone in ZONES:
        starts = [datetime(2026, 1, 1, tzinfo=UTC)] + [t - timedelta(hours=2) for t in transitions(zone)]
        cases += [(expression, zone, int(start.timestamp())) for expression in EXPRESSIONS for start in starts]
    node = subprocess.run(["node", "-e", NODE], input=json.dumps([[*case, COUNT] for case in cases]),
                          capture_output=True, text=True, check=True)  # fmt: skip
    agreed: dict[str, dict[str, list[Any]]] = {}
    disagreements: Counter[str] = Counter()
    for (expression, zone, start), by_node in zip(cases, json.loads(node.stdout), strict=True):
        by_cronsim = cronsim_fires(expression, zone, start)
        if isinstance(by_node, list) and by_node == by_cronsim:
            agreed.setdefault(expression, {}).setdefault(zone, []).append([start, *compact(start, by_cronsim)])
        elif isinstance(by_node, str) or isinstance(by_cronsim, str):
            refused = "cron-parser" if isinstance(by_node, str) else "cronsim"
            disagreements[f"{expression} (refused by {refused})"] += 1
        else:
            disagreements[f"{expression} ({zone})"] += 1
    OUT.parent.mkdir(exist_ok=True)
    document = {
        "about": "Cron fire times cronsim 2.8 and cron-parser 5.10.6 agree on; see scripts/cron_oracle.py.",
        "count": COUNT,
        "zones": ZONES,
        "disagreements": dict(sorted(disagreements.items())),
        "cases": agreed,
    }
    OUT.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    total = sum(len(starts) for zones in agreed.values() for starts in zones.values())
    print(f"{total} cases agreed, {sum(disagreements.values())} not; {OUT.stat().st_size} bytes", file=sys.stderr)
    for expression, count in sorted(disagreements.items()):
        print(f"  disagree {count:3} x {expression}", file=sys.stderr)


if __name__ == "__main__":
    main()
