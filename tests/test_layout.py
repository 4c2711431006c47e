"""The house rules of the package layout, checked on the imports themselves (parsed with `ast`).

The module map of docs/ARCHITECTURE.md is checked as written: each module imports only what its
row allows (`map_violations`). Beside it, the rules stated on their own:

* asyncpg (and so SQL and SQLSTATE handling) lives in `scheduler_grpc/db/` only;
* servicers (`scheduler_grpc/services/`) reach Redis through the application layer, never `redis`;
* handlers see neither store nor the gRPC layer;
* the queue and the leader election know nothing of gRPC.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "scheduler_grpc"


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "_pb2" not in path.name)


def imported_roots(path: Path) -> set[str]:
    """The top-level packages `path` imports (absolute imports, at any depth: functions included)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _importers(root: str, paths: list[Path]) -> list[str]:
    return [_name(path) for path in paths if root in imported_roots(path)]


def test_only_db_imports_asyncpg() -> None:
    outside = [path for path in _modules() if PACKAGE / "db" not in path.parents]
    assert _importers("asyncpg", outside) == []


def test_no_servicer_imports_redis() -> None:
    assert _importers("redis", sorted((PACKAGE / "services").glob("*.py"))) == []


@pytest.mark.parametrize("root", ["redis", "asyncpg", "grpc"])
def test_handlers_import_no_store_and_no_grpc(root: str) -> None:
    assert _importers(root, sorted((PACKAGE / "handlers").glob("*.py"))) == []


def test_the_queue_and_the_leader_election_import_no_grpc() -> None:
    assert _importers("grpc", [PACKAGE / "queue.py", PACKAGE / "leader.py"]) == []


def test_the_check_sees_imports(tmp_path: Path) -> None:
    # The parser must find imports in every form, or the checks above pass vacuously.
    source = tmp_path / "m.py"
    source.write_text("import a.b\nfrom c.d import e\nfrom . import f\n\ndef g():\n    import h\n")
    assert imported_roots(source) == {"a", "c", "h"}
    assert "asyncpg" in imported_roots(PACKAGE / "db" / "pool.py")


# -- the module map of docs/ARCHITECTURE.md, checked -------------------------------------------

ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
# The libraries a row must name to import them (the others are not the map's concern).
CHECKED_LIBRARIES = frozenset({"redis", "asyncpg", "grpc", "aiohttp", "jinja2", "prometheus_client"})
_TICKED = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Row:
    """One row of the module map: its modules and what they may import."""

    modules: frozenset[str]  # dotted names relative to the package ("services.jobs", "db")
    allowed: frozenset[str]  # internal modules named in the row (a package name covers its modules)
    libraries: frozenset[str]  # the checked libraries it names
    unchecked: bool  # "any module"
    nothing: bool  # "nothing": no module of the package


def _dotted(path: Path, package: Path) -> str:
    return path.relative_to(package).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")


def _covered(name: str, tokens: frozenset[str]) -> bool:
    return any(name == token or name.startswith(token + ".") for token in tokens)


def parse_module_map(text: str) -> tuple[frozenset[str], list[Row]]:
    """The modules every module may import, and the rows of the table under "## Module map"."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    shared_line = next(line for line in section.splitlines() if line.startswith("Every module may import"))
    shared = frozenset(_TICKED.findall(shared_line))
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        modules = set()
        for token in _TICKED.findall(cells[0]):
            if token.endswith("/"):
                modules.add(token.rstrip("/").replace("/", "."))
            elif token.endswith(".py"):
                modules.add(token.removesuffix(".py").replace("/", ".").removesuffix(".__init__") or "__init__")
        allowed_text = cells[2].split("; no ")[0]
        words = {word.strip() for word in _TICKED.sub("", allowed_text).replace("(", ",").split(",")}
        rows.append(
            Row(
                frozenset(modules),
                frozenset(_TICKED.findall(allowed_text)),
                frozenset(word.split()[0] for word in words if word and word.split()[0] in CHECKED_LIBRARIES),
                unchecked=cells[2].startswith("any module"),
                nothing=cells[2] == "nothing",
            )
        )
    return shared, rows


def _row_of(module: str, rows: list[Row]) -> Row | None:
    found = [row for row in rows if module in row.modules or _covered(module, row.modules)]
    if module == "":
        found = [row for row in rows if "__init__" in row.modules]
    return found[0] if found else None


def internal_imports(path: Path, modules: frozenset[str]) -> set[str]:
    """The package's modules `path` imports, dotted relative to the package ("" for the package itself)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name[len("scheduler_grpc.") :] for alias in node.names
                         if alias.name.startswith("scheduler_grpc."))  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "scheduler_grpc":
                found.update(alias.name if alias.name in modules else "" for alias in node.names)
            elif node.module.startswith("scheduler_grpc."):
                base = node.module[len("scheduler_grpc.") :]
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return found


def map_violations(package: Path, doc: str) -> list[str]:
    """Every import of a module in `package` that its row of the module map `doc` does not allow,
    and every module the map leaves out."""
    shared, rows = parse_module_map(doc)
    paths = sorted(path for path in package.rglob("*.py") if "_pb2" not in path.name)
    names = {(_dotted(path, package) if path.relative_to(package).as_posix() != "__init__.py" else "__init__"): path
             for path in paths}  # fmt: skip
    modules = frozenset(name for name in names if name != "__init__")
    problems = []
    for name, path in names.items():
        row = _row_of(name, rows)
        if row is None:
            problems.append(f"{name}: not in the module map")
            continue
        if row.unchecked:
            continue
        for imported in sorted(internal_imports(path, modules)):
            if row.nothing:
                problems.append(f"{name} imports {imported or 'the package'} (its row says nothing)")
            elif not (_covered(imported, row.modules) or _covered(imported, shared | row.allowed)):
                problems.append(f"{name} imports {imported or 'the package'}, which its row does not allow")
        for library in sorted(imported_roots(path) & CHECKED_LIBRARIES - row.libraries):
            problems.append(f"{name} imports {library}, which its row does not name")
    return problems


def test_every_import_is_one_the_module_map_allows() -> None:
    assert map_violations(PACKAGE, ARCHITECTURE.read_text()) == []


def test_the_map_check_fails_on_a_layer_crossed(tmp_path: Path) -> None:
    # The check must see each kind of crossing the map forbids, or it passes vacuously.
    package = tmp_path / "scheduler_grpc"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*_pb2*", "lua", "static"))
    crossings = {
        "services/jobs.py": "from scheduler_grpc.db.jobs import JobRepository\n",
        "services/queue.py": "from scheduler_grpc.queue import Queue\n",
        "console/views.py": "from scheduler_grpc.services import convert\n",
        "console/app.py": "from scheduler_grpc import queue\n",
        "console/forms.py": "import redis\n",
    }
    for name, line in crossings.items():
        (package / name).write_text(line + (package / name).read_text())
    problems = map_violations(package, ARCHITECTURE.read_text())
    assert problems == [
        "console.app imports queue, which its row does not allow",
        "console.forms imports redis, which its row does not name",
        "console.views imports services.convert, which its row does not allow",
        "services.jobs imports db.jobs, which its row does not allow",
        "services.queue imports queue, which its row does not allow",
    ]


def test_one_definition_of_the_latest_attempt() -> None:
    # A run's current state is its highest attempt: the SQL saying so lives in db/attempts.py only.
    spelt = [_name(path) for path in _modules() if "attempt DESC LIMIT 1" in " ".join(path.read_text().split())]
    assert spelt == ["scheduler_grpc/db/attempts.py"]
