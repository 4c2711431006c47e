"""The documentation: the generated references cover the code, the README is a front door, and
every repository path a page names exists."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from scheduler_grpc import config
from tests.conftest import ROOT

DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def docs_gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "scripts" / "docs_gen.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_proto_element_has_a_comment(docs_gen: ModuleType) -> None:
    elements = docs_gen.proto_elements()
    kinds = {element.kind for element in elements}
    assert kinds == {"service", "method", "message", "field", "enum", "value"}  # the walk saw them all
    assert docs_gen.missing_comments() == [], "add a comment to these in protos/scheduler/v1"


def test_a_missing_comment_is_reported(docs_gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a copy of the protos with one comment removed is caught."""
    protos = tmp_path / "protos"
    (protos / "scheduler" / "v1").mkdir(parents=True)
    for path in (ROOT / "protos" / "scheduler" / "v1").glob("*.proto"):
        (protos / "scheduler" / "v1" / path.name).write_text(path.read_text())
    jobs = protos / "scheduler" / "v1" / "jobs.proto"
    text = jobs.read_text()
    comment = "  // Reads one job.\n"
    assert comment in text
    jobs.write_text(text.replace(comment, "", 1))
    monkeypatch.setattr(docs_gen, "PROTOS", protos)
    assert docs_gen.missing_comments() == ["method scheduler.v1.JobService.GetJob"]


def test_the_api_reference_shows_every_method_message_and_field(docs_gen: ModuleType) -> None:
    page = docs_gen.api_reference()
    for element in docs_gen.proto_elements():
        short = element.name.rsplit(".", 1)[-1]
        assert f"`{short}`" in page or f"### {short}" in page or f"{short} {{ #" in page, element
        assert element.comment in page, element
    assert "| `CreateJob` |" in page
    assert "| admin |" in page  # least roles come from auth.METHOD_ROLES


def test_the_cli_reference_shows_every_command_and_flag(docs_gen: ModuleType) -> None:
    page = docs_gen.cli_reference()
    commands = docs_gen.cli_commands()
    assert "schedctl jobs create" in commands
    for command in commands:
        assert re.search(rf"^#+ {re.escape(command)}$", page, re.MULTILINE), command
    for flag in ("--cron", "--time-zone", "--depends-on", "--password-stdin", "--server", "--json", "--all"):
        assert f"`{flag}`" in page, flag


def test_generated_tables_fill_their_markers_and_refuse_unknown_ones(docs_gen: ModuleType) -> None:
    page = (DOCS / "operations" / "configuration.md").read_text()
    filled = docs_gen.fill_tables(page)
    assert config.readme_table() in filled
    for setting in config.SETTINGS:
        assert f"`{setting.env}`" in filled
    with pytest.raises(KeyError, match="no generated table 'nope'"):
        docs_gen.fill_tables("<!-- generated: nope -->\n")


def test_importing_the_generator_does_nothing(tmp_path: Path) -> None:
    """scripts/ run as programs; importing one must not write anything (the old readme script did)."""
    before = {path: path.stat().st_mtime_ns for path in [ROOT / "README.md", *DOCS.rglob("*.md")]}
    code = "import sys; sys.path.insert(0, 'scripts'); import docs_gen, mkdocs_hooks"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    after = {path: path.stat().st_mtime_ns for path in before}
    assert before == after


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 250
    assert "job scheduler" in "\n".join(lines[:8])  # the first screen says what it is
    for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


_PATH = re.compile(r"`((?:scheduler_grpc|tests|bench|chaos|scripts|clients|deploy|protos)/[\w./-]*?)(?:::\w+)?`")


def test_every_repository_path_a_page_names_exists() -> None:
    """A claim points at its module or test: those pointers must not rot."""
    pages = [path for path in DOCS.rglob("*.md") if path.name != "ARCHITECTURE.md"]  # edited elsewhere
    assert len(pages) > 10
    missing = []
    for page in pages:
        for match in _PATH.finditer(page.read_text()):
            path = match[1].rstrip(".")
            if "*" in path or "<" in path:
                continue
            if not (ROOT / path).exists() and not (ROOT / "scheduler_grpc" / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


_TEST_NAME = re.compile(r"`(tests/test_\w+\.py)::(\w+)`")


def test_every_test_a_page_names_exists() -> None:
    for page in DOCS.rglob("*.md"):
        for file, name in _TEST_NAME.findall(page.read_text()):
            assert re.search(rf"def {name}\(", (ROOT / file).read_text()), f"{page.name}: {file}::{name}"
