"""What this machine is and where eagle2 keeps what it measured on it.

Everything measured per machine (kernel plans, forward costs, thread counts, built native
operators) lives under `cache_root()` in files keyed by `machine_key`: the CPU model and its
vector extensions, the core and thread counts and the torch version, so that another machine,
or this one with another torch, measures again instead of reading figures that are not its own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path

import torch


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle2"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that a concurrent reader (another shard) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


@functools.cache
def cpu_info() -> tuple[str | None, frozenset[str]]:
    """(model name, instruction-set flags) from /proc/cpuinfo; (None, {}) where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, frozenset()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                 None)
    flags = next((ln.split(":", 1)[1] for ln in lines if ln.startswith("flags")), "")
    return model, frozenset(flags.split())


def machine_key(extra: str = "", threads: int | None = None) -> str:
    """Which CPU, how many threads (None: torch's current count), which torch: what the
    fastest kernel depends on."""
    model, flags = cpu_info()
    cpu = model or platform.processor() or platform.machine()
    if model is not None or flags:
        cpu += "|" + ",".join(sorted(f for f in flags if f.startswith(("avx", "amx"))))
    threads = torch.get_num_threads() if threads is None else threads
    text = f"{cpu}|{os.cpu_count()}|{threads}|{torch.__version__}|{extra}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
