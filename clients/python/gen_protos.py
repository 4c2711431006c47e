"""Generate the Python stubs of protos/scheduler/v1 into scheduler_client/v1 (messages, .pyi, gRPC and
its typed `_pb2_grpc.pyi`, the latter by mypy-protobuf's `protoc-gen-mypy_grpc`).

Run from anywhere: `python clients/python/gen_protos.py [OUT_DIR]`. protoc's generated imports name
the proto package (`from scheduler.v1 import jobs_pb2`); they are rewritten to
`scheduler_client.v1` so the stubs live inside this distribution. tests/test_protos.py regenerates
into a temporary directory and compares with the committed files.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = HERE.parent.parent / "protos"
_IMPORT = re.compile(r"^from scheduler\.v1 import", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # a dev dependency: only generation needs it

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(path.relative_to(PROTOS)) for path in (PROTOS / "scheduler" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with _tmp() as tmp:
        code = protoc.main([
            "grpc_tools.protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}", f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_grpc_out={tmp}", *sources,
        ])  # fmt: skip
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")
        written = []
        for generated in sorted((tmp / "scheduler" / "v1").iterdir()):
            text = _IMPORT.sub("from scheduler_client.v1 import", generated.read_text())
            target = out_dir / generated.name
            target.write_text(text)
            written.append(target)
    return written


def _plugin(name: str) -> str:
    """A protoc plugin installed next to this Python (mypy-protobuf's, a pinned dev dependency)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise SystemExit(f"{name} not found: install the dev dependencies (mypy-protobuf)")
        return found
    return str(path)


class _tmp:
    def __enter__(self) -> Path:
        import tempfile

        self._dir = tempfile.TemporaryDirectory()
        return Path(self._dir.name)

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "scheduler_client" / "v1"
    for path in generate(target):
        print(path)
