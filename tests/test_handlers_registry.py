"""Handler registry: lookup, payload validation rules shared by all handlers, and plugin loading."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from ipaddress import ip_network
from typing import Any, ClassVar

import orjson
import pytest

from scheduler_grpc import config
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import (
    BUILTIN_HANDLERS,
    MAX_PAYLOAD_BYTES,
    ExecutionContext,
    Field,
    Handler,
    HandlerRegistry,
    HandlerSettings,
    JSONValue,
    default_registry,
    load_plugins,
)

BUILTIN_NAMES = [
    "http.webhook",
    "shell.command",
    "system.cleanup",
    "test.crash",
    "test.delay",
    "test.echo",
    "test.fail",
    "test.log",
    "test.result",
]


class GreetHandler(Handler):
    name: ClassVar[str] = "acme.greet"
    description: ClassVar[str] = "Greets someone"
    fields: ClassVar[tuple[Field, ...]] = (Field("who", "string", "whom to greet", required=True),)

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        return {"greeting": f"hello {payload['who']}"}


class AbstractPlugin(Handler):
    name: ClassVar[str] = "acme.abstract"
    description: ClassVar[str] = "forgot run"


class BadNamePlugin(GreetHandler):
    name: ClassVar[str] = "Acme Greet!"


class ClashPlugin(GreetHandler):
    name: ClassVar[str] = "test.echo"


class ExplodingPlugin(GreetHandler):
    name: ClassVar[str] = "acme.explode"

    def __init__(self) -> None:
        raise RuntimeError("cannot start")


@dataclass
class FakeEntryPoint:
    """Stands in for importlib.metadata.EntryPoint: our loader only calls `.load()`."""

    name: str
    target: object = None
    error: BaseException | None = None

    def load(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.target


def registry(**settings: Any) -> HandlerRegistry:
    return default_registry(HandlerSettings(**settings), plugins=False)


def test_builtins_registered_and_iterable() -> None:
    reg = registry()
    assert reg.names() == BUILTIN_NAMES
    assert [h.name for h in reg] == BUILTIN_NAMES
    assert len(reg) == len(BUILTIN_HANDLERS)
    assert "http.webhook" in reg
    assert reg.get("test.echo").name == "test.echo"


def test_unknown_handler_names_the_field_and_lists_known() -> None:
    with pytest.raises(InvalidArgument) as err:
        registry().get("nope")
    assert err.value.field == "handler"
    assert "unknown handler 'nope'" in err.value.message
    assert "http.webhook" in err.value.message
    with pytest.raises(InvalidArgument, match="handler: unknown handler"):
        registry().validate("nope", {})


@pytest.mark.parametrize(
    ("handler", "payload", "field"),
    [
        ("test.delay", {"seconds": 1, "sconds": 2}, "payload.sconds"),
        ("system.cleanup", {"retention": 3}, "payload.retention"),
        ("http.webhook", {"url": "https://example.com/", "verb": "GET"}, "payload.verb"),
        ("test.log", {"message": "m", "lvl": "INFO"}, "payload.lvl"),
    ],
)
def test_unknown_payload_field_is_an_error(handler: str, payload: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        registry().validate(handler, payload)
    assert err.value.field == field
    assert "unknown field" in err.value.message


def test_missing_required_field_is_named() -> None:
    with pytest.raises(InvalidArgument) as err:
        registry().validate("test.delay", {})
    assert err.value.field == "payload.seconds"
    assert "required" in err.value.message


def test_payload_limits() -> None:
    reg = registry()
    big = {"blob": "x" * MAX_PAYLOAD_BYTES}
    assert len(orjson.dumps(big)) > MAX_PAYLOAD_BYTES
    with pytest.raises(InvalidArgument) as err:
        reg.validate("test.echo", big)
    assert err.value.field == "payload"
    assert "bytes" in err.value.message
    assert reg.validate("test.echo", {"blob": "x" * 1000}) == {"blob": "x" * 1000}
    with pytest.raises(InvalidArgument) as err:
        reg.validate("test.echo", [1, 2])  # type: ignore[arg-type]
    assert err.value.field == "payload"
    with pytest.raises(InvalidArgument) as err:
        reg.validate("test.echo", {"when": {1: 2}})
    assert err.value.field == "payload.when"  # the object whose key is not a string


def test_describe_lists_fields_and_enabled_state() -> None:
    described: dict[Any, Any] = {entry["name"]: entry for entry in registry().describe()}
    assert set(described) == set(BUILTIN_NAMES)
    shell = described["shell.command"]
    assert shell["admin_only"] is True
    assert shell["enabled"] is False
    assert "SCHEDULER_SHELL_ENABLED" in str(shell["disabled_reason"])
    webhook = described["http.webhook"]
    assert webhook["enabled"] is True
    fields = {f["name"]: f for f in webhook["fields"]}
    assert fields["url"]["required"] is True
    assert fields["method"]["default"] == "POST"
    assert set(fields["url"]) == {"name", "type", "required", "default", "description"}
    orjson.dumps(registry().describe())  # JSON-able
    assert registry(shell_enabled=True).describe()[1]["enabled"] is True


def test_settings_from_process_settings() -> None:
    settings = config.load(
        {"SCHEDULER_SHELL_ENABLED": "true", "SCHEDULER_WEBHOOK_ALLOWLIST": "10.0.0.0/8,127.0.0.1/32"}, {}
    )
    handler_settings = HandlerSettings.from_settings(settings)
    assert handler_settings == HandlerSettings(
        shell_enabled=True,
        webhook_allowlist=(ip_network("10.0.0.0/8"), ip_network("127.0.0.1/32")),
        dev_mode=True,
    )
    production = config.load(
        {"SCHEDULER_ENV": "production", "REDIS_URL": "redis://r:6379/0", "DATABASE_URL": "postgresql://p/db"}, {}
    )
    assert HandlerSettings.from_settings(production).dev_mode is False


def test_register_rejects_duplicates_and_bad_names() -> None:
    reg = HandlerRegistry(HandlerSettings(), [GreetHandler()])
    with pytest.raises(ValueError, match="registered already"):
        reg.register(GreetHandler())
    with pytest.raises(TypeError, match="lowercase dotted"):
        reg.register(BadNamePlugin())


async def test_plugin_loaded_and_broken_plugins_skipped(caplog: pytest.LogCaptureFixture) -> None:
    entry_points = [
        FakeEntryPoint("greet", GreetHandler),
        FakeEntryPoint("missing", error=ModuleNotFoundError("No module named 'acme_missing'")),
        FakeEntryPoint("not-a-class", target=lambda: None),
        FakeEntryPoint("not-a-handler", target=dict),
        FakeEntryPoint("abstract", AbstractPlugin),
        FakeEntryPoint("bad-name", BadNamePlugin),
        FakeEntryPoint("clash", ClashPlugin),
        FakeEntryPoint("explode", ExplodingPlugin),
        FakeEntryPoint("exits", error=SystemExit(3)),
        FakeEntryPoint("greet-again", GreetHandler),
    ]
    with caplog.at_level(logging.INFO, logger="scheduler_grpc.handlers.base"):
        reg = default_registry(HandlerSettings(), entry_points=entry_points)
    assert reg.names() == sorted([*BUILTIN_NAMES, "acme.greet"])
    skipped = {record.plugin for record in caplog.records if record.levelno == logging.ERROR}  # type: ignore[attr-defined]
    assert skipped == {
        "missing",
        "not-a-class",
        "not-a-handler",
        "abstract",
        "bad-name",
        "clash",
        "explode",
        "exits",
        "greet-again",
    }
    assert reg.get("test.echo").__class__.__name__ == "EchoHandler"  # the built-in won the clash
    assert reg.validate("acme.greet", {"who": "ada"}) == {"who": "ada"}
    ctx = ExecutionContext(
        "e", "j", "job", 1, datetime.now(UTC), timedelta(seconds=5), reg.settings, None, logging.getLogger("t")
    )
    assert await reg.get("acme.greet").run(ctx, {"who": "ada"}) == {"greeting": "hello ada"}
    await reg.aclose()


def test_installed_plugins_are_listed_without_error() -> None:
    # No plugin is installed in the test environment; the real importlib path must still work.
    assert load_plugins() == []
    assert default_registry(HandlerSettings()).names() == BUILTIN_NAMES


def test_breaker_keys() -> None:
    reg = registry()
    assert reg.get("test.fail").breaker_key({}) == "test.fail"
    webhook = reg.get("http.webhook")
    assert webhook.breaker_key({"url": "https://Hooks.Example.com:8443/x"}) == "http.webhook:hooks.example.com"
    assert webhook.breaker_key({"url": "http://0x7f.1/"}) == "http.webhook:127.0.0.1"
    assert webhook.breaker_key({"url": "not a url"}) == "http.webhook"
    assert webhook.breaker_key({}) == "http.webhook"
