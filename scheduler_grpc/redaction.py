"""Secrets in job payloads and run results: readable only by the role that may write jobs.

A webhook job's payload carries its `Authorization` header; every viewer of the job used to read
it (console and API alike). The application layer now hands a job or a run to a caller through
`job_for` / `execution_for`, which replace secret values with `REDACTED` for a caller below
`SECRET_READER`.

Who reads secrets: the role that may create and update jobs (`JobService/UpdateJob` in the role
table, admin). Hiding them from that role would buy nothing (it can point the webhook at a server
of its own and receive the header) and would break editing (a form saved with `<redacted>` would
overwrite the secret). Operators (who trigger, pause and cancel, but do not define jobs) and
viewers see them redacted.

What is a secret (the rule, applied at any depth of a JSON value):

* the value of a key whose words include a secret word: `authorization`, `password`, `passwd`,
  `secret`, `token`, `cookie`, `credential(s)`, `apikey`/`api_key`, `private_key`, `auth`
  (`X-Auth-Token`, `client_secret`, `proxy-authorization`, `Set-Cookie`, `accessToken` ... ), the key
  split into words at `-`, `_`, `.`, spaces and lower-to-upper case changes;
* any string that is a credential by its form: `Bearer ...`, `Basic ...`, `Token ...`, `Digest ...`;
* the password of a URL with one (`https://user:password@host/`), which keeps the rest of the URL.

Free text (an error message: a node's error on the flow run page, a live row, a dead letter) is
not JSON: in it the credentials recognisable by their form are redacted (`redact_text`): a scheme
and a credential (`Bearer eyJ...`, the credential at least 8 characters with a digit, so prose
such as "basic auth failed" stays), `name=value` or `name: value` of a secret name
(`password=...`, `Authorization: ...`), and the password of a URL.

Keys stay, so the reader still sees that a header is set. A payload value a job takes from an
upstream result (`{"$from": ...}`) is a reference, not a secret, and is shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from scheduler_grpc.auth import Role
from scheduler_grpc.executions import Execution
from scheduler_grpc.flows import FROM_KEY
from scheduler_grpc.jobs import Job

SECRET_READER: Final = Role.ADMIN
"""The least role that reads secrets: the one `JobService/UpdateJob` needs (see the module doc)."""
REDACTED: Final = "<redacted>"
_SECRET_WORDS: Final = frozenset(
    {"authorization", "auth", "password", "passwd", "pwd", "secret", "token", "cookie", "credential", "credentials"}
)
# Secret names written as two words, compared with the separators removed.
_SECRET_COMPOUNDS: Final = ("apikey", "privatekey", "accesskey", "secretkey", "sessionid", "passphrase")
_WORD_SPLIT: Final = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_CREDENTIAL: Final = re.compile(r"^\s*(bearer|basic|token|digest|negotiate)\s+\S", re.IGNORECASE)
_URL_WITH_PASSWORD: Final = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]*@", re.IGNORECASE)
# The same three forms inside free text (see the module doc).
_CREDENTIAL_IN_TEXT: Final = re.compile(
    r"\b(bearer|basic|token|digest|negotiate)(\s+)(?=[A-Za-z0-9._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE
)
_SECRET_ASSIGNMENT: Final = re.compile(
    r"\b((?:proxy[-_])?authorization|password|passwd|secret|client[-_]?secret|api[-_]?key|access[-_]?token"
    r"|token|cookie)([\"']?\s*[:=]\s*[\"']?)(?!<redacted>)(?:(?:bearer|basic|token|digest)\s+)?[^\s\"',;&})\]]+",
    re.IGNORECASE,
)
_URL_PASSWORD_IN_TEXT: Final = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/@\s:]*:)[^/@\s]+(@)", re.IGNORECASE)


def sees_secrets(role: Role) -> bool:
    """Whether `role` reads payloads and results unredacted."""
    return role.allows(SECRET_READER)


def secret_key(key: str) -> bool:
    """Whether a value under `key` is a secret (by the key's name)."""
    words = [word.lower() for word in _WORD_SPLIT.split(key) if word]
    if any(word in _SECRET_WORDS for word in words):
        return True
    compact = "".join(words)
    return any(compound in compact for compound in _SECRET_COMPOUNDS)


def _redact_string(text: str) -> str:
    if _CREDENTIAL.match(text):
        return REDACTED
    if _URL_WITH_PASSWORD.match(text):
        try:
            parts = urlsplit(text)
        except ValueError:
            return REDACTED
        host = parts.netloc.rpartition("@")[2]
        user = parts.netloc.rpartition("@")[0].partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))
    return text


def redact(value: Any) -> Any:
    """`value` (JSON) with every secret replaced by `REDACTED` (a new value; `value` is not changed)."""
    if isinstance(value, Mapping):
        if set(value) == {FROM_KEY}:
            return dict(value)  # a `$from` reference names an upstream result, it holds no secret
        return {
            key: (REDACTED if secret_key(str(key)) and item is not None else redact(item))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return _redact_string(value)
    return value


def redact_text(text: str) -> str:
    """Free `text` (an error message) with the credentials recognisable by their form replaced by
    `REDACTED` (the rule in the module doc; the rest of the text is kept)."""
    text = _URL_PASSWORD_IN_TEXT.sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(2)}", text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return _CREDENTIAL_IN_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def error_for(role: Role, error: str) -> str:
    """An error message as a caller with `role` may read it (credentials redacted below SECRET_READER)."""
    return error if sees_secrets(role) or not error else redact_text(error)


def error_matches(role: Role, error: str, term: str) -> bool:
    """Whether an error search for `term` finds `error` as a caller with `role` reads it: below
    SECRET_READER a term found only inside a redacted credential finds nothing, so a search is no
    oracle for a secret (the store's ILIKE selects candidates; this decides)."""
    return term.casefold() in error_for(role, error).casefold()


def job_for(role: Role, job: Job) -> Job:
    """`job` as a caller with `role` may read it (secrets of its payload redacted below SECRET_READER)."""
    if sees_secrets(role):
        return job
    return replace(job, payload=redact(job.payload))


def execution_for(role: Role, execution: Execution) -> Execution:
    """`execution` as a caller with `role` may read it (secrets of its result and credentials in its
    error redacted below SECRET_READER)."""
    if sees_secrets(role) or (execution.result is None and not execution.error):
        return execution
    return replace(
        execution,
        result=None if execution.result is None else redact(execution.result),
        error=redact_text(execution.error) if execution.error else execution.error,
    )
