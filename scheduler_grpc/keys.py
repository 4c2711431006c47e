"""Every Redis key name, built in one place.

All keys of one queue share the hash tag `{q:<name>}` so each multi-key Lua script touches a single
Redis Cluster slot; a sharded queue's shard i > 0 has its own (`{q:<name>#<i>}`,
`shard_name`). Nothing else in the package spells a key.
"""

from __future__ import annotations

from dataclasses import dataclass


def shard_name(queue: str, shard: int) -> str:
    """The key name of one shard of a queue (`sharding.py`): shard 0 is the queue itself (so an
    unsharded queue and its existing data are unchanged), shard i > 0 is `<queue>#<i>`, its hash tag
    `{q:<queue>#<i>}`. `#` is not allowed in a queue name, so no queue's keys are another's shard."""
    return queue if shard == 0 else f"{queue}#{shard}"


@dataclass(frozen=True)
class QueueKeys:
    """The keys of one queue.

    Attributes:
        ready: ZSET id -> score encoding (priority desc, enqueue sequence asc).
        processing: ZSET id -> lease deadline (ms, Redis clock).
        delayed: ZSET id -> due time (ms, Redis clock); retries and future one-shots.
        dead: ZSET id -> time parked (ms).
        priority: HASH id -> priority; an id is "in the queue" exactly while it has an entry here.
        data: HASH id -> opaque payload given at enqueue.
        deliveries: HASH id -> times handed to a consumer.
        lease: HASH id -> current lease token.
        owner: HASH id -> worker holding the lease.
        dead_reason: HASH id -> why it was dead-lettered.
        seq: STRING counter giving FIFO order within a priority.
        lease_seq: STRING counter giving lease tokens.
        marker: ZSET with one member; set when work becomes ready, blocking-popped by idle workers.
        solo: SET of waiting ids (ready or delayed) whose next delivery is solo: it has stalled
            max_stalls - 1 times, so it runs only alone on an idle worker (see `Queue.dequeue`).
        drainer: STRING, the worker asked to become idle for a solo item (expires).
        request(id): STRING, the remembered reply of one script call (see `resend`), short-lived.

    Keyed flow control (limits, see `queue.py`); `lk` below is `limit NUL key`, `group` the
    canonical JSON of a run's sorted limit keys (`gcra.encode_group`):

        limdef: HASH limit name -> its definition as the scripts read it (`gcra.encode_definition`).
        lims: HASH id -> group, for every item (in any state) that carries limit keys.
        gwait: ZSET (all scores 0, read BYLEX) of `group NUL ready-score NUL id`: the waiting items of
            every group, each group's in priority then FIFO order.
        gmem: HASH id -> its gwait member, while it waits in a group.
        gactive: ZSET group -> round-robin turn: groups with waiting items that are not parked.
        gdelay: ZSET group -> ms (Redis clock) when a parked group wakes (rate retry, pause end).
        gblock: HASH group -> why it waits (JSON: limit, key, since ms, kind, its kpark member, woken).
        grr: STRING counter giving round-robin turns and park order.
        kpark: ZSET (scores 0, BYLEX) of `lk NUL turn NUL group`: groups parked on a key, FIFO.
        kqueued: HASH lk -> runs waiting in groups that contain the key.
        held: HASH lk -> concurrency units held by leased runs.
        holds: HASH id -> the units its lease holds (JSON [[lk, units], ...], padded with spaces past
            64 bytes so the hash stays a hash table, not a listpack scanned per field), deleted on
            return.
        tat: ZSET lk -> a rate key's theoretical arrival time, whole ms (GCRA, see `gcra.py`).
        tatrem: HASH lk -> the TAT's remainder in 1/limit ms steps (absent when 0).
        kpause: ZSET lk -> ms until which the key admits nothing (paused by hand or by back-pressure).
        recount: ZSET id -> ms: runs still running whose units were counted again after Redis lost
            them (`Queue.hold_running`), until `Queue.unhold` gives them back.

    Reservations' fair shares (`Queue.dequeue`'s `held`):

        reservers: ZSET worker -> ms (Redis clock) of its last reserving dequeue; forgotten after 5 s.
        reserving: ZSET id -> due ms: reservations not due yet (pruned as they come due).
    """

    name: str

    def _key(self, suffix: str) -> str:
        return f"{{q:{self.name}}}:{suffix}"

    def request(self, request_id: str) -> str:
        return self._key(f"request:{request_id}")

    @property
    def ready(self) -> str:
        return self._key("ready")

    @property
    def processing(self) -> str:
        return self._key("processing")

    @property
    def delayed(self) -> str:
        return self._key("delayed")

    @property
    def dead(self) -> str:
        return self._key("dead")

    @property
    def priority(self) -> str:
        return self._key("priority")

    @property
    def data(self) -> str:
        return self._key("data")

    @property
    def deliveries(self) -> str:
        return self._key("deliveries")

    @property
    def lease(self) -> str:
        return self._key("lease")

    @property
    def owner(self) -> str:
        return self._key("owner")

    @property
    def dead_reason(self) -> str:
        return self._key("dead_reason")

    @property
    def seq(self) -> str:
        return self._key("seq")

    @property
    def lease_seq(self) -> str:
        return self._key("lease_seq")

    @property
    def marker(self) -> str:
        return self._key("marker")

    @property
    def solo(self) -> str:
        return self._key("solo")

    @property
    def drainer(self) -> str:
        return self._key("drainer")

    @property
    def limdef(self) -> str:
        return self._key("limdef")

    @property
    def lims(self) -> str:
        return self._key("lims")

    @property
    def gwait(self) -> str:
        return self._key("gwait")

    @property
    def gmem(self) -> str:
        return self._key("gmem")

    @property
    def gactive(self) -> str:
        return self._key("gactive")

    @property
    def gdelay(self) -> str:
        return self._key("gdelay")

    @property
    def gblock(self) -> str:
        return self._key("gblock")

    @property
    def grr(self) -> str:
        return self._key("grr")

    @property
    def kpark(self) -> str:
        return self._key("kpark")

    @property
    def kqueued(self) -> str:
        return self._key("kqueued")

    @property
    def held(self) -> str:
        return self._key("held")

    @property
    def holds(self) -> str:
        return self._key("holds")

    @property
    def tat(self) -> str:
        return self._key("tat")

    @property
    def tatrem(self) -> str:
        return self._key("tatrem")

    @property
    def kpause(self) -> str:
        return self._key("kpause")

    @property
    def recount(self) -> str:
        return self._key("recount")

    @property
    def reservers(self) -> str:
        return self._key("reservers")

    @property
    def reserving(self) -> str:
        return self._key("reserving")


@dataclass(frozen=True)
class LeaderKeys:
    """The keys of one leader election (one per deployment, named by `scope`)."""

    scope: str = "scheduler"

    @property
    def lock(self) -> str:
        """STRING holding the current leader's lease id, with a PX expiry."""
        return f"{{leader:{self.scope}}}:lock"

    @property
    def released(self) -> str:
        """Pub/sub channel announcing a graceful release, so standbys take over at once."""
        return f"{{leader:{self.scope}}}:released"


@dataclass(frozen=True)
class EventKeys:
    """The execution event stream (capped), read by every gRPC server and fanned out to subscribers."""

    @property
    def stream(self) -> str:
        return "{events}:executions"

    def request(self, request_id: str) -> str:
        """STRING, the remembered reply of one publish call (see `resend`), short-lived."""
        return f"{{events}}:request:{request_id}"


@dataclass(frozen=True)
class WorkerKeys:
    """The worker heartbeat registry: one hash per worker with a TTL, plus an index set."""

    @property
    def index(self) -> str:
        """ZSET worker id -> last beat (ms)."""
        return "{workers}:index"

    def worker(self, worker_id: str) -> str:
        """HASH of one worker's facts (host, pid, slots, active, handlers, started, last beat)."""
        return f"{{workers}}:worker:{worker_id}"

    @property
    def cancel(self) -> str:
        """Pub/sub channel of run ids to cancel; the worker running one cancels it."""
        return "{workers}:cancel"


@dataclass(frozen=True)
class AuthKeys:
    """Redis keys of sessions and login rate limits (one hash tag: a Cluster slot of their own)."""

    def session(self, token_hash: bytes) -> str:
        """STRING: the session's principal as JSON, expiring with the session."""
        return f"{{auth}}:session:{token_hash.hex()}"

    def user_sessions(self, user_id: str) -> str:
        """SET of the hex token hashes of a user's sessions (members may outlive their session),
        expiring with the newest one: what a change to the user re-scopes or ends."""
        return f"{{auth}}:user-sessions:{user_id}"

    def failures_by_username(self, username: str) -> str:
        """STRING counter of failed logins for one username, expiring after the window."""
        return f"{{auth}}:login-failures:user:{username.lower()}"

    def failures_by_peer(self, peer: str) -> str:
        """STRING counter of failed logins from one peer address, expiring after the window."""
        return f"{{auth}}:login-failures:peer:{peer}"

    def failures_by_pair(self, username: str, peer: str) -> str:
        """STRING counter of failed logins for one username from one address (an address has no `/`)."""
        return f"{{auth}}:login-failures:pair:{peer}/{username.lower()}"

    def known_address(self, username: str, peer: str) -> str:
        """STRING marker: `peer` logged in as this username recently (expires after KNOWN_ADDRESS_TTL)."""
        return f"{{auth}}:login-known:{peer}/{username.lower()}"

    def login_slots(self, username: str) -> str:
        """HASH lane (`clean`, `suspect`) -> ms since the epoch before which that lane may not try."""
        return f"{{auth}}:login-slots:user:{username.lower()}"


@dataclass(frozen=True)
class DepthKeys:
    """Redis keys of the console's queue depth samples (the charts' queue depth over time)."""

    def samples(self, queue: str) -> str:
        """LIST of "epoch ready processing delayed dead", newest first, trimmed to a day of minutes."""
        return f"{{depth}}:samples:{queue}"

    def tick(self, minute: int) -> str:
        """STRING claim of one minute's sampling (SET NX): one server process samples each minute."""
        return f"{{depth}}:tick:{minute}"
