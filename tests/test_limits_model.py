"""The limit model (issue 22), pure: definitions and refs validated with the field named, key
templates parsed, and keys resolved against payloads (Hypothesis over templates and payloads)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.jobs import JobSpec, validate_job
from scheduler_grpc.limits import (
    MAX_KEY_LENGTH,
    MAX_OVERRIDES,
    KeyTemplate,
    LimitKeyError,
    LimitKind,
    LimitRef,
    LimitSpec,
    Override,
    check_units,
    overrides_from_json,
    overrides_to_json,
    refs_from_json,
    refs_to_json,
    resolve_keys,
    validate_limit,
    validate_refs,
)

SECOND = timedelta(seconds=1)
# Payload field names: anything without a dot (a dot separates the fields of a path).
fields = st.text(st.characters(codec="utf-8", exclude_characters=".\x00"), min_size=1, max_size=12)
scalars = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40),
    st.integers(-(2**53), 2**53),
    st.booleans(),
)


def field_of(call: Any) -> str:
    with pytest.raises(InvalidArgument) as raised:
        call()
    return raised.value.field


# -- definitions -------------------------------------------------------------------------------


def test_a_concurrency_and_a_rate_limit_are_valid_as_written() -> None:
    cap = validate_limit(LimitSpec(" per-customer ", LimitKind.CONCURRENCY, 2, overrides={"acme": Override(5)}))
    assert (cap.name, cap.kind, cap.limit, cap.period, cap.burst) == ("per-customer", LimitKind.CONCURRENCY, 2, None, 0)
    rate = validate_limit(LimitSpec("billing-api", LimitKind("rate"), 100, SECOND, burst=10))
    assert (rate.kind, rate.period, rate.burst) == (LimitKind.RATE, SECOND, 10)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (LimitSpec("", LimitKind.CONCURRENCY, 1), "name"),
        (LimitSpec("has space", LimitKind.CONCURRENCY, 1), "name"),
        (LimitSpec("-dash-first", LimitKind.CONCURRENCY, 1), "name"),
        (LimitSpec("x" * 201, LimitKind.CONCURRENCY, 1), "name"),
        (LimitSpec("k", "fixed_window", 1), "kind"),  # type: ignore[arg-type]
        (LimitSpec("k", LimitKind.CONCURRENCY, 0), "limit"),
        (LimitSpec("k", LimitKind.CONCURRENCY, -3), "limit"),
        (LimitSpec("k", LimitKind.CONCURRENCY, True), "limit"),
        (LimitSpec("k", LimitKind.CONCURRENCY, 1_000_001), "limit"),
        (LimitSpec("k", LimitKind.CONCURRENCY, 1, SECOND), "period"),
        (LimitSpec("k", LimitKind.CONCURRENCY, 1, burst=1), "burst"),
        (LimitSpec("k", LimitKind.RATE, 1), "period"),
        (LimitSpec("k", LimitKind.RATE, 1, -SECOND), "period"),
        (LimitSpec("k", LimitKind.RATE, 1, timedelta(0)), "period"),
        (LimitSpec("k", LimitKind.RATE, 1, timedelta(days=2)), "period"),
        (LimitSpec("k", LimitKind.RATE, 1, SECOND, burst=-1), "burst"),
        (LimitSpec("k", LimitKind.RATE, 1, SECOND, overrides={"": Override(1)}), "overrides['']"),
        (LimitSpec("k", LimitKind.RATE, 1, SECOND, overrides={"a": Override(0)}), "overrides['a'].limit"),
        (LimitSpec("k", LimitKind.RATE, 1, SECOND, overrides={"a": Override(1, -1)}), "overrides['a'].burst"),
        (LimitSpec("k", LimitKind.CONCURRENCY, 1, overrides={"a": Override(1, 2)}), "overrides['a'].burst"),
        (LimitSpec("k", LimitKind.CONCURRENCY, 1, overrides={"a" * 201: Override(1)}), f"overrides[{'a' * 40!r}]"),
        (
            LimitSpec("k", LimitKind.CONCURRENCY, 1, overrides={str(i): Override(1) for i in range(MAX_OVERRIDES + 1)}),
            "overrides",
        ),
    ],
)
def test_every_bad_definition_names_its_field(spec: LimitSpec, field: str) -> None:
    assert field_of(lambda: validate_limit(spec)) == field


# -- refs --------------------------------------------------------------------------------------


def test_refs_are_checked_with_their_index_named() -> None:
    good = [LimitRef("per-customer", "payload.customer_id"), LimitRef("billing-api", "billing", 2)]
    assert validate_refs(good) == tuple(good)
    assert field_of(lambda: validate_refs([LimitRef("a", "k")] * 5)) == "limits"
    assert field_of(lambda: validate_refs([LimitRef("a", "k"), LimitRef("a", "other")])) == "limits[1].limit"
    assert field_of(lambda: validate_refs([LimitRef("a", "k", 0)])) == "limits[0].units"
    assert field_of(lambda: validate_refs([LimitRef("a", "k", -1)])) == "limits[0].units"
    assert field_of(lambda: validate_refs([LimitRef("bad name", "k")])) == "limits[0].limit"
    assert field_of(lambda: validate_refs([LimitRef("a", "")])) == "limits[0].key"
    assert field_of(lambda: validate_refs([LimitRef("a", "b"), LimitRef("c", "payload..x")])) == "limits[1].key"


def test_a_job_validates_its_refs() -> None:
    class Handlers:
        def validate(self, handler: str, payload: Any) -> dict[str, Any]:
            return dict(payload)

    spec = JobSpec("j", "test.echo", limits=(LimitRef(" cap ", "payload.c"),))
    assert validate_job(spec, Handlers()).limits == (LimitRef("cap", "payload.c"),)
    bad = JobSpec("j", "test.echo", limits=(LimitRef("cap", "k", 0),))
    assert field_of(lambda: validate_job(bad, Handlers())) == "limits[0].units"


def test_units_are_checked_against_the_limits_named() -> None:
    limits = {
        "cap": LimitSpec("cap", LimitKind.CONCURRENCY, 3),
        "rate": LimitSpec("rate", LimitKind.RATE, 5, SECOND, burst=2),
    }
    check_units([LimitRef("cap", "k", 3), LimitRef("rate", "k", 7)], limits)
    assert field_of(lambda: check_units([LimitRef("cap", "k"), LimitRef("nope", "k")], limits)) == "limits[1].limit"
    assert field_of(lambda: check_units([LimitRef("cap", "k", 4)], limits)) == "limits[0].units"
    assert field_of(lambda: check_units([LimitRef("rate", "k", 8)], limits)) == "limits[0].units"


# -- key templates -------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=MAX_KEY_LENGTH).filter(lambda t: "\x00" not in t and t != "payload"))
def test_a_template_is_a_constant_unless_it_starts_with_payload(text: str) -> None:
    if text.startswith("payload.") and "" in text.removeprefix("payload.").split("."):
        assert field_of(lambda: KeyTemplate.parse(text)) == "key"  # a path with an empty field
        return
    template = KeyTemplate.parse(text)
    assert template.text == text
    if text.startswith("payload."):
        assert template.path == tuple(text.removeprefix("payload.").split("."))
    else:
        assert template.path is None
        assert template.resolve({"anything": 1}) == text  # a constant ignores the payload


@pytest.mark.parametrize("text", ["", "payload", "payload.", "payload.a.", "payload..b", "x" * 201, "a\x00b"])
def test_bad_templates_are_refused(text: str) -> None:
    assert field_of(lambda: KeyTemplate.parse(text, "limits[2].key")) == "limits[2].key"


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    return dict(nested)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@given(st.lists(fields, min_size=1, max_size=5), scalars)
def test_a_path_resolves_to_its_scalar_as_text(path: list[str], value: Any) -> None:
    template = KeyTemplate.parse("payload." + ".".join(path))
    payload = _nest(path, value)
    assert template.resolve(payload) == _text(value)
    assert resolve_keys([LimitRef("cap", template.text, 3)], payload) == [("cap", _text(value), 3)]


@given(
    st.lists(fields, min_size=1, max_size=5),
    st.one_of(
        st.none(),
        st.floats(allow_nan=False).filter(lambda f: not f.is_integer()),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(fields, st.integers(), max_size=2),
        st.just(""),
        st.text(min_size=MAX_KEY_LENGTH + 1, max_size=MAX_KEY_LENGTH + 5).filter(lambda t: "\x00" not in t),
        st.just("nul\x00inside"),
    ),
)
def test_a_path_to_anything_else_fails_with_the_limit_named(path: list[str], value: Any) -> None:
    payload = _nest(path, value)
    with pytest.raises(LimitKeyError, match=r"^limit 'cap': key payload\."):
        resolve_keys([LimitRef("cap", "payload." + ".".join(path))], payload)


@given(st.lists(fields, min_size=1, max_size=4), st.lists(fields, min_size=1, max_size=4), scalars)
def test_a_missing_path_fails(path: list[str], other: list[str], value: Any) -> None:
    payload = _nest(path, value)
    wanted = path + other  # deeper than the value: the walk meets a scalar where an object should be
    with pytest.raises(LimitKeyError, match="not an object"):
        KeyTemplate.parse("payload." + ".".join(wanted)).resolve(payload)
    if other[0] != path[0]:
        with pytest.raises(LimitKeyError, match="no such field"):
            KeyTemplate.parse("payload." + ".".join(other)).resolve(payload)


def test_resolution_keeps_the_refs_order_and_reports_the_first_failure() -> None:
    refs = [LimitRef("host", "billing-api"), LimitRef("cap", "payload.customer.id", 2)]
    assert resolve_keys(refs, {"customer": {"id": 42}}) == [("host", "billing-api", 1), ("cap", "42", 2)]
    with pytest.raises(LimitKeyError) as raised:
        resolve_keys(refs, {"customer": [1]})
    assert str(raised.value) == "limit 'cap': key payload.customer.id: payload.customer is an array, not an object"
    assert resolve_keys([], {}) == []


@given(
    st.lists(
        st.builds(LimitRef, fields.map(lambda f: "l" + f), st.just("payload.x"), st.integers(1, 99)),
        max_size=4,
    ),
    st.dictionaries(fields, st.builds(Override, st.integers(1, 100), st.integers(0, 100)), max_size=5),
)
def test_stored_forms_round_trip(refs: list[LimitRef], overrides: dict[str, Override]) -> None:
    assert refs_from_json(refs_to_json(refs)) == tuple(refs)
    assert overrides_from_json(overrides_to_json(overrides)) == overrides
