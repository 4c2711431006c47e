"""The worker role: takes runs from the queue and executes them with bounded concurrency.

Every run the worker holds lives in one tracker (`lifecycle.RunTracker`), in one state, and moves
only by the tracker's transitions; slots, reservations, what to extend, cancel or hand back are
all derived from those states. The stages ask the tracker and tell it what happened:

- fetch (`stages.Fetcher`): books the free slots (and reservations), leases that many items in
  one blocking script call and tracks them (LEASED, or RESERVED for a delayed item due within
  `SCHEDULER_WORKER_RESERVE_AHEAD`); the next batch is leased while the previous one is claimed.
- claim (`stages.Claimer`): items whose breaker is open go straight back (HANDED_BACK); one
  statement claims the rest under their lease tokens: a ready run starts (RUNNING; its recorded
  start is its lease instant, `Lease.leased_at`), a reserved one is held (HELD); an item with
  nothing left to run is acked away (DROPPED).
- execute (`executor.Executor`): each claimed run in a task of the role's task group. A held run
  waits for its due time on the database clock, then for a slot (STARTING; first come, first
  served, before fetching) within the reserve grace, else goes back unspent (RETURNING, then
  UNRESERVED). The handler runs under the job's timeout (one shared timer per batch and timeout,
  `attempt.Deadline`) and its breaker; its end is its outcome (FINISHED), and its slot is free.
- complete (`stages.Completer`): takes outcomes in batches (RECORDING): one statement records
  them (only under the claim token), one script call tells the queue (acks, retries, dead
  letters): RECORDED. Events (STARTED, the outcome's) go through an ordered outbox one task
  publishes in batches.
- extend (`stages.Leases`): keeps every lease but those being abandoned; a lost lease stops its
  run's task (LOSING) and its attempt is recorded abandoned (ABANDONED).
- cancel (`stages.Cancels`): a request (pub/sub, or the 1 s poll of persisted requests) stops the
  run's task: a running run ends `cancelled` (FINISHED), a held one is recorded cancelled unstarted.

Outcomes wait for recording outside the slots up to 4 per slot; beyond that each holds a slot,
so a completion stage that falls behind stops fetching; a handler never waits to hand its outcome
over (so no cancel can strand it between its handler and the completion stage).

On SIGTERM: stop fetching, let the claim stage finish its batch, hand held runs back unspent, let
running handlers finish within the grace, then stop the rest and hand them straight back
(`interrupted`, the next attempt `queued`), record the outcomes, publish the events.

Faults. Every loop survives any store error: it counts it, logs it once per
`STORE_ERROR_LOG_EVERY`, backs off and retries; a write that fails for good lets its runs' leases
lapse (the leader recovers the items). Only a bug ends the role: an exception in any stage or any
run's task propagates through the task group; `run_worker` logs its traceback and the process
exits non-zero. Outcomes whose recording fails are kept, their leases extended, and written again
(for up to `COMPLETION_RETRY_FOR`, or the grace plus 5 s once stopping).

Solo deliveries (a run whose next stall would dead-letter it): only an idle worker (the tracker
empty) dequeues as idle and may get one; a solo run takes every slot from its lease until it is
recorded (or otherwise leaves), so nothing runs beside it. A reply saying a solo item waits makes
the fetch stage stop until the worker holds nothing, then dequeue once as idle.
"""

from scheduler_grpc.worker.attempt import HandBack
from scheduler_grpc.worker.lifecycle import IllegalTransition, Run, RunTracker, State, Stop
from scheduler_grpc.worker.role import DEFAULT_METRICS_PORT, GC_THRESHOLD, Worker, run_worker
from scheduler_grpc.worker.support import (
    BATCH_WAIT,
    CANCEL_POLL_INTERVAL,
    COMPLETION_BATCH,
    COMPLETION_RETRY_FOR,
    FETCH_WAIT,
    PUBLISH_BATCH,
    RESERVE_BATCH,
    STORE_BACKOFF_MAX,
    STORE_ERROR_LOG_EVERY,
    WorkerStats,
)

__all__ = [
    "BATCH_WAIT", "CANCEL_POLL_INTERVAL", "COMPLETION_BATCH", "COMPLETION_RETRY_FOR", "DEFAULT_METRICS_PORT",
    "FETCH_WAIT", "GC_THRESHOLD", "PUBLISH_BATCH", "RESERVE_BATCH", "STORE_BACKOFF_MAX", "STORE_ERROR_LOG_EVERY",
    "HandBack", "IllegalTransition", "Run", "RunTracker", "State", "Stop", "Worker", "WorkerStats", "run_worker",
]  # fmt: skip
