"""Generate the Python stubs of ``proto/operator.proto`` (checked in next to it).

    python proto/generate.py            # writes proto/operator_pb2.py, _pb2_grpc.py, _pb2.pyi
    python proto/generate.py --out DIR  # elsewhere (tests/test_proto_stubs.py compares the two)

It runs ``grpc_tools.protoc`` (grpcio-tools, pinned in the ``test`` extra: another version
writes other bytes) and makes the service stub's ``import operator_pb2`` package-relative, so
``from proto import operator_pb2_grpc`` works. The stubs ask at import for a grpcio and a
protobuf at least as new as the tools that wrote them (pyproject's dependencies say so).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = "operator.proto"
OUTPUTS = ("operator_pb2.py", "operator_pb2_grpc.py", "operator_pb2.pyi")
_FLAT_IMPORT = "import operator_pb2 as operator__pb2"
_PACKAGE_IMPORT = "from . import operator_pb2 as operator__pb2"


def generate(out_dir: Path) -> list[Path]:
    """Write the three stub files into ``out_dir``; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(HERE / SOURCE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {HERE / SOURCE} (its message is above)")
        paths = []
        for name in OUTPUTS:
            text = (Path(tmp) / name).read_text()
            if name == "operator_pb2_grpc.py":
                if _FLAT_IMPORT not in text:
                    raise RuntimeError(f"{name}: no {_FLAT_IMPORT!r} to make package-relative")
                text = text.replace(_FLAT_IMPORT, _PACKAGE_IMPORT)
            path = out_dir / name
            path.write_text(text)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where to write (default: proto/)")
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
