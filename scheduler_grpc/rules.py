"""Rules on names and numbers that several layers check, each written once here.

The API (INVALID_ARGUMENT), the configuration, the queue and the job model import these; the
database schema repeats them as CHECK constraints (SQL cannot import), and a test compares the
constraints of a migrated database with this module.
"""

from __future__ import annotations

import re
from typing import Final

QUEUE_NAME_PATTERN: Final = r"[A-Za-z0-9_.-]{1,64}"
"""A queue name: 1-64 letters, digits, '_', '.' or '-' (it becomes part of Redis keys)."""
QUEUE_NAME_RULE: Final = "expected 1-64 letters, digits, '_', '.' or '-'"
"""What an error says about a bad queue name."""
_QUEUE_NAME: Final = re.compile(QUEUE_NAME_PATTERN)

PRIORITY_MIN: Final = -1000
"""Least urgent priority."""
PRIORITY_MAX: Final = 1000
"""Most urgent priority (the queue's ready score also depends on it: see lua/_ready_score.lua)."""


def is_queue_name(name: object) -> bool:
    """Whether `name` is a valid queue name."""
    return isinstance(name, str) and _QUEUE_NAME.fullmatch(name) is not None


def is_priority(priority: object) -> bool:
    """Whether `priority` is an int within [PRIORITY_MIN, PRIORITY_MAX] (bool is not a priority)."""
    return isinstance(priority, int) and not isinstance(priority, bool) and PRIORITY_MIN <= priority <= PRIORITY_MAX


NAME_PATTERN: Final = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}"
"""A job's or a limit's name: a letter or digit, then letters, digits, '_', '.', ':' or '-' (at most 200)."""
NAME_RULE: Final = "use letters, digits and _ . : - (starting with a letter or digit), at most 200 characters"
"""What an error says about a bad job or limit name."""
_NAME: Final = re.compile(NAME_PATTERN)


def is_name(name: object) -> bool:
    """Whether `name` is a valid job or limit name."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None
