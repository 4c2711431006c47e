"""The Lua scripts in `scheduler_grpc/lua/` and the text of Redis replies: one loader for every module.

A script may share code with others through a line `-- @include x`, replaced here by the file
`lua/_x.lua` (Redis scripts cannot import, and rules such as the ready-score layout must be written
exactly once). The scripts ship as package data next to this module; a plain path also works from
an editable install.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Final

LUA_DIR: Final = Path(__file__).resolve().parent / "lua"
"""Where the scripts are."""

_INCLUDE: Final = re.compile(r"^-- @include ([a-z_]+)$", re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    """The source of `lua/<name>.lua`, its `-- @include x` lines replaced by `lua/_x.lua`.

    Args:
        name: The script's file name without `.lua`, e.g. `queue_enqueue`.

    Raises:
        FileNotFoundError: no such script (a bug: the scripts ship with the package).
    """
    text = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda match: (LUA_DIR / f"_{match.group(1)}.lua").read_text(encoding="utf-8"), text)


def text(value: object) -> str:
    """A Redis reply as text, whether the client decodes responses or not (bytes are UTF-8;
    an undecodable byte becomes U+FFFD rather than failing a read of someone else's data)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
