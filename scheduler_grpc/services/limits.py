"""LimitService: limit definitions through `Control.limits`, limit keys through `Control.limit_keys`
(the rights are in `auth.METHOD_ROLES`)."""

from __future__ import annotations

import re
from typing import Any, Final

import grpc
from google.protobuf import field_mask_pb2
from scheduler_client.v1 import limits_pb2, limits_pb2_grpc

from scheduler_grpc.application import Api
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.limits import Limit, LimitSpec
from scheduler_grpc.services import convert

Context = grpc.aio.ServicerContext[Any, Any]

_ETAG: Final = re.compile(r'W/"(\d{1,18})"')
_WRITABLE: Final = ("kind", "limit", "period", "burst", "overrides")
_OUTPUT_ONLY: Final = frozenset({"id", "etag", "create_time", "update_time"})


def _expected_version(etag: str) -> int | None:
    """The version an etag names (None: no etag, no check).

    Raises:
        InvalidArgument: naming `etag`: not one this server issued.
    """
    if not etag:
        return None
    match = _ETAG.fullmatch(etag.strip())
    if match is None:
        raise InvalidArgument("etag", f"{etag[:40]!r} is not an etag this server issued")
    return int(match.group(1))


def _update_paths(mask: field_mask_pb2.FieldMask) -> list[str]:
    """The writable Limit fields `mask` names (all of them for an empty mask).

    Raises:
        InvalidArgument: naming `update_mask`: an unknown, output-only or immutable path.
    """
    if not mask.paths:
        return list(_WRITABLE)
    for path in mask.paths:
        if path in _OUTPUT_ONLY:
            raise InvalidArgument("update_mask", f"{path!r} is output only")
        if path == "name":
            raise InvalidArgument("update_mask", "'name' cannot be changed (jobs refer to a limit by name)")
        if path not in _WRITABLE:
            raise InvalidArgument("update_mask", f"unknown field {path!r}")
    return list(dict.fromkeys(mask.paths))


class LimitService(limits_pb2_grpc.LimitServiceServicer):
    """CRUD on limits plus per-key overrides, through `Control.limits`."""

    def __init__(self, api: Api) -> None:
        self._control = api.control

    async def CreateLimit(
        self, request: limits_pb2.CreateLimitRequest, context: Context
    ) -> limits_pb2.CreateLimitResponse:
        if not request.HasField("limit"):
            raise InvalidArgument("limit", "required")
        with convert.limit_fields():
            limit = await self._control.limits.create_limit(
                convert.limit_spec(request.limit), request_id=request.request_id or None
            )
        return limits_pb2.CreateLimitResponse(limit=convert.limit_to_proto(limit))

    async def GetLimit(self, request: limits_pb2.GetLimitRequest, context: Context) -> limits_pb2.GetLimitResponse:
        if request.id or not request.name:
            limit = await self._control.limits.get_limit(convert.resource_id(request.id))
        else:
            limit = await self._control.limits.get_limit_by_name(request.name)
        return limits_pb2.GetLimitResponse(limit=convert.limit_to_proto(limit))

    async def ListLimits(
        self, request: limits_pb2.ListLimitsRequest, context: Context
    ) -> limits_pb2.ListLimitsResponse:
        page = await self._control.limits.list_limits(convert.page_size(request.page_size), request.page_token)
        return limits_pb2.ListLimitsResponse(
            limits=[convert.limit_to_proto(limit) for limit in page.limits], next_page_token=page.next_page_token
        )

    async def UpdateLimit(
        self, request: limits_pb2.UpdateLimitRequest, context: Context
    ) -> limits_pb2.UpdateLimitResponse:
        if not request.HasField("limit"):
            raise InvalidArgument("limit", "required")
        limit_id = convert.resource_id(request.limit.id, "limit.id")
        paths = _update_paths(request.update_mask)

        def merge(current: Limit) -> LimitSpec:
            merged = convert.limit_to_proto(current)
            field_mask_pb2.FieldMask(paths=paths).MergeMessage(
                request.limit, merged, replace_message_field=True, replace_repeated_field=True
            )
            return convert.limit_spec(merged)

        with convert.limit_fields():  # covers `merge` too: it runs inside merge_limit
            limit = await self._control.limits.merge_limit(
                limit_id, merge, expected_version=_expected_version(request.etag)
            )
        return limits_pb2.UpdateLimitResponse(limit=convert.limit_to_proto(limit))

    async def DeleteLimit(
        self, request: limits_pb2.DeleteLimitRequest, context: Context
    ) -> limits_pb2.DeleteLimitResponse:
        await self._control.limits.delete_limit(
            convert.resource_id(request.id), expected_version=_expected_version(request.etag)
        )
        return limits_pb2.DeleteLimitResponse()

    async def SetLimitOverride(
        self, request: limits_pb2.SetLimitOverrideRequest, context: Context
    ) -> limits_pb2.SetLimitOverrideResponse:
        limit_id = convert.resource_id(request.id)
        override = convert.override(request.override) if request.HasField("override") else None
        limit = await self._control.limits.set_override(
            limit_id, request.key, override, expected_version=_expected_version(request.etag)
        )
        return limits_pb2.SetLimitOverrideResponse(limit=convert.limit_to_proto(limit))

    # -- limit keys (`Control.limit_keys`) --------------------------------------------------------

    async def GetLimitKey(
        self, request: limits_pb2.GetLimitKeyRequest, context: Context
    ) -> limits_pb2.GetLimitKeyResponse:
        state = await self._control.limit_keys.key_state(request.limit, request.key, queue=request.queue or None)
        return limits_pb2.GetLimitKeyResponse(state=convert.limit_key_state_to_proto(state))

    async def PauseLimitKey(
        self, request: limits_pb2.PauseLimitKeyRequest, context: Context
    ) -> limits_pb2.PauseLimitKeyResponse:
        end = request.WhichOneof("end")
        state = await self._control.limit_keys.pause_key(
            request.limit,
            request.key,
            duration=convert.from_duration(request.duration, "duration") if end == "duration" else None,
            until=convert.from_timestamp(request.pause_end_time, "pause_end_time") if end == "pause_end_time" else None,
            queue=request.queue or None,
        )
        return limits_pb2.PauseLimitKeyResponse(state=convert.limit_key_state_to_proto(state))

    async def ResumeLimitKey(
        self, request: limits_pb2.ResumeLimitKeyRequest, context: Context
    ) -> limits_pb2.ResumeLimitKeyResponse:
        state = await self._control.limit_keys.resume_key(request.limit, request.key, queue=request.queue or None)
        return limits_pb2.ResumeLimitKeyResponse(state=convert.limit_key_state_to_proto(state))
