"""requirements.lock: every requirement of pyproject.toml is locked, and this environment is the lock."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

LOCAL = {"scheduler-grpc", "scheduler-grpc-client"}  # installed editable from this checkout


def _locked() -> dict[str, Requirement]:
    locked = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            requirement = Requirement(line)
            locked[canonicalize_name(requirement.name)] = requirement
    return locked


def _pin(requirement: Requirement) -> Version:
    (spec,) = requirement.specifier
    assert spec.operator == "==", requirement
    return Version(spec.version)


def _applies(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(dict(default_environment()))


def test_every_requirement_of_pyproject_is_locked_at_a_version_it_allows() -> None:
    locked = _locked()
    wanted = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "clients" / "python" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        wanted += project["dependencies"]
        for extra in project.get("optional-dependencies", {}).values():
            wanted += extra
    assert len(wanted) > 20
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name in LOCAL:
            continue
        assert name in locked, f"{name} is not in requirements.lock: run `make lock`"
        assert requirement.specifier.contains(_pin(locked[name]), prereleases=True), (text, str(locked[name]))


def test_this_environment_has_exactly_the_locked_versions() -> None:
    """`make` installs the lock; a package at another version was not installed by it."""
    wrong = []
    for name, requirement in _locked().items():
        if not _applies(requirement):
            continue
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed, locked {_pin(requirement)}")
            continue
        if installed != _pin(requirement):
            wrong.append(f"{name}: installed {installed}, locked {_pin(requirement)}")
    assert not wrong, "run `make` (it reinstalls from requirements.lock): " + "; ".join(wrong)
