"""Several script calls in one round trip (`script_calls.run_together`), on a real server."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from scheduler_grpc.script_calls import ScriptCall, run_together, together

APPEND = "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])"
FAIL = "return redis.error_reply('refused ' .. ARGV[1])"


async def test_calls_run_in_their_order_and_reply_in_it(redis: aioredis.Redis) -> None:
    append = redis.register_script(APPEND)
    calls = [ScriptCall(append, ["log"], [word]) for word in ("a", "b", "c")]
    assert together(redis)
    assert await run_together(redis, calls) == [1, 2, 3]
    assert await redis.lrange("log", 0, -1) == [b"a", b"b", b"c"]


async def test_scripts_the_server_lost_are_loaded_and_the_calls_sent_again(redis: aioredis.Redis) -> None:
    append = redis.register_script(APPEND)
    other = redis.register_script(APPEND + " -- another script")
    assert await run_together(redis, [ScriptCall(append, ["log"], ["before"])]) == [1]
    await redis.script_flush()  # as after a restart: the server knows neither script
    replies = await run_together(redis, [ScriptCall(append, ["log"], ["x"]), ScriptCall(other, ["log"], ["y"])])
    assert replies == [2, 3]
    assert await redis.lrange("log", 0, -1) == [b"before", b"x", b"y"]


async def test_a_failed_call_raises_after_the_others_ran(redis: aioredis.Redis) -> None:
    append, fail = redis.register_script(APPEND), redis.register_script(FAIL)
    with pytest.raises(ResponseError, match="refused here"):
        await run_together(redis, [ScriptCall(fail, [], ["here"]), ScriptCall(append, ["log"], ["after"])])
    assert await redis.lrange("log", 0, -1) == [b"after"]
