"""Several Lua script calls in one round trip to one Redis server.

A round trip costs the caller's thread far more than the script's arguments do (on loopback, the
send and the wake-up for the reply are most of a small call's CPU), so a writer that makes several
script calls in a row, in a fixed order, sends them together: one pipeline without MULTI, one
connection, the replies read at once. Redis runs them in the order sent, as it would have run
them one after the other. On a cluster the calls' keys lie on different nodes; there each call
is sent on its own (`together` says which).

Every call sent this way must be safe to resend (see `resend`): the client's auto-retry resends
the whole pipeline after a lost connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One call of a registered script: its keys and arguments."""

    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]

    async def send(self) -> Any:
        """The call on its own (EVALSHA on the script's client, loading the script on NOSCRIPT)."""
        return await self.script(keys=self.keys, args=self.args)


def together(client: Redis) -> bool:
    """Whether calls on `client` may share a round trip: one server, not a cluster."""
    return not isinstance(client, RedisCluster)


async def run_together(client: Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run `calls` in their order in one round trip on one of `client`'s connections (a client of
    one server: `together`); returns their replies in the same order.

    A script the server does not know (first use, a restart, SCRIPT FLUSH) is loaded, and the calls
    that found it missing are sent again, in their order (they did not run).

    Raises:
        Exception: the first call's error, if any failed (the calls after it still ran), or what
            the connection raised.
    """
    replies = await _send(client, calls)
    missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[index].script): calls[index].script for index in missing}.values():
            script.sha = await client.script_load(script.script)
        for index, reply in zip(missing, await _send(client, [calls[index] for index in missing]), strict=True):
            replies[index] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _send(client: Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    # Not AsyncScript on the pipeline: that makes every execute ask SCRIPT EXISTS first, a round
    # trip of its own.
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    return list(await pipe.execute(raise_on_error=False))
