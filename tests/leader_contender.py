"""One leader-election contender in a process of its own, driven by tests/test_leader.py.

Run as `python -m tests.leader_contender ...` from the repository root.

Reports on stdout, one JSON object per line, with `time.monotonic()` instants (CLOCK_MONOTONIC is
system-wide on Linux, so the parent can compare instants of several children):

    {"event": "ready"}                           campaigning
    {"event": "lead", "token": T, "t": ...}      lead(term) started
    {"event": "valid", "token": T, "until": ...} the term's local deadline moved (after a renewal)
    {"event": "gap", "token": T, "t": ..., "valid": bool}
                                                 lead() did not run for a while (the process was
                                                 stopped); `valid` is Term.is_valid() on resuming
    {"event": "end", "token": T, "t": ...}       lead(term) was cancelled

SIGTERM cancels `run()`, which releases leadership gracefully, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from datetime import timedelta

import uvloop

from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.pool import create_pool
from scheduler_grpc.leader import LeaderElector, Term
from tests.engine_helpers import redis_for

_POLL_S = 0.002
# A longer pause than this between two polls can only be a stop of the process.
_GAP_S = 0.1


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def lead(term: Term) -> None:
    emit(event="lead", token=term.token, t=time.monotonic())
    reported = float("-inf")
    last_poll = time.monotonic()
    try:
        while True:
            # remaining() first, then the clock: `until` is never earlier than the real deadline.
            remaining = term.remaining().total_seconds()
            now = time.monotonic()
            if now - last_poll > _GAP_S:
                emit(event="gap", token=term.token, t=now, valid=term.is_valid())
            last_poll = now
            until = now + remaining
            if remaining > 0 and until > reported + 0.001:
                reported = until
                emit(event="valid", token=term.token, until=until)
            await asyncio.sleep(_POLL_S)
    finally:
        emit(event="end", token=term.token, t=time.monotonic())


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--holder", required=True)
    parser.add_argument("--ttl-ms", type=int, required=True)
    parser.add_argument("--retry-ms", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    client = redis_for(args.redis_url, decode_responses=False)
    pool = await create_pool(args.database_url, size=2, connect_timeout=timedelta(seconds=10))
    elector = LeaderElector(
        client,
        LeadershipRepository(pool),
        holder=args.holder,
        ttl=timedelta(milliseconds=args.ttl_ms),
        retry_interval=timedelta(milliseconds=args.retry_ms),
    )
    running = asyncio.create_task(elector.run(lead), name=f"elector[{args.holder}]")
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, running.cancel)
    emit(event="ready")
    try:
        await asyncio.wait([running])
        if not running.cancelled():
            running.result()  # an error of run() fails the process
    finally:
        await pool.close()
        await client.aclose()


if __name__ == "__main__":
    uvloop.run(main())
