"""Scripts that are safe to resend: a request id per call, its reply remembered briefly in Redis.

`connections.redis_client` retries a command whose connection failed (that is how a role rides out
a Redis restart: a pooled connection the server closed is replaced). But when the failure is a lost
*reply*, the server already ran the command, and the retry runs it again. For an idempotent script
that is harmless; for the others it is not: a resent dequeue leases a second batch and orphans the
first until the visibility timeout (counting a stall), a resent event publish duplicates events, a
resent recover or dead-letter requeue/purge loses the ids the first run moved.

We keep the auto-retry (a client without it would fail the first call on every stale connection
after each Redis restart) and make those scripts safe to resend instead: each call carries a fresh
request key, and the script (wrapped by `lua/_once.lua`) stores its reply under it for
`REMEMBER`; a resend with the same key gets the stored reply and changes nothing. One SET with a
TTL per non-empty reply is the whole cost; empty replies (an idle dequeue) store nothing.

The other scripts are safe to resend as they are: enqueue is idempotent per id; ack, nack,
extend and dead_letter act only under the current lease token, so a repeat answers "lease lost"
(which the worker ignores for a lease it has just finished) and changes nothing; promote, remove,
rearm, states and list_dead only move or read what is there; the limits script only sets a
definition or a pause again (a resent pause ends a few ms later) or reads.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Final

from scheduler_grpc import scripts

REMEMBER: Final = timedelta(seconds=60)
"""How long a reply is kept for a resend: far beyond the client's retry window (3 retries, backoff
of at most 0.5 s, each attempt bounded by the caller's call timeout)."""

_BODY: Final = "-- @body\n"


def guarded(source: str) -> str:
    """`source` wrapped in the resend guard; call it with `request_key(...)` as an extra last key and
    `remember_ms()` as an extra last argument."""
    head, tail = scripts.source("_once").split(_BODY)
    return head + source.rstrip("\n") + "\n" + tail


def request_id() -> str:
    """A fresh id for one call (the retry of that call reuses it)."""
    return uuid.uuid4().hex


def remember_ms() -> int:
    return int(REMEMBER.total_seconds() * 1000)
