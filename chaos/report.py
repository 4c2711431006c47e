"""The one table `make chaos` ends with, and the violations behind every non-zero cell."""

from __future__ import annotations

import re
from collections.abc import Sequence

from chaos.harness import Outcome

COLUMNS = ("scenario", "faults", "expected", "fired", "policy", "dup", "lost", "unfinished", "stuck", "stale",
           "over cap", "recovery p50", "recovery p99", "roles alive", "result")  # fmt: skip


# "scheduler-2/redis" -> "scheduler/redis": the table counts kinds of faults, the notes name roles.
_ROLE = re.compile(r"\b(scheduler|worker|server)-\d+(/\w+)?")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "never"
    return f"{value:.2f}s"


def _faults(outcome: Outcome) -> str:
    kinds: dict[str, int] = {}
    for fault in outcome.faults:
        kind = fault.split(" (")[0]
        kind = _ROLE.sub(lambda m: m.group(1) + (m.group(2) or ""), kind)
        kinds[kind] = kinds.get(kind, 0) + 1
    return "; ".join(f"{kind} x{count}" if count > 1 else kind for kind, count in kinds.items()) or "-"


def row(outcome: Outcome) -> list[str]:
    report = outcome.report
    return [
        outcome.name,
        _faults(outcome),
        str(report.expected),
        str(report.fired),
        str(report.explained),
        str(report.duplicated),
        str(report.lost),
        str(report.failed),
        str(report.stuck),
        str(report.stale),
        "-" if report.caps is None else f"{len(report.caps.breaches)} ({report.caps.keys} keys)",
        _seconds(report.recovery_median()),
        _seconds(report.recovery_percentile(0.99)),
        f"{outcome.roles_alive}/{outcome.roles_total}",
        "ok" if outcome.ok else ("ERROR" if outcome.error else "FAIL"),
    ]


def render(outcomes: Sequence[Outcome], seconds: float) -> str:
    """The table, then per scenario its violations and notes."""
    rows = [list(COLUMNS), *(row(outcome) for outcome in outcomes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["", "| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths, strict=True)) + " |"]
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows[1:]]
    failed = [outcome for outcome in outcomes if not outcome.ok]
    lines.append("")
    lines.append(f"{len(outcomes) - len(failed)}/{len(outcomes)} scenarios passed in {seconds / 60:.1f} min.")
    lines.append("policy: slots recorded missed/skipped by the job's misfire or concurrency policy (not lost); "
                 "unfinished: fired runs whose last attempt did not succeed; stale: rows written under a term "
                 "older than the one already recorded; over cap: instants a key of a concurrency limit was held "
                 "beyond its cap (of how many capped keys; scenarios with limits only); recovery: fault (or heal) "
                 "-> next slot fired, or -> the affected runs succeeded for worker faults, or -> a slot fired after "
                 "it succeeded for a Valkey Cluster's faults.")  # fmt: skip
    for outcome in outcomes:
        if outcome.ok and not outcome.notes:
            continue
        lines.append("")
        lines.append(f"{outcome.name}: {'ok' if outcome.ok else 'FAILED'} ({outcome.seconds:.0f}s)")
        if outcome.error:
            lines.append(f"  error: {outcome.error}")
        for violation in outcome.report.violations:
            lines.append(f"  VIOLATION {violation.invariant}: {violation.detail}")
        for note in outcome.notes:
            lines.append(f"  note: {note}")
        recoveries = outcome.report.recovery
        if recoveries:
            lines.append(
                "  recoveries: " + ", ".join(_seconds(r if r is not None else float("inf")) for r in recoveries)
            )
    return "\n".join(lines)
