"""Generate the protobuf / gRPC stubs of proto/modalmesh/v1 into the modalmesh package.

Run by setup.py at build/install time (stubs are git-ignored), or by hand:
``python modalmesh/_protogen.py``. Deliberately imports nothing from modalmesh so
that the build can load it before the package's own dependencies exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def generate(proto_root: Path = REPO / "proto", out_root: Path = REPO) -> list[Path]:
    """Compile every .proto under proto_root; outputs land in out_root/modalmesh/v1/."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    generated = sorted({(out_root / p).parent for p in protos})
    for package_dir in generated:
        init = package_dir / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ by modalmesh/_protogen.py: do not edit."""\n')
    return [out_root / p.replace(".proto", "_pb2.py") for p in protos]


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
