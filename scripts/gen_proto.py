#!/usr/bin/env python3
"""Regenerate the gRPC Python code in ``engine.core.rpc._gen`` from ``proto/``.

    python scripts/gen_proto.py            # rewrite packages/engine-core/.../rpc/_gen
    python scripts/gen_proto.py --check    # regenerate into a temp dir; exit 1 on any drift
    python scripts/gen_proto.py --out DIR  # write somewhere else

``proto/engine/v1/*.proto`` is the only source of truth. ``grpc_tools.protoc`` writes
``engine/v1/X_pb2.py``, ``X_pb2_grpc.py`` and ``X_pb2.pyi``; this script moves them into
one flat package and rewrites the stubs' absolute import (``from engine.v1 import X_pb2``)
to ``from engine.core.rpc._gen import X_pb2``. The output depends on the grpcio-tools
version (it is stamped into the files), so regenerate with :data:`GRPC_TOOLS_VERSION`.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE = "engine/v1"
GEN_DIR = ROOT / "packages/engine-core/src/engine/core/rpc/_gen"
GEN_PACKAGE = "engine.core.rpc._gen"
#: The grpcio-tools release the committed code was generated with.
GRPC_TOOLS_VERSION = "1.85.1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def protos() -> list[Path]:
    """The .proto files to compile, sorted."""
    return sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Compile every proto into ``out`` (flat, imports fixed); returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
               f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
               *(str(p.relative_to(PROTO_ROOT)) for p in protos())]
        subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            if not src.name.endswith(SUFFIXES):
                continue
            text = re.sub(rf"^from {PROTO_PACKAGE.replace('/', '.')} import ",
                          f"from {GEN_PACKAGE} import ", src.read_text(), flags=re.MULTILINE)
            (out / src.name).write_text(text)
            written.append(out / src.name)
        return written


def check() -> int:
    """Regenerate into a temp dir and compare with the committed files; 1 on drift."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        committed = {p.name: p for p in GEN_DIR.iterdir() if p.name.endswith(SUFFIXES)}
        drift = []
        for name in sorted(set(fresh) | set(committed)):
            if name not in committed:
                drift.append(f"{name}: missing from {GEN_DIR.relative_to(ROOT)}")
            elif name not in fresh:
                drift.append(f"{name}: committed but no .proto generates it")
            else:
                old, new = committed[name].read_text(), fresh[name].read_text()
                if old != new:
                    diff = difflib.unified_diff(old.splitlines(), new.splitlines(),
                                                f"committed/{name}", f"generated/{name}",
                                                lineterm="", n=1)
                    drift.append("\n".join(list(diff)[:40]))
    if not drift:
        print(f"proto_check: {len(fresh)} generated files match proto/")
        return 0
    print("proto_check: the committed code in engine.core.rpc._gen differs from proto/:\n")
    print("\n\n".join(drift))
    installed = metadata.version("grpcio-tools")
    if installed != GRPC_TOOLS_VERSION:
        print(f"\n(grpcio-tools {installed} is installed; the committed code comes from "
              f"{GRPC_TOOLS_VERSION}: install that version before regenerating.)")
    print("\nRun `nox -s proto` (or python scripts/gen_proto.py) and commit the result.")
    return 1


def main() -> int:
    """Regenerate, or check with ``--check``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail on drift, write nothing")
    parser.add_argument("--out", type=Path, default=GEN_DIR, help="output directory")
    args = parser.parse_args()
    if args.check:
        return check()
    installed = metadata.version("grpcio-tools")
    if installed != GRPC_TOOLS_VERSION:
        print(f"warning: grpcio-tools {installed} is installed; the committed code is "
              f"generated with {GRPC_TOOLS_VERSION}", file=sys.stderr)
    for path in generate(args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
