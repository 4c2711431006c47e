"""The GCRA arithmetic of keyed rate limits: its guarantees as properties, and its Lua twin run on a
real Valkey against the same inputs (the scripts must decide exactly as `gcra.decide`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_grpc import gcra
from scheduler_grpc.embedded import ServerUrls
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.gcra import LimitDefinition, LimitKey, decide
from scheduler_grpc.scripts import LUA_DIR

NOW = 1_800_000_000_000  # ms, a plausible Redis clock

rates = st.tuples(
    st.integers(1, 200),  # limit
    st.integers(1, 10_000),  # period ms
    st.integers(0, 12),  # burst
)


def run(limit: int, period: int, burst: int, requests: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Feed `(gap ms, units)` requests to one key from a fresh state; the admitted `(time, units)`."""
    tat, rem, now, admitted = 0, 0, NOW, []
    for gap, units in requests:
        now += gap
        decision = decide(tat, rem, now, limit, period, burst, units)
        if decision.admitted:
            tat, rem = decision.tat_ms, decision.tat_rem
            admitted.append((now, units))
    return admitted


@settings(max_examples=300, deadline=None)
@given(rates, st.data())
def test_no_window_admits_more_than_the_rate_plus_the_burst(rate: tuple[int, int, int], data: st.DataObject) -> None:
    limit, period, burst = rate
    requests = data.draw(
        st.lists(st.tuples(st.integers(0, 3 * period // limit + 2), st.integers(1, burst + 1)), max_size=120)
    )
    admitted = run(limit, period, burst, requests)
    # The fullest half-open windows start at an admission and end just after one: check them all.
    for i, (start, _) in enumerate(admitted):
        units = 0
        for end, n in admitted[i:]:
            units += n
            window = end - start + 1
            assert (units - burst - 1) * period < window * limit, (units, window)


@settings(max_examples=300, deadline=None)
@given(rates, st.integers(1, 300))
def test_a_backlog_is_admitted_at_exactly_the_rate(rate: tuple[int, int, int], count: int) -> None:
    # A caller that always comes back at the retry time: burst + 1 at once, then one every T.
    limit, period, burst = rate
    tat, rem, now = 0, 0, NOW
    for k in range(count):
        decision = decide(tat, rem, now, limit, period, burst, 1)
        if not decision.admitted:
            now += decision.retry_ms
            decision = decide(tat, rem, now, limit, period, burst, 1)
            assert decision.admitted, "admitted at the retry time"
        ideal = NOW + max(0, -(-(k - burst) * period // limit))
        # Never early. Exactly on time when T is whole milliseconds, or when the burst covers a
        # millisecond: otherwise (burst 0, T fractional) a caller that can only come back on the
        # next millisecond tick finds the TAT passed and starts from now: the rate errs low.
        assert now >= ideal
        if period % limit == 0 or burst * period >= limit:
            assert now == ideal
        tat, rem = decision.tat_ms, decision.tat_rem


@settings(max_examples=500, deadline=None)
@given(
    rates,
    st.integers(-100_000, 1_000_000),
    st.integers(0, 10_000),
    st.integers(1, 20),
)
def test_a_refusal_says_exactly_when_to_come_back(rate: tuple[int, int, int], ahead: int, rem: int, units: int) -> None:
    limit, period, burst = rate
    tat = NOW + ahead
    decision = decide(tat, rem, NOW, limit, period, burst, units)
    if decision.admitted:
        assert decision.retry_ms == 0
        return
    assert (decision.tat_ms, decision.tat_rem) == (tat, rem)  # nothing taken
    assert decision.retry_ms >= 1
    assert decide(tat, rem, NOW + decision.retry_ms, limit, period, burst, units).admitted
    assert not decide(tat, rem, NOW + decision.retry_ms - 1, limit, period, burst, units).admitted


def test_a_request_beyond_the_burst_waits_for_an_idle_key_and_pays_in_full() -> None:
    # 5 units against 1/s with burst 1 could never fit; it passes when the key is idle.
    first = decide(0, 0, NOW, 1, 1000, 1, 5)
    assert first.admitted
    assert first.tat_ms == NOW + 5000
    again = decide(first.tat_ms, first.tat_rem, NOW + 1000, 1, 1000, 1, 5)
    assert not again.admitted
    assert again.retry_ms == 4000
    one = decide(first.tat_ms, first.tat_rem, NOW + 1000, 1, 1000, 1, 1)
    assert not one.admitted
    assert one.retry_ms == 3000  # one unit passes once tat - now <= burst * T


def test_groups_are_canonical_and_bad_keys_name_their_field() -> None:
    a = gcra.encode_group([LimitKey("rate", "h"), LimitKey("cust", "7", 2), LimitKey("rate", "h")])
    b = gcra.encode_group([LimitKey("cust", "7", 2), LimitKey("rate", "h", 2)])
    assert a == b == '[["cust","7",2],["rate","h",2]]'
    assert gcra.encode_group([]) == ""
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.limits\[1\]\.key"):
        gcra.encode_group([LimitKey("a", "x"), LimitKey("a", "bad\x00key")], "items[0].limits")
    with pytest.raises(InvalidArgument, match=r"limits\[0\]\.units"):
        gcra.encode_group([LimitKey("a", "x", 0)])
    with pytest.raises(InvalidArgument, match=r"definitions\.period"):
        gcra.encode_definition(LimitDefinition("r", "rate", 10))
    name, encoded = gcra.encode_definition(LimitDefinition("c", "concurrency", 2, overrides={"vip": (5, 0)}))
    assert (name, encoded) == ("c", '{"k":"c","l":2,"p":0,"b":0,"o":{"vip":[5,0]}}')


# -- the Lua twin ---------------------------------------------------------------------------------

_HARNESS = (LUA_DIR / "_gcra.lua").read_text(encoding="utf-8") + (
    "\nlocal ok, tat, rem, retry = gcra(tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),"
    " tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]))\n"
    "return {ok and 1 or 0, string.format('%.0f', tat), string.format('%.0f', rem), string.format('%.0f', retry)}\n"
)


@pytest.fixture(scope="module")
def sync_redis(servers: ServerUrls) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(servers.redis_url)
    try:
        yield client
    finally:
        client.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.tuples(
        st.integers(1, 1_000_000),  # limit
        st.integers(1, 100_000_000),  # period ms
        st.integers(0, 1000),  # burst
        st.integers(-(10**9), 10**7),  # tat - now
        st.integers(0, 1_000_000),  # stored remainder
        st.integers(1, 1000),  # units
    )
)
def test_the_lua_twin_decides_exactly_as_python(sync_redis: redis.Redis, case: tuple[int, ...]) -> None:
    limit, period, burst, ahead, rem, units = case
    tat = 0 if ahead < -(10**8) else NOW + ahead  # also a key never seen
    args = (tat, rem, NOW, limit, period, burst, units)
    ok, lua_tat, lua_rem, retry = sync_redis.eval(_HARNESS, 0, *args)  # type: ignore[misc]
    expected = decide(*args)
    assert (bool(int(ok)), int(lua_tat), int(lua_rem), int(retry)) == (
        expected.admitted,
        expected.tat_ms,
        expected.tat_rem,
        expected.retry_ms,
    )
