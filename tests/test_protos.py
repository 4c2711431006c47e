"""The committed stubs are exactly what the protos generate."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

from tests.conftest import ROOT

GENERATED = ROOT / "clients" / "python" / "scheduler_client" / "v1"


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "clients" / "python" / "gen_protos.py")
    assert spec is not None
    assert spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {path.name: path.read_text() for path in gen.generate(tmp_path)}
    committed = {path.name: path.read_text() for path in GENERATED.glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"regenerate with `python clients/python/gen_protos.py`: {stale}"


_GRPC_GUARD = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", re.MULTILINE)
_PROTOBUF_GUARD = re.compile(r"ValidateProtobufRuntimeVersion\(\s*\S+PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),")


def _floors(pyproject: Path) -> dict[str, str]:
    """`{name: ">=x,<y"}` of a pyproject's runtime dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {match[1]: match[2] for dep in deps if (match := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?(.*)", dep))}


def test_dependency_floors_match_what_the_generated_stubs_need() -> None:
    """The stubs refuse to import on an older grpcio or protobuf: the floors must not promise less."""
    grpc_versions = {m[1] for path in GENERATED.glob("*_pb2_grpc.py") if (m := _GRPC_GUARD.search(path.read_text()))}
    protobuf_versions = {
        ".".join(m.groups()) for path in GENERATED.glob("*_pb2.py") if (m := _PROTOBUF_GUARD.search(path.read_text()))
    }
    assert len(grpc_versions) == 1, grpc_versions
    assert len(protobuf_versions) == 1, protobuf_versions
    (grpc_version,) = grpc_versions
    (protobuf_version,) = protobuf_versions
    major = int(protobuf_version.split(".")[0])
    for pyproject in (ROOT / "pyproject.toml", ROOT / "clients" / "python" / "pyproject.toml"):
        floors = _floors(pyproject)
        assert floors["grpcio"] == f">={grpc_version}", pyproject
        # The runtime check also refuses another major version of protobuf.
        assert floors["protobuf"] == f">={protobuf_version},<{major + 1}", pyproject
