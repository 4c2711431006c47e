"""Limit definitions (issue 22): the application logic behind LimitService (`Control.limits`).

Every definition is validated (`scheduler_grpc.limits`) before anything is written, and written to
PostgreSQL (`db/limits.py`). A limit's name never changes (jobs refer to it by name); a limit that
jobs still use cannot be deleted (FAILED_PRECONDITION naming them). Jobs name limits in their
`limits` refs, checked where jobs are stored (`db/jobs.py`).

Each change is put in the queues at once (`limit_sync.LimitSync`: every queue a job names), after
the commit; if Redis fails then, the change is logged and the leader's reconcile puts it later
(the call does not fail: the limit is stored). Admitting runs is the queues' work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from scheduler_grpc.db.limits import LimitPage, LimitRepository
from scheduler_grpc.errors import Aborted, InvalidArgument, NotFound
from scheduler_grpc.limit_sync import LimitSync
from scheduler_grpc.limits import Limit, LimitSpec, Override, check_override_key, override_field, validate_limit
from scheduler_grpc.rules import is_name

log = logging.getLogger(__name__)

# An update without an expected version merges onto the limit as read; if someone else writes in
# between, the merge is redone on the new version ("last writer wins", not ABORTED).
UPDATE_ATTEMPTS = 3


class LimitControl:
    """Creates, reads, lists, changes and deletes limits.

    Args:
        limits: The limits table.
        check_request_id: `Control`'s rule for request ids (returns None for none).
        sync: Puts changes in the queues (None: nothing is put; the leader's reconcile does it).
    """

    def __init__(
        self,
        limits: LimitRepository,
        check_request_id: Callable[[str | None], str | None],
        sync: LimitSync | None = None,
    ) -> None:
        self._limits = limits
        self._check_request_id = check_request_id
        self._sync = sync

    async def _synced(self, what: str, call: Callable[[], Awaitable[None]]) -> None:
        """Put a committed change in the queues; a failure is logged, not raised (see the module)."""
        if self._sync is None:
            return
        try:
            await call()
        except Exception as exc:
            log.warning("limit %s not put in the queues; the leader's reconcile puts it: %r", what, exc)

    async def create_limit(self, spec: LimitSpec, *, request_id: str | None = None) -> Limit:
        """Validate and store a limit; a repeated `request_id` returns the limit its first call created.

        Raises:
            InvalidArgument: naming the field (`name`, `kind`, `limit`, `period`, `burst`,
                `overrides[...]`, `request_id`).
            AlreadyExists: a limit has this name.
        """
        request_id = self._check_request_id(request_id)
        limit = await self._limits.create(validate_limit(spec), request_id)
        await self._put(limit)
        return limit

    async def _put(self, limit: Limit) -> None:
        sync = self._sync
        if sync is not None:
            await self._synced(limit.name, lambda: sync.push([limit]))

    async def get_limit(self, limit_id: str) -> Limit:
        """One limit by id.

        Raises:
            InvalidArgument: `id` is not a UUID.
            NotFound: no such limit.
        """
        return await self._limits.get(limit_id)

    async def get_limit_by_name(self, name: str) -> Limit:
        """One limit by its unique name.

        Raises:
            NotFound: no such limit.
        """
        if not is_name(name):  # no limit has it; and PostgreSQL text refuses some (a NUL character)
            raise NotFound(f"limit named {name[:200]!r} not found")
        return await self._limits.get_by_name(name)

    async def list_limits(self, page_size: int = 0, page_token: str = "") -> LimitPage:
        """A page of limits by name.

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` of another listing.
        """
        return await self._limits.list_page(page_size, page_token)

    async def merge_limit(
        self, limit_id: str, merge: Callable[[Limit], LimitSpec], *, expected_version: int | None = None
    ) -> Limit:
        """Update a limit with the spec `merge` makes of it as it stands (a partial update).

        With `expected_version`, the limit must still be at that version (else `Aborted`).
        Without it, a concurrent write between the read and the update makes the merge run again
        on the new version, up to `UPDATE_ATTEMPTS` times.

        Raises:
            InvalidArgument: the merged definition is invalid (naming the field), or changes the name.
            NotFound: no such limit.
            Aborted: the limit is not at `expected_version`, or kept changing under the merge.
        """
        for attempt in range(1, UPDATE_ATTEMPTS + 1):
            current = await self._limits.get(limit_id)
            if expected_version is not None and current.version != expected_version:
                raise Aborted(f"etag: limit changed meanwhile (now {current.etag}); read it again and retry")
            spec = validate_limit(merge(current))
            if spec.name != current.name:
                raise InvalidArgument("name", "a limit's name cannot be changed (jobs refer to it by name)")
            try:
                updated = await self._limits.update(limit_id, spec, current.version)
            except Aborted:
                if expected_version is not None or attempt == UPDATE_ATTEMPTS:
                    raise
            else:
                await self._put(updated)
                return updated
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def set_override(
        self, limit_id: str, key: str, override: Override | None, *, expected_version: int | None = None
    ) -> Limit:
        """Give `key` its own limit and burst (`override`), or take its override away (None).

        Raises:
            InvalidArgument: naming `key` or `override.limit`/`override.burst` (through
                `overrides[...]`), or `overrides` when the limit would have too many.
            NotFound: no such limit.
            Aborted: the limit is not at `expected_version`.
        """
        check_override_key(key, "key")

        def merge(current: Limit) -> LimitSpec:
            overrides = dict(current.overrides)
            if override is None:
                overrides.pop(key, None)
            else:
                overrides[key] = override
            return replace(current, overrides=overrides)

        try:
            return await self.merge_limit(limit_id, merge, expected_version=expected_version)
        except InvalidArgument as exc:
            prefix = override_field(key)
            if exc.field.startswith(prefix + "."):  # the override's own fields, as the request names them
                raise InvalidArgument("override" + exc.field[len(prefix) :], exc.message) from None
            if exc.field == "overrides":  # one key too many: the key is what the caller can change
                raise InvalidArgument("key", f"{exc.message}; the limit has that many already") from None
            raise

    async def delete_limit(self, limit_id: str, *, expected_version: int | None = None) -> Limit:
        """Delete a limit that no job uses; returns it as it was.

        Raises:
            InvalidArgument: `id` is not a UUID.
            NotFound: no such limit.
            Aborted: the limit is not at `expected_version`.
            FailedPrecondition: jobs use it (named in the message).
        """
        deleted = await self._limits.delete(limit_id, expected_version=expected_version)
        sync = self._sync
        if sync is not None:
            await self._synced(deleted.name, lambda: sync.forget(deleted.name))
        return deleted
