"""Domain errors.

Every module raises these; the gRPC layer maps them to status codes in one place and the CLI
prints them as one line. Messages name the field or setting at fault and say what to do.
"""

from __future__ import annotations


class SchedulerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(SchedulerError):
    """A setting is invalid or a server it names cannot be reached (exit code 2 at start-up)."""


class InvalidArgument(SchedulerError):
    """Input that fails validation; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFound(SchedulerError):
    """The named resource does not exist."""


class AlreadyExists(SchedulerError):
    """A resource with that unique name already exists."""


class FailedPrecondition(SchedulerError):
    """The resource is not in a state that allows the operation."""


class Aborted(SchedulerError):
    """A concurrent change won (stale etag or version)."""


class Unavailable(SchedulerError):
    """A backing server (Redis, PostgreSQL) cannot be reached right now."""


class Fenced(SchedulerError):
    """A write was attempted under a leader term that is no longer current."""


class LeaseLost(SchedulerError):
    """The caller's queue lease expired and was handed to someone else."""
