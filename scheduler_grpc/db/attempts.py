"""The one SQL definition of a run's current state: its latest attempt.

A run's attempts are rows of `job_executions` sharing its `run_id`; the one with the highest
`attempt` is the run's current state, and every query that asks for it uses `latest_attempt`.
(A run has at most one open attempt, and it is the latest: so "the latest attempt is queued" may
also be read as "an attempt of the run is open and queued", `finished_at IS NULL`, as the
reconcile scans do.)
"""

from __future__ import annotations


def latest_attempt(run_id: str, columns: str = "*", *, lock: bool = False, slot: str | None = None) -> str:
    """A subquery (for a `CROSS JOIN LATERAL`, a `LEFT JOIN LATERAL ... ON true` or a comparison)
    of the latest attempt of run `run_id` (an SQL expression), with `columns` of its row `a`,
    locked `FOR UPDATE` when the statement changes it. Served by the (run_id, attempt DESC) index.

    `slot`: an SQL expression of the run's `scheduled_for` (the partition key, shared by all its
    attempts): the subquery then reads one partition's index instead of every one's (run-time
    pruning); NULL finds nothing."""
    locking = " FOR UPDATE" if lock else ""
    pruned = f" AND a.scheduled_for = {slot}" if slot else ""
    return (
        f"(SELECT {columns} FROM job_executions a WHERE a.run_id = {run_id}{pruned}"
        f" ORDER BY a.attempt DESC LIMIT 1{locking})"
    )
