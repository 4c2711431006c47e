"""The generated parts of the documentation site: nothing here is written by hand, nothing is copied.

* `api_reference()`: every service, method, message, enum and field of `protos/scheduler/v1`, with
  its comment, read from protoc's descriptors (source info kept), and each method's least role
  (`scheduler_grpc.auth.METHOD_ROLES`). `missing_comments()` lists the elements without a comment
  (tests/test_docs.py fails on any).
* `cli_reference()`: every `schedctl` command and flag, walked from its own argparse parser
  (`scheduler_client.cli.build_parser`).
* `TABLES`: the configuration and metrics tables (`scheduler_grpc.config`, `scheduler_grpc.metrics`),
  put where a page says `<!-- generated: NAME -->`.

`mkdocs build` calls this through scripts/mkdocs_hooks.py. Importing the module does nothing; run
`python scripts/docs_gen.py OUT_DIR` to write the generated pages into OUT_DIR for a look.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = "scheduler.v1"

# Field numbers of descriptor.proto, the steps of a SourceCodeInfo location path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


# ---------------------------------------------------------------- API reference (protos)


@dataclass(frozen=True)
class Element:
    """One documented element of a proto file: its kind, full name and comment."""

    kind: str  # service, method, message, field, enum, value
    name: str
    comment: str


def _descriptors() -> list[pb.FileDescriptorProto]:
    """The FileDescriptorProtos of protos/scheduler/v1, with their comments (protoc's source info)."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # a dev dependency, like the stub generation

    include = Path(protoc.__file__).parent / "_proto"
    sources = sorted(str(path.relative_to(PROTOS)) for path in (PROTOS / "scheduler" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        argv = ["protoc", f"-I{PROTOS}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}"]
        if protoc.main([*argv, *sources]) != 0:
            raise RuntimeError("protoc could not read protos/scheduler/v1")
        files = pb.FileDescriptorSet.FromString(out.read_bytes()).file
    return sorted(files, key=lambda f: f.name)


def _comments(file: pb.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Leading (else trailing) comment of every location of one file, by path."""
    found: dict[tuple[int, ...], str] = {}
    for location in file.source_code_info.location:
        text = (location.leading_comments or location.trailing_comments).strip()
        if text:
            found[tuple(location.path)] = " ".join(line.strip() for line in text.splitlines())
    return found


@dataclass
class _Walk:
    """What one pass over the descriptors yields: the elements, and the Markdown sections."""

    elements: list[Element]
    services: list[str]
    messages: list[str]
    enums: list[str]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _anchor(full_name: str) -> str:
    return full_name.removeprefix(PACKAGE + ".").replace(".", "-").lower()


def _type_ref(full_name: str) -> str:
    name = full_name.lstrip(".")
    if name.startswith(PACKAGE + "."):
        short = name.removeprefix(PACKAGE + ".")
        return f"[`{short}`](#{_anchor(name)})"
    if name.startswith("google.protobuf."):
        return f"`{name}`"
    return f"`{name}`"


def _walk() -> _Walk:
    field = pb.FieldDescriptorProto
    scalar = {
        value: name.removeprefix("TYPE_").lower()
        for name, value in field.Type.items()
        if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
    }
    roles = _method_roles()
    walk = _Walk([], [], [], [])
    for file in _descriptors():
        comments = _comments(file)
        maps = {
            f".{file.package}.{m.name}.{n.name}": n
            for m in _all_messages(file)
            for n in m.nested_type
            if n.options.map_entry
        }

        def type_of(f: pb.FieldDescriptorProto, maps: dict[str, pb.DescriptorProto] = maps) -> str:
            if f.type_name in maps:
                entry = maps[f.type_name]
                key, value = entry.field
                return f"map<{type_of(key)}, {type_of(value)}>"
            linked = f.type in (field.TYPE_MESSAGE, field.TYPE_ENUM)
            base = _type_ref(f.type_name) if linked else f"`{scalar[f.type]}`"
            if f.label == field.LABEL_REPEATED:
                return f"repeated {base}"
            if f.proto3_optional:
                return f"optional {base}"
            return base

        for s_index, service in enumerate(file.service):
            full = f"{file.package}.{service.name}"
            text = comments.get((_FILE_SERVICE, s_index), "")
            walk.elements.append(Element("service", full, text))
            lines = [f"### {service.name} {{ #{_anchor(full)} }}", "", text, "", f"`{file.name}`", ""]
            lines += ["| method | request → response | least role | what it does |", "| --- | --- | --- | --- |"]
            for m_index, method in enumerate(service.method):
                method_text = comments.get((_FILE_SERVICE, s_index, _SERVICE_METHOD, m_index), "")
                walk.elements.append(Element("method", f"{full}.{method.name}", method_text))
                request = ("stream " if method.client_streaming else "") + _type_ref(method.input_type)
                response = ("stream " if method.server_streaming else "") + _type_ref(method.output_type)
                role = roles.get(f"/{full}/{method.name}", "none (no token needed)")
                lines.append(f"| `{method.name}` | {request} → {response} | {role} | {_cell(method_text)} |")
            walk.services.append("\n".join(lines))
        for e_index, enum in enumerate(file.enum_type):
            full = f"{file.package}.{enum.name}"
            walk.enums.append(_enum(enum, path=(_FILE_ENUM, e_index), full=full, comments=comments, walk=walk))
        for m_index, message in enumerate(file.message_type):
            full = f"{file.package}.{message.name}"
            path = (_FILE_MESSAGE, m_index)
            _message(message, path=path, full=full, comments=comments, walk=walk, type_of=type_of)
    return walk


def _all_messages(file: pb.FileDescriptorProto) -> Iterator[pb.DescriptorProto]:
    stack = list(file.message_type)
    while stack:
        message = stack.pop()
        yield message
        stack.extend(message.nested_type)


def _enum(
    enum: pb.EnumDescriptorProto,
    *,
    path: tuple[int, ...],
    full: str,
    comments: dict[tuple[int, ...], str],
    walk: _Walk,
) -> str:
    text = comments.get(path, "")
    walk.elements.append(Element("enum", full, text))
    lines = [f"### {full.removeprefix(PACKAGE + '.')} {{ #{_anchor(full)} }}", "", text, ""]
    lines += ["| value | number | meaning |", "| --- | ---: | --- |"]
    for v_index, value in enumerate(enum.value):
        value_text = comments.get((*path, _ENUM_VALUE, v_index), "")
        walk.elements.append(Element("value", f"{full}.{value.name}", value_text))
        lines.append(f"| `{value.name}` | {value.number} | {_cell(value_text)} |")
    return "\n".join(lines)


def _message(
    message: pb.DescriptorProto,
    *,
    path: tuple[int, ...],
    full: str,
    comments: dict[tuple[int, ...], str],
    walk: _Walk,
    type_of: Callable[[pb.FieldDescriptorProto], str],
) -> None:
    if message.options.map_entry:
        return  # shown as map<K, V> in its field
    text = comments.get(path, "")
    walk.elements.append(Element("message", full, text))
    lines = [f"### {full.removeprefix(PACKAGE + '.')} {{ #{_anchor(full)} }}", "", text, ""]
    oneofs = [o.name for o in message.oneof_decl]
    if message.field:
        lines += ["| field | number | type | meaning |", "| --- | ---: | --- | --- |"]
        for f_index, f in enumerate(message.field):
            field_text = comments.get((*path, _MESSAGE_FIELD, f_index), "")
            walk.elements.append(Element("field", f"{full}.{f.name}", field_text))
            in_oneof = f.HasField("oneof_index") and not f.proto3_optional
            note = f" (one of `{oneofs[f.oneof_index]}`)" if in_oneof else ""
            lines.append(f"| `{f.name}` | {f.number} | {type_of(f)}{note} | {_cell(field_text)} |")
    else:
        lines.append("No fields.")
    walk.messages.append("\n".join(lines))
    for n_index, nested in enumerate(message.nested_type):
        nested_full = f"{full}.{nested.name}"
        nested_path = (*path, _MESSAGE_NESTED, n_index)
        _message(nested, path=nested_path, full=nested_full, comments=comments, walk=walk, type_of=type_of)
    for e_index, enum in enumerate(message.enum_type):
        enum_path = (*path, _MESSAGE_ENUM, e_index)
        walk.enums.append(_enum(enum, path=enum_path, full=f"{full}.{enum.name}", comments=comments, walk=walk))


def _method_roles() -> dict[str, str]:
    from scheduler_grpc.auth import METHOD_ROLES

    return {
        method: "anyone (no token)" if role is None else str(getattr(role, "value", role))
        for method, role in METHOD_ROLES.items()
    }


def proto_elements() -> list[Element]:
    """Every service, method, message, field, enum and enum value of the API, with its comment."""
    return _walk().elements


def missing_comments() -> list[str]:
    """The elements of the API that have no comment: `kind name` each."""
    return [f"{e.kind} {e.name}" for e in proto_elements() if not e.comment]


def api_reference() -> str:
    """The API reference page (Markdown)."""
    walk = _walk()
    return "\n\n".join([
        "# API reference",
        "Generated at build time from `protos/scheduler/v1/*.proto` by `scripts/docs_gen.py`: every "
        "service, method, message, enum and field with its comment in the `.proto` file "
        "(`tests/test_docs.py` fails when one has none). Each method's least role comes from "
        "`scheduler_grpc.auth.METHOD_ROLES`. How to call the API (authentication, errors, limits, paging, "
        "watching) is in [Using the API](../api.md).",
        "## Services",
        *walk.services,
        "## Messages",
        *sorted(walk.messages, key=lambda block: block.split("\n", 1)[0].lower()),
        "## Enums",
        *sorted(walk.enums, key=lambda block: block.split("\n", 1)[0].lower()),
    ]) + "\n"  # fmt: skip


# ---------------------------------------------------------------- CLI reference (schedctl)


def _parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    from scheduler_client.cli import build_parser

    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each direct subcommand, in the order the parser lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _options(parser: argparse.ArgumentParser, skip: set[str]) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.dest in skip:
            continue
        if action.option_strings:
            name = ", ".join(f"`{option}`" for option in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}`"
        takes = ""
        if action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if action.option_strings else "")
            takes = f"`{metavar}`" if metavar else ""
            if action.choices:
                takes = ", ".join(f"`{choice}`" for choice in action.choices)
        help_text = formatter._expand_help(action) if action.help and action.help != argparse.SUPPRESS else ""
        rows.append(f"| {name} | {takes} | {_cell(' '.join(help_text.split()))} |")
    if not rows:
        return []
    return ["| argument | value | meaning |", "| --- | --- | --- |", *rows]


def cli_reference() -> str:
    """The schedctl reference page (Markdown), walked from the parser schedctl itself uses."""
    top = _parser()
    global_dests = {action.dest for action in top._actions if action.option_strings}
    parts = [
        "# CLI reference: schedctl",
        "Generated at build time from schedctl's own argparse parser "
        "(`scheduler_client.cli.build_parser`, in `clients/python/scheduler_client/cli.py`) by "
        "`scripts/docs_gen.py`. A walk-through is in [Clients](../clients.md).",
        f"```text\n{top.format_usage().strip()}\n```",
        (top.description or "").strip(),
        "## Global flags",
        "They go before or after the command.",
        "\n".join(_options(top, set())),
    ]

    def visit(parser: argparse.ArgumentParser, words: list[str], level: int) -> None:
        for name, help_text, sub in _subcommands(parser):
            path = [*words, name]
            parts.append(f"{'#' * level} {' '.join(path)}")
            parts.append(f"```text\n{' '.join(sub.format_usage().split())}\n```")
            if help_text:
                parts.append(help_text)
            options = _options(sub, global_dests)
            if options:
                parts.append("\n".join(options))
            visit(sub, path, min(level + 1, 4))

    visit(top, ["schedctl"], 2)
    return "\n\n".join(part for part in parts if part) + "\n"


def cli_commands() -> list[str]:
    """Every schedctl command, as `schedctl jobs create`."""
    found: list[str] = []

    def visit(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for name, _, sub in _subcommands(parser):
            found.append(" ".join([*words, name]))
            visit(sub, [*words, name])

    visit(_parser(), ["schedctl"])
    return found


# ---------------------------------------------------------------- tables from the code


def _settings_table() -> str:
    from scheduler_grpc.config import readme_table

    return readme_table()


def _metrics_table() -> str:
    from scheduler_grpc.metrics import readme_table

    return readme_table()


TABLES: dict[str, Callable[[], str]] = {"settings": _settings_table, "metrics": _metrics_table}
MARKER = re.compile(r"^<!-- generated: ([a-z_]+) -->$", re.MULTILINE)


def fill_tables(markdown: str) -> str:
    """Each `<!-- generated: NAME -->` line followed by the table NAME (an unknown name is an error)."""

    def table(match: re.Match[str]) -> str:
        name = match[1]
        if name not in TABLES:
            raise KeyError(f"no generated table {name!r}; known: {', '.join(TABLES)}")
        return f"{match[0]}\n\n{TABLES[name]()}"

    return MARKER.sub(table, markdown)


# The pages generated whole, by their path in the site.
PAGES: dict[str, Callable[[], str]] = {"reference/api.md": api_reference, "reference/cli.md": cli_reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the generated documentation pages into a directory.")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    for name, render in PAGES.items():
        target = args.out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render())
        print(target)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
