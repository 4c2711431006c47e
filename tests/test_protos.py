"""The committed stubs are exactly what the protos generate."""

from __future__ import annotations

import importlib.util
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
