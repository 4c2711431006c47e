"""The house rules of the package layout, checked on the imports themselves (parsed with `ast`).

* asyncpg (and so SQL and SQLSTATE handling) lives in `scheduler_grpc/db/` only;
* servicers (`scheduler_grpc/services/`) reach Redis through the application layer, never `redis`;
* handlers see neither store nor the gRPC layer;
* the queue and the leader election know nothing of gRPC.
"""

from __future__ import annotations

import ast
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
