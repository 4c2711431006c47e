"""Output bounds (issue 19): `outputs.measure` agrees with PostgreSQL's own `octet_length(v::jsonb::text)`,
walks any depth without recursion, and refuses what PostgreSQL or orjson refuse."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_grpc import outputs
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import MAX_PAYLOAD_BYTES
from scheduler_grpc.handlers.base import check_payload_size

_STORED_SIZE = "SELECT octet_length(v::jsonb::text) FROM unnest($1::text[]) AS v"

# Every character but NUL (which jsonb refuses) and surrogates (not UTF-8).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [1e15, 1e16, 1e20, 1e21, 1e22, 1e-5, 1e-7, 1.5e-7, -0.0, 5e-324, 1.7976931348623157e308, 123456789.0, 0.1]
)
_SCALARS = st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | _FLOATS | _TEXT
_JSON = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(_TEXT, children, max_size=5),
    max_leaves=30,
)


async def _stored_sizes(pool: asyncpg.Pool, values: list[Any]) -> list[int]:
    # The text the repositories send (orjson), cast as they cast it.
    rows = await pool.fetch(_STORED_SIZE, [orjson.dumps(value).decode() for value in values])
    return [row[0] for row in rows]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(_JSON, min_size=1, max_size=20))
async def test_the_size_measured_is_postgresqls_octet_length_of_jsonb_text(
    pool: asyncpg.Pool, values: list[Any]
) -> None:
    assert [outputs.stored_size(value) for value in values] == await _stored_sizes(pool, values)
    assert [outputs.measure(value).depth for value in values] == [_depth(value) for value in values]
    assert [outputs.depth(value) for value in values] == [_depth(value) for value in values]


def _depth(value: Any) -> int:
    """The plain recursive definition, for small values."""
    if isinstance(value, dict):
        return 1 + max((_depth(item) for item in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(item) for item in value), default=0)
    return 0


async def test_numbers_measure_as_postgresql_numeric_prints_them(pool: asyncpg.Pool) -> None:
    values: list[Any] = [1e20, -0.0, 0.0, 1e-7, 5e-324, 1.7976931348623157e308, 1e15, 1e16, 2**64 - 1, -(2**63), 0]
    values += ['\x01\x1f\x7f"\\/\u2028\b\t\n\r\f é 日本 🎉', {"a": [1, "b"], "": {}}, [], {}]
    sizes = await _stored_sizes(pool, values)
    assert [outputs.stored_size(value) for value in values] == sizes
    assert sizes[0] == len("100000000000000000000")


def test_depth_is_measured_without_recursion_at_any_depth() -> None:
    value: Any = 1
    for _ in range(10_000):
        value = [value]
    assert outputs.measure(value) == outputs.Measure(size=20_001, depth=10_000)
    nested: Any = {}
    for _ in range(10_000):
        nested = {"k": nested}
    assert outputs.measure(nested).depth == 10_001
    with pytest.raises(outputs.Unstorable, match="deeper than 20"):
        outputs.measure(nested, max_depth=20)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"a": "x\x00y"}, "NUL"),
        ({"a\x00": 1}, "NUL"),
        (["\ud800"], "surrogate"),
        ({"\udfff": 1}, "surrogate"),
        ([2**64], "64 bits"),
        ([-(2**63) - 1], "64 bits"),
        ([math.nan], "not a JSON number"),
        ([math.inf], "not a JSON number"),
        ({"when": datetime.now(UTC)}, "datetime"),
        ({"tags": {1, 2}}, "set"),
        ({1: 2}, "key is a int"),
        (object(), "object"),
    ],
)
def test_what_postgresql_or_orjson_refuse_is_refused(value: Any, reason: str) -> None:
    with pytest.raises(outputs.Unstorable, match=reason):
        outputs.measure(value)
    with pytest.raises(outputs.Unstorable, match=f"^result is not storable: .*{reason}"):
        outputs.bound_result(value)


async def test_postgresql_refuses_the_nul_character_measure_refuses(pool: asyncpg.Pool) -> None:
    with pytest.raises(asyncpg.UntranslatableCharacterError):
        await _stored_sizes(pool, [{"a": "x\x00y"}])


def test_results_and_resolved_payloads_are_bounded_as_stored_with_clear_errors() -> None:
    # The payload: 65,001 bytes compact, 78,000 as stored: the unit is jsonb's text, not compact JSON.
    keys = {f"k{i:04d}": 0 for i in range(6_500)}
    assert len(orjson.dumps(keys)) == 65_001
    assert outputs.stored_size(keys) == 78_000
    with pytest.raises(outputs.Unstorable, match=r"^result is 78,000 bytes as stored; at most 65,536$"):
        outputs.bound_result(keys)
    with pytest.raises(outputs.Unstorable, match=r"^payload resolved to 78,000 bytes; at most 65,536$"):
        outputs.bound_resolved_payload(keys)
    with pytest.raises(outputs.Unstorable, match=r"more than 1,048,576 bytes"):
        outputs.bound_result(["x" * 2_000_000])
    deep: Any = {}
    for _ in range(outputs.MAX_DEPTH):
        deep = {"k": deep}
    with pytest.raises(outputs.Unstorable, match=r"^result is not storable: nested deeper than 20"):
        outputs.bound_result(deep)
    assert outputs.bound_result(deep["k"]) is deep["k"]
    assert outputs.bound_result(None) is None
    fits = {"s": "x" * (MAX_PAYLOAD_BYTES - len('{"s": ""}'))}
    assert outputs.stored_size(fits) == MAX_PAYLOAD_BYTES
    assert outputs.bound_result(fits) is fits
    with pytest.raises(outputs.Unstorable):
        outputs.bound_result({"s": fits["s"] + "x"})


def test_the_api_measures_a_payload_in_the_unit_postgresql_stores_it() -> None:
    with pytest.raises(InvalidArgument) as err:
        check_payload_size({f"k{i:04d}": 0 for i in range(6_500)})
    assert err.value.field == "payload"
    assert "78,000 bytes as stored" in err.value.message


@given(st.text(max_size=20_000) | st.text(st.characters(), min_size=8_000, max_size=9_000))
def test_error_text_fits_its_column(text: str) -> None:
    bounded = outputs.bound_error(text)
    assert len(bounded) <= outputs.MAX_ERROR_CHARS
    assert "\x00" not in bounded
    bounded.encode()  # no lone surrogate left
    if len(text) <= outputs.MAX_ERROR_CHARS and "\x00" not in text:
        assert bounded == text
    elif len(text) > outputs.MAX_ERROR_CHARS:
        assert f"characters cut] … {text[-256:]}" in bounded
        assert bounded.startswith(text[:4096])


def test_error_text_loses_nul_and_lone_surrogates_and_keeps_its_end() -> None:
    assert outputs.bound_error("a\x00b\ud800c") == "a\ufffdb\ufffdc"
    long = "x" * 20_000 + " (retry budget of 3 spent)"
    assert outputs.bound_error(long).endswith("x (retry budget of 3 spent)")
    assert "[11,8" in outputs.bound_error(long)


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"argv": ["ls", "a\x00b"]}, ".argv[1]"),
        ({"a": {"b c": [1, {"d": float("nan")}]}}, '.a["b c"][1].d'),
        ({"ok": 1, "bad\x00key": 2}, ""),
        ([1, 2, {3}], "[2]"),
        ({"fine": [1, "x"]}, ""),
    ],
)
def test_the_unstorable_element_is_located_by_its_path(value: Any, path: str) -> None:
    assert outputs.locate_unstorable(value) == path
