"""Building eagle2's C++ operators with torch's extension builder, once per machine.

A source file is compiled the first time it is needed into the eagle2 cache
(`machine.cache_root() / "ext"`), in a directory keyed by the source text, the flags, torch and
whatever else the caller names (e.g. the CPU), and loaded: its operators register themselves
under `torch.ops.<namespace>`. The n-gram store's chains (`csrc/ngram.cpp`, host-side, portable)
are built here; the CPU backend builds its kernels through the same functions
(`eagle2.cpu.native`).
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

from eagle2.machine import cache_root

log = logging.getLogger(__name__)

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
    build = keyed_dir("ngram", NGRAM_SOURCE.read_text(), flags)
    try:
        build_extension("eagle2_ngram_ops", NGRAM_SOURCE, build, flags)
        return torch.ops.eagle2_ngram
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("eagle2's n-gram chains could not be built (%s); walking them in Python "
                    "(slower)", e)
        return None


def keyed_dir(prefix: str, text: str, flags: tuple[str, ...], *more: str) -> Path:
    """The eagle2 cache's build directory of a source text built with `flags` under this
    torch (and whatever else `more` names), made if missing: ext/<prefix>-<hash>."""
    key = hashlib.sha256("|".join([text, " ".join(flags), torch.__version__, *more]).encode())
    build = cache_root() / "ext" / f"{prefix}-{key.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    return build


def build_extension(name: str, source: Path, build: Path, flags: tuple[str, ...],
                    ldflags: tuple[str, ...] = ("-fopenmp",)) -> None:
    """torch's extension builder on one source file (loads the library: its operators
    register themselves)."""
    from torch.utils.cpp_extension import load

    _find_ninja()
    # torch's builder waits forever on a lock file that a killed build left behind; an flock
    # dies with its process, so whoever holds it knows such a file is stale
    with open(build / "eagle2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        load(name, [str(source)], extra_cflags=list(flags), extra_ldflags=list(ldflags),
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
