"""Page tokens: opaque, checked, and bound to the listing that issued them.

A token carries the position after the last item of a page (a job name; an execution's creation
time and id), the kind of listing and the request's filters, and a keyed BLAKE2b checksum over
all of it. Every list call decodes its token here, so they all refuse the same things the same way
with INVALID_ARGUMENT naming `page_token`: bytes that are not a token, a token that was altered or
built by hand, a token of another listing, and a token reused with different filters (AIP-158).

The key is fixed, not a secret (tokens must work on every stateless server replica, and a page
token grants nothing the caller's filters would not): the checksum tells tokens this server issued
from forged or corrupted ones, it does not hide their content.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, Final

import orjson

from scheduler_grpc.errors import InvalidArgument

_KEY: Final = b"scheduler.v1 page token"
_DIGEST: Final = 12
_VERSION: Final = 1
MAX_TOKEN_LENGTH: Final = 1024


def _mac(body: bytes) -> bytes:
    return hashlib.blake2b(body, key=_KEY, digest_size=_DIGEST).digest()


def encode(kind: str, scope: Mapping[str, Any], position: list[Any]) -> str:
    """A token for the page after `position` of listing `kind` under filters `scope`."""
    body = orjson.dumps({"v": _VERSION, "k": kind, "s": scope, "p": position}, option=orjson.OPT_SORT_KEYS)
    return base64.urlsafe_b64encode(_mac(body) + body).decode().rstrip("=")


def decode(token: str, kind: str, scope: Mapping[str, Any]) -> list[Any]:
    """The position a token of listing `kind` under filters `scope` carries.

    Raises:
        InvalidArgument: naming `page_token`: not a token this server issued for this listing, or
            issued with other filters.
    """
    if len(token) > MAX_TOKEN_LENGTH:
        raise InvalidArgument("page_token", "not a token this server issued")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, binascii.Error):
        raise InvalidArgument("page_token", "not a token this server issued") from None
    mac, body = raw[:_DIGEST], raw[_DIGEST:]
    if len(mac) != _DIGEST or not hmac.compare_digest(mac, _mac(body)):
        raise InvalidArgument("page_token", "not a token this server issued")
    try:
        content = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidArgument("page_token", "not a token this server issued") from None
    if not isinstance(content, dict) or content.get("v") != _VERSION or content.get("k") != kind:
        raise InvalidArgument("page_token", "not a token of this listing")
    if content.get("s") != orjson.loads(orjson.dumps(scope)):
        raise InvalidArgument("page_token", "was issued for other filters; list again from the first page")
    position = content.get("p")
    if not isinstance(position, list):
        raise InvalidArgument("page_token", "not a token this server issued")
    return position
