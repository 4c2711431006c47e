"""`services.convert.timestamp` builds Timestamps by integer arithmetic: the same message as
protobuf's own FromDatetime for every aware datetime, any zone, before and after the epoch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from google.protobuf import timestamp_pb2

from scheduler_grpc.services.convert import from_timestamp, timestamp

VALUES = [
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(2026, 12, 1, 23, 59, 59, 999_999, tzinfo=UTC),
    datetime(2026, 7, 14, 12, 30, 0, 1, tzinfo=ZoneInfo("Europe/Paris")),
    datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=UTC),  # before the epoch: nanos stay >= 0
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=timezone(timedelta(hours=12))),
]


@pytest.mark.parametrize("value", VALUES, ids=str)
def test_timestamp_matches_protobufs_own_conversion(value: datetime) -> None:
    expected = timestamp_pb2.Timestamp()
    expected.FromDatetime(value.astimezone(UTC))
    message = timestamp(value)
    assert message is not None
    assert (message.seconds, message.nanos) == (expected.seconds, expected.nanos)
    assert from_timestamp(message, "t") == value


def test_none_stays_unset() -> None:
    assert timestamp(None) is None
