"""The fused bf16 CPU operations of `csrc/cpu_ops.cpp`, built once per machine.

docs/DESIGN.md, "CPU performance": a one-token forward of a small model spent as much time in
~100 small operations per layer (norms, RoPE, cache writes, the exact attention's gathers and
matmuls) as in its matrix products. The C++ file does each group of them in one call, row by
row in a fixed order, so results stay row-invariant (exact bf16 verification). It is compiled
with torch's extension builder the first time a bf16 CPU target loads (~30 s, needs a C++
compiler) into the eagle2 cache, keyed by the source, torch and the CPU (a machine with another
CPU builds its own).
Where it cannot be built, `cpu_ops()` is None and the layers use ATen operations instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# no -ffast-math: every floating-point operation stays as written (row invariance); -fopenmp:
# at::parallel_for runs on torch's OpenMP threads (without it, the operators ran on one thread
# whatever torch.get_num_threads() said); the process keeps torch's one libgomp (same soname)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")


@functools.cache
def build_key() -> str:
    """Source, flags, torch and CPU: what the compiled operators (and their speed) depend on."""
    from eagle2.kernels import cpu_info

    model, flags = cpu_info()
    key = hashlib.sha256("|".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__,
                                   str(model), " ".join(sorted(flags))]).encode())
    return key.hexdigest()[:16]


def _build_dir() -> Path:
    from eagle2.target import cache_root

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
        _build("eagle2_cpu_ops", SOURCE, build, CFLAGS)
        return torch.ops.eagle2_cpu
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, build error
        log.warning("eagle2's fused CPU operations could not be built (%s); using ATen "
                    "operations (slower)", e)
        return None


NGRAM_SOURCE = Path(__file__).parent / "csrc" / "ngram.cpp"


@functools.cache
def ngram_ops() -> ModuleType | None:
    """`torch.ops.eagle2_ngram` (csrc/ngram.cpp: the n-gram store's chains for a batch,
    `NgramStore.propose_many`), built on first use into the eagle2 cache, keyed by the source
    and torch (portable code: no -march); None where it cannot be built or EAGLE2_NATIVE=0
    (the store then walks its chains in Python, to the same tokens and values)."""
    if os.environ.get("EAGLE2_NATIVE", "1") == "0":
        return None
    flags = ("-O2",)
    build = _keyed_dir("ngram", NGRAM_SOURCE.read_text(), flags)
    try:
        _build("eagle2_ngram_ops", NGRAM_SOURCE, build, flags)
        return torch.ops.eagle2_ngram
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("eagle2's n-gram chains could not be built (%s); walking them in Python "
                    "(slower)", e)
        return None


def load_variant(namespace: str, source: Path = SOURCE, march: str = "native") -> ModuleType:
    """`source` built with its operators as torch.ops.<namespace> beside this build's: another
    commit's source (a benchmark's baseline), or this one for another instruction set (march
    "haswell": the AVX2 build, which the tests run on an AVX-512 machine too). Built into the
    eagle2 cache once per source, flags, torch and CPU; raises where it cannot be built."""
    from eagle2.kernels import cpu_info

    text = source.read_text().replace("(eagle2_cpu,", f"({namespace},")
    flags = tuple(f for f in CFLAGS if not f.startswith("-march")) + (f"-march={march}",)
    build = _keyed_dir(namespace, text, flags, str(cpu_info()))
    copy = build / f"{namespace}.cpp"
    if not copy.exists() or copy.read_text() != text:
        copy.write_text(text)
    _build(f"{namespace}_ops", copy, build, flags)
    return getattr(torch.ops, namespace)


def _keyed_dir(prefix: str, text: str, flags: tuple[str, ...], *more: str) -> Path:
    """The eagle2 cache's build directory of a source text built with `flags` under this
    torch (and whatever else `more` names), made if missing: ext/<prefix>-<hash>."""
    from eagle2.target import cache_root

    key = hashlib.sha256("|".join([text, " ".join(flags), torch.__version__, *more]).encode())
    build = cache_root() / "ext" / f"{prefix}-{key.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    return build


def _build(name: str, source: Path, build: Path, flags: tuple[str, ...]) -> None:
    """torch's extension builder on one source file (loads the library: its operators
    register themselves)."""
    from torch.utils.cpp_extension import load

    _find_ninja()
    # torch's builder waits forever on a lock file that a killed build left behind; an flock
    # dies with its process, so whoever holds it knows such a file is stale
    with open(build / "eagle2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        load(name, [str(source)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
             build_directory=str(build), verbose=False, is_python_module=False)


def _find_ninja() -> None:
    """The extension builder runs `ninja` from PATH: where only the `ninja` wheel has it (a
    venv that is not activated), put the wheel's directory on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
