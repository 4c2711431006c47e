"""One page of a table ordered by a unique text column (a name), for the lists the API pages by name."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, TypeVar

import asyncpg

from scheduler_grpc import pagetokens
from scheduler_grpc.errors import InvalidArgument

MAX_PAGE_SIZE: Final = 1000
DEFAULT_PAGE_SIZE: Final = 100

T = TypeVar("T")


async def page_by_name(
    pool: asyncpg.Pool | asyncpg.Connection,
    bound: float,
    *,
    kind: str,
    select: str,
    column: str,
    page_size: int,
    page_token: str,
    item: Callable[[asyncpg.Record], T],
    name_of: Callable[[T], str],
) -> tuple[list[T], str]:
    """The items after `page_token` in `column` order (`select` is `SELECT ... FROM table`, both
    ours, never a caller's text) and the token of the next page ("" at the end).

    Raises:
        InvalidArgument: `page_size` out of range or a `page_token` this server did not issue.
    """
    if not 0 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
    size = page_size or DEFAULT_PAGE_SIZE
    after: str | None = None
    if page_token:
        position = pagetokens.decode(page_token, kind, {})
        if len(position) != 1 or not isinstance(position[0], str):
            raise InvalidArgument("page_token", "not a token this server issued")
        after = position[0]
    async with asyncio.timeout(bound):  # the repository's statement bound, in seconds
        rows = await pool.fetch(
            f"{select} WHERE $1::text IS NULL OR {column} > $1 ORDER BY {column} LIMIT $2", after, size + 1
        )
    items = [item(row) for row in rows[:size]]
    token = pagetokens.encode(kind, {}, [name_of(items[-1])]) if len(rows) > size else ""
    return items, token
