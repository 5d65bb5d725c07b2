"""Generated gRPC stubs for protos/eagle2/v1, built on first import (never edited by hand).

The stubs are build output: `grpc_tools.protoc` writes them into services/_generated/ (git
ignored) whenever a .proto file is newer than its stub, so a fresh checkout, an installed
wheel and a container all get stubs that match the protos they ship with.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
PROTO_DIR = _HERE.parent / "protos" / "eagle2" / "v1"
OUT_DIR = _HERE / "_generated"
PROTOS = ("eagle2.proto", "draft.proto")


def _digest() -> str:
    h = hashlib.sha256()
    for name in PROTOS:
        h.update((PROTO_DIR / name).read_bytes())
    return h.hexdigest()


def generate(force: bool = False) -> Path:
    """Run protoc if the stubs are missing or stale; returns the output directory."""
    stamp = OUT_DIR / "STAMP"
    if not force and stamp.exists() and stamp.read_text() == _digest():
        return OUT_DIR
    from grpc_tools import protoc

    OUT_DIR.mkdir(exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={OUT_DIR}",
            f"--grpc_python_out={OUT_DIR}", *(str(PROTO_DIR / p) for p in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {PROTO_DIR}")
    stamp.write_text(_digest())
    return OUT_DIR


if PROTO_DIR.exists():
    generate()
if str(OUT_DIR) not in sys.path:  # generated modules import each other by bare name
    sys.path.insert(0, str(OUT_DIR))

eagle2_pb2 = importlib.import_module("eagle2_pb2")
eagle2_pb2_grpc = importlib.import_module("eagle2_pb2_grpc")
draft_pb2 = importlib.import_module("draft_pb2")
draft_pb2_grpc = importlib.import_module("draft_pb2_grpc")

# What Ray Serve's gRPC proxy registers (gRPCOptions.grpc_servicer_functions).
add_Eagle2Servicer_to_server = eagle2_pb2_grpc.add_Eagle2Servicer_to_server
SERVICER_FUNCTIONS = ["services.protos.add_Eagle2Servicer_to_server",
                      "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]
