"""The fused bf16 CPU operations of `csrc/cpu_ops.cpp`, built once per machine.

docs/cpu-backend.md: a one-token forward of a small model spent as much time in ~100 small
operations per layer (norms, RoPE, cache writes, the exact attention's gathers and matmuls) as
in its matrix products. The C++ file does each group of them in one call, row by row in a fixed
order, so results stay row-invariant (exact bf16 verification). It is compiled with torch's
extension builder (`eagle2.ext`) the first time a bf16 CPU target loads (~30 s, needs a C++
compiler) into the eagle2 cache, keyed by the source, torch and the CPU (a machine with another
CPU builds its own).
Where it cannot be built, `cpu_ops()` is None and the layers use ATen operations instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from eagle2.ext import build_extension, keyed_dir
from eagle2.machine import cache_root, cpu_info

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# no -ffast-math: every floating-point operation stays as written (row invariance); -fopenmp:
# at::parallel_for runs on torch's OpenMP threads (without it, the operators ran on one thread
# whatever torch.get_num_threads() said); the process keeps torch's one libgomp (same soname)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")


@functools.cache
def build_key() -> str:
    """Source, flags, torch and CPU: what the compiled operators (and their speed) depend on."""
    model, flags = cpu_info()
    key = hashlib.sha256("|".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__,
                                   str(model), " ".join(sorted(flags))]).encode())
    return key.hexdigest()[:16]


def _build_dir() -> Path:
    return cache_root() / "ext" / f"cpu_ops-{build_key()}"


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled operators, `torch.ops.eagle2_cpu` (built on first use), or None where
    they cannot be built, or where EAGLE2_NATIVE=0 (read when the first bf16 CPU target
    loads, not at import)."""
    if os.environ.get("EAGLE2_NATIVE", "1") == "0":
        return None
    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        log.info("building eagle2's fused CPU operations into %s (once per machine, ~30 s)",
                 build)
    try:
        build_extension("eagle2_cpu_ops", SOURCE, build, CFLAGS)
        return torch.ops.eagle2_cpu
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, build error
        log.warning("eagle2's fused CPU operations could not be built (%s); using ATen "
                    "operations (slower)", e)
        return None


def load_variant(namespace: str, source: Path = SOURCE, march: str = "native") -> ModuleType:
    """`source` built with its operators as torch.ops.<namespace> beside this build's: another
    commit's source (a benchmark's baseline), or this one for another instruction set (march
    "haswell": the AVX2 build, which the tests run on an AVX-512 machine too). Built into the
    eagle2 cache once per source, flags, torch and CPU; raises where it cannot be built."""
    text = source.read_text().replace("(eagle2_cpu,", f"({namespace},")
    flags = tuple(f for f in CFLAGS if not f.startswith("-march")) + (f"-march={march}",)
    build = keyed_dir(namespace, text, flags, str(cpu_info()))
    copy = build / f"{namespace}.cpp"
    if not copy.exists() or copy.read_text() != text:
        copy.write_text(text)
    build_extension(f"{namespace}_ops", copy, build, flags)
    return getattr(torch.ops, namespace)
