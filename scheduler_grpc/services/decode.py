"""Request decoding that answers a malformed message with INVALID_ARGUMENT naming the field.

grpc.aio decodes a request with the handler's deserializer before any interceptor or servicer
runs, and a deserializer that raises (protobuf's `DecodeError`: a string field that is not UTF-8,
a Struct nested past protobuf's recursion limit, truncated bytes) ends the call with
`UNKNOWN: Unexpected <class 'DecodeError'>`. Here the deserializer never raises: it returns an
`Undecodable` carrying the field path of the fault (found by walking the wire format along the
message's descriptor), and the servicer method, wrapped by `register`, raises `InvalidArgument`
with it, so the error interceptor maps it like any other client mistake.

A request that does decode is refused the same way when one of its string fields holds the NUL
character (U+0000): PostgreSQL's text and jsonb cannot store it (the statement fails: INTERNAL)
and Redis keys use it as a separator, so no field of any request may carry one (`find_nul`).
A payload's Struct is left to `jobs.check_json`, which names the JSON path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.jobs import MAX_PAYLOAD_DEPTH

# protobuf (upb) refuses messages nested deeper than this while decoding.
_UPB_MAX_DEPTH: Final = 100
_STRUCT: Final = "google.protobuf.Struct"
_VALUE: Final = "google.protobuf.Value"
_LIST: Final = "google.protobuf.ListValue"
# Left to the payload's own validation (`jobs.check_json`), and skipped unread (a payload is large).
_JSON_TYPES: Final = frozenset({_STRUCT, _VALUE, _LIST})
NUL_MESSAGE: Final = "must not contain the NUL character (U+0000)"


@dataclass(frozen=True)
class Undecodable:
    """A request that did not decode, or holds a NUL character: the field path at fault and why."""

    field: str
    message: str


class _Malformed(Exception):
    """The wire bytes end or break inside a field."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        end = pos + 8
    elif wire_type == 5:
        end = pos + 4
    elif wire_type == 2:
        length, pos = _varint(data, pos)
        end = pos + length
    else:
        raise _Malformed  # groups (3, 4) are not used by proto3 messages; anything else is garbage
    if end > len(data):
        raise _Malformed
    return end


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _find_fault(descriptor: Descriptor, data: bytes, path: str, depth: int, json_depth: int) -> tuple[str, str] | None:
    """The first (field path, reason) that makes `data` undecodable as `descriptor`, if any.

    `json_depth` counts the Structs and ListValues around `data`, the nesting a payload's JSON has.
    """
    if depth >= _UPB_MAX_DEPTH:
        return path or "request", "nested too deeply"
    pos = 0
    counts: dict[int, int] = {}
    while pos < len(data):
        try:
            tag, after_tag = _varint(data, pos)
        except _Malformed:
            return path or "request", "malformed message bytes"
        number, wire_type = tag >> 3, tag & 7
        field = descriptor.fields_by_number.get(number)
        index = counts.get(number, 0)
        counts[number] = index + 1
        field_path = _field_path(descriptor, field, path, index)
        try:
            end = _skip(data, after_tag, wire_type)
        except _Malformed:
            return field_path, "malformed or truncated field bytes"
        if field is not None and wire_type == 2:
            _, start = _varint(data, after_tag)
            body = data[start:end]
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError:
                    return field_path, "not valid UTF-8"
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                child = field.message_type
                assert child is not None  # a message field has a message type
                if descriptor.full_name == _STRUCT:
                    field_path = _struct_entry_path(body, path)
                nested = json_depth + (1 if child.full_name in (_STRUCT, _LIST) else 0)
                if nested > MAX_PAYLOAD_DEPTH:
                    return field_path, f"nested deeper than {MAX_PAYLOAD_DEPTH} objects or arrays"
                fault = _find_fault(child, body, field_path, depth + 1, nested)
                if fault is not None:
                    return fault
        pos = end
    return None


def _field_path(descriptor: Descriptor, field: FieldDescriptor | None, path: str, index: int) -> str:
    """How a client names a field: Struct keys and list indexes as JSON paths (`payload.a[2]`)."""
    if field is None:
        return path or "request"  # a field this message does not have: blame where it sits
    if descriptor.full_name == _VALUE or descriptor.GetOptions().map_entry:
        return path  # a Value and a map entry add nothing; a Struct's entry adds its key (below)
    if descriptor.full_name == _LIST or field.is_repeated:
        base = path if descriptor.full_name == _LIST else _join(path, field.name)
        return f"{base}[{index}]"
    return _join(path, field.name)


def _struct_entry_path(data: bytes, path: str) -> str:
    """The path of a Struct map entry: its key appended (as far as it decodes)."""
    pos = 0
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            if tag == (1 << 3) | 2:
                length, pos = _varint(data, pos)
                return _join(path, data[pos : pos + length].decode("utf-8", errors="replace"))
            pos = _skip(data, pos, tag & 7)
    except _Malformed:
        pass
    return path


def find_nul(message: Message, path: str = "") -> tuple[str, str] | None:
    """The path of the first string field of `message` holding the NUL character, and why, if any;
    Structs (a payload) are not looked into.

    A repeated field's item is named by its index (`job.depends_on[1]`), a map's entry by its key
    (`limit.overrides['acme']`), as the domain's own checks name them.
    """
    for field, value in message.ListFields():
        field_path = _join(path, field.name)
        if field.type == FieldDescriptor.TYPE_STRING:
            items = enumerate(value) if field.is_repeated else [(None, value)]
            for index, text in items:
                if "\x00" in text:
                    return (field_path if index is None else f"{field_path}[{index}]"), NUL_MESSAGE
            continue
        child = field.message_type
        if child is None or child.full_name in _JSON_TYPES:
            continue
        if child.GetOptions().map_entry:
            found = _find_nul_in_map(child, value, field_path)
        elif field.is_repeated:
            found = next(
                (hit for index, item in enumerate(value) if (hit := find_nul(item, f"{field_path}[{index}]"))), None
            )
        else:
            found = find_nul(value, field_path)
        if found is not None:
            return found
    return None


def _find_nul_in_map(entry: Descriptor, entries: Any, path: str) -> tuple[str, str] | None:
    value_field = entry.fields_by_name["value"]
    for key, value in entries.items():
        if isinstance(key, str) and "\x00" in key:
            return path, f"a key {NUL_MESSAGE}"
        item_path = f"{path}[{str(key)[:40]!r}]"
        if value_field.type == FieldDescriptor.TYPE_STRING and "\x00" in value:
            return item_path, NUL_MESSAGE
        message_type = value_field.message_type
        if message_type is not None and message_type.full_name not in _JSON_TYPES:
            found = find_nul(value, item_path)
            if found is not None:
                return found
    return None


def diagnose(descriptor: Descriptor, data: bytes) -> Undecodable:
    """Why `data` does not decode as `descriptor`, as precisely as the wire format tells."""
    fault = _find_fault(descriptor, data, "", 0, 0)
    if fault is None:
        return Undecodable("request", f"not a valid {descriptor.full_name} message")
    return Undecodable(*fault)


def _deserializer(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    descriptor: Descriptor = message_class.DESCRIPTOR  # type: ignore[assignment]  # upb's Descriptor

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            message = message_class.FromString(data)
        except DecodeError:
            return diagnose(descriptor, data)
        # UTF-8 encodes U+0000, and only it, as a zero byte: most requests need no look.
        nul = find_nul(message) if b"\x00" in data else None
        return message if nul is None else Undecodable(*nul)

    return deserialize


def _refuse(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.field, request.message)


def _guard(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    # The wrapper keeps the behaviour's shape (async generator or coroutine function): the
    # interceptors, and grpc.aio, tell streams from unary calls by it.
    if inspect.isasyncgenfunction(behaviour):

        @functools.wraps(behaviour)
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            _refuse(request)
            async for item in behaviour(request, context):
                yield item

        return stream

    @functools.wraps(behaviour)
    async def unary(request: Any, context: Any) -> Any:
        _refuse(request)
        return await behaviour(request, context)

    return unary


def register(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Add `servicer`'s methods for `service` to `server` (what the generated `add_*_to_server`
    does), with deserializers that never raise."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        if method.client_streaming:
            if not method.server_streaming:
                raise NotImplementedError(f"{method.full_name}: client streams are supported only bidirectional")
            # A bidirectional stream (WorkerService.Connect): each request may be an `Undecodable`,
            # which the servicer answers itself (refusing one message must not end the stream).
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=_deserializer(request_class),
                response_serializer=response_class.SerializeToString,
            )
            continue
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            _guard(getattr(servicer, method.name)),
            request_deserializer=_deserializer(request_class),
            response_serializer=_serialize if method.server_streaming else response_class.SerializeToString,
        )
    # Generic handlers only, not also `add_registered_method_handlers` as generated code does:
    # grpc.aio keeps one pending call request per registered method and waits on all of them for
    # every call (grpc/grpc#43461), which cost ~100 us per call with our ~40 methods. A generic
    # handler is looked up in a dict by method name: the same answer for ~25 us.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _serialize(response: Message | bytes) -> bytes:
    """A stream's response: a message, or the wire bytes of one, encoded once and shared by many
    streams (WatchExecutions, `services.executions.EventWire`)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


class GenericOnly:
    """A server as seen by generated `add_*_to_server` code (health, reflection): its generic
    handlers are added, its registered-method handlers dropped (see `register` for why)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        """Dropped: the generic handler added with them serves the same methods."""
